"""A micro-batch as the model reads it: right-padded rows, or one packed row.

Which rows form a micro-batch is the engine's (:func:`nrl_core.api.plan_micro_batches`); this
module turns them into model inputs and maps the model's per-token output back to the padded
layout the loss expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import lcm
from typing import Any

import torch

from nrl_core.api import PackedRows, TokenBatch, pack_sequences


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(kw_only=True)
class ModelInputs:
    """One micro-batch's rows as the model reads them, and how to read the output back."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed: PackedRows | None = None

    def token_mask(self, sub: TokenBatch) -> torch.Tensor:
        """``[r, w]`` True where the model input holds one of ``sub``'s tokens (not padding)."""
        rows, width = self.input_ids.shape
        if self.packed is None:
            return torch.arange(width)[None, :] < sub.input_lengths[:, None]
        mask = torch.zeros(rows, width, dtype=torch.bool)
        for row, start, length, _ in self.packed.segments:
            mask[row, start:start + length] = True
        return mask

    def to_padded(self, logprobs: torch.Tensor, sub: TokenBatch, shifted: bool = True) -> torch.Tensor:
        """The model's ``[r, w, ...]`` logprobs as ``[sub rows, sub width, ...]``, zeros past each
        length. ``shifted=False`` for outputs that read their own position (a value head's)."""
        width = int(sub.input_ids.shape[1])
        trailing = (None,) * (logprobs.dim() - 2)
        if self.packed is not None and not shifted:
            return self.packed.unpack(logprobs, sub.size, width)
        if self.packed is not None:
            # a segment's first position was "predicted" from the previous segment's last token
            # in the packed row; aligned logprobs are 0 at every sequence's position 0
            not_first = (torch.arange(width, device=logprobs.device) > 0)[(None, slice(None), *trailing)]
            return self.packed.unpack(logprobs, sub.size, width) * not_first
        valid = torch.arange(width, device=logprobs.device)[None, :] < sub.input_lengths[:, None].to(logprobs.device)
        return logprobs[:, :width] * valid[(slice(None), slice(None), *trailing)]

    def to_model_layout(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token field of the rows (``[n, T, ...]``, aligned) laid out as the model
        input (``[r, w, ...]``), zeros where the input is padding: the inverse of :meth:`to_padded`."""
        rows, width = self.input_ids.shape
        out = values.new_zeros((rows, width, *values.shape[2:]))
        if self.packed is None:
            keep = min(width, int(values.shape[1]))
            out[:, :keep] = values[:, :keep]
            return out
        for row, start, length, index in self.packed.segments:
            out[row, start:start + length] = values[index, :length]
        return out


def _padded(sub: TokenBatch, pad_id: int, multiple: int) -> ModelInputs:
    width = _round_up(max(int(sub.input_ids.shape[1]), 1), multiple)
    ids = torch.full((sub.size, width), pad_id, dtype=sub.input_ids.dtype)
    ids[:, :sub.input_ids.shape[1]] = sub.input_ids
    pos = torch.arange(width).expand(sub.size, width).contiguous()
    return ModelInputs(input_ids=ids, position_ids=pos)


def model_inputs(sub: TokenBatch, policy: Mapping[str, Any], *, packed: bool, pad_id: int,
                 width_multiple: int = 1) -> ModelInputs:
    """``sub``'s rows as model inputs: one packed row (``packed``), else right-padded rows.

    ``width_multiple`` pads every input's sequence width to a multiple of it (sequence-parallel
    sharding needs the tensor-parallel size); packing and dynamic batching also round each
    sequence to their ``sequence_length_round``.
    """
    if packed:
        round_to = int((policy.get("sequence_packing") or {}).get("sequence_length_round") or 1)
        natural = sum(_round_up(n, round_to) for n in sub.input_lengths.tolist())
        packing = pack_sequences(sub.input_ids, sub.input_lengths, [list(range(sub.size))], pad_id=pad_id,
                                 round_to=round_to, row_width=_round_up(natural, lcm(round_to, width_multiple)))
        return ModelInputs(input_ids=packing.input_ids, position_ids=packing.position_ids, packed=packing)
    dynamic = policy.get("dynamic_batching") or {}
    round_to = int(dynamic.get("sequence_length_round") or 1) if dynamic.get("enabled") else 1
    return _padded(sub, pad_id, lcm(round_to, width_multiple))
