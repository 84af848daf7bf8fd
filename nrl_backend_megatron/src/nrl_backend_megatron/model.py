"""Build a Megatron-Core ``GPTModel`` that computes what the Hugging Face model computes.

Why each choice: the local layer spec (pure PyTorch) is the only one that runs without CUDA;
Transformer Engine's spec is used when TE is importable (GPU machines). RoPE frequencies are taken
from the HF model's own rotary-embedding class and written over Megatron's, so every scaling
variant HF computes in ``inv_freq`` (default, linear, llama3) matches exactly; variants that also
rescale cos/sin or depend on sequence length are refused in one line, but for gpt-oss's YaRN,
whose rescaling Megatron's attention applies (gpt_oss.py).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nrl_backend_megatron import gpt_oss
from nrl_backend_megatron.convert.families import family_of, head_dim, head_kind, moe_layers, num_experts
from nrl_backend_megatron.convert.mapping import tied_embeddings
from nrl_backend_megatron.memory import recompute_kwargs
from nrl_backend_megatron.moe import moe_config_kwargs
from nrl_backend_megatron.norms import SequenceParallelTorchNorm, with_sequence_parallel_norms
from nrl_core.api import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_engine_installed() -> bool:
    """Whether Transformer Engine can be imported here at all (not imported: that needs CUDA);
    :func:`te_available` says whether the layers use it."""
    return importlib.util.find_spec("transformer_engine") is not None


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return torch.cuda.is_available()


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False


def _rope_type(hf_config: Any) -> str:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def hf_inv_freq(hf_config: Any) -> torch.Tensor:
    """RoPE inverse frequencies exactly as the HF model computes them (scaling included)."""
    kind = _rope_type(hf_config)
    rescaled = family_of(hf_config).gpt_oss and kind == "yarn"  # Megatron's attention rescales (gpt_oss.py)
    if kind not in SUPPORTED_ROPE_TYPES and not rescaled:
        raise ConfigError("policy.model_name", f"RoPE type '{kind}' is not supported by the Megatron backend; "
                                               f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    # The three families compute RoPE identically; Llama's class reads head_dim and rope_parameters.
    cfg = hf_config
    if getattr(cfg, "head_dim", None) is None:
        cfg = type(hf_config).from_dict(hf_config.to_dict())
        cfg.head_dim = head_dim(hf_config)
    rope = LlamaRotaryEmbedding(cfg)
    if rescaled:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor,
        )

        ours = _yarn_get_concentration_factor(gpt_oss.yarn_attributes(hf_config)["yarn_rotary_scaling_factor"],
                                              None, None)
        if not math.isclose(float(rope.attention_scaling), ours, rel_tol=1e-6):
            raise ConfigError("policy.model_name", f"YaRN scales attention by {float(rope.attention_scaling)} in HF and "
                                                   f"{ours} in Megatron-Core; not supported by the Megatron backend")
    elif not math.isclose(float(getattr(rope, "attention_scaling", 1.0)), 1.0):
        raise ConfigError("policy.model_name", f"RoPE type '{kind}' rescales attention; not supported by the "
                                               "Megatron backend")
    return rope.inv_freq.detach().to(torch.float32).clone()


def transformer_config(hf_config: Any, layout: ParallelLayout, *, params_dtype: torch.dtype,
                       pipeline_dtype: torch.dtype | None = None, bf16: bool = False, fp16: bool = False,
                       moe: Mapping[str, Any] | None = None, recompute: Mapping[str, Any] | None = None) -> Any:
    """Megatron ``TransformerConfig`` equivalent to the HF config; ``moe`` is the
    ``policy.megatron_cfg`` section whose ``moe_*`` keys configure a mixture-of-experts model,
    ``recompute`` the one whose ``activation_checkpointing`` and ``recompute_*`` keys set activation
    recompute (:func:`nrl_backend_megatron.memory.recompute_kwargs`; None: none)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    family = family_of(hf_config)
    on_gpu = te_available()
    shape: dict[str, Any] = dict(ffn_hidden_size=hf_config.intermediate_size, gated_linear_unit=True,
                                 activation_func=torch.nn.functional.silu)
    if family.hybrid:
        from nrl_backend_megatron.hybrid import check_hybrid, transformer_config_kwargs

        check_hybrid(hf_config, layout.tp)
        config_class, attention = TransformerConfig, {}
        shape = transformer_config_kwargs(hf_config)
    elif family.latent:
        config_class, attention = MLATransformerConfig, latent_attention_kwargs(hf_config)
    else:
        config_class, attention = TransformerConfig, dict(
            num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            kv_channels=head_dim(hf_config), qk_layernorm=family.qk_norm)
    shape = dict(add_bias_linear=False, add_qkv_bias=family.qkv_bias, **shape)
    if family.gpt_oss:
        shape.update(gpt_oss.config_kwargs(hf_config))
    if "layernorm_epsilon" not in shape:
        shape["layernorm_epsilon"] = hf_config.rms_norm_eps
    config = config_class(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, **attention, **shape,
        normalization="RMSNorm",
        attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, sequence_parallel=layout.sequence_parallel,
        params_dtype=params_dtype, pipeline_dtype=pipeline_dtype or params_dtype, bf16=bf16, fp16=fp16,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=True,
        bias_dropout_fusion=on_gpu, apply_rope_fusion=False, masked_softmax_fusion=on_gpu,
        persist_layer_norm=on_gpu, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        attention_softmax_in_fp32=True,
        **recompute_kwargs(recompute, hf_config, transformer_engine=on_gpu),
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=1,
        **moe_config_kwargs(hf_config, moe or {}, on_gpu),
    )
    if family.gpt_oss:  # read by Megatron's attention, not fields of its config
        for name, value in gpt_oss.yarn_attributes(hf_config).items():
            setattr(config, name, value)
    return config


def latent_attention_kwargs(hf_config: Any) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of a DeepSeek-V3-style HF config: the latent widths, the
    rotary part's RoPE (plain or YaRN, as HF scales it), and the query and latent norms (Megatron's
    ``qk_layernorm`` builds them)."""
    kind = _rope_type(hf_config)
    if kind not in ("default", "yarn"):
        raise ConfigError("policy.model_name", f"RoPE type '{kind}' of latent attention is not supported by the "
                                               "Megatron backend; supported: default, yarn")
    if getattr(hf_config, "rope_interleave", True) is False:
        raise ConfigError("policy.model_name", "this latent-attention model rotates its rotary dimensions in halves "
                                               "(rope_interleave: false); Megatron's latent attention rotates "
                                               "interleaved pairs, so it is not supported by the Megatron backend")
    if not any(moe_layers(hf_config)):
        raise ConfigError("policy.model_name", "a latent-attention model without experts is not supported by the "
                                               "Megatron backend (its layer spec builds latent attention only for "
                                               "mixture-of-experts models)")
    kwargs: dict[str, Any] = dict(
        q_lora_rank=hf_config.q_lora_rank or None, kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim, qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim, qk_layernorm=True, rotary_base=rope_theta(hf_config),
        rope_type="rope" if kind == "default" else "yarn")
    if kind == "yarn":
        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        kwargs.update(rotary_scaling_factor=float(params["factor"]),
                      original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                      beta_fast=float(params.get("beta_fast", 32)), beta_slow=float(params.get("beta_slow", 1)),
                      mscale=float(params.get("mscale", 1.0)), mscale_all_dim=float(params.get("mscale_all_dim", 0.0)))
    return kwargs


def layer_spec(hf_config: Any, config: Any) -> Any:
    """Transformer Engine's layer spec when usable, else the local spec with packed-sequence attention
    and norms that allow sequence parallelism (:mod:`~nrl_backend_megatron.norms`).

    Both come as a block spec, built from the ``TransformerConfig``: one layer spec per layer of
    this pipeline stage (for a model with experts, MoE where ``moe_layer_freq`` says so, the dense
    MLP elsewhere) and the final norm.
    """
    family = family_of(hf_config)
    if num_experts(hf_config):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te_available(), normalization="RMSNorm")
        if not te_available():
            for spec in block.layer_specs:
                _use_packed_attention(spec)
            with_sequence_parallel_norms(block)
            if family.gpt_oss:
                gpt_oss.with_expert_output_projections(block)
        return block
    if te_available():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=family.qk_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_gpt_layer_local_spec(qk_layernorm=family.qk_norm, normalization="RMSNorm")
    with_sequence_parallel_norms(_use_packed_attention(spec))
    # the block spelled out, so that its final norm is the local layers' own too
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def _use_packed_attention(spec: Any) -> Any:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from nrl_backend_megatron.packed_attention import LatentDotProductAttention, PackedDotProductAttention

    attention = spec.submodules.self_attention
    latent = isinstance(attention.module, type) and issubclass(attention.module, MLASelfAttention)
    attention.submodules.core_attention = LatentDotProductAttention if latent else PackedDotProductAttention
    if latent:
        from nrl_backend_megatron.latent import use_duplicated_down_projections

        use_duplicated_down_projections(attention)
    return spec


def build_model(hf_config: Any, config: Any, *, pre_process: bool, post_process: bool) -> Any:
    """The (possibly pipeline-stage) model: a ``GPTModel`` with HF-exact RoPE frequencies, or for
    Nemotron-H a ``MambaModel`` (:mod:`~nrl_backend_megatron.hybrid`); for an HF classifier config
    (a value model, :func:`~nrl_backend_megatron.convert.families.head_kind`) its last stage has a
    :class:`~nrl_backend_megatron.value_head.ValueHead` where the output layer was."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if family_of(hf_config).hybrid:
        from nrl_backend_megatron.hybrid import build_hybrid_model

        model = build_hybrid_model(hf_config, config, pre_process=pre_process, post_process=post_process,
                                   on_gpu=te_available())
        return _finish(model, hf_config, config, post_process)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(hf_config, config), vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=tied_embeddings(hf_config),
        position_embedding_type="rope", rotary_base=int(rope_theta(hf_config)),
    )
    if getattr(model, "rotary_pos_emb", None) is not None:
        device = model.rotary_pos_emb.inv_freq.device  # a meta build (the conversion) keeps real frequencies
        with torch.device("cpu"):
            frequencies = hf_inv_freq(hf_config)
        model.rotary_pos_emb.inv_freq = frequencies.to("cpu" if device.type == "meta" else device)
    if family_of(hf_config).gpt_oss:
        gpt_oss.mark_sinks_tensor_parallel(model)
    return _finish(model, hf_config, config, post_process)


def _finish(model: Any, hf_config: Any, config: Any, post_process: bool) -> Any:
    """What every model gets: the value head, recompute's gradients, parameters in their dtype."""
    kind = head_kind(hf_config)
    if kind is not None and post_process:
        from nrl_backend_megatron import value_head

        value_head.attach(model, kind, hf_config.hidden_size, config.params_dtype)
    if config.recompute_granularity is not None:
        from nrl_backend_megatron.memory import keep_gradients_through_recompute

        keep_gradients_through_recompute(model)  # frozen (LoRA) base weights
    # The local spec's torch norms ignore params_dtype. Megatron's mixed-precision optimizer maps its
    # checkpoint through the bf16/fp16 parameters only, so one fp32 norm weight fails the first save
    # ("Param id N does not match any model sharded param", seen on a GPU); Float16Module, which nrl
    # does not use, would have cast them too. Buffers (RoPE frequencies) stay as they are.
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != config.params_dtype:
            param.data = param.data.to(config.params_dtype)
    return model
