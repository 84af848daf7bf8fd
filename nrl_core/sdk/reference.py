"""The reference policy's weights (the initial ones, for the KL penalty) without a second model.

Why not a frozen copy of the model: it would hold a second model in device memory for the whole
run and double the build time. The weights are kept in host memory instead (each rank its own
shards) and swapped into the live parameters for a reference pass: two copies per pass and host
memory equal to this rank's part of the model. Plain parameters already on the host can point
at the reference copy itself for the pass (no copy at all)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from nrl_core.device import host_copy

#: The key of the worker's ``policy`` section by which the core says the run never asks for
#: reference logprobs (an algorithm's ``AlgorithmSpec.reference_policy``). Users do not set it.
INIT_REFERENCE_KEY = "init_reference_model"


def init_reference_model(policy: Mapping[str, Any]) -> bool:
    """Whether a worker built with this ``policy`` section keeps the reference policy's weights:
    yes unless the core said the run never asks for them (a worker built outside a run keeps them)."""
    return bool(policy.get(INIT_REFERENCE_KEY, True))


def without_reference_model(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` for workers of a run that never asks for reference logprobs."""
    return {**config, "policy": {**config["policy"], INIT_REFERENCE_KEY: False}}


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


class ReferenceWeights:
    """A host copy of ``params`` (in their order), taken now; :meth:`swapped_in` puts it in place."""

    def __init__(self, params: Iterable[torch.Tensor], *, by_storage: bool = True) -> None:
        """``by_storage``: allow the no-copy swap for plain host parameters (a backend whose
        parameters are views into buffers it manages itself passes False)."""
        self.params = list(params)
        self.copies = [host_copy(_local(p)) for p in self.params]
        self.by_storage = by_storage

    def _storage_swap(self) -> bool:
        from torch.distributed.tensor import DTensor

        return self.by_storage and all(not isinstance(p, DTensor) and p.device == c.device
                                       for p, c in zip(self.params, self.copies))

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the parameters hold the reference weights; after it, their own again."""
        if self._storage_swap():
            current = [p.data for p in self.params]
            try:
                for p, ref in zip(self.params, self.copies):
                    p.data = ref
                yield
            finally:
                for p, cur in zip(self.params, current):
                    p.data = cur
            return
        locals_ = [_local(p) for p in self.params]
        saved = [host_copy(t) for t in locals_]
        with torch.no_grad():
            for t, ref in zip(locals_, self.copies):
                t.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, cur in zip(locals_, saved):
                    t.copy_(cur)
