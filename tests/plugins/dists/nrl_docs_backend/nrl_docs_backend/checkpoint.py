"""The docs backend's checkpoint files: written complete-or-not, read and checked before anything changes.

Layout of a checkpoint directory: ``model.safetensors`` (the weights), ``state.pt`` (optimizer
state and, with ``load_rng``, every RNG state) and ``docs_checkpoint.json``, written last, naming
the format and each file's size. A directory without that file is an unfinished or foreign write;
a size that differs is a truncated one. Loading reads and checks everything into memory first, so
a bad checkpoint raises one line and leaves the worker as it was.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

from nrl_core.errors import NrlError

FORMAT = "nrl-docs-backend/1"
META = "docs_checkpoint.json"
WEIGHTS = "model.safetensors"
STATE = "state.pt"


def _write(path: Path, weights: dict[str, torch.Tensor], state: dict[str, Any], options: dict[str, bool]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / META).unlink(missing_ok=True)  # an overwritten checkpoint is incomplete until the new META lands
    save_file(weights, str(path / WEIGHTS))
    torch.save(state, path / STATE)
    meta = {"format": FORMAT, "options": options,
            "files": {name: os.path.getsize(path / name) for name in (WEIGHTS, STATE)}}
    tmp = path / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, path / META)


class CheckpointWriter:
    """Writes snapshots synchronously or in one background thread; ``wait`` re-raises its failure."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, path: str, weights: dict[str, torch.Tensor], state: dict[str, Any],
              options: dict[str, bool], *, background: bool) -> None:
        self.wait()
        if not background:
            _write(Path(path), weights, state, options)
            return

        def run() -> None:
            try:
                _write(Path(path), weights, state, options)
            except BaseException as exc:  # handed to the caller of wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"docs-checkpoint:{path}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise NrlError(f"asynchronous checkpoint save failed: {error}") from error


def read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights, state)`` of a complete docs-backend checkpoint, or a one-line NrlError saying why not."""
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise NrlError(f"no checkpoint at {path}: the directory does not exist")
    if not (root / META).is_file():
        raise NrlError(f"{path} is not a complete docs-backend checkpoint ({META} is missing: an unfinished "
                       "save or another backend's checkpoint)")
    try:
        meta = json.loads((root / META).read_text())
    except ValueError as exc:
        raise NrlError(f"{path}/{META} is unreadable: {exc}") from None
    if meta.get("format") != FORMAT:
        raise NrlError(f"{path} holds format {meta.get('format')!r}, not {FORMAT!r}: not a docs-backend checkpoint")
    for name, size in meta["files"].items():
        actual = os.path.getsize(root / name) if (root / name).is_file() else None
        if actual != size:
            raise NrlError(f"{path}/{name} is {'missing' if actual is None else f'{actual} bytes'}, "
                           f"expected {size} bytes: the checkpoint is truncated; resume from another one")
    try:
        weights = load_file(str(root / WEIGHTS))
        state = torch.load(root / STATE, weights_only=True)
    except Exception as exc:  # corrupt despite the right size
        raise NrlError(f"{path} is corrupt: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    return weights, state
