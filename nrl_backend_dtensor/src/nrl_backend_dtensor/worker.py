"""``DTensorPolicyWorker``: one rank of the FSDP2/DTensor training backend.

The driver hands every rank the *full* global batch; each rank takes its data-parallel shard
(``batch.shard(dp_rank, dp_size)``: ranks in one tensor-parallel group share a shard, as DTensor
TP requires identical inputs; at one data-parallel rank in float32 the model is not wrapped in
FSDP, ``parallel.fsdp_needed``), runs micro-batches with gradient accumulation (reduced across ranks once, after the last
micro-batch) and steps the optimizer. Results that the driver reads (metrics, logprobs) are reduced or gathered so that every
rank returns the same global answer.

Reference logprobs come from the initial weights, a host copy of this rank's *shards* swapped into
the live parameters for the reference pass (:class:`nrl_core.sdk.ReferenceWeights`). The colocated
memory hand-off and the HF export are the SDK's (:class:`nrl_core.sdk.TrainingWorkerBase`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from nrl_backend_dtensor import lora
from nrl_backend_dtensor import weights as weights_io
from nrl_backend_dtensor.checkpoint import CheckpointIO, TrainState
from nrl_backend_dtensor.microbatch import MicroBatch, plan_micro_batches
from nrl_backend_dtensor.model import LogprobModel, hf_name, load_hf_config, load_hf_model
from nrl_backend_dtensor.moe import RouterMetrics, check_tensor_parallel
from nrl_backend_dtensor.optim import build_optimizer, build_scheduler, clip_grad_norm
from nrl_backend_dtensor.parallel import apply_fsdp, apply_tensor_parallel, build_layout
from nrl_core.api import (
    BatchShard,
    CheckpointOptions,
    ConfigError,
    LossFunction,
    NrlError,
    ReferenceWeights,
    TokenBatch,
    TopkShard,
    TrainingWorkerBase,
    WeightSpec,
    all_reduce,
    all_reduce_values,
    base_model_identity,
    check_batch_device,
    check_finite,
    dtype_name,
    guard_enabled,
    iter_buckets,
    logprob_temperature,
    main_group_timeout,
    model_device,
    parse_dtype,
    to_device,
    training_precision,
    value_head_type,
)
from nrl_core.api import timeline_mark as mark


def _ensure_process_group() -> None:
    if not dist.is_initialized():
        from nrl_core.api import init_local_group

        init_local_group()


class DTensorPolicyWorker(TrainingWorkerBase):
    """One training rank (see the module docstring and ``nrl_core.contracts.TrainingWorker``)."""

    backend_name = "dtensor"
    lazy_imports = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")  # the HF model's load

    def __init__(self, config: dict[str, Any], rank: int | None = None, world_size: int | None = None) -> None:
        _ensure_process_group()
        self.config = config
        self.policy: dict[str, Any] = config["policy"]
        self.dcfg: dict[str, Any] = self.policy.get("dtensor_config") or {}
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        if (self.rank, self.world_size) != (dist.get_rank(), dist.get_world_size()):
            raise NrlError(f"worker built as rank {self.rank}/{self.world_size} but the process group is rank "
                           f"{dist.get_rank()}/{dist.get_world_size()}")
        self.seed = int(self.policy["seed"])  # resolved at validation (nrl_core.config.validate)
        torch.manual_seed(self.seed)
        self.device = model_device()
        precision = training_precision(self.policy, self.device)
        self.layout = build_layout(self.device.type, int(self.dcfg.get("tensor_parallel_size", 1)),
                                   int(self.dcfg.get("context_parallel_size", 1)))
        gbs = self.policy.get("train_global_batch_size")
        if gbs is not None and gbs % self.layout.dp_size:
            raise ConfigError("policy.train_global_batch_size",
                              f"{gbs} does not divide over {self.layout.dp_size} data-parallel ranks")
        self.sequence_parallel = bool(self.dcfg.get("sequence_parallel")) and self.layout.tp_size > 1

        model_name = self.policy["model_name"]
        trust = bool(self.policy.get("trust_remote_code", False))
        self.value_head = value_head_type(self.policy)  # reward model or critic: a score head, no logprobs
        self.hf_config = load_hf_config(model_name, trust_remote_code=trust,
                                        overrides=self.policy.get("hf_config_overrides"), value_head=self.value_head,
                                        tokenizer_source=self.tokenizer_source())
        hf_model = load_hf_model(model_name, self.hf_config, trust_remote_code=trust, value_head=self.value_head)
        self.lora = dict(self.dcfg.get("lora_cfg") or {}) if lora.enabled(self.dcfg.get("lora_cfg")) else None
        if self.lora is not None:
            lora.check_section(self.lora, self.layout.tp_size)
            lora.inject(hf_model, self.lora, self.seed)
        mark("model_loaded", rank=self.rank)
        self.pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        if not self.dcfg.get("cpu_offload"):
            hf_model.to(self.device)
        check_tensor_parallel(self.hf_config, self.layout.tp_size)
        self.router_metrics = RouterMetrics.attach(hf_model)
        apply_tensor_parallel(hf_model, self.layout, sequence_parallel=self.sequence_parallel,
                              custom_plan=self.dcfg.get("custom_parallel_plan"))
        if self.dcfg.get("activation_checkpointing"):
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = LogprobModel(hf_model, self.policy.get("logprob_chunk_size"), logprob_temperature(config),
                                  value_head=self.value_head is not None)
        self.fsdp = apply_fsdp(self.model, hf_model.model.layers, self.layout, param_dtype=getattr(torch, precision),
                               cpu_offload=bool(self.dcfg.get("cpu_offload")))

        trainable = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        self.optimizer = build_optimizer(trainable, self.policy.get("optimizer") or {})
        self.scheduler = build_scheduler(self.optimizer, self.policy.get("scheduler"))
        mark("optimizer_built", rank=self.rank)
        self.train_step_count = 0
        # with LoRA the reference policy is the base model: the adapters switched off, no copy; a
        # value model has no reference policy
        self.reference = ReferenceWeights(self.model.parameters()) if self.lora is None and not self.value_head \
            else None
        # DCP async saves talk on their own group, with the main group's timeout (not torch's default)
        async_group = dist.new_group(backend="gloo", timeout=main_group_timeout())
        self.checkpoint_io = CheckpointIO(TrainState(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            get_step=lambda: self.train_step_count, set_step=self._set_step,
            architecture={"model_type": self.hf_config.model_type,
                          "architectures": list(getattr(self.hf_config, "architectures", None) or [])},
            param_shapes={**{s.name: list(s.shape) for s in self.weight_manifest("float32")},
                          **(lora.adapter_shapes(self.model) if self.lora else {})},
            async_group=async_group, frozen_in_checkpoints=self.lora is None,
            base_model=base_model_identity(model_name) if self.lora is not None else None))

    # ------------------------------------------------------------------ helpers

    def _set_step(self, step: int) -> None:
        self.train_step_count = step

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters gathered after a forward without backward; put the
        shards back so that parameters() and state dicts see the sharded DTensors again."""
        if self.fsdp:
            self.model.reshard()

    def _local_batch(self, batch: TokenBatch) -> TokenBatch:
        if batch.size % self.layout.dp_size:
            raise NrlError(f"a batch of {batch.size} sequences does not divide over {self.layout.dp_size} "
                           f"data-parallel ranks; make the global batch a multiple of {self.layout.dp_size}")
        return batch.shard(self.layout.dp_rank, self.layout.dp_size)

    def _plan(self, local: TokenBatch, train: bool) -> list[MicroBatch]:
        plan = plan_micro_batches(local, self.policy, train=train, pad_id=self.pad_id,
                                  width_multiple=self.layout.tp_size if self.sequence_parallel else 1,
                                  seed=self.seed + self.train_step_count)
        # every rank must run the same number of forwards (FSDP and TP collectives)
        count = all_reduce(torch.tensor([len(plan)], dtype=torch.long), op=dist.ReduceOp.MAX)
        return plan + [None] * (int(count) - len(plan))  # type: ignore[list-item]

    def _forward(self, mb: MicroBatch, sub: TokenBatch | None = None, ids_field: str | None = None,
                 topk: int = 0) -> Any:
        """The model on ``mb``: token logprobs, or those of ``sub.fields[ids_field]``, or the top-k."""
        extra: dict[str, Any] = {"topk": topk} if topk else {}
        if ids_field is not None and sub is not None:
            extra["gather_ids"] = to_device(mb.to_model_layout(sub.fields[ids_field]), self.device)
        return self.model(to_device(mb.input_ids, self.device), to_device(mb.position_ids, self.device), **extra)

    def _dummy(self, local: TokenBatch) -> tuple[MicroBatch, TokenBatch]:
        sub = local.select([0])
        return plan_micro_batches(sub, {"train_micro_batch_size": 1, "logprob_batch_size": 1}, train=True,
                                  pad_id=self.pad_id, width_multiple=self.layout.tp_size)[0], sub

    # ------------------------------------------------------------------ training

    def train(self, batch: TokenBatch, loss_fn: LossFunction) -> dict[str, float]:
        """One optimizer step on the global ``batch`` (see module docstring); metrics are global."""
        self.require_on_device("train")
        self.require_loss_fits(loss_fn)
        start = time.perf_counter()
        self.model.train()
        local = self._local_batch(batch)
        valid_tokens, valid_seqs = local.loss_counts()
        global_tokens, global_seqs, tokens_seen = all_reduce_values(
            [valid_tokens, valid_seqs, float(local.input_lengths.sum())], group=self.layout.dp_group)

        self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.optimizer.param_groups[0]["lr"])
        sums: dict[str, float] = {}
        loss_total = 0.0
        plan = self._plan(local, train=True)
        for i, mb in enumerate(plan):
            # Gradients are reduced once, after the last micro-batch: until then each rank sums its
            # own, as a reduce-scatter per layer and micro-batch would only move partial sums.
            if self.fsdp:
                self.model.set_requires_gradient_sync(i == len(plan) - 1)
            dummy = mb is None
            if dummy:
                mb, sub = self._dummy(local)
            else:
                sub = local.select(mb.rows)
            with self.recording_routes(None if dummy else functools.partial(mb.token_mask, sub)):
                logprobs = mb.to_padded(self._forward(mb, sub, getattr(loss_fn, "gather_ids_field", None)), sub,
                                        shifted=not self.value_head)
            sub = to_device(sub, logprobs.device)  # what the loss reads, where the logprobs are
            check_batch_device(sub, logprobs.device, "dtensor train")
            loss, metrics = loss_fn(logprobs, sub, global_valid_tokens=global_tokens, global_valid_seqs=global_seqs)
            # FSDP averages gradients over dp ranks; the loss is already a share of the global
            # loss, so scale by dp to get the sum. A padding micro-batch contributes nothing.
            (loss * (0.0 if dummy else float(self.layout.dp_size))).backward()
            if not dummy:
                loss_total += float(loss.detach())
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        grad_norm = clip_grad_norm(self.model.parameters(), self.policy.get("max_grad_norm"))
        keys = sorted(sums)
        reduced = all_reduce_values([loss_total] + [sums[k] for k in keys], group=self.layout.dp_group)
        if guard_enabled(self.policy):  # both values are global: every rank raises together
            check_finite(self.train_step_count + 1, {"loss": reduced[0], "grad_norm": grad_norm}, backend="dtensor")
        self.optimizer.step()
        self.scheduler.step()
        self.train_step_count += 1

        seconds = all_reduce_values([time.perf_counter() - start], op=dist.ReduceOp.MAX)[0]
        out = dict(zip(keys, reduced[1:]))
        out.update(loss=reduced[0], grad_norm=grad_norm, lr=lr, num_tokens=tokens_seen,
                   num_valid_tokens=global_tokens, step_seconds=seconds)
        if self.router_metrics is not None:
            out.update(self.router_metrics.collect(self.layout.dp_group))
        return out

    # ------------------------------------------------------------------ logprobs

    @torch.no_grad()
    def get_logprobs(self, batch: TokenBatch) -> BatchShard | None:
        """Float32 logprobs of this data-parallel group's shard under the current weights; the
        group's tensor-parallel rank 0 returns them, the other ranks ``None``."""
        self.require_lm_head("get_logprobs")
        self.require_on_device("get_logprobs")
        out = self._per_token(batch, lambda mb, sub: (self._forward(mb, sub),))
        return None if out is None else BatchShard(rows=out[0], values=out[1].float())

    @torch.no_grad()
    def get_gathered_logprobs(self, batch: TokenBatch, ids_field: str) -> BatchShard | None:
        """Logprobs ``[n, T, k]`` of the ids in ``batch.fields[ids_field]`` (``TopkScorer``)."""
        self.require_lm_head("get_gathered_logprobs")
        self.require_on_device("get_gathered_logprobs")
        out = self._per_token(batch, lambda mb, sub: (self._forward(mb, sub, ids_field),))
        return None if out is None else BatchShard(rows=out[0], values=out[1].float())

    @torch.no_grad()
    def get_topk_logprobs(self, batch: TokenBatch, k: int) -> TopkShard | None:
        """The ``k`` likeliest next tokens at every position, logprobs and ids (``TopkScorer``)."""
        self.require_lm_head("get_topk_logprobs")
        self.require_on_device("get_topk_logprobs")
        out = self._per_token(batch, lambda mb, sub: self._forward(mb, topk=k))
        return None if out is None else TopkShard(rows=out[0], logprobs=out[1].float(), ids=out[2].long())

    @torch.no_grad()
    def get_values(self, batch: TokenBatch) -> BatchShard | None:
        """The value head at every position, ``[n, T]`` (``ValueScorer``), returned as logprobs are."""
        self.require_value_head("get_values")
        self.require_on_device("get_values")
        out = self._per_token(batch, lambda mb, sub: (self._forward(mb, sub),))
        return None if out is None else BatchShard(rows=out[0], values=out[1].float())

    def _per_token(self, batch: TokenBatch, run: Any) -> tuple[list[int], ...] | None:
        """``run(mb, sub)``'s per-token outputs over this rank's shard, in the padded layout; on the
        group's tensor-parallel rank 0 ``(rows, *outputs)``, elsewhere ``None``."""
        self.model.eval()
        local = self._local_batch(batch)
        width = int(batch.input_ids.shape[1])
        outs: list[torch.Tensor] | None = None
        for mb in self._plan(local, train=False):
            if mb is None:
                mb, sub = self._dummy(local)
                run(mb, sub)
                continue
            sub = local.select(mb.rows)
            parts = [mb.to_padded(part, sub, shifted=not self.value_head).cpu() for part in run(mb, sub)]
            if outs is None:
                outs = [torch.zeros((local.size, width, *p.shape[2:]), dtype=p.dtype) for p in parts]
            for out, part in zip(outs, parts):
                out[mb.rows, :part.shape[1]] = part
        self._reshard()
        if self.layout.mesh.get_local_rank("tp") != 0:
            return None
        rows = batch.shard_rows(self.layout.dp_rank, self.layout.dp_size)
        if outs is None:  # no rows on this rank
            outs = [torch.zeros((0, width))]
        return (rows, *outs)

    @torch.no_grad()
    def get_reference_logprobs(self, batch: TokenBatch) -> BatchShard | None:
        """Logprobs under the initial weights (swapped in from the host copy, then swapped back;
        with LoRA, the base model's: the adapters switched off)."""
        self.require_lm_head("get_reference_logprobs")
        self._reshard()
        with self.reference.swapped_in() if self.reference is not None else lora.adapters_disabled(self.model):
            return self.get_logprobs(batch)

    # ------------------------------------------------------------------ memory hand-off (colocated)

    @property
    def moves_to_host(self) -> bool:
        """With FSDP's CPU offload the state already lives on the host between uses."""
        return super().moves_to_host and not self.dcfg.get("cpu_offload")

    # ------------------------------------------------------------------ weights out

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        self._reshard()
        return weights_io.manifest(self.model, dtype, lora.merged_shapes(self.model) if self.lora else None)

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full weights; with LoRA each adapter is merged into its base weight."""
        self._reshard()
        merged = lora.merged_named_tensors(self.model) if self.lora else None
        return weights_io.export_buckets(self.model, bucket_bytes, dtype, merged)

    # adapter-only refit (contract 9, policy.refit.adapters): the engine applies them to its base
    def adapter_config(self) -> dict[str, Any]:
        return lora.peft_config(self._lora_section("adapter_config"), str(self.policy["model_name"]))

    def adapter_manifest(self, dtype: str) -> list[WeightSpec]:
        self._lora_section("adapter_manifest")
        return [WeightSpec(name=name, shape=tuple(shape), dtype=dtype_name(parse_dtype(dtype)))
                for name, shape in lora.peft_shapes(self.model)]

    def export_adapter(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The adapters, whole, cast to ``dtype``. Collective under FSDP."""
        self._lora_section("export_adapter")
        self._reshard()
        target = parse_dtype(dtype)
        return iter_buckets(((n, t.detach().to(target)) for n, t in lora.peft_named_tensors(self.model)), bucket_bytes)

    def _lora_section(self, method: str) -> dict[str, Any]:
        if self.lora is None:
            raise NrlError(f"dtensor {method}: this worker trains full weights; adapter-only refit needs LoRA "
                           f"({lora.KEY}.enabled: true), or set policy.refit.adapters: false")
        return self.lora

    def export_hf(self, path: str) -> None:
        """A Hugging Face directory: the model, or with LoRA the PEFT adapter (``lora_cfg.export:
        merged`` writes the base with the adapters merged in instead). Collective."""
        if self.lora is None or self.lora["export"] == "merged":
            return super().export_hf(path)
        self._reshard()
        lora.write_adapter(self.model, self.lora, str(self.policy["model_name"]), path,
                           tokenizer_source=self.tokenizer_source(), writer=dist.get_rank() == 0)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        self.require_on_device("save_checkpoint")
        self.checkpoint_io.save(path, options or CheckpointOptions.from_section(self.dcfg))

    def load_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        self.require_on_device("load_checkpoint")
        self.checkpoint_io.load(path, options or CheckpointOptions.from_section(self.dcfg))

    def finalize_checkpoint(self) -> None:
        self.checkpoint_io.finalize()

    def parameter_names(self) -> list[str]:
        """HF names of the trainable parameters (what checkpoints and exports use)."""
        return [hf_name(n) for n, _ in self.model.named_parameters()]
