"""Attention that computes each packed sequence on its own.

A packed row holds several sequences whose positions restart at 0. Handing the HF model a
block-diagonal mask is correct but the CPU SDPA kernel computes that mask densely, so a row pays
for (row length)^2 scores however short its sequences are, and packing saves little. This
attention splits every row at its position resets and runs causal SDPA on each segment: cost
proportional to the sum of squared sequence lengths, no mask materialised. For an unpacked row
(one reset) it is plain causal SDPA. A sliding-window layer (Gemma 3's local layers, Mistral's)
keeps its window: a segment longer than it gets the banded causal mask transformers would build.
Registered with transformers' attention and mask interfaces under :data:`NAME`, it is what the
DTensor backend loads models with.

gpt-oss's attention adds a learned sink logit per head that takes a share of each softmax and
then is dropped; SDPA has no such term, so a model with sinks gets the same segments computed
eagerly, under :data:`SINK_NAME` (transformers refuses names with "sdpa" in them for such models).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "nrl_packed_sdpa"
SINK_NAME = "nrl_packed_eager_sinks"


def _segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], int(position_ids.shape[0])]
    return list(zip(starts, ends))


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``query`` ``[B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, T, D]`` -> ``[B, T, Hq, D]``."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None:
        if "s_aux" in kwargs:  # the model's own eager attention is the one that knows its sinks
            import sys

            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    sinks = kwargs.get("s_aux")
    rows = []
    # split, not slicing: the backward of one split is one concatenation, while each slice's
    # backward would write a zero tensor the size of the whole row
    for b, (q, k, v) in enumerate(zip(query.split(1), key.split(1), value.split(1))):
        sizes = [e - s for s, e in _segments(position_ids[b if position_ids.shape[0] > 1 else 0])]
        parts = [_causal_sdpa(qs, ks, vs, window, dropout_p=dropout, scale=scaling, enable_gqa=gqa) if sinks is None
                 else _causal_with_sinks(qs, ks, vs, window, sinks, scaling, dropout)
                 for qs, ks, vs in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2))]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def _causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None,
                 **sdpa: Any) -> torch.Tensor:
    """Causal SDPA over one segment; with a ``window``, position i sees j only when
    ``i - window < j <= i`` (transformers' and vLLM's sliding window)."""
    length = query.shape[2]
    if not window or length <= window:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, **sdpa)
    i = torch.arange(length, device=query.device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=band, **sdpa)


def _causal_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None,
                       sinks: torch.Tensor, scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention over one segment whose softmax also spans one sink logit per head."""
    length, groups = query.shape[2], query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(2, 3)) * (scale if scale is not None else query.shape[-1] ** -0.5)
    i = torch.arange(length, device=query.device)
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return F.dropout(probs, p=dropout).to(value.dtype) @ value


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask builder for :data:`NAME`: segments come from position ids, so no mask is built."""
    return None


def register(config: Any = None) -> str:
    """Make this attention usable as ``attn_implementation`` (idempotent); returns the name for a
    model of ``config``: :data:`SINK_NAME` when its class cannot take SDPA, else :data:`NAME`."""
    from transformers import AttentionInterface, AttentionMaskInterface

    for name in (NAME, SINK_NAME):
        AttentionInterface.register(name, packed_sdpa)
        AttentionMaskInterface.register(name, _no_mask)
    return SINK_NAME if config is not None and not _supports_sdpa(config) else NAME


def _supports_sdpa(config: Any) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return bool(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa)
    except KeyError:  # a classifier's or a remote-code config: its class decides at load
        return True
