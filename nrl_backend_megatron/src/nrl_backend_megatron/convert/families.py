"""Which Hugging Face architectures the backend supports, and how each differs from Llama.

All three families share Llama's decoder layout (RMSNorm, GQA attention, SwiGLU MLP, RoPE);
Qwen2 adds a bias on the q/k/v projections, Qwen3 adds per-head RMSNorm on queries and keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nrl_core.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    qkv_bias: bool
    qk_norm: bool


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
}


def family_of(hf_config: Any, key_path: str = "policy.model_name") -> Family:
    """The family of an HF config; an unsupported architecture is a one-line error."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    got = ", ".join(archs) or getattr(hf_config, "model_type", "unknown")
    raise ConfigError(key_path, f"architecture {got} is not supported by the Megatron backend; "
                                f"supported: {', '.join(sorted(FAMILIES))}")


def head_dim(hf_config: Any) -> int:
    value = getattr(hf_config, "head_dim", None)
    return int(value) if value else hf_config.hidden_size // hf_config.num_attention_heads
