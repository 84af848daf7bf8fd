"""Checkpoints of a training worker that holds its whole state in one process: one file.

Why one file written under a temporary name and renamed: a reader never sees half of it, and a
crash mid-save leaves the previous checkpoint as it was. It is read with ``weights_only`` (tensors
and plain values: nothing unpickled), checked against the live model, and applied only when
everything matched, so a bad checkpoint raises one line and changes nothing.
"""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path
from typing import Any

import torch

from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import NrlError
from nrl_core.sdk.rng import rng_state, set_rng_state

STATE_FILE = "state.pt"


class StateFileCheckpoints:
    """Save and load a one-process worker's ``model``, ``optimizer``, ``step`` and the RNG; the
    worker's ``policy.model_name`` names the model in the one-line errors."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._pending: threading.Thread | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def model_name(self) -> str:
        return str(self.worker.policy["model_name"])

    def save(self, path: str, options: CheckpointOptions) -> None:
        """A snapshot now; written in a thread with ``options.async_save`` (one save at a time)."""
        self.finalize()
        state = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                 "optimizer": copy.deepcopy(self.worker.optimizer.state_dict()), "step": self.worker.step,
                 "rng": rng_state(), "model_name": self.model_name}
        Path(path).mkdir(parents=True, exist_ok=True)

        def write() -> None:
            staging = os.path.join(path, STATE_FILE + ".tmp")
            torch.save(state, staging)
            os.replace(staging, os.path.join(path, STATE_FILE))

        if options.async_save:
            self._pending = threading.Thread(target=write, name="nrl-checkpoint")
            self._pending.start()
        else:
            write()

    def finalize(self) -> None:
        if self._pending is not None:
            self._pending.join()
            self._pending = None

    def load(self, path: str, options: CheckpointOptions) -> None:
        self.finalize()
        file = Path(path) / STATE_FILE
        if not file.is_file():
            raise NrlError(f"checkpoint {path} does not exist or is incomplete (no {STATE_FILE})")
        try:
            state: dict[str, Any] = torch.load(file, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise NrlError(f"checkpoint {path} is truncated or corrupt ({type(exc).__name__})") from None
        current, saved = self.model.state_dict(), state.get("model", {})
        if saved.keys() != current.keys() or any(saved[k].shape != current[k].shape for k in current):
            raise NrlError(f"checkpoint {path} is from another model ({state.get('model_name')}); "
                           f"this run trains {self.model_name}")
        self.model.load_state_dict(saved)
        self.worker.optimizer.load_state_dict(state["optimizer"])
        self.worker.step = int(state["step"])
        if options.load_rng:
            set_rng_state(state["rng"])
