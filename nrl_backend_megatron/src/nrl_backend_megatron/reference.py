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
        self.shards = [host_copy(view) for view in self._own_views()]
        self.rest = ReferenceWeights(other_params, by_storage=False) if other_params else None

    @property
    def host_bytes(self) -> int:
        rest = sum(c.numel() * c.element_size() for c in self.rest.copies) if self.rest is not None else 0
        return sum(s.numel() * s.element_size() for s in self.shards) + rest

    def _own_views(self) -> list[torch.Tensor]:
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        return [shard_buffer(bucket.param_data, group.intra_distributed_optimizer_instance_size)[
                    group.intra_distributed_optimizer_instance_rank]
                for group in self.groups for bucket in group.buckets]

    def _gather(self) -> None:
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        for group in self.groups:
            size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                own = shard_buffer(bucket.param_data, size)[rank]
                all_gather_into(bucket.param_data, own, group=group.intra_distributed_optimizer_instance_group)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the parameters hold the reference weights; after it, their own again.
        Collective over each buffer's data-parallel ranks."""
        views = self._own_views()
        current = [host_copy(view) for view in views]
        try:
            with torch.no_grad():
                for view, ref in zip(views, self.shards):
                    view.copy_(ref)
                self._gather()
            with self.rest.swapped_in() if self.rest is not None else nullcontext():
                yield
        finally:
            with torch.no_grad():
                for view, own in zip(views, current):
                    view.copy_(own)
                self._gather()
