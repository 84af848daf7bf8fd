"""HF ↔ Megatron-Core weight mapping for the supported families (full, unsharded tensors).

The Megatron side uses the *local* layer spec's parameter names (the canonical form stored in a
converted checkpoint); :func:`te_name` renames the two fused-norm weights for Transformer Engine's
spec. Two layouts are fused on the Megatron side:

* ``linear_qkv``: per query group ``g``, the group's query heads then its one key head then its one
  value head, stacked along the output dimension (so a contiguous tensor-parallel split keeps whole
  groups together);
* ``linear_fc1``: ``[gate; up]`` stacked along the output dimension, for the dense MLP, every
  routed expert (``mlp.experts.local_experts.<e>``, ``e`` the global expert index) and the shared
  expert alike.

The MoE router (``mlp.router``) and the shared expert's sigmoid gate (``mlp.shared_experts.
gate_weight``) are plain copies. One table, :func:`layer_rules`, drives both directions and the
shapes; both directions only slice and concatenate, so HF → Megatron → HF is bit-identical.

gpt-oss keeps each projection of all of a layer's experts in one HF tensor (``mlp.experts.
gate_up_proj`` ``[experts, hidden, 2 x width]`` with gate and up columns interleaved, its bias,
``down_proj`` ``[experts, width, hidden]`` and its bias): a Megatron expert tensor is one expert's
slice of it, transposed to ``[out, in]`` and de-interleaved to ``[gate; up]``. The way back needs
every expert of the layer, so :func:`megatron_to_hf_stream` gathers them before it yields the HF
tensor.

A value model (an HF classifier's config, see :func:`~nrl_backend_megatron.convert.families.head_kind`)
has HF's ``score`` where a causal LM has ``lm_head``: Megatron's ``output_layer.weight`` (and
``output_layer.bias``) are ``score.weight`` (``score.bias``), of one row.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nrl_backend_megatron.convert.families import (
    family_of,
    head_dim,
    head_kind,
    moe_layers,
    num_experts,
    shared_expert_width,
)
from nrl_core.api import head_has_bias

_TE_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
               # latent attention: Transformer Engine's spec fuses its query and latent norms into the
               # up-projections that follow them
               "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
               "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}


# a Mamba layer's pre-norm, which Transformer Engine's spec fuses into the mixer's input projection
_MAMBA_NORM, _MAMBA_TE_NORM = re.compile(r"(layers\.\d+\.)norm\.weight$"), re.compile(r"(layers\.\d+\.)mixer\.in_proj\.layer_norm_weight$")


def te_name(local_name: str) -> str:
    """The Transformer Engine spec's name for a local-spec parameter name of a dense layer (a MoE
    layer keeps its ``pre_mlp_layernorm`` apart from the experts, so its names do not change)."""
    if _MAMBA_NORM.search(local_name):
        return _MAMBA_NORM.sub(r"\1mixer.in_proj.layer_norm_weight", local_name)
    for old, new in _TE_RENAMES.items():
        if local_name.endswith(old):
            return local_name[: -len(old)] + new
    return local_name


def local_name(any_name: str) -> str:
    """Inverse of :func:`te_name`."""
    if _MAMBA_TE_NORM.search(any_name):
        return _MAMBA_TE_NORM.sub(r"\1norm.weight", any_name)
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


@dataclass(frozen=True)
class Rule:
    """One canonical Megatron tensor of a decoder layer and the HF tensor(s) it is made of.

    ``how``: ``copy`` (one HF tensor, same layout), ``qkv`` (q, k, v fused by query group, see
    :func:`fuse_qkv`) or ``gate_up`` (SwiGLU ``[gate; up]`` stacked along the output dimension);
    with ``expert`` set, expert ``expert``'s slice of a stacked HF tensor (:data:`_STACKED`).
    """

    megatron: str
    hf: tuple[str, ...]
    how: str
    shape: tuple[int, ...]
    expert: int | None = None


def _interleave(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's layout: gate and up alternating along ``dim`` (gate first)."""
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


# how → (HF expert slice → Megatron tensor, Megatron tensor → HF expert slice)
_STACKED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    # [hidden, 2 x width] interleaved  <->  [gate; up] of [width, hidden] each
    "stacked_gate_up": (lambda t: torch.cat([t[:, 0::2].t(), t[:, 1::2].t()]).contiguous(),
                        lambda m: _interleave(*(part.t() for part in torch.chunk(m, 2)), dim=1).contiguous()),
    "stacked_gate_up_bias": (lambda t: torch.cat([t[0::2], t[1::2]]).contiguous(),
                             lambda m: _interleave(*torch.chunk(m, 2), dim=0).contiguous()),
    "stacked_transposed": (lambda t: t.t().contiguous(), lambda m: m.t().contiguous()),  # [width, hidden]
    "stacked_copy": (lambda t: t.contiguous(), lambda m: m.contiguous()),
}


def _swiglu(megatron: str, hf: str, width: int, hidden: int) -> list[Rule]:
    """A SwiGLU MLP: Megatron's fused ``linear_fc1`` and its ``linear_fc2``."""
    return [Rule(f"{megatron}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), "gate_up",
                 (2 * width, hidden)),
            Rule(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",), "copy", (hidden, width))]


def _latent_attention_rules(cfg: Any) -> list[Rule]:
    """Multi-head latent attention: HF's and Megatron's projections hold the same layouts (the
    rotary part last in each head's query and in the compressed key-value projection; keys then
    values per head in the up-projection), so each is a copy under another name."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    q_width = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    rules = [Rule("input_layernorm.weight", ("input_layernorm.weight",), "copy", (hidden,))]
    if cfg.q_lora_rank:
        rules += [Rule("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), "copy",
                       (cfg.q_lora_rank, hidden)),
                  Rule("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",), "copy",
                       (cfg.q_lora_rank,)),
                  Rule("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), "copy",
                       (q_width, cfg.q_lora_rank))]
    else:
        rules.append(Rule("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), "copy", (q_width, hidden)))
    return rules + [
        Rule("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), "copy",
             (cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden)),
        Rule("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",), "copy", (cfg.kv_lora_rank,)),
        Rule("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), "copy",
             (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
        Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy", (hidden, heads * cfg.v_head_dim)),
        Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy", (hidden,))]


def _latent_moe_rules(cfg: Any) -> list[Rule]:
    """DeepSeek-V3's experts: the router with its correction bias (a buffer on Megatron's side), the
    routed experts and one ungated shared expert as wide as the shared experts together."""
    hidden, experts = cfg.hidden_size, num_experts(cfg)
    rules = [Rule("mlp.router.weight", ("mlp.gate.weight",), "copy", (experts, hidden)),
             Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), "copy", (experts,))]
    for e in range(experts):
        rules += _swiglu(f"mlp.experts.local_experts.{e}", f"mlp.experts.{e}", cfg.moe_intermediate_size, hidden)
    if shared_expert_width(cfg):
        rules += _swiglu("mlp.shared_experts", "mlp.shared_experts", shared_expert_width(cfg), hidden)
    return rules


def _hybrid_rules(cfg: Any, layer: int) -> list[Rule]:
    """A Nemotron-H layer: its pre-norm, then a Mamba mixer (same layouts on both sides), attention,
    an ungated MLP or Nemotron 3's experts; HF names all four ``mixer``."""
    from nrl_backend_megatron.hybrid import layer_pattern, mamba_dims

    hidden, kind = cfg.hidden_size, layer_pattern(cfg)[layer]
    if kind == "M":
        d = mamba_dims(cfg)
        rules = [Rule("norm.weight", ("norm.weight",), "copy", (hidden,)),
                 Rule("mixer.in_proj.weight", ("mixer.in_proj.weight",), "copy",
                      (2 * d["inner"] + 2 * d["groups"] * d["state"] + d["heads"], hidden)),
                 Rule("mixer.conv1d.weight", ("mixer.conv1d.weight",), "copy", (d["conv_channels"], 1, d["kernel"]))]
        if getattr(cfg, "use_conv_bias", True):
            rules.append(Rule("mixer.conv1d.bias", ("mixer.conv1d.bias",), "copy", (d["conv_channels"],)))
        return rules + [Rule(f"mixer.{n}", (f"mixer.{n}",), "copy", (d["heads"],)) for n in ("A_log", "D", "dt_bias")] + [
            Rule("mixer.norm.weight", ("mixer.norm.weight",), "copy", (d["inner"],)),
            Rule("mixer.out_proj.weight", ("mixer.out_proj.weight",), "copy", (hidden, d["inner"]))]
    if kind == "*":
        dims = _Dims(cfg)
        return [Rule("input_layernorm.weight", ("norm.weight",), "copy", (hidden,)),
                Rule("self_attention.linear_qkv.weight", tuple(f"mixer.{p}_proj.weight" for p in "qkv"), "qkv",
                     ((dims.heads + 2 * dims.groups) * dims.d, hidden)),
                Rule("self_attention.linear_proj.weight", ("mixer.o_proj.weight",), "copy", (hidden, dims.heads * dims.d))]
    if kind == "-":
        return [Rule("pre_mlp_layernorm.weight", ("norm.weight",), "copy", (hidden,)),
                *_squared_relu("mlp", "mixer", cfg.intermediate_size, hidden)]
    # Nemotron 3's experts: DeepSeek-V3's router (a correction bias, a buffer on Megatron's side),
    # squared-ReLU routed experts and one shared expert
    # (Nemotron 3 Super's experts read and write a latent width, projected from and to the hidden one)
    experts, latent = num_experts(cfg), getattr(cfg, "moe_latent_size", None)
    rules = [Rule("pre_mlp_layernorm.weight", ("norm.weight",), "copy", (hidden,)),
             Rule("mlp.router.weight", ("mixer.gate.weight",), "copy", (experts, hidden)),
             Rule("mlp.router.expert_bias", ("mixer.gate.e_score_correction_bias",), "copy", (experts,))]
    if latent:
        rules += [Rule("mlp.fc1_latent_proj.weight", ("mixer.fc1_latent_proj.weight",), "copy", (latent, hidden)),
                  Rule("mlp.fc2_latent_proj.weight", ("mixer.fc2_latent_proj.weight",), "copy", (hidden, latent))]
    for e in range(experts):
        rules += _squared_relu(f"mlp.experts.local_experts.{e}", f"mixer.experts.{e}", cfg.moe_intermediate_size,
                               latent or hidden)
    if shared_expert_width(cfg):
        rules += _squared_relu("mlp.shared_experts", "mixer.shared_experts", shared_expert_width(cfg), hidden)
    return rules


def _squared_relu(megatron: str, hf: str, width: int, hidden: int) -> list[Rule]:
    """An ungated MLP: ``up_proj`` is Megatron's ``linear_fc1``, ``down_proj`` its ``linear_fc2``."""
    return [Rule(f"{megatron}.linear_fc1.weight", (f"{hf}.up_proj.weight",), "copy", (width, hidden)),
            Rule(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",), "copy", (hidden, width))]


def _gpt_oss_moe_rules(cfg: Any) -> list[Rule]:
    """gpt-oss's router (a bias too) and its experts, each a slice of HF's stacked tensors."""
    hidden, experts, width = cfg.hidden_size, num_experts(cfg), cfg.intermediate_size
    rules = [Rule("mlp.router.weight", ("mlp.router.weight",), "copy", (experts, hidden)),
             Rule("mlp.router.bias", ("mlp.router.bias",), "copy", (experts,))]
    for e in range(experts):
        local = f"mlp.experts.local_experts.{e}"
        rules += [Rule(f"{local}.linear_fc1.weight", ("mlp.experts.gate_up_proj",), "stacked_gate_up",
                       (2 * width, hidden), e),
                  Rule(f"{local}.linear_fc1.bias", ("mlp.experts.gate_up_proj_bias",), "stacked_gate_up_bias",
                       (2 * width,), e),
                  Rule(f"{local}.linear_fc2.weight", ("mlp.experts.down_proj",), "stacked_transposed",
                       (hidden, width), e),
                  Rule(f"{local}.linear_fc2.bias", ("mlp.experts.down_proj_bias",), "stacked_copy", (hidden,), e)]
    return rules


def layer_rules(cfg: Any, layer: int) -> list[Rule]:
    """Every canonical tensor of decoder layer ``layer``, in export order (attention, then MLP)."""
    family = family_of(cfg)
    dims = _Dims(cfg)
    hidden = cfg.hidden_size
    if family.hybrid:
        return _hybrid_rules(cfg, layer)
    if family.latent:
        rules = _latent_attention_rules(cfg)
        if not moe_layers(cfg)[layer]:
            return rules + _swiglu("mlp", "mlp", cfg.intermediate_size, hidden)
        return rules + _latent_moe_rules(cfg)
    qkv_out = (dims.heads + 2 * dims.groups) * dims.d
    qkv = tuple(f"self_attn.{p}_proj" for p in "qkv")
    rules = [Rule("input_layernorm.weight", ("input_layernorm.weight",), "copy", (hidden,)),
             Rule("self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in qkv), "qkv", (qkv_out, hidden))]
    if family.qkv_bias:
        rules.append(Rule("self_attention.linear_qkv.bias", tuple(f"{p}.bias" for p in qkv), "qkv", (qkv_out,)))
    if family.qk_norm:
        rules += [Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "copy", (dims.d,)),
                  Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "copy", (dims.d,))]
    rules.append(Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy",
                      (hidden, dims.heads * dims.d)))
    if family.gpt_oss:
        rules += [Rule("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), "copy", (hidden,)),
                  Rule("self_attention.core_attention.softmax_offset", ("self_attn.sinks",), "copy", (dims.heads,))]
    rules.append(Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy", (hidden,)))
    if family.gpt_oss:
        return rules + _gpt_oss_moe_rules(cfg)
    if not moe_layers(cfg)[layer]:
        return rules + _swiglu("mlp", "mlp", cfg.intermediate_size, hidden)
    rules.append(Rule("mlp.router.weight", ("mlp.gate.weight",), "copy", (num_experts(cfg), hidden)))
    for e in range(num_experts(cfg)):
        rules += _swiglu(f"mlp.experts.local_experts.{e}", f"mlp.experts.{e}", cfg.moe_intermediate_size, hidden)
    if family.shared_expert:
        rules += _swiglu("mlp.shared_experts", "mlp.shared_expert", shared_expert_width(cfg), hidden)
        rules.append(Rule("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), "copy", (1, hidden)))
    return rules


def _join(rule: Rule, parts: list[torch.Tensor], cfg: Any) -> torch.Tensor:
    if rule.expert is not None:
        return _STACKED[rule.how][0](parts[0][rule.expert])
    if rule.how == "qkv":
        return fuse_qkv(*parts, cfg)
    if rule.how == "gate_up":
        return torch.cat(parts, 0)
    return parts[0]


def _split(rule: Rule, tensor: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, ...]:
    if rule.expert is not None:
        raise ValueError(f"'{rule.megatron}' is one expert's slice of the HF tensor {rule.hf[0]}; convert a layer's "
                         "experts together (megatron_to_hf_stream)")
    if rule.how == "qkv":
        return split_qkv(tensor, cfg)
    if rule.how == "gate_up":
        return tuple(t.contiguous() for t in torch.chunk(tensor, 2, dim=0))
    return (tensor,)


def tied_embeddings(cfg: Any) -> bool:
    """Whether the output layer is the embedding's transpose: never for a value head, which
    replaces it (a classifier's config may still carry its LM's ``tie_word_embeddings``)."""
    return bool(cfg.tie_word_embeddings) and head_kind(cfg) is None


def head_names(cfg: Any) -> dict[str, str]:
    """Megatron's output-layer tensors → their HF names: ``lm_head`` of a causal LM (none when
    tied), ``score`` of a value model (with its bias for ``regression``)."""
    kind = head_kind(cfg)
    if kind is not None:
        return {"output_layer.weight": "score.weight",
                **({"output_layer.bias": "score.bias"} if head_has_bias(kind) else {})}
    return {} if tied_embeddings(cfg) else {"output_layer.weight": "lm_head.weight"}


@dataclass(frozen=True)
class _Names:
    """Where a family keeps its embedding, layers and final norm, on each side."""

    embedding: str
    layers: str
    hf_norm: str
    norm: str


_LLAMA_NAMES = _Names("model.embed_tokens.weight", "model.layers", "model.norm.weight", "decoder.final_layernorm.weight")
_HYBRID_NAMES = _Names("backbone.embeddings.weight", "backbone.layers", "backbone.norm_f.weight", "decoder.final_norm.weight")


def _names(cfg: Any) -> _Names:
    return _HYBRID_NAMES if family_of(cfg).hybrid else _LLAMA_NAMES


def hf_embedding_name(cfg: Any) -> str:
    """The HF name of the input embedding."""
    return _names(cfg).embedding


def hf_to_megatron(hf: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A full HF state dict → the canonical full Megatron state dict (local-spec names)."""
    table = source_table(cfg)
    return {name: megatron_tensor(name, hf.__getitem__, cfg, table) for name in table}


def source_table(cfg: Any) -> dict[str, tuple[Rule | None, tuple[str, ...]]]:
    """Every canonical Megatron tensor, in :func:`canonical_shapes`' order → its layer rule (None:
    a plain copy) and the HF tensors it is made of. Built once per model: looking a name up in
    :func:`layer_rules` costs a layer's rules, which a MoE layer has hundreds of."""
    names = _names(cfg)
    table: dict[str, tuple[Rule | None, tuple[str, ...]]] = {
        "embedding.word_embeddings.weight": (None, (names.embedding,))}
    for i in range(cfg.num_hidden_layers):
        for rule in layer_rules(cfg, i):
            table[f"decoder.layers.{i}.{rule.megatron}"] = (rule, tuple(f"{names.layers}.{i}.{hf}" for hf in rule.hf))
    table[names.norm] = (None, (names.hf_norm,))
    table.update({megatron: (None, (hf,)) for megatron, hf in head_names(cfg).items()})
    return table


def megatron_tensor(name: str, get: Callable[[str], torch.Tensor], cfg: Any,
                    table: Mapping[str, tuple[Rule | None, tuple[str, ...]]]) -> torch.Tensor:
    """Canonical Megatron tensor ``name`` (an entry of ``table``, :func:`source_table`), made of the
    HF tensors ``get`` reads one at a time, so a conversion can stream a checkpoint instead of
    holding it."""
    if name not in table:
        raise KeyError(f"no HF name for Megatron parameter '{name}'")
    rule, sources = table[name]
    parts = [get(hf) for hf in sources]
    return parts[0] if rule is None else _join(rule, parts, cfg)


def _layer_rule(name: str, cfg: Any) -> tuple[Rule, int]:
    prefix, _, rest = name.partition(".layers.")
    index, _, suffix = rest.partition(".")
    if prefix == "decoder" and index.isdigit() and int(index) < cfg.num_hidden_layers:
        for rule in layer_rules(cfg, int(index)):
            if rule.megatron == suffix:
                return rule, int(index)
    raise KeyError(f"no HF name for Megatron parameter '{name}'")


def megatron_to_hf_items(name: str, tensor: torch.Tensor, cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One full canonical Megatron tensor → its HF tensor(s) (qkv and fc1 unfuse into several)."""
    names = _names(cfg)
    if name == "embedding.word_embeddings.weight":
        yield names.embedding, tensor
        return
    if name == names.norm:
        yield names.hf_norm, tensor
        return
    heads = head_names(cfg) if head_kind(cfg) else {"output_layer.weight": "lm_head.weight"}  # tied: still named
    if name in heads:
        yield heads[name], tensor
        return
    rule, index = _layer_rule(name, cfg)
    for hf_suffix, part in zip(rule.hf, _split(rule, tensor, cfg)):
        yield f"{names.layers}.{index}.{hf_suffix}", part


def megatron_to_hf_stream(pairs: Iterable[tuple[str, torch.Tensor]], cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Full canonical Megatron tensors, in :func:`canonical_shapes`' order → the HF tensors, each
    as soon as what it is made of has passed: an HF tensor that stacks a layer's experts (gpt-oss)
    once its last expert has, the others at once (:func:`megatron_to_hf_items`)."""
    # only gpt-oss stacks experts: other models skip building the table, once per refit and manifest
    stacked = {name: (rule, hf[0]) for name, (rule, hf) in source_table(cfg).items()
               if rule is not None and rule.expert is not None} if family_of(cfg).gpt_oss else {}
    pending: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in pairs:
        if name not in stacked:
            yield from megatron_to_hf_items(name, tensor, cfg)
            continue
        rule, hf_name = stacked[name]
        slots = pending.setdefault(hf_name, [None] * num_experts(cfg))
        slots[rule.expert] = _STACKED[rule.how][1](tensor)  # type: ignore[index]
        if all(slot is not None for slot in slots):
            del pending[hf_name]
            yield hf_name, torch.stack(slots)  # type: ignore[arg-type]
    if pending:
        name = sorted(pending)[0]
        missing = [e for e, slot in enumerate(pending[name]) if slot is None]
        raise ValueError(f"experts {missing} of {name} were not among the Megatron tensors")


def megatron_to_hf(mg: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A full canonical Megatron state dict → the HF state dict (``lm_head`` omitted when tied)."""
    return dict(megatron_to_hf_stream(mg.items(), cfg))


def canonical_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every canonical Megatron tensor of a model and its full shape, in a fixed order."""
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (vocab, hidden)}
    for i in range(cfg.num_hidden_layers):
        for rule in layer_rules(cfg, i):
            shapes[f"decoder.layers.{i}.{rule.megatron}"] = rule.shape
    shapes[_names(cfg).norm] = (hidden,)
    rows = 1 if head_kind(cfg) else vocab
    for name in head_names(cfg):
        shapes[name] = (rows, hidden) if name.endswith(".weight") else (rows,)
    return shapes
