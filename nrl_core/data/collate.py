"""Lists of :class:`~nrl_core.data.processors.DatumSpec` into the right-padded ``TokenBatch``
every backend consumes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from nrl_core.contracts import TokenBatch
from nrl_core.data.processors import DatumSpec

if TYPE_CHECKING:
    import torch

__all__ = ["prompt_batch", "sft_batch"]


def _pad(rows: Sequence[Sequence[int]], pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if len(rows) else 0
    out = torch.full((len(rows), width), pad_value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out, lengths


def prompt_batch(data: Sequence[DatumSpec], pad_token_id: int) -> TokenBatch:
    """The prompts alone (``input_ids`` right-padded with ``pad_token_id``)."""
    ids, lengths = _pad([d.prompt_ids for d in data], pad_token_id)
    return TokenBatch(input_ids=ids, input_lengths=lengths)


def sft_batch(data: Sequence[DatumSpec], pad_token_id: int) -> TokenBatch:
    """Prompt + response sequences with ``fields["token_mask"]`` set on response tokens only."""
    ids, lengths = _pad([d.input_ids for d in data], pad_token_id)
    mask, _ = _pad([d.token_mask for d in data], 0)
    return TokenBatch(input_ids=ids, input_lengths=lengths, fields={"token_mask": mask.float()})
