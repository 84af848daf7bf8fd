"""The CPU KV cache an engine needs for this run, when ``vllm_cfg.kv_cache_space_gb`` is not set.

vLLM on CPU allocates (and zeroes, so it is resident) exactly the space it is given; a fixed 1 GiB
holds 65,536 tokens of the 25.7M-parameter bench model where a GRPO step of 32 sequences of 128
tokens needs 4,096, and it was most of the gap between nrl's memory and TRL's. So the space is
derived from the largest batch one engine generates in this run:

    sequences = ceil(max(train batch, validation batch) / engines)
    train batch = grpo.num_prompts_per_step x grpo.num_generations_per_prompt
    validation batch = min(grpo.val_batch_size, grpo.max_val_samples) when validation runs
    blocks = ceil(MARGIN x sequences x ceil(max_model_len / BLOCK_TOKENS)) + 1 (vLLM's null block)
    bytes = blocks x BLOCK_TOKENS x bytes per token (K and V of every layer's key/value heads on this rank)

With that many blocks every sequence of the batch is resident at once at its longest, so vLLM never
preempts; the margin covers the scheduler's partial blocks. vLLM's own minimum (one sequence of
``max_model_len``) is always met. The space never exceeds the old default, :data:`FALLBACK_GIB`
(a batch that needs more, e.g. a 1B model's 512 x 4096-token step, 64 GiB, would not fit in a
CPU machine's memory; vLLM preempts and recomputes within 1 GiB as it did before), so leaving the
key unset never costs more memory than it did. Without a ``grpo`` section (an engine built outside GRPO) or for
attention this formula does not describe (multi-head latent attention), the space stays the old
default, :data:`FALLBACK_GIB`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BLOCK_TOKENS", "FALLBACK_GIB", "MARGIN", "KvCacheSize", "derived_kv_cache", "kv_cache_space",
           "kv_bytes_per_token", "largest_batch"]

BLOCK_TOKENS = 128
"""vLLM's CPU block size for standard attention (``vllm/platforms/cpu.py``)."""
MARGIN = 1.1
FALLBACK_GIB = 1.0
_GIB = 2**30


@dataclass(frozen=True)
class KvCacheSize:
    """The space one engine rank gets and where it came from: ``config`` (the user's
    ``kv_cache_space_gb``), ``derived`` (this module's formula) or ``default``."""

    nbytes: int
    source: str
    sequences: int | None = None
    blocks: int | None = None
    bytes_per_token: int | None = None

    def describe(self) -> str:
        if self.source == "config":
            return f"{self.nbytes / _GIB:g} GiB (policy.generation.vllm_cfg.kv_cache_space_gb)"
        if self.source == "default":
            return f"{self.nbytes / _GIB:g} GiB (the default: nothing in the config sizes it)"
        return (f"{self.nbytes / 2**20:.1f} MiB ({self.blocks} blocks of {BLOCK_TOKENS} tokens for {self.sequences} "
                f"sequences, {self.bytes_per_token} B per token; set policy.generation.vllm_cfg.kv_cache_space_gb "
                "to choose)")


def largest_batch(config: Mapping[str, Any]) -> int | None:
    """The most sequences one ``generate`` call of this run asks for over all engines; None
    without a ``grpo`` section."""
    grpo = config.get("grpo") or {}
    if "num_prompts_per_step" not in grpo or "num_generations_per_prompt" not in grpo:
        return None
    batch = int(grpo["num_prompts_per_step"]) * int(grpo["num_generations_per_prompt"])
    validates = bool(grpo.get("val_at_start")) or bool(grpo.get("val_at_end")) or int(grpo.get("val_period") or 0) > 0
    if validates and grpo.get("val_batch_size"):
        val = int(grpo["val_batch_size"])
        if grpo.get("max_val_samples"):
            val = min(val, int(grpo["max_val_samples"]))
        batch = max(batch, val)
    return batch


def kv_bytes_per_token(hf_config: Any, tensor_parallel_size: int, dtype: torch.dtype) -> int | None:
    """Bytes of K and V one token takes on one rank of the engine; None for attention the
    formula does not describe."""
    if getattr(hf_config, "kv_lora_rank", None):  # multi-head latent attention caches a latent, not K and V
        return None
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if not layers or not heads:
        return None
    try:
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    except RuntimeError:  # layers of different shapes (Gemma 4): transformers refuses one global value
        return None
    heads_per_rank = max(1, kv_heads // tensor_parallel_size)
    return 2 * int(layers) * heads_per_rank * int(head_dim) * torch.empty((), dtype=dtype).element_size()


def derived_kv_cache(config: Mapping[str, Any], hf_config: Any, *, max_model_len: int, tensor_parallel_size: int,
                     engines: int, dtype: torch.dtype) -> KvCacheSize:
    """The KV cache space of one rank of one of ``engines`` engines (see the module docstring)."""
    batch = largest_batch(config)
    per_token = kv_bytes_per_token(hf_config, tensor_parallel_size, dtype) if hf_config is not None else None
    if batch is None or per_token is None:
        return KvCacheSize(int(FALLBACK_GIB * _GIB), "default")
    sequences = math.ceil(batch / max(1, engines))
    blocks = math.ceil(MARGIN * sequences * math.ceil(max_model_len / BLOCK_TOKENS)) + 1
    blocks = min(blocks, int(FALLBACK_GIB * _GIB) // (BLOCK_TOKENS * per_token))
    return KvCacheSize(blocks * BLOCK_TOKENS * per_token, "derived", sequences, blocks, per_token)


def kv_cache_space(config: Mapping[str, Any], *, max_model_len: int, tensor_parallel_size: int, engines: int,
                   dtype: str, cache_dtype: str = "auto") -> KvCacheSize:
    """The user's ``vllm_cfg.kv_cache_space_gb`` when set, else :func:`derived_kv_cache` for the
    model ``config`` names (``dtype``: the engine's, ``auto`` for the checkpoint's; ``cache_dtype``:
    ``vllm_cfg.kv_cache_dtype``, one byte per element for the fp8 kinds)."""
    from nrl_core.api import local_model_config, parse_dtype

    space_gb = ((config["policy"].get("generation") or {}).get("vllm_cfg") or {}).get("kv_cache_space_gb")
    if space_gb is not None:
        return KvCacheSize(int(float(space_gb) * _GIB), "config")
    hf_config = local_model_config(config)
    if dtype == "auto":
        dtype = str(getattr(hf_config, "torch_dtype", None) or "float32")
    if cache_dtype.startswith("fp8"):
        dtype = "float8_e4m3fn"
    elif cache_dtype != "auto":
        dtype = cache_dtype
    return derived_kv_cache(config, hf_config, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                            engines=engines, dtype=parse_dtype(dtype))
