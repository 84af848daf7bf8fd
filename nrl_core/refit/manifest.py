"""Manifest verification: did every promised weight arrive exactly once, as promised?

The generation side calls :func:`verify` after staging a refit and *before* touching its engine,
so a broken refit (a training backend that forgot a tensor, renamed one, or resharded one wrongly)
fails with the offending key names while the engine keeps serving its previous weights.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from nrl_core.contracts import WeightSpec
from nrl_core.errors import NrlError

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
        if tuple(spec.shape) != tuple(want.shape) or spec.dtype != want.dtype:
            mismatched.append(f"{spec.name} (got {list(spec.shape)} {spec.dtype}, expected {list(want.shape)} {want.dtype})")
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
