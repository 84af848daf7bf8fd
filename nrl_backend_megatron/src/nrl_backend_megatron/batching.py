"""Split this rank's rows into the micro-batches Megatron's pipeline schedule consumes.

Every micro-batch of a step has the same ``[rows, tokens]`` shape, because pipeline stages send
activations of a fixed shape. Without packing, rows are right-padded to the shard's longest
sequence (with dynamic batching, at pipeline size 1 only, each micro-batch to its own). With packing, sequences are placed first-fit-decreasing into bins of ``mb_tokens``
tokens (each padded to ``sequence_length_round``), one packed row per micro-batch, and attention
and RoPE restart at each sequence boundary (``PackedSeqParams`` in THD layout). The number of bins
is made equal across data-parallel ranks with empty bins, so every rank runs the same schedule.

(A private packer: ``nrl_core.data.packing`` did not exist when this was written.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nrl_core.api import TokenBatch, all_reduce


@dataclass
class MicroBatch:
    """Model inputs for one micro-batch and how to map per-token outputs back to its rows."""

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
        if not out:  # an empty bin: a view of the output, so its (zero) loss stays in the graph
            return flat[:0].reshape(0, 1, *trailing).expand(0, width, *trailing)
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


def padded_micro_batches(shard: TokenBatch, mbs: int, width_multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches of ``mbs`` rows, right-padded to the shard's longest sequence rounded up to
    ``width_multiple`` (sequence parallelism splits the sequence over the tensor-parallel ranks)."""
    if shard.size % mbs:
        raise ValueError(f"this rank's {shard.size} sequences do not divide into micro-batches of {mbs}; "
                         "make the global batch a multiple of micro-batch size x data-parallel size")
    width = _round_up(int(shard.input_ids.shape[1]), width_multiple)
    out = []
    for start in range(0, shard.size, mbs):
        idx = list(range(start, start + mbs))
        rows = shard.select(idx)
        ids = torch.nn.functional.pad(rows.input_ids, (0, width - rows.input_ids.shape[1]))
        pos = torch.arange(width).unsqueeze(0).expand(len(idx), -1).contiguous()
        out.append(MicroBatch(rows=rows, input_ids=ids, position_ids=pos))
    return out


def dynamic_micro_batches(shard: TokenBatch, mb_tokens: int, round_to: int, dp_group: Any,
                          width_multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches sized by a token budget (NeMo RL's dynamic batching, the core's grouping:
    ``rows x padded width <= mb_tokens``), each right-padded to its own longest sequence. Shapes
    differ between micro-batches, which only a schedule without pipeline stages accepts (checks.py
    refuses it with pipeline parallelism). Every data-parallel rank runs the same number: the
    ranks with fewer get empty ones (one row of padding, no rows to report)."""
    from nrl_core.api import dynamic_micro_batches as group

    lengths = [int(n) for n in shard.input_lengths.tolist()]
    groups = group(lengths, mb_tokens, round_to) if lengths else []
    count = torch.tensor([len(groups)], dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    out = []
    for members in groups:
        rows = shard.select(sorted(members))
        width = _round_up(_round_up(int(rows.input_lengths.max()), round_to), width_multiple)
        ids = torch.nn.functional.pad(rows.input_ids, (0, width - rows.input_ids.shape[1]))
        pos = torch.arange(width).unsqueeze(0).expand(rows.size, -1).contiguous()
        out.append(MicroBatch(rows=rows, input_ids=ids, position_ids=pos))
    width = _round_up(max(round_to, 1), width_multiple)
    for _ in range(int(count) - len(groups)):
        # the packed layout of no rows: outputs map to none, and the zero loss stays in the graph
        out.append(MicroBatch(rows=shard.select([]), input_ids=torch.zeros((1, width), dtype=shard.input_ids.dtype),
                              position_ids=torch.arange(width).unsqueeze(0), offsets=[]))
    return out


def _round_up(n: int, k: int) -> int:
    return ((n + k - 1) // k) * k if k > 1 else n


def packed_micro_batches(shard: TokenBatch, mb_tokens: int, round_to: int, dp_group: Any,
                         algorithm: str = "modified_first_fit_decreasing", seed: int = 0) -> list[MicroBatch]:
    from megatron.core.packed_seq_params import PackedSeqParams

    from nrl_core.api import pack_bins

    lengths = shard.input_lengths.tolist()
    sizes = [_round_up(int(n), round_to) for n in lengths]
    bins = [list(b) for b in pack_bins(lengths, mb_tokens, algorithm, round_to=round_to, seed=seed)]
    count = torch.tensor([len(bins)], dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    bins += [[] for _ in range(int(count) - len(bins))]
    out = []
    for members in bins:
        members = sorted(members)
        ids = torch.full((1, mb_tokens), 0, dtype=shard.input_ids.dtype)
        pos = torch.zeros((1, mb_tokens), dtype=torch.long)
        cu, offsets, cursor = [0], [], 0
        for i in members:
            n = int(lengths[i])
            ids[0, cursor:cursor + n] = shard.input_ids[i, :n]
            pos[0, cursor:cursor + sizes[i]] = torch.arange(sizes[i])
            offsets.append(cursor)
            cursor += sizes[i]
            cu.append(cursor)
        if cursor < mb_tokens:
            cu.append(mb_tokens)  # trailing padding is its own segment
        cu_t = torch.tensor(cu, dtype=torch.int32)
        max_len = int((cu_t[1:] - cu_t[:-1]).max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
        rows = shard.select(members) if members else _empty_rows(shard)
        out.append(MicroBatch(rows=rows, input_ids=ids, position_ids=pos, packed=params, offsets=offsets))
    return out


def _empty_rows(shard: TokenBatch) -> TokenBatch:
    return TokenBatch(input_ids=shard.input_ids[:0, :1], input_lengths=shard.input_lengths[:0],
                      fields={k: v[:0, :1] if v.dim() > 1 else v[:0] for k, v in shard.fields.items()})
