"""Manifest verification: did every promised weight arrive exactly once, as promised?

The generation side calls :func:`verify` after staging a refit and *before* touching its engine,
so a broken refit (a training backend that forgot a tensor, renamed one, or resharded one wrongly)
fails with the offending key names while the engine keeps serving its previous weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from nrl_core.contracts import WeightSpec
from nrl_core.errors import NrlError

if TYPE_CHECKING:
    import torch

_MAX_LISTED = 8


class RefitError(NrlError):
    """A refit was rejected; ``missing``, ``extra``, ``duplicate`` and ``mismatched`` hold the keys."""

    def __init__(self, message: str, *, missing: list[str] | None = None, extra: list[str] | None = None,
                 duplicate: list[str] | None = None, mismatched: list[str] | None = None) -> None:
        self.missing = missing or []
        self.extra = extra or []
        self.duplicate = duplicate or []
        self.mismatched = mismatched or []
        super().__init__(message)


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def _difference(got: WeightSpec, want: WeightSpec) -> str:
    """How ``got`` differs from ``want`` in shape or dtype; empty when it does not."""
    if tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype:
        return ""
    return f"got {list(got.shape)} {got.dtype}, expected {list(want.shape)} {want.dtype}"


def verify(received: Iterable[WeightSpec], manifest: Iterable[WeightSpec], *, what: str = "refit") -> None:
    """Raise :class:`RefitError` unless ``received`` matches ``manifest`` exactly.

    Exactly means: the same set of names, each received once, each with the manifest's shape and
    dtype. Every problem is reported in one message, key names included (first few of each kind).
    """
    received = list(received)
    expected = {spec.name: spec for spec in manifest}
    counts = Counter(spec.name for spec in received)
    duplicate = sorted(name for name, n in counts.items() if n > 1)
    missing = sorted(name for name in expected if name not in counts)
    extra = sorted(name for name in counts if name not in expected)
    mismatched = []
    seen: set[str] = set()
    for spec in received:
        want = expected.get(spec.name)
        if want is None or spec.name in seen:
            continue
        seen.add(spec.name)
        differs = _difference(spec, want)
        if differs:
            mismatched.append(f"{spec.name} ({differs})")
    if not (missing or extra or duplicate or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {_listing(missing)}")
    if extra:
        parts.append(f"unexpected {len(extra)}: {_listing(extra)}")
    if duplicate:
        parts.append(f"sent more than once {len(duplicate)}: {_listing(duplicate)}")
    if mismatched:
        parts.append(f"wrong shape or dtype {len(mismatched)}: {_listing(mismatched)}")
    raise RefitError(
        f"{what} rejected, weights unchanged; " + "; ".join(parts),
        missing=missing, extra=extra, duplicate=duplicate, mismatched=[m.split(" ")[0] for m in mismatched],
    )


class TornRefitError(RefitError):
    """A pipelined refit failed after the engine had loaded part of the new weights: the engine
    holds a mix of versions and refuses to generate until a refit succeeds."""


def _verified_bucket(bucket: list[tuple[str, torch.Tensor]], expected: dict[str, WeightSpec], seen: set[str],
                     what: str) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`verified_stream` of one bucket, in a frame of its own: none of its tensors is kept
    once it is done."""
    from nrl_core.refit.buckets import spec_of

    for name, tensor in bucket:
        want = expected.get(name)
        spec = spec_of(name, tensor)
        differs = "" if want is None else _difference(spec, want)
        problem = ("unexpected" if want is None else "sent more than once" if name in seen else
                   f"wrong shape or dtype ({differs})" if differs else "")
        if problem:
            raise TornRefitError(f"{what} failed part-way: {name}: {problem}", extra=[name] if want is None else [],
                                 duplicate=[name] if problem.startswith("sent") else [],
                                 mismatched=[name] if problem.startswith("wrong") else [])
        seen.add(name)
        yield name, tensor
        del tensor


def verified_stream(buckets: Iterable[list[tuple[str, torch.Tensor]]], manifest: Iterable[WeightSpec],
                    *, what: str = "refit") -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``buckets`` as it arrives, once it is proven to be the manifest's: a known
    name, not seen before, the manifest's shape and dtype; at the end, every name arrived. What a
    pipelined import loads from (:class:`~nrl_core.contracts.PipelinedImporter`): a bad tensor
    raises :class:`TornRefitError` before it reaches the engine, but after the ones before it did."""
    expected = {spec.name: spec for spec in manifest}
    seen: set[str] = set()
    for bucket in buckets:
        yield from _verified_bucket(bucket, expected, seen, what)
        del bucket  # a bucket kept while the next is received holds its buffer: two in memory, not one
    missing = sorted(set(expected) - seen)
    if missing:
        raise TornRefitError(f"{what} failed part-way: missing {len(missing)}: {_listing(missing)}", missing=missing)
