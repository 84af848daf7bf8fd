"""``DTensorPolicyWorker``: one rank of the FSDP2/DTensor training backend, on the engine SDK.

It writes the engine primitives of :class:`nrl_core.api.TrainingEngine`: the model built and
parallelised (tensor parallelism, then FSDP2; at one data-parallel rank in float32 the model is
not wrapped, ``parallel.fsdp_needed``), a micro-batch laid out as padded or packed model inputs,
the forward, the backward with FSDP's gradient reduction once per step, and the optimizer step
with DTensor gradient clipping. The engine shards the global batch (ranks in one tensor-parallel
group share a shard, as DTensor TP requires identical inputs), plans the micro-batches, runs the
loss and reduces the metrics, and serves every scoring variant.

Reference logprobs come from the initial weights, a host copy of this rank's *shards* swapped into
the live parameters for the reference pass (:class:`nrl_core.sdk.ReferenceWeights`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from nrl_backend_dtensor import lora
from nrl_backend_dtensor import weights as weights_io
from nrl_backend_dtensor.checkpoint import CheckpointIO, TrainState
from nrl_backend_dtensor.checks import check_packing
from nrl_backend_dtensor.microbatch import ModelInputs, model_inputs
from nrl_backend_dtensor.model import LogprobModel, build_hf_model_on_meta, hf_name, load_hf_config, load_hf_model
from nrl_backend_dtensor.moe import RouterMetrics, check_tensor_parallel
from nrl_backend_dtensor.optim import build_optimizer, build_scheduler, clip_grad_norm
from nrl_backend_dtensor.parallel import apply_fsdp, apply_tensor_parallel, build_layout, output_head_unit
from nrl_backend_dtensor.sharded_load import LoadStats, checkpoint_index, load_own_shards, why_not_sharded
from nrl_core.api import (
    KINDS,
    CheckpointOptions,
    ConfigError,
    ForwardRequest,
    MicroBatch,
    NrlError,
    ReferenceWeights,
    TrainingEngine,
    WeightSpec,
    base_model_identity,
    dtype_name,
    init_reference_model,
    iter_buckets,
    logprob_temperature,
    main_group_timeout,
    map_large_host_allocations,
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


class DTensorPolicyWorker(TrainingEngine):
    """One training rank (see the module docstring and ``nrl_core.contracts.TrainingWorker``)."""

    backend_name = "dtensor"
    forward_outputs = frozenset(KINDS)
    lazy_imports = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")  # the HF model's load

    def __init__(self, config: dict[str, Any], rank: int | None = None, world_size: int | None = None) -> None:
        _ensure_process_group()
        map_large_host_allocations()  # before the first layer-sized buffer: the heap keeps no slack from them
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
        # FSDP's CPU offload moves device state to pinned host memory; where the device is the CPU
        # there is nothing to move (and pinning needs an accelerator), so it is a no-op there
        self.cpu_offload = bool(self.dcfg.get("cpu_offload")) and self.device.type != "cpu"

        model_name = self.policy["model_name"]
        trust = bool(self.policy.get("trust_remote_code", False))
        self.value_head = value_head_type(self.policy)  # reward model or critic: a score head, no logprobs
        self.hf_config = load_hf_config(model_name, trust_remote_code=trust,
                                        overrides=self.policy.get("hf_config_overrides"), value_head=self.value_head,
                                        tokenizer_source=self.tokenizer_source())
        self.lora = dict(self.dcfg.get("lora_cfg") or {}) if lora.enabled(self.dcfg.get("lora_cfg")) else None
        hf_model, checkpoint = self._build_model(model_name, trust)
        if self.lora is not None:
            lora.check_section(self.lora, self.layout.tp_size)
            lora.inject(hf_model, self.lora, self.seed)
        self.pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        if checkpoint is None and not self.cpu_offload:
            hf_model.to(self.device)
        check_tensor_parallel(self.hf_config, self.layout.tp_size)
        check_packing(self.policy, self.hf_config)
        self.router_metrics = RouterMetrics.attach(hf_model)
        apply_tensor_parallel(hf_model, self.layout, sequence_parallel=self.sequence_parallel,
                              custom_plan=self.dcfg.get("custom_parallel_plan"))
        if self.dcfg.get("activation_checkpointing"):
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = LogprobModel(hf_model, self.policy.get("logprob_chunk_size"), logprob_temperature(config),
                                  value_head=self.value_head is not None)
        self.fsdp = apply_fsdp(self.model, hf_model.model.layers, self.layout, param_dtype=getattr(torch, precision),
                               cpu_offload=self.cpu_offload, head=output_head_unit(hf_model))
        if checkpoint is not None:  # each rank reads only its own shards
            self.load_stats = load_own_shards(hf_model, model_name, checkpoint,
                                              torch.device("cpu") if self.cpu_offload else self.device)
        mark("model_loaded", rank=self.rank)

        trainable = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        self.optimizer = build_optimizer(trainable, self.policy.get("optimizer") or {})
        self.scheduler = build_scheduler(self.optimizer, self.policy.get("scheduler"))
        mark("optimizer_built", rank=self.rank)
        self.step = 0
        # with LoRA the reference policy is the base model: the adapters switched off, no copy; a
        # value model has none, nor a run that never asks for reference logprobs
        self.reference = ReferenceWeights(self.model.parameters()) \
            if self.lora is None and not self.value_head and init_reference_model(self.policy) else None
        if self.reference is not None:
            mark("reference_kept", rank=self.rank)
        # DCP async saves talk on their own group, with the main group's timeout (not torch's default)
        async_group = dist.new_group(backend="gloo", timeout=main_group_timeout())
        self.dp_rank, self.dp_size, self.dp_group = self.layout.dp_rank, self.layout.dp_size, self.layout.dp_group
        buffers = weights_io.buffer_names(self.model)
        self.checkpoint_io = CheckpointIO(TrainState(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            get_step=lambda: self.step, set_step=functools.partial(setattr, self, "step"),
            architecture={"model_type": self.hf_config.model_type,
                          "architectures": list(getattr(self.hf_config, "architectures", None) or [])},
            # parameters only: what a checkpoint of an earlier release recorded (buffers travel at refit)
            param_shapes={**{s.name: list(s.shape) for s in self.weight_manifest("float32") if s.name not in buffers},
                          **(lora.adapter_shapes(self.model) if self.lora else {})},
            async_group=async_group, frozen_in_checkpoints=self.lora is None,
            base_model=base_model_identity(model_name) if self.lora is not None else None))

    def _build_model(self, model_name: str, trust: bool) -> tuple[Any, dict[str, str] | None]:
        """The HF model on the meta device with the checkpoint's index, to be filled rank by rank
        once laid out (:mod:`nrl_backend_dtensor.sharded_load`); or, where that does not apply,
        loaded whole (index None) and the reason kept in ``load_stats``."""
        reason = "a value head has fresh weights to initialise" if self.value_head else \
            "LoRA adapters have fresh weights to initialise" if self.lora is not None else None
        if reason is None:
            index = checkpoint_index(model_name)
            meta = build_hf_model_on_meta(self.hf_config, trust_remote_code=trust)
            reason = why_not_sharded(meta, index)
            if reason is None:
                return meta, index
        self.load_stats = LoadStats(path=f"whole: {reason}")
        return load_hf_model(model_name, self.hf_config, trust_remote_code=trust, value_head=self.value_head), None

    # ------------------------------------------------------------------ engine primitives

    def lay_out(self, mbs: list[MicroBatch]) -> None:
        multiple = self.layout.tp_size if self.sequence_parallel else 1
        for mb in mbs:
            mb.inputs = model_inputs(mb.batch, self.policy, packed=mb.packed, pad_id=self.pad_id,
                                     width_multiple=multiple)

    def forward(self, mb: MicroBatch, request: ForwardRequest) -> tuple[torch.Tensor, ...]:
        """The model on ``mb``: token logprobs, or those of ``request.ids_field``, or the top-k, or values."""
        inputs: ModelInputs = mb.inputs
        extra: dict[str, Any] = {"topk": request.k} if request.kind == "topk" else {}
        if request.kind == "gathered":
            extra["gather_ids"] = to_device(inputs.to_model_layout(mb.batch.fields[request.ids_field]), self.device)
        routes = functools.partial(inputs.token_mask, mb.batch) if mb.train and not mb.padding else None
        with self.recording_routes(routes):
            out = self.model(to_device(inputs.input_ids, self.device), to_device(inputs.position_ids, self.device),
                             **extra)
        return tuple(inputs.to_padded(part, mb.batch, shifted=request.shifted)
                     for part in (out if isinstance(out, tuple) else (out,)))

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """FSDP averages gradients over data-parallel ranks, so the loss (a share of the global one)
        is scaled by their count. Gradients are reduced once, after the last micro-batch: until
        then each rank sums its own, as a reduce-scatter per layer and micro-batch would only move
        partial sums."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
        (loss * float(self.layout.dp_size)).backward()

    def optimizer_step(self, check: Callable[[float], None]) -> dict[str, float]:
        grad_norm = clip_grad_norm(self.model.parameters(), self.policy.get("max_grad_norm"))
        check(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}

    def step_metrics(self, micro_batches: int) -> dict[str, float]:
        return {} if self.router_metrics is None else self.router_metrics.collect(self.layout.dp_group)

    def after_scoring(self) -> None:
        self._reshard()

    @property
    def reports_results(self) -> bool:
        """Ranks of one tensor-parallel group hold the same outputs: its rank 0 returns them."""
        return self.layout.mesh.get_local_rank("tp") == 0

    @contextmanager
    def reference_policy(self) -> Iterator[None]:
        """The initial weights (swapped in from the host copy, then swapped back; with LoRA the
        base model's: the adapters switched off)."""
        if self.reference is None and self.lora is None:
            raise self.no_reference_policy()
        self._reshard()
        with self.reference.swapped_in() if self.reference is not None else lora.adapters_disabled(self.model):
            yield

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters, and the output head's, gathered after a forward
        without backward; put the shards back so that parameters() and state dicts see the sharded
        DTensors again."""
        if self.fsdp:
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # ------------------------------------------------------------------ memory hand-off (colocated)

    @property
    def moves_to_host(self) -> bool:
        """With FSDP's CPU offload the state already lives on the host between uses."""
        return super().moves_to_host and not self.cpu_offload

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
