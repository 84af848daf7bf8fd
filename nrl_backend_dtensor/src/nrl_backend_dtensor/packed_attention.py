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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "nrl_packed_sdpa"


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
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    rows = []
    # split, not slicing: the backward of one split is one concatenation, while each slice's
    # backward would write a zero tensor the size of the whole row
    for b, (q, k, v) in enumerate(zip(query.split(1), key.split(1), value.split(1))):
        sizes = [e - s for s, e in _segments(position_ids[b if position_ids.shape[0] > 1 else 0])]
        parts = [_causal_sdpa(qs, ks, vs, window, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
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


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask builder for :data:`NAME`: segments come from position ids, so no mask is built."""
    return None


def register() -> str:
    """Make :data:`NAME` usable as ``attn_implementation`` (idempotent); returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME
