"""A decoder model's sizes from its Hugging Face config alone: what ``nrl plan`` counts with.

Why its own module: the plan must run before any weight exists (a recipe checked on a laptop
names a 70B model), so parameter counts come from the architecture's config, split by where each
kind of parameter lives under model parallelism (dense layers, experts, embeddings).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nrl_core.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer with gated (SwiGLU) MLPs, dense or mixture-of-experts."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    qk_norm: bool = False
    qkv_bias: bool = False
    shared_expert_gate: bool = False
    sandwich_norms: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        get = cfg.get
        hidden = int(get("hidden_size") or 0)
        heads = int(get("num_attention_heads") or 0)
        if not hidden or not heads or not get("num_hidden_layers") or not get("vocab_size"):
            raise ConfigError("policy.model_name", "its config.json lacks hidden_size, num_attention_heads, "
                                                   "num_hidden_layers or vocab_size: not a decoder model nrl plans")
        experts = int(get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0)
        family = str(get("model_type") or "")
        return cls(
            hidden=hidden, layers=int(get("num_hidden_layers")), heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate=int(get("intermediate_size") or 4 * hidden), vocab=int(get("vocab_size")),
            tied_embeddings=bool(get("tie_word_embeddings", False)), experts=experts,
            experts_per_token=int(get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=int(get("moe_intermediate_size") or get("intermediate_size") or 0) if experts else 0,
            shared_expert_intermediate=int(get("shared_expert_intermediate_size") or 0) if experts else 0,
            qk_norm=family.startswith(("qwen3", "gemma3")),  # a norm over each head's queries and keys
            sandwich_norms=family.startswith(("gemma2", "gemma3")),  # norms after each sublayer as well
            qkv_bias=family.startswith("qwen2") or bool(get("attention_bias")),
            shared_expert_gate=family == "qwen2_moe")  # a sigmoid gate on the shared expert

    @classmethod
    def from_model_path(cls, path: str | Path, key: str = "policy.model_name") -> ModelShape:
        """From a local model directory's ``config.json`` (or the HF hub's cache for a hub name)."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            config_file = _cached_hub_config(str(path))
        if config_file is None or not config_file.is_file():
            raise ConfigError(key, f"no config.json for '{path}' here (not a local model directory, not in the "
                                   "Hugging Face cache); nrl plan needs the model's config only: pass a directory "
                                   "holding its config.json with --model-config")
        return cls.from_hf_config(json.loads(config_file.read_text()))

    # ------------------------------------------------------------------ parameter counts
    @property
    def attention_params(self) -> int:
        """One layer's attention: q, k, v and output projections."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        extra = 2 * self.head_dim if self.qk_norm else 0
        extra += (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return q + kv + self.heads * self.head_dim * self.hidden + extra

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """One layer's routed experts together (0 for a dense model)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def layer_params(self) -> int:
        """One layer's parameters outside its routed experts (attention, norms, router, shared
        expert, or the dense MLP)."""
        norms = (4 if self.sandwich_norms else 2) * self.hidden
        if not self.experts:
            return self.attention_params + self.dense_mlp_params + norms
        shared = 3 * self.hidden * self.shared_expert_intermediate + (self.hidden if self.shared_expert_gate else 0)
        return self.attention_params + shared + self.experts * self.hidden + norms

    @property
    def embedding_params(self) -> int:
        """Input embedding, output head (unless tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def dense_params(self) -> int:
        """Every parameter that is not a routed expert's."""
        return self.layers * self.layer_params + self.embedding_params

    @property
    def total_params(self) -> int:
        return self.dense_params + self.layers * self.expert_params

    @property
    def active_mlp_width(self) -> int:
        """The MLP width one token passes through: the dense MLP, or its experts and shared expert."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate

    def adapter_params(self, rank: int) -> int:
        """LoRA adapters of the given rank on every linear layer of every layer (routed experts
        aside): ``rank x (inputs + outputs)`` each, an upper bound for narrower target lists."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = (self.hidden + q) + 2 * (self.hidden + kv) + (q + self.hidden)
        mlp = 3 * (self.hidden + (self.intermediate if not self.experts else self.shared_expert_intermediate))
        return self.layers * rank * (attention + mlp)

    @property
    def kv_elements_per_token(self) -> int:
        """KV-cache elements per token over all layers (times the cache's bytes per element)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def _cached_hub_config(name: str) -> Path | None:
    """The hub's ``config.json`` for ``name`` if the Hugging Face cache holds it (offline use)."""
    if "/" not in name:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a hub name at all (a relative path that does not exist yet)
        return None
    return Path(found) if isinstance(found, str) else None
