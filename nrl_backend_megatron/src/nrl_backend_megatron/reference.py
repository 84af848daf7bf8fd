"""The reference policy's weights under Megatron's distributed optimizer: each data-parallel rank
keeps only its own range of the parameter buffers.

Why: every data-parallel replica holds the same initial weights, so a whole host copy on each
rank (what :class:`ReferenceWeights` keeps) costs the model once per replica. The distributed
optimizer already splits the contiguous parameter buffers into one range per data-parallel rank
and all-gathers them after each step; the reference is kept the same way. For a reference pass
each rank writes its reference range into the buffers and the buffers are gathered; after it,
each rank writes its current range back and they are gathered again. Host memory and the copy in
flight are both the rank's share, not the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from nrl_core.api import ReferenceWeights, all_gather_into, host_copy


class ShardedReference:
    """Host copies of this rank's range of every parameter buffer of ``bucket_groups`` (Megatron
    DDP's, with the distributed optimizer), plus whole copies of ``other_params`` (parameters no
    buffer holds)."""

    def __init__(self, bucket_groups: Iterable[Any], other_params: list[torch.Tensor]) -> None:
        self.groups = list(bucket_groups)
        self.shards = [host_copy(own) for _, own, _ in self._ranges()]
        self.rest = ReferenceWeights(other_params, by_storage=False) if other_params else None

    @property
    def host_bytes(self) -> int:
        rest = sum(c.numel() * c.element_size() for c in self.rest.copies) if self.rest is not None else 0
        return sum(s.numel() * s.element_size() for s in self.shards) + rest

    def _ranges(self) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
        """``(buffer, this rank's range of it, the process group it is gathered over)`` for every
        bucket, as the distributed optimizer splits them."""
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        return [(bucket.param_data, shard_buffer(bucket.param_data, group.intra_distributed_optimizer_instance_size)[
                    group.intra_distributed_optimizer_instance_rank], group.intra_distributed_optimizer_instance_group)
                for group in self.groups for bucket in group.buckets]

    @staticmethod
    def _write_and_gather(ranges: list[tuple[torch.Tensor, torch.Tensor, Any]], values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for (_, own, _), value in zip(ranges, values):
                own.copy_(value)
            for buffer, own, group in ranges:
                all_gather_into(buffer, own, group=group)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the parameters hold the reference weights; after it, their own again.
        Collective over each buffer's data-parallel ranks."""
        ranges = self._ranges()
        current = [host_copy(own) for _, own, _ in ranges]
        try:
            self._write_and_gather(ranges, self.shards)
            with self.rest.swapped_in() if self.rest is not None else nullcontext():
                yield
        finally:
            self._write_and_gather(ranges, current)
