"""``ExampleWorker``: the smallest complete nrl training worker, one process, plain PyTorch, on
the backend SDK (:mod:`nrl_core.sdk`).

It keeps every promise of :class:`nrl_core.contracts.TrainingWorker` and nothing more: an HF
causal LM trained with AdamW on padded micro-batches, logprobs under the sampling temperature,
HF-named weight export, and checkpoints that restore model, optimizer, step and (with
``load_rng``) the RNG. The SDK's base class brings the colocated memory hand-off and the HF
export (built from ``export_weights``); its ``ReferenceWeights`` keep the initial weights for the
KL penalty in host memory. It declares no capabilities, so validation refuses configs that need
data parallelism, sequence packing or dynamic batching with it.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nrl_core.api import (
    BatchShard,
    CheckpointOptions,
    ConfigError,
    HFWeightSource,
    LossFunction,
    NrlError,
    ReferenceWeights,
    TokenBatch,
    TrainingWorkerBase,
    WeightSpec,
    check_finite,
    guard_enabled,
    logprob_temperature,
    parse_dtype,
    rng_state,
    set_rng_state,
    training_precision,
)

STATE_FILE = "example_state.pt"


class ExampleWorker(TrainingWorkerBase):
    backend_name = "example"

    def __init__(self, config: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        if world_size != 1:
            raise ConfigError("cluster", f"the example backend trains on one rank, got a world of {world_size}")
        self.config, self.rank, self.device = config, rank, torch.device("cpu")
        self.policy = policy = config["policy"]
        if policy.get("scheduler"):
            raise ConfigError("policy.scheduler", "the example backend has no LR schedulers; remove policy.scheduler")
        self.temperature = logprob_temperature(config)
        torch.manual_seed(int(policy["seed"]))  # validation resolves a null seed to the algorithm's
        self.model = AutoModelForCausalLM.from_pretrained(
            policy["model_name"], dtype=parse_dtype(training_precision(policy, self.device)),
            trust_remote_code=bool(policy.get("trust_remote_code")))
        for key, value in (policy.get("hf_config_overrides") or {}).items():
            setattr(self.model.config, key, value)
        self.hf_config = self.model.config
        self.reference = ReferenceWeights(self.model.parameters())  # the initial weights, for the KL penalty
        optimizer = policy.get("optimizer") or {}
        if optimizer.get("name", "torch.optim.AdamW") not in ("torch.optim.AdamW", "AdamW"):
            raise ConfigError("policy.optimizer.name", "the example backend supports torch.optim.AdamW only")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **(optimizer.get("kwargs") or {}))
        self.section, self.step = policy["example_cfg"], 0
        self._pending_save: threading.Thread | None = None

    # ------------------------------------------------------------------ logprobs and training

    def _logprobs(self, model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[b, T]`` log p(token_t | tokens_<t) under softmax(logits / T); 0 at position 0 and padding."""
        attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
        lp = torch.log_softmax(logits[:, :-1] / self.temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return torch.cat([torch.zeros(ids.shape[0], 1), lp], 1) * attention

    def _all_logprobs(self, model: torch.nn.Module, batch: TokenBatch) -> BatchShard:
        size = int(self.policy["logprob_batch_size"])
        model.eval()
        with torch.no_grad():
            parts = [self._logprobs(model, batch.input_ids[i:i + size], batch.input_lengths[i:i + size])
                     for i in range(0, batch.size, size)]
        return BatchShard(rows=list(range(batch.size)), values=torch.cat(parts))

    def get_logprobs(self, batch: TokenBatch) -> BatchShard:
        return self._all_logprobs(self.model, batch)

    def get_reference_logprobs(self, batch: TokenBatch) -> BatchShard:
        with self.reference.swapped_in():
            return self._all_logprobs(self.model, batch)

    def train(self, batch: TokenBatch, loss_fn: LossFunction) -> dict[str, float]:
        tokens, seqs = batch.loss_counts()  # global normalisers: micro-batch losses add up to the batch's
        size = int(self.policy["train_micro_batch_size"])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        for start in range(0, batch.size, size):
            mb = batch.select(range(start, min(start + size, batch.size)))
            loss, mb_metrics = loss_fn(self._logprobs(self.model, mb.input_ids, mb.input_lengths), mb,
                                       global_valid_tokens=tokens, global_valid_seqs=seqs)
            loss.backward()
            for key, value in mb_metrics.items():  # loss metrics are additive over micro-batches
                metrics[key] = metrics.get(key, 0.0) + float(value)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.policy["max_grad_norm"] or 1e9))
        if guard_enabled(self.policy):  # a NaN/Inf loss or gradient never reaches the weights
            check_finite(self.step + 1, {"loss": metrics.get("loss", 0.0), "grad_norm": float(grad_norm)}, backend="example")
        self.optimizer.step()
        self.step += 1
        return {**metrics, "grad_norm": float(grad_norm)}

    # ------------------------------------------------------------------ weights out

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        return HFWeightSource(self.model).weight_manifest(dtype)

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return HFWeightSource(self.model).export_weights(bucket_bytes, dtype)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        """One file, written to a temporary name and renamed, so a reader never sees half of it.
        One process holds everything, so fully_parallel_save and fully_parallel_load change nothing."""
        options = options or CheckpointOptions.from_section(self.section)
        self.finalize_checkpoint()  # one save at a time
        state = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                 "optimizer": copy.deepcopy(self.optimizer.state_dict()), "step": self.step,
                 "rng": rng_state(), "model_name": str(self.policy["model_name"])}
        Path(path).mkdir(parents=True, exist_ok=True)

        def write() -> None:
            staging = os.path.join(path, STATE_FILE + ".tmp")
            torch.save(state, staging)
            os.replace(staging, os.path.join(path, STATE_FILE))

        if options.async_save:
            self._pending_save = threading.Thread(target=write, name="example-checkpoint")
            self._pending_save.start()
        else:
            write()

    def finalize_checkpoint(self) -> None:
        if self._pending_save is not None:
            self._pending_save.join()
            self._pending_save = None

    def load_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        """Read and check everything first, then apply: a bad checkpoint raises before the worker changes."""
        options = options or CheckpointOptions.from_section(self.section)
        self.finalize_checkpoint()
        file = Path(path) / STATE_FILE
        if not file.is_file():
            raise NrlError(f"checkpoint {path} does not exist or is incomplete (no {STATE_FILE})")
        try:
            state = torch.load(file, weights_only=True)  # tensors and plain values only: nothing unpickled
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise NrlError(f"checkpoint {path} is truncated or corrupt ({type(exc).__name__})") from None
        current = self.model.state_dict()
        saved = state.get("model", {})
        if saved.keys() != current.keys() or any(saved[k].shape != current[k].shape for k in current):
            raise NrlError(f"checkpoint {path} is from another model ({state.get('model_name')}); "
                           f"this run trains {self.policy['model_name']}")
        self.model.load_state_dict(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        if options.load_rng:
            set_rng_state(state["rng"])
