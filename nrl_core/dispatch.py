"""How a call on a worker group fans out over its ranks and how the answers come back.

A worker method declares it once, where it is defined (the Protocols of :mod:`nrl_core.contracts`,
the host's endpoints), with :func:`dispatch`; :meth:`WorkerGroup.call
<nrl_core.cluster.worker_group.WorkerGroup.call>` reads the declaration, so the algorithms, the
generation engines and refit call workers the same way and get the same failure handling. A
backend's own extension methods may declare theirs the same way; undeclared, a method runs on
every rank and returns the answers in rank order.

Standard library only: the contracts import it, and ``nrl plugins`` imports them without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["Dispatch", "Fanout", "Gather", "dispatch", "dispatch_of"]


class Fanout(StrEnum):
    """Which ranks a call reaches."""

    ALL = "all"  # every rank (collective methods: every rank must take part)
    DP = "dp"  # one rank per data-parallel group (the group's ``dp_leads``: engines, shard owners)
    RANK0 = "rank0"  # rank 0 alone
    STREAM = "stream"  # one rank, a generator whose items arrive as they are made


class Gather(StrEnum):
    """What the caller gets back from the ranks that answered."""

    LIST = "list"  # every answer, in rank order
    FIRST = "first"  # the first rank's answer (the same on every rank, e.g. globally reduced metrics)
    SHARDS = "shards"  # the answers that are not None (one per data-parallel group), in rank order
    NONE = "none"  # nothing: the call is for its effect


@dataclass(frozen=True)
class Dispatch:
    fanout: Fanout = Fanout.ALL
    gather: Gather = Gather.LIST


DEFAULT = Dispatch()
_ATTRIBUTE = "__nrl_dispatch__"


def dispatch(fanout: Fanout | str = Fanout.ALL, gather: Gather | str = Gather.LIST) -> Callable[[F], F]:
    """Declare how the core calls the decorated worker method: ``@dispatch(Fanout.DP, Gather.LIST)``."""
    declared = Dispatch(Fanout(fanout), Gather(gather))
    if declared.fanout is Fanout.STREAM and declared.gather is not Gather.LIST:
        raise ValueError("a streamed method yields its items as they come: its gather is 'list'")

    def mark(method: F) -> F:
        setattr(method, _ATTRIBUTE, declared)
        return method

    return mark


def dispatch_of(method: Any) -> Dispatch:
    """The declaration of ``method`` (a function); :data:`DEFAULT` for a name or an undeclared method."""
    return getattr(method, _ATTRIBUTE, DEFAULT) if callable(method) else DEFAULT
