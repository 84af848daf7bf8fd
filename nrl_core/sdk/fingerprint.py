"""A fingerprint of a model's weight files, for adapters that must be resumed on their own base.

Each weight file's name and size and 1 MiB of its bytes at the start, middle and end
are hashed: a different fine-tune of the same architecture differs there, and hashing whole files
would read the whole model on every rank at every start.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 1 << 20

__all__ = ["base_model_identity", "weights_fingerprint"]


def weights_fingerprint(model_dir: str) -> str | None:
    """The fingerprint of ``model_dir``'s weight files: its safetensors, else the shards of a
    dist_checkpointing directory below it (``None`` without either: a hub id)."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors")) or sorted(root.rglob("*.distcp")) if root.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root)}:{size}".encode())
        with path.open("rb") as f:
            for offset in sorted({0, max(size // 2 - SAMPLE_BYTES // 2, 0), max(size - SAMPLE_BYTES, 0)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def base_model_identity(model_name: str) -> dict[str, Any]:
    """What a LoRA checkpoint records of its base: the directory's name and its fingerprint."""
    return {"model": os.path.basename(os.path.normpath(model_name)), "checksum": weights_fingerprint(model_name)}
