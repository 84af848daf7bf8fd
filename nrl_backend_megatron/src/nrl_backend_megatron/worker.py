"""``MegatronPolicyWorker``: one rank of the Megatron-Core training backend.

Built as ``MegatronPolicyWorker(config, rank, world_size)`` with the whole validated nrl config
(a plain dict). It starts torch.distributed if nobody did (a world on gloo without CUDA), creates
Megatron's parallel groups, converts the HF checkpoint once (see ``checkpoint_dir``), builds the
``GPTModel`` stage of this rank, wraps it in Megatron's DDP and builds Megatron's optimizer and
scheduler. The driver hands every rank the *full* global batch; each rank takes its
data-parallel shard and all ranks of a pipeline run the same micro-batches.

With ``policy.reward_model_cfg.enabled`` (capability ``value_head``) the last stage has a scalar
head in place of the output layer (:mod:`nrl_backend_megatron.value_head`): the worker gives values
(``get_values``, and to losses with ``reads_values``) instead of logprobs and exports HF's classifier.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nrl_backend_megatron import cpu_shim, lora
from nrl_backend_megatron import value_head as heads
from nrl_backend_megatron.batching import ModelInputs, packed_inputs, padded_inputs, round_up, token_logprobs
from nrl_backend_megatron.checkpoint_dir import (
    CheckpointDirError,
    Conversion,
    converted_dir,
    ensure_converted,
    identity,
    require_converted,
)
from nrl_backend_megatron.checks import check_value_head, layout_of, logging_level
from nrl_backend_megatron.convert import canonical_shapes, family_of, megatron_to_hf_stream
from nrl_backend_megatron.convert.families import head_kind
from nrl_backend_megatron.convert.megatron_checkpoint import MegatronCheckpointError, check_tensors, locate_checked
from nrl_backend_megatron.convert.sharded import convert_in_subprocess, load_shard, save_conversion, sharded_state_for
from nrl_backend_megatron.memory import check_recompute, empty_unused_memory, release_storage
from nrl_backend_megatron.model import DTYPES, build_model, te_available, transformer_config
from nrl_backend_megatron.moe import RouterMetrics, check_moe_section, freeze_router, is_moe, mark_experts_parallel
from nrl_backend_megatron.optim import (
    build_optimizer,
    fresh_optimizer,
    load_optimizer_state,
    main_params,
    optimizer_step,
    ready_to_load,
)
from nrl_backend_megatron.parallel import check_layout, ensure_process_group, init_model_parallel
from nrl_backend_megatron.reference import ShardedReference
from nrl_backend_megatron.weights import iter_full_tensors
from nrl_core.api import (
    KINDS,
    CheckpointOptions,
    Consume,
    ForwardRequest,
    MicroBatch,
    NonFiniteError,
    NrlError,
    ReferenceWeights,
    TrainingEngine,
    WeightSpec,
    all_reduce,
    base_model_identity,
    broadcast,
    check_batch_device,
    guard_enabled,
    host_copy,
    init_reference_model,
    logprob_temperature,
    map_large_host_allocations,
    model_device,
    move_optimizer_state,
    move_tensors,
    next_token_logprobs_at,
    next_token_topk,
    to_device,
    token_budget,
    training_precision,
    value_head_type,
)
from nrl_core.api import NONFINITE_KEY as NAN_KEY
from nrl_core.api import timeline_mark as mark

logger = logging.getLogger(__name__)

MEGATRON_LOGGERS = ("megatron", "megatron.core")
#: The distributed optimizer's state as Megatron-LM writes it by default: each rank its own
#: buffer ranges, with no gather, and a checkpoint that loads at another data-parallel size.
OPTIMIZER_CHECKPOINT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def set_megatron_logging(level: int | str) -> int:
    """Apply ``logging_level`` to Megatron-Core's loggers; returns the numeric level."""
    numeric = logging_level(level)
    for name in MEGATRON_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
    return numeric


def _resolve_model_path(name: str) -> str:
    if os.path.isdir(name):
        return name
    from huggingface_hub import snapshot_download

    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])


class MegatronPolicyWorker(TrainingEngine):
    """One rank of the Megatron-Core backend (see the module docstring)."""

    backend_name = "megatron"
    forward_outputs = frozenset(KINDS)
    lazy_imports = ("megatron.core", "megatron.core.models.gpt.gpt_model", "megatron.core.optimizer",
                    "transformers.modeling_utils")  # what building the GPT model and its optimizer imports

    def __init__(self, config: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        cpu_shim.install()
        map_large_host_allocations()  # before the first layer-sized buffer: the heap keeps no slack from them
        from transformers import AutoConfig

        self.rank = rank
        self.config = dict(config)
        policy = self.config["policy"]
        self.policy = policy
        self.temperature = logprob_temperature(self.config)
        self.cfg = dict(policy["megatron_cfg"])
        set_megatron_logging(self.cfg.get("logging_level", logging.INFO))
        if policy.get("optimizer"):
            logger.warning("policy.optimizer is ignored by the Megatron backend; configure "
                           "policy.megatron_cfg.optimizer and policy.megatron_cfg.scheduler instead")
        self.model_name = str(policy["model_name"])
        self.model_path = _resolve_model_path(self.model_name)
        self.overrides = dict(policy.get("hf_config_overrides") or {})
        hf_config = AutoConfig.from_pretrained(self.model_path,
                                               trust_remote_code=bool(policy.get("trust_remote_code", False)))
        for key, value in self.overrides.items():
            setattr(hf_config, key, value)
        family_of(hf_config)
        self.value_head = value_head_type(policy)  # reward model or critic: a score head, no logprobs
        check_value_head(policy, self.cfg, hf_config)
        self.source_config = hf_config  # what the checkpoint holds: the conversion's model
        self.hf_config = heads.model_config(hf_config, self.value_head, self.tokenizer_source())  # trained, exported
        self.layout = layout_of(self.cfg)
        self.device = model_device()
        check_moe_section(self.cfg, hf_config, te_available())
        check_recompute(self.cfg, hf_config, transformer_engine=te_available())
        self.empty_unused_memory_level = int(self.cfg.get("empty_unused_memory_level") or 0)
        self.cache_empties: Counter[str] = Counter()  # where the level emptied the CUDA cache (memory.py)
        check_layout(self.layout, world_size, hf_config)
        timeout = self.cfg.get("distributed_timeout_minutes")
        self.started_process_group = ensure_process_group(rank, world_size, timeout)
        init_model_parallel(self.layout, timeout)
        self._groups()
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(int(policy["seed"]))  # resolved at validation
        self.conversion = self._convert()
        self._build()
        self.step = 0

    # ------------------------------------------------------------------ setup
    def _groups(self) -> None:
        from megatron.core import parallel_state as ps

        self.tp_group, self.tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        self.pp_group, self.pp_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
        self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        self.dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        self.ep_group = ps.get_expert_model_parallel_group()
        self.is_first_stage, self.is_last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()

    def _convert(self) -> Conversion:
        """The one-time HF → Megatron conversion, shared by all ranks and runs (see checkpoint_dir).

        Rank 0 converts (under the file lock) or reuses; the others wait, then must find the
        finished conversion in the same directory: they never convert a second copy. Only with
        ``convert_on_each_node`` (a directory that is not shared, by choice) does the first rank of
        every node (``LOCAL_RANK`` 0) convert its node's own copy.
        """
        if self.cfg.get("pretrained_checkpoint"):
            return self._pretrained()
        target = converted_dir(self.model_name, self.overrides)
        expected = {**identity(self.model_name, self.source_config.to_dict(), self.overrides),
                    "transformer_engine": te_available()}  # TE and local layers store different keys
        per_node = bool(self.cfg.get("convert_on_each_node")) and int(os.environ.get("LOCAL_RANK", "-1")) == 0
        result = None
        if dist.get_rank() == 0 or per_node:
            result = ensure_converted(target, expected, self._write_conversion,
                                      force=bool(self.cfg["force_reconvert_from_hf"]))
        dist.barrier()
        problem = None
        if result is None:
            try:
                result = require_converted(target, expected, dist.get_rank())
            except CheckpointDirError as exc:
                problem = str(exc)
        # Every rank learns of a rank that cannot see it, so none waits in the load's collectives.
        _raise_first_problem(problem, CheckpointDirError)
        return result

    def _pretrained(self) -> Conversion:
        """The Megatron checkpoint ``pretrained_checkpoint`` names, checked on every rank (each must
        see it) against the HF config before any rank reads a tensor; no conversion."""
        problem = None
        try:
            checkpoint = locate_checked(self.cfg["pretrained_checkpoint"], self.hf_config, self.model_name)
        except MegatronCheckpointError as exc:
            problem = f"rank {dist.get_rank()} on {socket.gethostname()}: {exc}" if dist.get_rank() else str(exc)
        _raise_first_problem(problem, MegatronCheckpointError)
        logger.info("starting from the %s checkpoint %s", checkpoint.layout, checkpoint.path)
        return Conversion(checkpoint.path, converted=False)

    def _write_conversion(self, out: Path) -> None:
        trust = bool(self.policy.get("trust_remote_code", False))
        if dist.get_world_size() == 1:  # Megatron's state is at TP=PP=EP=1 already: no child needed
            save_conversion(self.model_path, str(out), self.cfg, self.overrides, trust)
        else:
            convert_in_subprocess(self.model_path, out, self.cfg, self.overrides, trust)

    def _build(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        precision = training_precision(self.policy, self.device)
        self.precision = self.export_dtype = precision
        dtype = DTYPES[precision]
        pipeline_dtype = DTYPES[self.cfg["pipeline_dtype"]] if self.cfg.get("pipeline_dtype") else None
        self.tconfig = transformer_config(
            self.hf_config, self.layout, params_dtype=dtype, pipeline_dtype=pipeline_dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, moe=self.cfg, recompute=self.cfg)
        self.hf_config_dropout()
        model = build_model(self.hf_config, self.tconfig, pre_process=self.is_first_stage,
                                post_process=self.is_last_stage).to(self.device)
        ddp_section = self.cfg["distributed_data_parallel_config"]
        opt_section = self.cfg["optimizer"]
        # The distributed optimizer's DDP copies each trained weight into a contiguous buffer: the
        # model's own storage goes first and the checkpoint loads into the buffer, so a rank never
        # holds its weights twice. A LoRA base is frozen, outside the buffer, and loads as it is.
        with_lora = lora.enabled(self.cfg.get("peft"))
        into_buffers = bool(opt_section["use_distributed_optimizer"]) and not with_lora
        if not into_buffers:
            self._load_weights(model)
        self.model = model
        self.adapters = None
        if with_lora:
            lora.check_section(self.cfg["peft"], transformer_engine=te_available())
            self.adapters = lora.attach(model, self.cfg["peft"], int(self.policy["seed"]), self.tp_rank, self.layout.tp)
            self._adapter_shapes = lora.global_shapes(self.adapters, self.layout.tp, self.pp_group, self.layout.pp)
        self.router_metrics = None
        if is_moe(self.hf_config):
            mark_experts_parallel(model)
            if self.cfg.get("freeze_moe_router"):
                freeze_router(model)
            self.router_metrics = RouterMetrics(model, self.tconfig, tp_rank=self.tp_rank, tp_size=self.layout.tp)
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=ddp_section["grad_reduce_in_fp32"],
            overlap_grad_reduce=ddp_section["overlap_grad_reduce"],
            overlap_param_gather=ddp_section["overlap_param_gather"],
            average_in_collective=ddp_section["average_in_collective"],
            use_distributed_optimizer=opt_section["use_distributed_optimizer"],
            check_for_nan_in_grad=bool(self.cfg.get("check_for_nan_in_grad", True)) and guard_enabled(self.policy),
        )
        if into_buffers:
            release_storage(p for p in model.parameters() if p.requires_grad)  # DDP's buffers replace them
        self.ddp = DistributedDataParallel(config=self.tconfig, ddp_config=self.ddp_config, module=model)
        if into_buffers:
            self._load_weights(model)  # before the optimizer, whose main weights copy the loaded ones
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.opt = build_optimizer([self.ddp], self.cfg, precision)
        if dtype != torch.float32:
            self.tconfig.grad_scale_func = self.opt.optimizer.scale_loss
        # host: not a second model on the device; copied in and out, since the parameters are
        # views into the DDP buffers
        # with LoRA the reference policy is the base model: the adapters switched off, no copy; a
        # value model has none, nor a run that never asks for reference logprobs
        self.reference: ReferenceWeights | ShardedReference | None = None
        if self.adapters is None and not self.value_head and init_reference_model(self.policy):
            if self.ddp_config.use_distributed_optimizer:  # each data-parallel rank keeps its own range
                groups = [*self.ddp.bucket_groups, *getattr(self.ddp, "expert_parallel_bucket_groups", [])]
                self.reference = ShardedReference(groups, self._unbuffered_params())
            else:
                self.reference = ReferenceWeights(model.parameters(), by_storage=False)
            mark("reference_kept", rank=self.rank)
        from nrl_backend_megatron.ckpt_io import CheckpointIO, register_exit_finalizer

        self.ckpt = CheckpointIO({"model_name": self.model_name, "tp": self.layout.tp, "pp": self.layout.pp,
                                  "config_sha": identity(self.model_name, self.hf_config.to_dict(),
                                                         self.overrides)["config_sha"],
                                  **({"value_head": self.value_head} if self.value_head else {}),
                                  **({"lora_base": base_model_identity(self.cfg.get("pretrained_checkpoint")
                                                                       or self.model_path),
                                      "lora_adapters": lora.adapter_shapes(self.adapters)} if self.adapters else {})},
                                 distributed_optimizer=self.ddp_config.use_distributed_optimizer)
        register_exit_finalizer(self.finalize_checkpoint)

    def _load_weights(self, model: Any) -> None:
        """This rank's part of the converted (or pretrained Megatron) checkpoint, read into
        ``model``'s parameters in place; a fresh value head is initialised instead of read."""
        sharded = sharded_state_for(model, self.conversion.path)
        if self.cfg.get("pretrained_checkpoint"):
            problem = None
            try:
                check_tensors(self.conversion.path, sharded, self.model_name)
            except MegatronCheckpointError as exc:
                problem = str(exc)
            _raise_first_problem(problem, MegatronCheckpointError)
        fresh = self._fresh_head(sharded)
        load_shard(model, self.conversion.path, sharded, fresh)  # this rank's part only
        del sharded  # views of the parameters' storage: none outlives the load
        if fresh:
            heads.initialise(model, float(getattr(self.hf_config, "initializer_range", 0.02)),
                                  int(self.policy["seed"]))

    def _fresh_head(self, sharded: Mapping[str, Any]) -> tuple[str, ...]:
        """The value head's keys when the checkpoint is a causal LM's (its ``lm_head`` is no use to
        a value model): initialised here rather than loaded. A classifier checkpoint's head loads."""
        if not self.value_head or head_kind(self.source_config) is not None:
            return ()
        return tuple(k for k in sharded if k.startswith("output_layer."))

    def hf_config_dropout(self) -> None:
        """HF's ``attention_dropout`` is Megatron's ``attention_dropout`` (0 for released models)."""
        self.tconfig.attention_dropout = float(getattr(self.hf_config, "attention_dropout", 0.0) or 0.0)

    # ------------------------------------------------------------------ engine primitives
    def lay_out(self, mbs: list[MicroBatch]) -> None:
        """Padded rows share the shard's width (pipeline stages pass activations of one shape); with
        dynamic batching each micro-batch has its own; packed bins fill one row of the token budget."""
        multiple = self.layout.tp if self.layout.sequence_parallel else 1  # sequence parallelism splits it
        packing = self.policy.get("sequence_packing") or {}
        dynamic = self.policy.get("dynamic_batching") or {}
        if packing.get("enabled"):
            tokens = round_up(token_budget(self.policy, train=mbs[0].train) or 0, multiple)
            for mb in mbs:
                mb.inputs = packed_inputs(mb.batch, tokens, int(packing.get("sequence_length_round") or 1))
            return
        if dynamic.get("enabled"):
            round_to = int(dynamic.get("sequence_length_round") or 1)
            for mb in mbs:
                width = round_up(round_up(int(mb.batch.input_lengths.max()), round_to), multiple)
                mb.inputs = padded_inputs(mb.batch, width)
            return
        if self.layout.pp > 1 and len({mb.batch.size for mb in mbs}) > 1:
            raise ValueError(f"this rank's {sum(len(mb.rows) for mb in mbs)} sequences do not divide into equal "
                             "micro-batches; make the global batch a multiple of micro-batch size x data-parallel size")
        width = round_up(max(int(mb.batch.input_ids.shape[1]) for mb in mbs), multiple)
        for mb in mbs:
            mb.inputs = padded_inputs(mb.batch, width)

    def run_micro_batches(self, mbs: list[MicroBatch], request: ForwardRequest, consume: Consume) -> None:
        """Megatron's pipeline schedule runs the micro-batches; its loss function hands each one's
        outputs to the engine (on the last stage). Megatron divides the loss by the micro-batch
        count and its DDP averages over data-parallel ranks: the loss is scaled back by both."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        train = mbs[0].train
        scale = float(len(mbs) * self.dp_size)

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            inputs = to_device(mb.inputs, self.device)
            with self.recording_routes(mb.inputs.token_mask if train and not mb.padding else None):  # host copy
                out = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed)
            return out, partial(loss_func, mb, inputs)

        def loss_func(mb: MicroBatch, inputs: ModelInputs, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            check_batch_device(inputs.rows, output.device, f"megatron {'train' if train else 'scoring'}")
            # the rows already on the device, so the engine does not copy them again
            loss = consume(dataclasses.replace(mb, batch=inputs.rows), self._outputs(inputs, output, request))
            return (output.new_zeros(()) if loss is None else loss * scale), {}

        shape = mbs[0].inputs.input_ids.shape
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.ddp], num_microbatches=len(mbs),
                seq_length=int(shape[1]), micro_batch_size=int(shape[0]), forward_only=not train)
        except RuntimeError as exc:
            if train and ("nan" in str(exc).lower() or "inf" in str(exc).lower()):
                raise NonFiniteError(f"training step {self.step + 1} (megatron): non-finite gradients found by "
                                     f"Megatron-Core's check ({str(exc).splitlines()[0][:160]}); stopped before the "
                                     f"optimizer step (policy.megatron_cfg.check_for_nan_in_grad: false or "
                                     f"{NAN_KEY}: false trains on regardless)") from None
            raise
        if train:
            self._empty_unused_memory("after_forward_backward")

    def _outputs(self, inputs: ModelInputs, output: torch.Tensor, request: ForwardRequest) -> tuple[torch.Tensor, ...]:
        """What ``request`` asks for from the last stage's output: logprobs from the
        vocabulary-parallel logits without a full-vocabulary gather (:mod:`nrl_core.sdk.vocab`), or
        the value head's ``[b, S, 1]`` as ``[b, S]`` float32."""
        if request.kind == "values":
            return (inputs.row_values(output.squeeze(-1).float()),)
        if request.kind == "topk":
            lp, ids = next_token_topk(output, request.k, temperature=self.temperature, tp_group=self.tp_group,
                                      vocab_size=self.hf_config.vocab_size)
            return inputs.row_logprobs(lp), inputs.row_logprobs(ids)
        if request.kind == "gathered":
            ids = inputs.to_model_layout(inputs.rows.fields[request.ids_field]).to(output.device)
            return (inputs.row_logprobs(next_token_logprobs_at(output, ids, temperature=self.temperature,
                                                                tp_group=self.tp_group)),)
        return (inputs.row_logprobs(token_logprobs(output, inputs.input_ids, self.temperature)),)

    def set_mode(self, train: bool) -> None:
        self.ddp.train(train)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.optimizer.zero_grad()
        if self.router_metrics is not None:
            self.router_metrics.reset()

    def optimizer_step(self, check: Callable[[float], None]) -> dict[str, float]:
        updated, grad_norm = optimizer_step(self.opt, lambda norm: check(float("nan") if norm is None else norm))
        self._empty_unused_memory("after_optimizer_step")
        if updated:
            self.opt.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "lr": float(self.opt.optimizer.param_groups[0]["lr"]), "updated": float(updated)}

    def step_metrics(self, micro_batches: int) -> dict[str, float]:
        if self.router_metrics is None:
            return {}
        return self.router_metrics.collect(micro_batches, self.dp_size // self.layout.cp)

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Only the last pipeline stage computed the loss: its names and sums go to the other
        stages first, then every stage sums over data-parallel ranks."""
        names_obj = [sorted(sums)]
        if self.layout.pp > 1:
            dist.broadcast_object_list(names_obj, src=dist.get_global_rank(self.pp_group, self.layout.pp - 1),
                                       group=self.pp_group)
        names = names_obj[0]
        values = torch.tensor([sums.get(k, 0.0) for k in names] if self.is_last_stage else [0.0] * len(names),
                              dtype=torch.float64)
        if self.layout.pp > 1:
            broadcast(values, src=dist.get_global_rank(self.pp_group, self.layout.pp - 1), group=self.pp_group)
        if self.dp_size > 1:
            all_reduce(values, group=self.dp_group)
        return {k: float(v) for k, v in zip(names, values.tolist())}

    @property
    def reports_results(self) -> bool:
        """The group's tensor-parallel rank 0 on the last pipeline stage has the outputs."""
        return self.is_last_stage and self.tp_rank == 0

    @contextmanager
    def reference_policy(self) -> Iterator[None]:
        """The initial weights swapped in (with LoRA: the adapters switched off)."""
        if self.reference is None and self.adapters is None:
            raise self.no_reference_policy()
        self._sync_params()  # else the pending gather would overwrite the swapped-in weights
        with self.reference.swapped_in() if self.reference is not None else lora.disabled(self.adapters):
            self._empty_unused_memory("reference_swapped_in")
            yield
        self._empty_unused_memory("reference_swapped_out")

    def _empty_unused_memory(self, point: str) -> None:
        """``empty_unused_memory_level``: empty the CUDA cache at ``point`` where NeMo RL's worker does."""
        if empty_unused_memory(self.empty_unused_memory_level, point):
            self.cache_empties[point] += 1

    # ------------------------------------------------------------------ memory hand-off (colocated)
    def prepare_for_training(self) -> None:
        super().prepare_for_training()
        self._empty_unused_memory("after_prepare_for_training")

    def offload_training_state(self) -> None:
        """Free the gradient buffers and move the optimizer state and the fp32 main parameters of
        mixed precision to host memory. A pending asynchronous save still references the device
        tensors, so it is finished first."""
        self.finalize_checkpoint()
        # the fp32 main parameters' gradients are the step's copies of the (bf16) gradient buffers:
        # the buffers' offload does not free them, and the next step rebuilds them
        self.opt.optimizer.zero_grad(set_to_none=True)
        for buffer in self._grad_buffers():
            buffer.offload_to_cpu(move_params=False, move_grads=True)
        move_tensors(main_params(self.opt.optimizer), torch.device("cpu"))
        if torch.cuda.is_available():
            move_optimizer_state(self.opt.optimizer, torch.device("cpu"))

    def reload_training_state(self) -> None:
        """The gradient buffers come back zeroed."""
        for buffer in self._grad_buffers():
            buffer.reload_from_cpu(move_params=False, move_grads=True)
        move_tensors(main_params(self.opt.optimizer), self.device)
        if torch.cuda.is_available():
            move_optimizer_state(self.opt.optimizer, self.device)

    def offload_weights(self) -> None:
        """The parameter buffers where Megatron keeps them contiguous (the distributed optimizer's);
        without it the parameters are standalone tensors, moved one by one."""
        if torch.cuda.is_available():
            for buffer in self._grad_buffers():
                if buffer.param_data is not None:
                    buffer.offload_to_cpu(move_params=True, move_grads=False)
            move_tensors(self._unbuffered_params(), torch.device("cpu"))

    def reload_weights(self) -> None:
        if torch.cuda.is_available():
            for buffer in self._grad_buffers():
                if buffer.param_data is not None:
                    buffer.reload_from_cpu(move_params=True, move_grads=False)
            move_tensors(self._unbuffered_params(), self.device)

    def _unbuffered_params(self) -> list[torch.Tensor]:
        """Every parameter no contiguous buffer holds (frozen LoRA base weights included)."""
        buffered = {id(p) for buffer in self._grad_buffers() if buffer.param_data is not None for p in buffer.params}
        return [p for p in self.model.parameters() if id(p) not in buffered]

    def _grad_buffers(self) -> list[Any]:
        return [*self.ddp.buffers, *getattr(self.ddp, "expert_parallel_buffers", [])]

    # ------------------------------------------------------------------ weights out
    def _sync_params(self) -> None:
        """With ``overlap_param_gather`` the distributed optimizer's all-gather of the updated
        parameters waits for the next forward; whatever reads parameters before one (export, save,
        the reference swap) finishes it here, as Megatron's own training loop does before a save."""
        if self.ddp_config.overlap_param_gather and self.ddp_config.use_distributed_optimizer:
            self.ddp.start_param_sync(force_sync=True)

    def _full_megatron(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        self._sync_params()
        return iter_full_tensors(self.model, canonical_shapes(self.hf_config), tp_group=self.tp_group,
                                 tp_size=self.layout.tp, pp_group=self.pp_group, pp_size=self.layout.pp,
                                 pp_rank=self.pp_rank, dtype=dtype, ep_group=self.ep_group, ep_size=self.layout.ep,
                                 local_values=partial(lora.merged_local, self.adapters) if self.adapters else None)

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        """Every HF-named weight ``export_weights`` yields, full shapes, in order."""
        metas = ((name, torch.empty(shape, device="meta")) for name, shape in canonical_shapes(self.hf_config).items())
        return [WeightSpec(name=hf_name, shape=tuple(t.shape), dtype=dtype)
                for hf_name, t in megatron_to_hf_stream(metas, self.hf_config)]

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF tensors (gathered over TP, broadcast over PP) in buckets of <= ``bucket_bytes``."""
        from nrl_core.api import iter_buckets

        yield from iter_buckets(megatron_to_hf_stream(self._full_megatron(getattr(torch, dtype)), self.hf_config),
                                bucket_bytes)

    def tokenizer_source(self) -> str:
        return self.model_path

    # adapter-only refit (contract 9, policy.refit.adapters): the engine applies them to its base
    def adapter_config(self) -> dict[str, Any]:
        from nrl_core.api import plain_config

        config = lora.peft_config(self._peft_section("adapter_config"),
                                  [spec.name for spec in self.adapter_manifest("float32")], self.model_path)
        return plain_config(config.to_dict())

    def adapter_manifest(self, dtype: str) -> list[WeightSpec]:
        """PEFT-named adapters on HF modules, full shapes, in :meth:`export_adapter`'s order."""
        self._peft_section("adapter_manifest")
        return [WeightSpec(name=name, shape=tuple(t.shape), dtype=dtype)
                for canonical, (a, b) in self._adapter_shapes.items()
                for name, t in lora.peft_items(canonical, torch.empty(a, device="meta"),
                                               torch.empty(b, device="meta"), self.hf_config)]

    def export_adapter(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The adapters, whole (gathered over TP, exchanged between stages). Collective."""
        from nrl_core.api import iter_buckets

        self._peft_section("export_adapter")
        full = lora.full_adapters(self.adapters, self.tp_group, self.layout.tp, self.pp_group, self.layout.pp)
        target = getattr(torch, dtype)
        yield from iter_buckets(((name, t.to(target)) for canonical, (a, b) in full.items()
                                 for name, t in lora.peft_items(canonical, a, b, self.hf_config)), bucket_bytes)

    def _peft_section(self, method: str) -> dict[str, Any]:
        if self.adapters is None:
            raise NrlError(f"megatron {method}: this worker trains full weights; adapter-only refit needs LoRA "
                           f"({lora.KEY}.enabled: true), or set policy.refit.adapters: false")
        return self.cfg["peft"]

    def export_hf(self, path: str) -> None:
        """A Hugging Face directory: the model, or with LoRA a PEFT adapter on HF module names
        (``peft.export: merged`` writes the base with the adapters merged in). Collective."""
        if self.adapters is None or self.cfg["peft"]["export"] == "merged":
            return super().export_hf(path)
        full = lora.full_adapters(self.adapters, self.tp_group, self.layout.tp, self.pp_group, self.layout.pp)
        if dist.get_rank() == 0:
            lora.write_peft_adapter(self.adapters, full, self.cfg["peft"], self.hf_config, self.model_path,
                                    self.tokenizer_source(), path)
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def _sharded_state(self, is_loading: bool, with_optimizer: bool = True, with_rng: bool = True) -> dict[str, Any]:
        from nrl_backend_megatron.ckpt_io import rng_sharded_object, rng_state

        model_sd = self.model.sharded_state_dict()
        if self.adapters is not None:  # the adapters only: the frozen base is the model the run started from
            model_sd = {k: v for k, v in model_sd.items() if k.startswith("lora.")}
        state: dict[str, Any] = {"model": model_sd}
        if with_rng:
            state["rng_state"] = rng_sharded_object("rng_state", rng_state())
        if with_optimizer:
            if is_loading:
                ready_to_load(self.opt.optimizer)
            state["optimizer"] = self.opt.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                       metadata=OPTIMIZER_CHECKPOINT_FORMAT)
        return state

    def save_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        """Model, optimizer, scheduler, step and RNG via ``dist_checkpointing`` (see ckpt_io);
        with ``options.save_optimizer`` false, no optimizer or scheduler state."""
        self.require_on_device("save_checkpoint")  # offloaded, the distributed optimizer's buffers are empty
        options = options or CheckpointOptions.from_section(self.cfg)
        self._sync_params()
        common: dict[str, Any] = {"step": self.step}
        if options.save_optimizer:  # the schedule goes with the optimizer, as in NeMo RL
            common["scheduler"] = self.opt.scheduler.state_dict()
        self.ckpt.save(path, options, self._sharded_state(is_loading=False, with_optimizer=options.save_optimizer),
                       common)

    def load_checkpoint(self, path: str, options: CheckpointOptions | None = None) -> None:
        """Restore what :meth:`save_checkpoint` wrote; RNG only with ``options.load_rng``. A
        checkpoint without optimizer state starts the optimizer and its schedule fresh."""
        from nrl_backend_megatron.ckpt_io import set_rng_state

        self.require_on_device("load_checkpoint")
        options = options or CheckpointOptions.from_section(self.cfg)
        with_optimizer, saved_dp = self.ckpt.saved(path)
        with_rng = saved_dp in (None, self.dp_size)  # one RNG state per rank of the layout it was saved at
        if options.load_rng and not with_rng and self.rank == 0:
            logger.warning("checkpoint %s was saved at data-parallel size %d and this run has %d: its RNG states "
                           "are not restored", path, saved_dp, self.dp_size)
        # dist_checkpointing reads into the live parameters and optimizer state, so a file that
        # fails halfway would leave a mix of old and new weights: keep a copy to put back.
        live = [p.data for p in self.model.parameters() if self.adapters is None or p.requires_grad]  # LoRA: adapters
        for inner in getattr(self.opt.optimizer, "chained_optimizers", None) or [self.opt.optimizer]:
            torch_optimizer = getattr(inner, "optimizer", inner)
            live += [v for st in torch_optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        backup = [host_copy(t) for t in live]
        try:
            state = self.ckpt.load(path, options, self._sharded_state(is_loading=True, with_optimizer=with_optimizer,
                                                                    with_rng=with_rng))
        except BaseException:
            with torch.no_grad():
                for tensor, saved in zip(live, backup):
                    tensor.copy_(saved)
            raise
        del backup
        self.model.load_state_dict(state["model"], strict=self.adapters is None)
        if with_optimizer:
            load_optimizer_state(self.opt.optimizer, state["optimizer"])
            self.opt.scheduler.num_steps = 0  # Megatron's load_state_dict adds the saved steps to these
            self.opt.scheduler.load_state_dict(state["scheduler"])
        else:
            fresh_optimizer(self.opt)
            if self.rank == 0:
                logger.info("checkpoint %s holds no optimizer state (saved with checkpointing.save_optimizer: "
                            "false): the optimizer and its learning-rate schedule start fresh", path)
        self.step = int(state["step"])
        if options.load_rng and with_rng:
            set_rng_state(state["rng_state"])

    def finalize_checkpoint(self) -> None:
        """Wait for an asynchronous save to be written and finalized (also runs at exit)."""
        if getattr(self, "ckpt", None) is not None and dist.is_initialized():
            self.ckpt.finalize()


def _raise_first_problem(problem: str | None, error: type[Exception]) -> None:
    """Collective: every rank raises the first rank's problem, so none is left waiting in a
    collective the others never reach."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise error(first)
