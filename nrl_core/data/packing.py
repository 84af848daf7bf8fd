"""Sequence packing: variable-length sequences concatenated into rows of a fixed token budget.

Why: a padded batch spends compute on padding in proportion to the spread of lengths; packing
several sequences into one row removes most of it. Correctness rests on two things the rows carry:

* ``position_ids`` restart at 0 at every sequence start, so rotary positions match the unpacked
  sequence;
* attention never crosses a sequence boundary. Hugging Face models (transformers >= 5) derive a
  block-diagonal causal mask from exactly these position resets when ``attention_mask`` is
  ``None`` (``masking_utils.find_packed_sequence_indices``), for the eager and SDPA kernels on CPU
  and for varlen flash attention on GPU. Padding at the end of a row is its own segment starting
  at position 0, so no real token attends to it.

Backends pass ``PackedRows.input_ids`` and ``position_ids`` to the model and map per-token outputs
back with :meth:`PackedRows.unpack`. Bin packing is pure Python over lengths, so the Megatron
backend reuses it unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nrl_core.errors import NrlError

Bins = list[list[int]]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def _check(lengths: Sequence[int], budget: int) -> None:
    if budget <= 0:
        raise NrlError(f"sequence packing token budget must be positive, got {budget}")
    longest = max(lengths, default=0)
    if longest > budget:
        raise NrlError(f"a sequence of {longest} tokens exceeds the packing budget of {budget} tokens; "
                       f"raise policy.sequence_packing.*_mb_tokens to at least {longest}")


def _first_fit(order: Sequence[int], lengths: Sequence[int], budget: int,
               bins: Bins | None = None, room: list[int] | None = None) -> Bins:
    """Each item of ``order`` into the first bin with room (``bins``/``room``: ones already open)."""
    bins = [] if bins is None else bins
    room = [] if room is None else room
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def first_fit_decreasing(lengths: Sequence[int], budget: int, seed: int = 0) -> Bins:
    """Longest first, each into the first bin with room: within 11/9 of the optimal bin count."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return _first_fit(order, lengths, budget)


def first_fit_shuffle(lengths: Sequence[int], budget: int, seed: int = 0) -> Bins:
    """First fit in a seeded random order: mixes lengths within bins (fewer bins than none, more than FFD)."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return _first_fit(order, lengths, budget)


def modified_first_fit_decreasing(lengths: Sequence[int], budget: int, seed: int = 0) -> Bins:
    """Johnson and Garey's refinement of FFD: items over half the budget open their own bins first,
    then each such bin takes the largest item in (budget/3, budget/2] that fits, and the rest go
    first-fit-decreasing. Better than FFD on batches dominated by long sequences."""
    large = [i for i in range(len(lengths)) if lengths[i] > budget / 2]
    medium = sorted((i for i in range(len(lengths)) if budget / 3 < lengths[i] <= budget / 2),
                    key=lambda i: (-lengths[i], i))
    large.sort(key=lambda i: (-lengths[i], i))
    bins: Bins = [[i] for i in large]
    room = [budget - lengths[i] for i in large]
    used: set[int] = set()
    for b in range(len(bins)):
        for i in medium:
            if i not in used and lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                used.add(i)
                break
    rest = sorted((i for i in range(len(lengths)) if i not in used and lengths[i] <= budget / 2),
                  key=lambda i: (-lengths[i], i))
    return _first_fit(rest, lengths, budget, bins, room)


PACKING_ALGORITHMS: dict[str, Callable[[Sequence[int], int, int], Bins]] = {
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
}


def pack_bins(lengths: Sequence[int], budget: int, algorithm: str = "modified_first_fit_decreasing",
              round_to: int = 1, seed: int = 0) -> Bins:
    """Group sequence indices into bins whose (rounded) lengths sum to at most ``budget`` tokens.

    Each length is rounded up to ``round_to`` first, so every packed sequence starts at a multiple
    of it (what kernels that want aligned segments need). Every index appears in exactly one bin.
    """
    if algorithm not in PACKING_ALGORITHMS:
        raise NrlError(f"unknown sequence packing algorithm '{algorithm}'; choose one of "
                       f"{', '.join(PACKING_ALGORITHMS)}")
    rounded = [_round_up(int(n), round_to) for n in lengths]
    _check(rounded, budget)
    return PACKING_ALGORITHMS[algorithm](rounded, budget, seed)


@dataclass(kw_only=True)
class PackedRows:
    """Sequences of a batch packed into rows.

    ``input_ids`` and ``position_ids`` are ``[R, W]``; ``segments[k] = (row, start, length, index)``
    places sequence ``index`` of the original batch at ``input_ids[row, start:start + length]``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: list[tuple[int, int, int, int]]

    @property
    def num_tokens(self) -> int:
        return sum(seg[2] for seg in self.segments)

    def unpack(self, values: torch.Tensor, batch_size: int, width: int) -> torch.Tensor:
        """Per-token ``values`` ``[R, W, ...]`` back to the padded layout ``[batch_size, width, ...]``,
        zeros past each length. Differentiable (gradients flow back into ``values``)."""
        rows, cols, dest_rows, dest_cols = [], [], [], []
        for row, start, length, index in self.segments:
            rows.extend([row] * length)
            cols.extend(range(start, start + length))
            dest_rows.extend([index] * length)
            dest_cols.extend(range(length))
        out = values.new_zeros((batch_size, width, *values.shape[2:]))
        if not rows:
            return out
        picked = values[torch.tensor(rows), torch.tensor(cols)]
        return out.index_put((torch.tensor(dest_rows), torch.tensor(dest_cols)), picked)


def pack_sequences(input_ids: torch.Tensor, input_lengths: torch.Tensor, bins: Bins, *, pad_id: int = 0,
                   round_to: int = 1, row_width: int | None = None) -> PackedRows:
    """Lay out the sequences of each bin end to end in one row (each starting at a multiple of
    ``round_to``), right-padded to ``row_width`` (default: the longest row rounded to ``round_to``).

    Padding takes positions restarting at 0 so that it forms a segment of its own.
    """
    layouts: list[list[tuple[int, int, int]]] = []
    widths = []
    for b in bins:
        start, layout = 0, []
        for i in b:
            n = int(input_lengths[i])
            layout.append((start, n, i))
            start += _round_up(n, round_to)
        layouts.append(layout)
        widths.append(start)
    width = row_width if row_width is not None else _round_up(max(widths, default=1), round_to)
    ids = torch.full((len(bins), max(width, 1)), pad_id, dtype=input_ids.dtype)
    pos = torch.zeros_like(ids)
    segments = []
    for r, layout in enumerate(layouts):
        end = 0
        for start, n, i in layout:
            ids[r, start:start + n] = input_ids[i, :n]
            pos[r, start:start + n] = torch.arange(n)
            # alignment gap after a sequence: continue its positions so it attaches to it (causal,
            # so the sequence never sees it), keeping the next sequence's reset at its own start
            gap_end = _round_up(start + n, round_to)
            pos[r, start + n:gap_end] = torch.arange(n, n + gap_end - start - n)
            segments.append((r, start, n, i))
            end = gap_end
        pos[r, end:] = torch.arange(ids.shape[1] - end)
    return PackedRows(input_ids=ids, position_ids=pos, segments=segments)
