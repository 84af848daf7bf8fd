"""What the worker Protocols of :mod:`nrl_core.contracts` say about themselves, so the contract is
written once: a capability Protocol carries its name, role, contract version and what a config
asks of it (:func:`capability`); a method of the base Protocols carries the version that added it
and whether an older worker gets a default (:func:`since`). The method tables the load-time check
uses, the conformance kit's method check and the docs' reference tables are all read from these
marks (:mod:`nrl_core.contract_versions`).

Standard library only, as :mod:`nrl_core.dispatch`: the contracts import it without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Capability", "Since", "capability", "capability_of", "since", "since_of"]

_CAPABILITY = "__nrl_capability__"
_SINCE = "__nrl_since__"


@dataclass(frozen=True)
class Capability:
    """An optional part of the contract a backend's spec declares by ``name``: its worker then has
    the Protocol's methods (``role``: ``training`` or ``generation``), checked at load."""

    name: str
    role: str
    since: int
    asks: str  # what in a config needs it, and what the worker then does


@dataclass(frozen=True)
class Since:
    version: int = 1
    adaptable: bool = False  # a worker of an older contract without it gets a default


def capability(name: str, *, role: str, since: int, asks: str) -> Callable[[type[T]], type[T]]:
    """Mark a Protocol as the methods capability ``name`` requires."""
    if role not in ("training", "generation"):
        raise ValueError(f"a capability's role is training or generation, got {role!r}")

    def mark(protocol: type[T]) -> type[T]:
        setattr(protocol, _CAPABILITY, Capability(name, role, since, " ".join(asks.split())))
        return protocol

    return mark


def since(version: int, *, adaptable: bool = False) -> Callable[[T], T]:
    """Mark a base Protocol's method as added by contract ``version``."""

    def mark(method: T) -> T:
        setattr(method, _SINCE, Since(version, adaptable))
        return method

    return mark


def capability_of(protocol: type) -> Capability | None:
    return protocol.__dict__.get(_CAPABILITY)


def since_of(method: Any) -> Since:
    return getattr(method, _SINCE, Since())
