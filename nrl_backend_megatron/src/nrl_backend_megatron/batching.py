"""A micro-batch as Megatron's pipeline schedule consumes it.

Which rows form a micro-batch is the engine's (:func:`nrl_core.api.plan_micro_batches`). Every
micro-batch of a step has the same ``[rows, tokens]`` shape, because pipeline stages send
activations of a fixed shape: without packing, rows are right-padded to the shard's longest
sequence (with dynamic batching, at pipeline size 1 only, each micro-batch to its own). With
packing, a bin's sequences lie in one row of ``mb_tokens`` tokens (each padded to
``sequence_length_round``), and attention and RoPE restart at each sequence boundary
(``PackedSeqParams`` in THD layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nrl_core.api import TokenBatch


@dataclass
class ModelInputs:
    """One micro-batch as the model reads it, and how to map per-token outputs back to its rows."""

    rows: TokenBatch
    input_ids: torch.Tensor  # [b, S]
    position_ids: torch.Tensor  # [b, S]
    packed: Any | None = None  # PackedSeqParams
    offsets: list[int] | None = None  # start of each row inside the packed sequence

    def token_mask(self) -> torch.Tensor:
        """``[b, S]`` True where the model input holds a real token (not padding)."""
        width = int(self.input_ids.shape[1])
        lengths = self.rows.input_lengths.cpu()
        if self.offsets is None:
            return torch.arange(width)[None, :] < lengths[:, None]
        mask = torch.zeros(1, width, dtype=torch.bool)
        for start, length in zip(self.offsets, lengths.tolist()):
            mask[0, start:start + length] = True
        return mask

    def row_logprobs(self, token_logprobs: torch.Tensor) -> torch.Tensor:
        """``[b, S, ...]`` per-position values of the model inputs → ``[n, T, ...]`` aligned with ``rows``."""
        return self._rows(token_logprobs, shifted=True)

    def row_values(self, values: torch.Tensor) -> torch.Tensor:
        """A value head's ``[b, S]`` outputs → ``[n, T]`` aligned with ``rows``; unlike logprobs,
        a packed sequence's first position has a value of its own (it reads only its own token)."""
        return self._rows(values, shifted=False)

    def _rows(self, per_position: torch.Tensor, *, shifted: bool) -> torch.Tensor:
        """``shifted``: position 0 of each packed sequence is 0 (a logprob there would read the
        previous sequence's last token); zeros past each row's length in both layouts."""
        width = self.rows.input_ids.shape[1]
        trailing = tuple(per_position.shape[2:])
        if self.offsets is None:  # zero past each row's length, as the packed path does
            lengths = self.rows.input_lengths.to(per_position.device)
            valid = torch.arange(width, device=per_position.device)[None, :] < lengths[:, None]
            return per_position[:, :width] * valid[(slice(None), slice(None), *(None,) * len(trailing))]
        flat = per_position[0]
        out = []
        first = 1 if shifted else 0
        for start, length in zip(self.offsets, self.rows.input_lengths.tolist()):
            seg = flat[start + first:start + length]
            out.append(torch.cat([seg.new_zeros((first, *trailing)), seg, seg.new_zeros((width - length, *trailing))]))
        return torch.stack(out)

    def to_model_layout(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token field of ``rows`` (``[n, T, ...]``, aligned) laid out as the model input
        (``[b, S, ...]``): the inverse of :meth:`row_logprobs`."""
        rows, width = self.input_ids.shape
        out = values.new_zeros((rows, width, *values.shape[2:]))
        if self.offsets is None:
            keep = min(width, int(values.shape[1]))
            out[:, :keep] = values[:, :keep]
            return out
        for row, (start, length) in enumerate(zip(self.offsets, self.rows.input_lengths.tolist())):
            out[0, start:start + length] = values[row, :length]
        return out


def token_logprobs(vocab_parallel_logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """``[b, S]`` log p(token_t | tokens_<t) under ``softmax(logits / temperature)`` from
    tensor-parallel logit shards (position 0 → 0).

    Megatron's ``vocab_parallel_cross_entropy`` reduces the max and the sum of exponentials over
    the tensor-parallel group: no rank ever holds the full-vocabulary logits.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = vocab_parallel_logits[:, :-1].float().transpose(0, 1).contiguous()  # [S-1, b, V/tp]
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].transpose(0, 1).contiguous()
    lp = -vocab_parallel_cross_entropy(logits, targets).transpose(0, 1)  # [b, S-1]
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


def padded_inputs(rows: TokenBatch, width: int) -> ModelInputs:
    """``rows`` right-padded to ``width`` tokens (every micro-batch of a pipeline step shares its
    shape; sequence parallelism splits the width over the tensor-parallel ranks)."""
    ids = torch.nn.functional.pad(rows.input_ids, (0, width - rows.input_ids.shape[1]))
    pos = torch.arange(width).unsqueeze(0).expand(rows.size, -1).contiguous()
    return ModelInputs(rows=rows, input_ids=ids, position_ids=pos)


def round_up(n: int, k: int) -> int:
    return ((n + k - 1) // k) * k if k > 1 else n


def packed_inputs(rows: TokenBatch, mb_tokens: int, round_to: int) -> ModelInputs:
    """``rows`` packed into one row of ``mb_tokens`` tokens, each sequence padded to
    ``round_to``; attention and RoPE restart at each boundary (``PackedSeqParams``, THD)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids = torch.full((1, mb_tokens), 0, dtype=rows.input_ids.dtype)
    pos = torch.zeros((1, mb_tokens), dtype=torch.long)
    cu, offsets, cursor = [0], [], 0
    for i, n in enumerate(rows.input_lengths.tolist()):
        size = round_up(int(n), round_to)
        ids[0, cursor:cursor + n] = rows.input_ids[i, :n]
        pos[0, cursor:cursor + size] = torch.arange(size)
        offsets.append(cursor)
        cursor += size
        cu.append(cursor)
    if cursor < mb_tokens:
        cu.append(mb_tokens)  # trailing padding is its own segment
    cu_t = torch.tensor(cu, dtype=torch.int32)
    max_len = int((cu_t[1:] - cu_t[:-1]).max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return ModelInputs(rows=rows, input_ids=ids, position_ids=pos, packed=params, offsets=offsets)
