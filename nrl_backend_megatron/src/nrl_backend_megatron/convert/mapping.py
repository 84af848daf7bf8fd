"""HF ↔ Megatron-Core weight mapping for the Llama/Qwen2/Qwen3 families (full, unsharded tensors).

The Megatron side uses the *local* layer spec's parameter names (the canonical form stored in a
converted checkpoint); :func:`te_name` renames the two fused-norm weights for Transformer Engine's
spec. Two layouts are fused on the Megatron side:

* ``linear_qkv``: per query group ``g``, the group's query heads then its one key head then its one
  value head, stacked along the output dimension (so a contiguous tensor-parallel split keeps whole
  groups together);
* ``linear_fc1``: ``[gate; up]`` stacked along the output dimension.

Both directions only slice and concatenate, so HF → Megatron → HF is bit-identical.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from nrl_backend_megatron.convert.families import Family, family_of, head_dim

_TE_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def te_name(local_name: str) -> str:
    """The Transformer Engine spec's name for a local-spec parameter name."""
    for old, new in _TE_RENAMES.items():
        if local_name.endswith(old):
            return local_name[: -len(old)] + new
    return local_name


def local_name(any_name: str) -> str:
    """Inverse of :func:`te_name`."""
    for old, new in _TE_RENAMES.items():
        if any_name.endswith(new):
            return any_name[: -len(new)] + old
    return any_name


class _Dims:
    def __init__(self, cfg: Any) -> None:
        self.heads = cfg.num_attention_heads
        self.groups = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.d = head_dim(cfg)
        self.per_group = self.heads // self.groups


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Any) -> torch.Tensor:
    """HF's separate q/k/v (weights ``[out, in]`` or biases ``[out]``) → Megatron's grouped layout."""
    dims = _Dims(cfg)
    rest = q.shape[1:]
    qg = q.reshape(dims.groups, dims.per_group * dims.d, *rest)
    kg = k.reshape(dims.groups, dims.d, *rest)
    vg = v.reshape(dims.groups, dims.d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    dims = _Dims(cfg)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(dims.groups, (dims.per_group + 2) * dims.d, *rest)
    q, k, v = torch.split(grouped, [dims.per_group * dims.d, dims.d, dims.d], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def _layer_pairs(family: Family) -> list[tuple[str, str]]:
    """One-to-one renames inside a decoder layer: (HF suffix, Megatron suffix)."""
    pairs = [("input_layernorm.weight", "input_layernorm.weight"),
             ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
             ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
             ("mlp.down_proj.weight", "mlp.linear_fc2.weight")]
    if family.qk_norm:
        pairs += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                  ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]
    return pairs


def hf_to_megatron(hf: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A full HF state dict → the canonical full Megatron state dict (local-spec names)."""
    family = family_of(cfg)
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
                                    "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mg_suffix in _layer_pairs(family):
            out[m + mg_suffix] = hf[h + hf_suffix]
        attn = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], cfg)
        if family.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], cfg)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], 0)
    return out


def megatron_to_hf_items(name: str, tensor: torch.Tensor, cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One full canonical Megatron tensor → its HF tensor(s) (qkv and fc1 unfuse into several)."""
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", tensor
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", tensor
        return
    if name == "output_layer.weight":
        yield "lm_head.weight", tensor
        return
    prefix, _, rest = name.partition(".layers.")
    index, _, suffix = rest.partition(".")
    if prefix != "decoder" or not index.isdigit():
        raise KeyError(f"no HF name for Megatron parameter '{name}'")
    h = f"model.layers.{index}."
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), split_qkv(tensor, cfg)):
            yield f"{h}self_attn.{proj}.{kind}", part
        return
    if suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        yield h + "mlp.gate_proj.weight", gate.contiguous()
        yield h + "mlp.up_proj.weight", up.contiguous()
        return
    for hf_suffix, mg_suffix in _layer_pairs(family_of(cfg)):
        if suffix == mg_suffix:
            yield h + hf_suffix, tensor
            return
    raise KeyError(f"no HF name for Megatron parameter '{name}'")


def megatron_to_hf(mg: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A full canonical Megatron state dict → the HF state dict (``lm_head`` omitted when tied)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mg.items():
        out.update(megatron_to_hf_items(name, tensor, cfg))
    return out


def canonical_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every canonical Megatron tensor of a model and its full shape, in a fixed order."""
    family = family_of(cfg)
    dims = _Dims(cfg)
    hidden, ffn, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv_out = (dims.heads + 2 * dims.groups) * dims.d
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (vocab, hidden)}
    for i in range(cfg.num_hidden_layers):
        m = f"decoder.layers.{i}."
        shapes[m + "input_layernorm.weight"] = (hidden,)
        shapes[m + "self_attention.linear_qkv.weight"] = (qkv_out, hidden)
        if family.qkv_bias:
            shapes[m + "self_attention.linear_qkv.bias"] = (qkv_out,)
        if family.qk_norm:
            shapes[m + "self_attention.q_layernorm.weight"] = (dims.d,)
            shapes[m + "self_attention.k_layernorm.weight"] = (dims.d,)
        shapes[m + "self_attention.linear_proj.weight"] = (hidden, dims.heads * dims.d)
        shapes[m + "pre_mlp_layernorm.weight"] = (hidden,)
        shapes[m + "mlp.linear_fc1.weight"] = (2 * ffn, hidden)
        shapes[m + "mlp.linear_fc2.weight"] = (hidden, ffn)
    shapes["decoder.final_layernorm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["output_layer.weight"] = (vocab, hidden)
    return shapes
