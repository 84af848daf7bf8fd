"""The schema of ``policy.megatron_cfg``: NeMo RL's key names, nrl's validation.

Keys NeMo RL has but this backend does not implement (kernel fusions, layer-count overrides) are
accepted as ``inert`` fields so copied NeMo RL configs validate (a warning names them when set).
The mixture-of-experts keys take effect for a MoE model (see :mod:`nrl_backend_megatron.moe`) and
are ignored for a dense one, since NeMo RL's base configs set them for every model.
NeMo RL's nested ``checkpoint: {async_save, fully_parallel_save, fully_parallel_load, load_rng}``
is folded into the flat keys by :class:`MegatronCfgSection` during validation, so everything
downstream reads only the flat spelling.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from nrl_core.api import ConfigError, Field, Section

CHECKPOINT_KNOBS = ("fully_parallel_save", "fully_parallel_load", "async_save", "load_rng")
_SCALAR = (bool, int, float, str)


def _inert(default: Any = None, types: Any = _SCALAR) -> Field:
    return Field(type=types, default=default, nullable=True, inert=True,
                 doc="NeMo RL key accepted for compatibility; no effect in nrl's Megatron backend")


OPTIMIZER = Section(doc="Megatron-Core OptimizerConfig (NeMo RL names).", fields={
    "optimizer": Field(type=str, default="adam", choices=("adam", "sgd")),
    "lr": Field(type=float, default=5.0e-6, minimum=0),
    "min_lr": Field(type=float, default=5.0e-7, minimum=0),
    "weight_decay": Field(type=float, default=0.01, minimum=0),
    "bf16": Field(type=bool, default=False, doc="keep bf16 params with fp32 main params"),
    "fp16": Field(type=bool, default=False),
    "params_dtype": Field(type=str, default="float32", choices=("float32", "bfloat16", "float16")),
    "adam_beta1": Field(type=float, default=0.9),
    "adam_beta2": Field(type=float, default=0.999),
    "adam_eps": Field(type=float, default=1.0e-8),
    "sgd_momentum": Field(type=float, default=0.9),
    "use_distributed_optimizer": Field(type=bool, default=False),
    "use_precision_aware_optimizer": Field(type=bool, default=False),
    "clip_grad": Field(type=float, default=1.0, minimum=0, nullable=True,
                       doc="global gradient-norm clip; 0 or null disables"),
    "optimizer_cpu_offload": _inert(False),
    "optimizer_offload_fraction": _inert(0.0),
})

SCHEDULER = Section(doc="Megatron-Core OptimizerParamScheduler (NeMo RL names).", fields={
    "start_weight_decay": Field(type=float, default=None, nullable=True, doc="null: optimizer.weight_decay"),
    "end_weight_decay": Field(type=float, default=None, nullable=True, doc="null: optimizer.weight_decay"),
    "weight_decay_incr_style": Field(type=str, default="constant", choices=("constant", "linear", "cosine")),
    "lr_decay_style": Field(type=str, default="constant",
                            choices=("constant", "linear", "cosine", "inverse-square-root", "WSD")),
    "lr_decay_iters": Field(type=int, default=None, nullable=True, minimum=1, doc="required unless lr_decay_style is constant"),
    "lr_warmup_iters": Field(type=int, default=0, minimum=0),
    "lr_warmup_init": Field(type=float, default=0.0),
})

DDP = Section(doc="Megatron-Core DistributedDataParallelConfig.", fields={
    "grad_reduce_in_fp32": Field(type=bool, default=False),
    "overlap_grad_reduce": Field(type=bool, default=False),
    "overlap_param_gather": Field(type=bool, default=False),
    "average_in_collective": Field(type=bool, default=False),
    "use_custom_fsdp": _inert(False),
    "data_parallel_sharding_strategy": _inert("optim_grads_params"),
})

NESTED_CHECKPOINT = Section(nullable=True, doc="NeMo RL's nested spelling of the four checkpoint knobs.", fields={
    name: Field(type=bool, default=None, nullable=True) for name in CHECKPOINT_KNOBS
})


class MegatronCfgSection(Section):
    """``Section`` that folds NeMo RL's nested ``checkpoint:`` block into the flat keys.

    A nested value wins over the default; setting a knob both ways with different values is an error.
    """

    def validate(self, value: Any, path: str = "") -> dict[str, Any] | None:
        raw: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
        out = super().validate(value, path)
        if out is None:
            return None
        nested = out.pop("checkpoint", None) or {}
        for name in CHECKPOINT_KNOBS:
            nested_value = nested.get(name)
            if nested_value is None:
                continue
            if name in raw and raw[name] != nested_value:
                raise ConfigError(f"{path}.checkpoint.{name}" if path else f"checkpoint.{name}",
                                  f"conflicts with {path}.{name}={raw[name]!r}; keep one spelling")
            out[name] = nested_value
        return out


MEGATRON_CFG_SCHEMA: Section = MegatronCfgSection(doc="Megatron-Core training backend (policy.megatron_cfg).", fields={
    "enabled": Field(type=bool, default=False),
    "tensor_model_parallel_size": Field(type=int, default=1, minimum=1),
    "pipeline_model_parallel_size": Field(type=int, default=1, minimum=1),
    "context_parallel_size": Field(type=int, default=1, minimum=1),
    "sequence_parallel": Field(type=bool, default=False),
    "activation_checkpointing": Field(type=bool, default=False,
                                      doc="recompute activations in backward (recompute_granularity says which)"),
    "recompute_granularity": Field(type=str, default="full", choices=("full", "selective"),
                                   doc="with activation_checkpointing: full recomputes every transformer layer, "
                                       "selective only recompute_modules (nrl_backend_megatron.memory)"),
    "recompute_modules": Field(type=list, default=None, nullable=True, item_type=str,
                               doc="what selective recompute recomputes (core_attn, mlp, moe, shared_experts; "
                                   "layernorm with Transformer Engine); null: core_attn"),
    "empty_unused_memory_level": Field(type=int, default=0, choices=(0, 1, 2),
                                       doc="empty the CUDA cache where NeMo RL's worker does: 1 after each "
                                           "forward/backward, reference swap and prepare_for_training, 2 also "
                                           "after the optimizer step"),
    "converter_type": _inert(None),
    "force_reconvert_from_hf": Field(type=bool, default=False),
    "pretrained_checkpoint": Field(type=str, default=None, nullable=True,
                                   doc="start from this Megatron-Core checkpoint instead of converting "
                                       "policy.model_name: Megatron-LM's or Megatron-Bridge's directory (its "
                                       "latest iteration), one iteration, or a bare dist_checkpointing directory; "
                                       "policy.model_name still gives the architecture, tokenizer and vLLM's model "
                                       "(docs/megatron_checkpoints.md)"),
    "convert_on_each_node": Field(type=bool, default=False,
                                  doc="the conversion directory is not shared: the first rank of every node "
                                      "converts its own copy (see docs/cluster.md)"),
    "pipeline_dtype": Field(type=str, default=None, nullable=True, choices=("float32", "bfloat16", "float16"),
                            doc="dtype of tensors sent between pipeline stages; null: the model's dtype"),
    "optimizer": OPTIMIZER,
    "scheduler": SCHEDULER,
    "distributed_data_parallel_config": DDP,
    "fully_parallel_save": Field(type=bool, default=True),
    "fully_parallel_load": Field(type=bool, default=True),
    "async_save": Field(type=bool, default=False),
    "load_rng": Field(type=bool, default=False),
    "checkpoint": NESTED_CHECKPOINT,
    "distributed_timeout_minutes": Field(type=int, default=None, nullable=True, minimum=1),
    "check_for_nan_in_grad": Field(type=bool, default=True),
    "logging_level": Field(type=(int, str), default=logging.INFO),
    # Mixture of experts (NeMo RL's keys, plus moe_router_topk).
    "expert_model_parallel_size": Field(type=int, default=1, doc="ranks the routed experts are split over"),
    "expert_tensor_parallel_size": Field(type=int, default=1, doc="only 1: experts are never tensor-parallel"),
    "freeze_moe_router": Field(type=bool, default=False, doc="the routers' weights do not train"),
    "moe_grouped_gemm": Field(type=bool, default=False, inert=True,
                              doc="NeMo RL's default is true; nrl always runs the experts as SequentialMLP (one "
                                  "GEMM per expert): grouped GEMM's expert weights have no converter mapping yet, "
                                  "so a true value is named in the inert-keys warning"),
    "moe_router_topk": Field(type=int, default=None, nullable=True,
                             doc="experts per token in training; null: the model's num_experts_per_tok"),
    "moe_router_dtype": Field(type=str, default=None, nullable=True, choices=("fp32", "fp64"),
                              doc="dtype of the router's logits and softmax; null: the model's dtype"),
    "moe_router_load_balancing_type": Field(type=str, default="none",
                                            choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                                     "none"),
                                            doc="load-balancing loss added to the training loss"),
    "moe_aux_loss_coeff": Field(type=float, default=0.0, doc="weight of the load-balancing loss"),
    "moe_router_bias_update_rate": Field(type=float, default=0.0, doc="expert-bias update rate (aux-loss-free)"),
    "moe_token_dispatcher_type": Field(type=str, default=None, nullable=True, choices=("allgather", "alltoall", "flex"),
                                       doc="null: alltoall with CUDA, allgather without (the only one on CPU)"),
    "moe_permute_fusion": Field(type=bool, default=False, doc="fused token permutation (CUDA only; off on CPU)"),
    "moe_enable_deepep": Field(type=bool, default=False, doc="DeepEP dispatch (CUDA, flex dispatcher)"),
    "moe_shared_expert_overlap": Field(type=bool, default=False, doc="overlap the shared expert (alltoall only)"),
    "moe_per_layer_logging": Field(type=bool, default=False, doc="also log the aux losses of every layer"),
    "peft": Section(doc="LoRA adapters (NeMo RL's keys; nrl_backend_megatron.lora, docs/lora.md).", fields={
        "enabled": Field(type=bool, default=False, doc="train LoRA adapters instead of the full weights"),
        "target_modules": Field(type=list, default=[], doc="linear_qkv, linear_proj, linear_fc1, linear_fc2 or globs "
                                                          "over module paths; empty: all four"),
        "exclude_modules": Field(type=list, default=[], doc="the same forms, never given an adapter"),
        "dim": Field(type=int, default=8, minimum=1, doc="the rank r"),
        "alpha": Field(type=(int, float), default=32, doc="scale: the adapter adds alpha/dim * B @ A"),
        "dropout": Field(type=float, default=0.0, minimum=0, doc="adapter dropout while training"),
        "dropout_position": Field(type=str, default="post", choices=("pre", "post"),
                                  doc="on the adapter's input (pre) or its output (post)"),
        "lora_A_init_method": Field(type=str, default="xavier", choices=("xavier", "uniform")),
        "lora_B_init_method": Field(type=str, default="zero", choices=("zero",)),
        "a2a_experimental": _inert(False),
        "lora_dtype": Field(type=str, default=None, nullable=True, doc="only null: the model's dtype"),
        "export": Field(type=str, default="adapter", choices=("adapter", "merged"),
                        doc="nrl's: the HF export is a PEFT adapter on HF module names, or the merged model"),
    }),
    # NeMo RL keys accepted without effect.
    "num_layers_in_first_pipeline_stage": _inert(None),
    "num_layers_in_last_pipeline_stage": _inert(None),
    "apply_rope_fusion": _inert(True),
    "bias_activation_fusion": _inert(True),
    "defer_fp32_logits": _inert(None),
    "train_iters": _inert(None),
    "env_vars": _inert(None, (dict,)),
})
