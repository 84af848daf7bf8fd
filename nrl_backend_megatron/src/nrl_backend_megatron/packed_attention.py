"""Local-spec core attention that also accepts packed (THD) sequences.

Why: Megatron-Core's local ``DotProductAttention`` (the only attention that runs on CPU) refuses
``packed_seq_params``; Transformer Engine's handles them but needs CUDA. Packed sequences must not
attend across their boundaries, so this subclass turns ``cu_seqlens`` into a block-diagonal causal
mask and reuses the parent's computation. RoPE position resets are done by Megatron's
``Attention`` itself from the same ``cu_seqlens`` before this is called.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


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
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        # THD: [t, heads, dim] -> [t, 1, heads, dim] (one packed row)
        total = query.shape[0]
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q, total).to(query.device)
        out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, attn_mask_type,
                              attention_bias)
        return out.reshape(total, 1, -1)
