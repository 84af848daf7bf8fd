"""Which Hugging Face architectures the backend supports, and how each differs from Llama.

All share Llama's decoder layout (RMSNorm, GQA attention, SwiGLU MLP, RoPE); Qwen2 adds a bias on
the q/k/v projections, Qwen3 adds per-head RMSNorm on queries and keys. The mixture-of-experts
families replace the MLP of their sparse layers by a router and ``num_experts`` SwiGLU experts:
Qwen3-MoE has Qwen3's attention and renormalises the top-k routing probabilities; Qwen2-MoE has
Qwen2's attention, keeps the top-k probabilities as they are and adds a shared expert scaled by a
sigmoid gate. DeepSeek-V3 (and GLM-4.7-Flash, built like it) replace the attention by multi-head
latent attention, route by sigmoid scores with a correction bias that chooses experts but does not
weigh them, and add an ungated shared expert; their first layers are dense. Nemotron-H is not
Llama-shaped: each of its layers is one Mamba-2 mixer, attention (no RoPE) or a squared-ReLU MLP,
with its own pre-norm (``nrl_backend_megatron.hybrid``). gpt-oss has experts in every layer and
biases on every projection, its router's and its experts' too; each attention head has a learned
sink logit, every other layer attends within a sliding window, RoPE is YaRN-scaled, and each
expert's gated unit is clamped (``swiglu_limit``) with ``(up + 1) * gate * sigmoid(1.702 gate)``.
HF stores its experts stacked, one tensor per projection with gate and up interleaved
(:mod:`~nrl_backend_megatron.convert.mapping`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nrl_core.api import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    qkv_bias: bool
    qk_norm: bool
    moe: bool = False
    shared_expert: bool = False
    latent: bool = False  # multi-head latent attention and DeepSeek-V3's routing
    hybrid: bool = False  # Mamba, attention and MLP layers in a pattern (Nemotron-H: hybrid.py)
    gpt_oss: bool = False  # biased projections, attention sinks, clamped experts stacked in HF (above)


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, moe=True),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, qk_norm=False, moe=True,
                                  shared_expert=True),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", "DeepseekV3ForCausalLM", qkv_bias=False, qk_norm=False, moe=True,
                                    shared_expert=True, latent=True),
    "Glm4MoeLiteForCausalLM": Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", qkv_bias=False, qk_norm=False,
                                     moe=True, shared_expert=True, latent=True),
    "NemotronHForCausalLM": Family("nemotron_h", "NemotronHForCausalLM", qkv_bias=False, qk_norm=False, hybrid=True),
    "GptOssForCausalLM": Family("gpt_oss", "GptOssForCausalLM", qkv_bias=True, qk_norm=False, moe=True, gpt_oss=True),
}


HEAD_SUFFIXES = {"ForSequenceClassification": "bradley_terry", "ForTokenClassification": "regression"}
"""HF's classifier classes of one label: a value head (``nrl_core.sdk.value_head``) of each type."""


def head_kind(hf_config: Any) -> str | None:
    """The value head an HF config's architecture names (``LlamaForSequenceClassification``:
    ``bradley_terry``), or None for a causal LM: what the checkpoint holds in place of ``lm_head``."""
    for arch in getattr(hf_config, "architectures", None) or []:
        for suffix, kind in HEAD_SUFFIXES.items():
            if arch.endswith(suffix):
                return kind
    return None


def _causal_name(arch: str) -> str:
    """``LlamaForSequenceClassification`` -> ``LlamaForCausalLM``: a classifier has its LM's body."""
    for suffix in HEAD_SUFFIXES:
        if arch.endswith(suffix):
            return arch[: -len(suffix)] + "ForCausalLM"
    return arch


def family_of(hf_config: Any, key_path: str = "policy.model_name") -> Family:
    """The family of an HF config (a classifier's is its causal LM's); an unsupported architecture
    is a one-line error."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if _causal_name(arch) in FAMILIES:
            return FAMILIES[_causal_name(arch)]
    got = ", ".join(archs) or getattr(hf_config, "model_type", "unknown")
    raise ConfigError(key_path, f"architecture {got} is not supported by the Megatron backend; "
                                f"supported: {', '.join(sorted(FAMILIES))}")


def head_dim(hf_config: Any) -> int:
    value = getattr(hf_config, "head_dim", None)
    return int(value) if value else hf_config.hidden_size // hf_config.num_attention_heads


def moe_layers(hf_config: Any) -> list[bool]:
    """Per decoder layer, whether it is a mixture-of-experts layer (HF's rule: not listed in
    ``mlp_only_layers`` and every ``decoder_sparse_step``-th layer); all False for dense families."""
    family = family_of(hf_config)
    if family.hybrid:  # Nemotron 3: the pattern's mixture-of-experts layers
        from nrl_backend_megatron.hybrid import layer_pattern

        return [kind == "E" for kind in layer_pattern(hf_config)]
    if not family.moe:
        return [False] * hf_config.num_hidden_layers
    if family.latent and getattr(hf_config, "mlp_layer_types", None):  # GLM's list, as transformers reads it
        return [kind == "sparse" for kind in hf_config.mlp_layer_types]
    if family.latent:  # DeepSeek-V3's rule: dense below first_k_dense_replace, then every moe_layer_freq-th
        dense, step = int(getattr(hf_config, "first_k_dense_replace", 0) or 0), int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return [int(hf_config.n_routed_experts) > 0 and i >= dense and i % step == 0
                for i in range(hf_config.num_hidden_layers)]
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if family.gpt_oss:  # experts in every layer
        return [experts > 0] * hf_config.num_hidden_layers
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)]


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    family = family_of(hf_config)
    count = getattr(hf_config, "n_routed_experts", None) if family.latent or family.hybrid else None
    count = count if count is not None else getattr(hf_config, "num_experts", 0)
    return int(count or 0) if any(moe_layers(hf_config)) else 0


def shared_expert_width(hf_config: Any) -> int:
    """The shared expert's intermediate width: Qwen2-MoE names it, DeepSeek-V3 counts shared experts
    of the routed experts' width (Megatron runs them as one), Nemotron 3 names it too."""
    if family_of(hf_config).hybrid:
        return int(getattr(hf_config, "moe_shared_expert_intermediate_size", 0) or 0)
    if family_of(hf_config).latent:
        return int(hf_config.n_shared_experts or 0) * int(hf_config.moe_intermediate_size)
    return int(hf_config.shared_expert_intermediate_size)


def expert_width(hf_config: Any) -> int:
    """A routed expert's intermediate width (gpt-oss names it ``intermediate_size``)."""
    if family_of(hf_config).gpt_oss:
        return int(hf_config.intermediate_size)
    return int(hf_config.moe_intermediate_size)
