"""Checksums of every file of a checkpoint: recorded when it is published, verified before a load.

A size check catches truncation but not a flipped bit; a bad disk, a partial copy between
machines or a hand edit can leave a shard the same size with other bytes, which loads silently
and trains on from other weights. The checkpoint manager records one digest per file in the
completion marker (``training_info.json``) and refuses a checkpoint whose files differ.

The digest is xxHash's XXH3-64 (``xxhash``, installed with ``datasets``, a core dependency): a
non-cryptographic hash at several GB/s, so verifying costs a fraction of reading the shards
(figures in docs/reliability.md). It detects accidents, not an attacker who can also rewrite the
marker. BLAKE2b from the standard library is kept as a fallback and for markers that name it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nrl_core.errors import NrlError

CHUNK = 8 << 20


class ChecksumError(NrlError):
    """A checkpoint file is missing or differs from what was recorded when it was saved."""


def _xxh3() -> Any:
    import xxhash

    return xxhash.xxh3_64()


def _blake2b() -> Any:
    return hashlib.blake2b(digest_size=16)


HASHERS: dict[str, Callable[[], Any]] = {"xxh3_64": _xxh3, "blake2b": _blake2b}


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b"
    return "xxh3_64"


def file_digest(path: Path, algorithm: str) -> str:
    hasher = HASHERS[algorithm]()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            hasher.update(view[:n])
    return hasher.hexdigest()


def tree_digests(root: Path, algorithm: str, *, skip: frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "digest"}}`` of every regular file under ``root`` (sorted)."""
    found: dict[str, dict[str, Any]] = {}
    for base, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            full = Path(base) / name
            rel = full.relative_to(root).as_posix()
            if rel in skip:
                continue
            found[rel] = {"size": full.stat().st_size, "digest": file_digest(full, algorithm)}
    return found


def verify_tree(root: Path, recorded: dict[str, dict[str, Any]], algorithm: str) -> None:
    """Raise :class:`ChecksumError` naming the first file under ``root`` that differs from ``recorded``."""
    if algorithm not in HASHERS:
        raise ChecksumError(f"checkpoint {root} records checksums as '{algorithm}', which this nrl cannot compute "
                            f"(known: {', '.join(HASHERS)})")
    for rel, entry in recorded.items():
        full = root / rel
        if not full.is_file():
            raise ChecksumError(f"checkpoint {root}: file '{rel}' is missing")
        size = full.stat().st_size
        if size != entry["size"]:
            raise ChecksumError(f"checkpoint {root}: file '{rel}' has {size} bytes, {entry['size']} were saved")
        if file_digest(full, algorithm) != entry["digest"]:
            raise ChecksumError(f"checkpoint {root}: file '{rel}' fails its {algorithm} checksum (same size, other "
                                f"bytes): it was corrupted or modified after the save")
