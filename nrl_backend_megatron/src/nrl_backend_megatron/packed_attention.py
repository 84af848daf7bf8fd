"""Local-spec core attention that also accepts packed (THD) sequences.

Why: Megatron-Core's local ``DotProductAttention`` (the attention of machines without Transformer
Engine, the CPU among them) refuses ``packed_seq_params``; Transformer Engine's handles them but
needs CUDA. Packed sequences must not attend across their boundaries, so this subclass splits the
packed row at ``cu_seqlens`` and runs causal SDPA on each sequence: memory and work grow with the
sum of squared sequence lengths, where a block-diagonal mask over the whole row would hold
(row length)^2 scores per head and layer for the backward (on a GPU, out of memory at a few
thousand tokens). RoPE position resets are done by Megatron's ``Attention`` itself from the same
``cu_seqlens`` before this is called.

gpt-oss's layers add a learned sink logit per head, which takes a share of each softmax and is then
dropped, and every other layer attends within a sliding window; SDPA has no sink term, so those
layers compute each sequence's attention eagerly (its scores are the sequence's alone, as above),
and padded rows too, where Megatron's own masked softmax would build its window mask on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, 1, total, total]`` boolean mask, True where attention is NOT allowed."""
    seg = torch.zeros(total, dtype=torch.long)
    bounds = cu_seqlens.to("cpu").tolist()
    for i in range(len(bounds) - 1):
        seg[bounds[i]:bounds[i + 1]] = i
    if bounds[-1] < total:  # trailing padding: its own segment
        seg[bounds[-1]:] = len(bounds)
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return ~(same & causal)[None, None]


class PackedDotProductAttention(DotProductAttention):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        sinks, window = getattr(self, "softmax_offset", None), self.scale_mask_softmax.window_size
        if packed_seq_params is None and (sinks is None and window is None or attention_mask is not None):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if attention_bias is None and packed_seq_params is None:  # right-padded rows: each row a sequence
            rows = zip(query.unbind(1), key.unbind(1), value.unbind(1))
            length = torch.tensor([0, query.shape[0]], dtype=torch.int32)
            return torch.cat([self._per_sequence(q, k, v, length) for q, k, v in rows], dim=1)
        if attention_bias is None:
            return self._per_sequence(query, key, value, packed_seq_params.cu_seqlens_q)
        # THD: [t, heads, dim] -> [t, 1, heads, dim] (one packed row)
        total = query.shape[0]
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q, total).to(query.device)
        out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, attn_mask_type,
                              attention_bias)
        return out.reshape(total, 1, -1)

    def _per_sequence(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      cu_seqlens: torch.Tensor) -> torch.Tensor:
        dropout = self.attention_dropout.p if self.training else 0.0
        window = self.scale_mask_softmax.window_size
        return per_sequence_attention(query, key, value, cu_seqlens, self.softmax_scale, dropout,
                                      window_left=None if window is None else int(window[0]),
                                      sinks=getattr(self, "softmax_offset", None))


def per_sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                           scale: float | None, dropout: float, *, window_left: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """THD ``[t, heads, dim]`` in, ``[t, 1, heads * value dim]`` out, each sequence attending only to
    itself (trailing padding after the last boundary is one more sequence). ``window_left``: a
    query sees at most that many keys before its own; ``sinks``: a logit per head in each softmax."""
    total = query.shape[0]
    bounds = cu_seqlens.to("cpu").tolist()
    sizes = [end - start for start, end in zip(bounds, bounds[1:]) if end > start]
    if bounds[-1] < total:
        sizes.append(total - bounds[-1])
    q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # [1, heads, t, dim]
    parts = [_causal(qs, ks, vs, scale, dropout, window_left, sinks)
             for qs, ks, vs in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2))]
    return torch.cat(parts, dim=2)[0].permute(1, 0, 2).reshape(total, 1, -1)


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, dropout: float,
            window_left: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal attention over one sequence ``[1, heads, s, dim]``: SDPA, or eagerly with sinks."""
    length, gqa = query.shape[2], query.shape[1] != key.shape[1]
    band = None
    if window_left is not None and length > window_left + 1:
        i = torch.arange(length, device=query.device)
        band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window_left)
    if sinks is None:
        if band is None:
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=band, dropout_p=dropout, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    if band is None:
        band = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    factor = scale if scale is not None else query.shape[-1] ** -0.5
    wide = torch.promote_types(query.dtype, torch.float32)  # the softmax in float32 at least, as Megatron's
    scores = (query.to(wide) @ key.to(wide).transpose(-1, -2)) * factor
    scores = scores.masked_fill(~band, float("-inf"))
    sink = sinks.to(wide).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    probs = F.dropout(probs, p=dropout) if dropout else probs
    return (probs.to(value.dtype) @ value)


class LatentDotProductAttention(MegatronModule):
    """Core attention of multi-head latent attention (DeepSeek-V3) without Transformer Engine.

    Megatron-Core's ``MLASelfAttention`` hands its core attention keys as wide as the queries (the
    latent and rotary parts) and narrower values, with their widths as ``k_channels`` and
    ``v_channels``; its local ``DotProductAttention`` accepts neither, so on a machine without
    Transformer Engine no MLA model could be built. This one runs causal SDPA, per packed
    sequence as :class:`PackedDotProductAttention` does, or over a padded batch with its mask.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, **_: Any) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("nrl: latent attention without Transformer Engine takes no attention bias")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None:
            return per_sequence_attention(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale,
                                          dropout)
        seq, batch, heads = query.shape[:3]  # SBHD
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        allowed = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
        if attention_mask is not None:  # Megatron's: True where attention is not allowed
            allowed = allowed & ~attention_mask.to(torch.bool)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
