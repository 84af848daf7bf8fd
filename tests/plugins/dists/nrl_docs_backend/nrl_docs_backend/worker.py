"""The docs backend's worker: one rank, one plain ``AutoModelForCausalLM``, one torch optimizer.

It satisfies ``nrl_core.contracts.TrainingWorker`` plus ``save_checkpoint``/``load_checkpoint``
(which the core calls directly). The backend declares no capabilities, so the core
never builds it with more than one rank, packed sequences or dynamic batches.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from nrl_core.contracts import BatchShard, CheckpointOptions, LossFunction, TokenBatch, WeightSpec, logprob_temperature
from nrl_core.errors import NrlError
from nrl_core.refit.buckets import parse_dtype
from nrl_core.refit.hf_source import HFWeightSource
from nrl_core.sdk import rng_state, set_rng_state
from nrl_docs_backend import checkpoint
from nrl_docs_backend.checks import optimizer_class


def _move(obj: Any, device: torch.device | str, *, copy_tensors: bool = False) -> Any:
    """``obj`` (nested dicts/lists of tensors, as optimizer state dicts are) with tensors on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=copy_tensors)
    if isinstance(obj, dict):
        return {k: _move(v, device, copy_tensors=copy_tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device, copy_tensors=copy_tensors) for v in obj)
    return obj


class DocsWorker:
    """One training rank of the ``docs`` backend (see the module docstring)."""

    def __init__(self, config: Mapping[str, Any], *, rank: int = 0, world_size: int = 1) -> None:
        if world_size != 1:
            raise NrlError(f"the docs backend trains on one rank, got world size {world_size}; "
                           "use one training worker or a backend that declares data_parallel")
        self.config = config
        self.policy = config["policy"]
        self.rank = rank
        seed = self.policy.get("seed")
        torch.manual_seed(42 if seed is None else int(seed))
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.temperature = logprob_temperature(config)
        self.model = self._load_model().to(self.device)
        self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        optimizer = self.policy["optimizer"]
        self.optimizer = optimizer_class(optimizer["name"])(self.model.parameters(), **dict(optimizer.get("kwargs") or {}))
        self.writer = checkpoint.CheckpointWriter()

    def _load_model(self) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        name, remote = self.policy["model_name"], bool(self.policy.get("trust_remote_code"))
        hf_config = AutoConfig.from_pretrained(name, trust_remote_code=remote)
        hf_config.update(dict(self.policy.get("hf_config_overrides") or {}))
        return AutoModelForCausalLM.from_pretrained(name, config=hf_config, dtype=parse_dtype(self.policy["precision"]),
                                                    trust_remote_code=remote)

    # ------------------------------------------------------------------ logprobs and training

    def _token_logprobs(self, model: Any, batch: TokenBatch) -> torch.Tensor:
        """``[B, T]`` float32 log p(token_t | tokens_<t) under softmax(logits / T); 0 at t=0 and padding."""
        ids = batch.input_ids.to(self.device)
        valid = torch.arange(ids.shape[1], device=self.device)[None, :] < batch.input_lengths.to(self.device)[:, None]
        ids = ids.masked_fill(~valid, 0)
        logits = model(input_ids=ids, attention_mask=valid.long()).logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.nn.functional.pad(picked * valid[:, 1:], (1, 0))

    @torch.no_grad()
    def _logprobs(self, model: Any, batch: TokenBatch) -> BatchShard:
        model.eval()
        out = torch.zeros(tuple(batch.input_ids.shape), dtype=torch.float32)
        step = int(self.policy["logprob_batch_size"])
        for start in range(0, batch.size, step):
            rows = list(range(start, min(start + step, batch.size)))
            values = self._token_logprobs(model, batch.select(rows)).cpu()
            out[start:start + len(rows), : values.shape[1]] = values
        return BatchShard(rows=list(range(batch.size)), values=out)

    def get_logprobs(self, batch: TokenBatch) -> BatchShard:
        return self._logprobs(self.model, batch)

    def get_reference_logprobs(self, batch: TokenBatch) -> BatchShard:
        return self._logprobs(self.reference, batch)

    def train(self, batch: TokenBatch, loss_fn: LossFunction) -> dict[str, float]:
        """One optimizer step over the whole batch, in micro-batches normalised by the batch's counts."""
        tokens, seqs = batch.loss_counts()
        step = int(self.policy["train_micro_batch_size"])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        total_loss = 0.0
        for start in range(0, batch.size, step):
            micro = batch.select(list(range(start, min(start + step, batch.size))))
            loss, micro_metrics = loss_fn(self._token_logprobs(self.model, micro), micro,
                                          global_valid_tokens=tokens, global_valid_seqs=seqs)
            loss.backward()
            total_loss += float(loss.detach())
            for key, value in micro_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + float(value)
        metrics.setdefault("loss", total_loss)
        max_norm = self.policy.get("max_grad_norm")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm or math.inf))
        if self.policy.get("check_for_nan", True) and not (math.isfinite(total_loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NrlError(f"policy.check_for_nan: loss {total_loss} / grad norm {grad_norm} is not finite; the "
                           "optimizer step was skipped (lower the learning rate or set policy.check_for_nan: false)")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics["grad_norm"] = grad_norm
        return metrics

    # ------------------------------------------------------------------ colocation hand-off

    def offload_before_refit(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for state in self.optimizer.state.values():
            state.update(_move(state, "cpu"))
        self.reference.to("cpu")

    def offload_after_refit(self) -> None:
        self.model.to("cpu")

    def prepare_for_training(self) -> None:
        self.model.to(self.device)
        self.reference.to(self.device)
        for state in self.optimizer.state.values():
            state.update({k: v.to(self.device) if isinstance(v, torch.Tensor) and v.dim() else v
                          for k, v in state.items()})

    # ------------------------------------------------------------------ weights out

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        return HFWeightSource(self.model).weight_manifest(dtype)

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return HFWeightSource(self.model).export_weights(bucket_bytes, dtype)

    def export_hf(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.model.save_pretrained(path)
        tokenizer = (self.policy.get("tokenizer") or {}).get("name") or self.policy["model_name"]
        AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=bool(self.policy.get("trust_remote_code"))).save_pretrained(path)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, options: CheckpointOptions) -> None:
        """Snapshot to CPU now (training may continue at once), write now or in the background."""
        weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.model.state_dict().items()}
        state: dict[str, Any] = {"optimizer": _move(self.optimizer.state_dict(), "cpu", copy_tensors=True)}
        if options.load_rng:
            state["rng"] = rng_state()
        self.writer.write(path, weights, state, dataclasses.asdict(options), background=options.async_save)

    def load_checkpoint(self, path: str, options: CheckpointOptions) -> None:
        """Read and check everything, then apply: a bad checkpoint changes nothing."""
        self.writer.wait()
        weights, state = checkpoint.read(path)
        expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in weights.items()}
        if got != expected:
            diff = sorted(set(got.items()) ^ set(expected.items()))[:3]
            raise NrlError(f"{path} does not fit this model ({self.policy['model_name']}): differing weights {diff}")
        mine, theirs = self.optimizer.state_dict()["param_groups"], state["optimizer"]["param_groups"]
        if [len(g["params"]) for g in mine] != [len(g["params"]) for g in theirs]:
            raise NrlError(f"{path}: its optimizer state has other parameter groups than this worker's optimizer")
        if options.load_rng and "rng" not in state:
            raise NrlError(f"{path} was saved without RNG state; load it with load_rng: false")
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(state["optimizer"])
        if options.load_rng:
            set_rng_state(state["rng"])

    def finalize_checkpoint(self) -> None:
        self.writer.wait()
