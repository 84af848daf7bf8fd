"""A repair to vLLM's CPU rotary embedding (vLLM 0.32), installed in every vLLM worker process.

vLLM's CPU kernel (``ops.rotary_embedding``) is right for queries and keys laid out as
``[tokens, heads * head_size]``, which is how most models call it, and wrong for a
``[tokens, heads, head_size]`` tensor: it rotates the first head's worth of each row only, with
the wrong stride between tokens. Multi-head latent attention calls it that way, on views of its
rotary part, when its RoPE is plain (Moonlight, GLM-4.7-Flash, nrl's tiny DeepSeek-V3; the YaRN
of DeepSeek-V3's own checkpoints takes vLLM's PyTorch path already), so the engine's logprobs
matched the trainer's only at a sequence's first position, where the rotation is the identity.
Such calls take vLLM's own PyTorch implementation instead, written back in place as the kernel
would.
"""

from __future__ import annotations

from typing import Any

import torch


def rotate_three_dimensional_inputs_natively() -> bool:
    """Route ``RotaryEmbedding.forward_cpu`` calls with 3-D queries or keys to ``forward_native``;
    False when this vLLM has no such method."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return False
    kernel = getattr(RotaryEmbedding, "forward_cpu", None)
    if kernel is None or getattr(kernel, "_nrl_three_dimensional", False):
        return kernel is not None

    def forward_cpu(self: Any, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return kernel(self, positions, query, key)
        rotated_query, rotated_key = self.forward_native(positions, query.contiguous(),
                                                         None if key is None else key.contiguous())
        query.copy_(rotated_query)
        if key is not None and rotated_key is not None:
            key.copy_(rotated_key)
        return query, key

    forward_cpu._nrl_three_dimensional = True  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu
    return True
