"""Dynamic batching: micro-batches sized by a token budget instead of a fixed sequence count.

Why: with a fixed count, a micro-batch of long sequences can exhaust memory while one of short
sequences wastes the device. Grouping sequences of similar length (sorted, longest first) so that
``count x padded length <= budget`` keeps every micro-batch's padded size bounded and padding low.
Pure Python over lengths, so every backend reuses it.
"""

from __future__ import annotations

from collections.abc import Sequence

from nrl_core.errors import NrlError


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def dynamic_micro_batches(lengths: Sequence[int], max_tokens: int, round_to: int = 1) -> list[list[int]]:
    """Indices grouped into micro-batches whose padded size (sequences x longest length rounded up
    to ``round_to``) stays within ``max_tokens``. Longest sequences come first; each micro-batch's
    indices are in ascending length order reversed (longest first). Every index appears once."""
    if max_tokens <= 0:
        raise NrlError(f"dynamic batching token budget must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    current_width = 0
    for i in order:
        width = _round_up(int(lengths[i]), round_to)
        if width > max_tokens:
            raise NrlError(f"a sequence of {lengths[i]} tokens exceeds the dynamic batching budget of "
                           f"{max_tokens} tokens; raise policy.dynamic_batching.*_mb_tokens")
        new_width = max(current_width, width)
        if current and new_width * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_width = [], width
        current.append(i)
        current_width = new_width
    if current:
        batches.append(current)
    return batches
