"""Splitting this rank's batch into micro-batches: fixed count, dynamic (token budget) or packed.

The grouping itself is the core's (:mod:`nrl_core.data`); this module turns groups into model
inputs and maps the model's per-token output back to the padded layout the loss expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import lcm
from typing import Any

import torch

from nrl_core.api import ConfigError, PackedRows, TokenBatch, dynamic_micro_batches, pack_bins, pack_sequences


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(kw_only=True)
class MicroBatch:
    """Model inputs for the rows ``rows`` of the local batch, and how to read the output back."""

    rows: list[int]
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
        """The model's ``[r, w, ...]`` logprobs as ``[len(rows), sub width, ...]``, zeros past each
        length. ``shifted=False`` for outputs that read their own position (a value head's)."""
        width = int(sub.input_ids.shape[1])
        trailing = (None,) * (logprobs.dim() - 2)
        if self.packed is not None and not shifted:
            return self.packed.unpack(logprobs, len(self.rows), width)
        if self.packed is not None:
            # a segment's first position was "predicted" from the previous segment's last token
            # in the packed row; aligned logprobs are 0 at every sequence's position 0
            not_first = (torch.arange(width, device=logprobs.device) > 0)[(None, slice(None), *trailing)]
            return self.packed.unpack(logprobs, len(self.rows), width) * not_first
        valid = torch.arange(width, device=logprobs.device)[None, :] < sub.input_lengths[:, None].to(logprobs.device)
        return logprobs[:, :width] * valid[(slice(None), slice(None), *trailing)]

    def to_model_layout(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token field of the rows (``[len(rows), T, ...]``, aligned) laid out as the model
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


def _padded(sub: TokenBatch, rows: list[int], pad_id: int, multiple: int) -> MicroBatch:
    width = _round_up(max(int(sub.input_ids.shape[1]), 1), multiple)
    ids = torch.full((sub.size, width), pad_id, dtype=sub.input_ids.dtype)
    ids[:, :sub.input_ids.shape[1]] = sub.input_ids
    pos = torch.arange(width).expand(sub.size, width).contiguous()
    return MicroBatch(rows=rows, input_ids=ids, position_ids=pos)


def plan_micro_batches(local: TokenBatch, policy: Mapping[str, Any], *, train: bool, pad_id: int,
                       width_multiple: int = 1, seed: int = 0) -> list[MicroBatch]:
    """Micro-batches covering every row of ``local`` exactly once, per ``policy`` settings.

    ``width_multiple`` pads every input's sequence width to a multiple of it (sequence-parallel
    sharding needs the tensor-parallel size).
    """
    packing = policy.get("sequence_packing") or {}
    dynamic = policy.get("dynamic_batching") or {}
    if packing.get("enabled") and dynamic.get("enabled"):
        raise ConfigError("policy.sequence_packing.enabled",
                          "sequence packing and dynamic batching cannot both be enabled; pick one")
    lengths = [int(n) for n in local.input_lengths]
    budget_key = "train_mb_tokens" if train else "logprob_mb_tokens"
    if packing.get("enabled"):
        round_to = int(packing.get("sequence_length_round") or 1)
        budget = packing.get(budget_key) or packing.get("train_mb_tokens")
        bins = pack_bins(lengths, int(budget), packing.get("algorithm") or "modified_first_fit_decreasing",
                         round_to=round_to, seed=seed)
        out = []
        for rows in bins:
            sub = local.select(rows)
            natural = sum(_round_up(n, round_to) for n in sub.input_lengths.tolist())
            packed = pack_sequences(sub.input_ids, sub.input_lengths, [list(range(len(rows)))], pad_id=pad_id,
                                    round_to=round_to, row_width=_round_up(natural, lcm(round_to, width_multiple)))
            out.append(MicroBatch(rows=rows, input_ids=packed.input_ids, position_ids=packed.position_ids,
                                  packed=packed))
        return out
    if dynamic.get("enabled"):
        round_to = int(dynamic.get("sequence_length_round") or 1)
        groups = dynamic_micro_batches(lengths, int(dynamic.get(budget_key) or dynamic.get("train_mb_tokens")),
                                       round_to=round_to)
        return [_padded(local.select(g), g, pad_id, lcm(round_to, width_multiple)) for g in groups]
    size = int(policy.get("train_micro_batch_size" if train else "logprob_batch_size") or local.size)
    groups = [list(range(s, min(s + size, local.size))) for s in range(0, local.size, size)]
    return [_padded(local.select(g), g, pad_id, width_multiple) for g in groups]
