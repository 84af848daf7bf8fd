"""Checkpoints of a training worker that holds its whole state in one process: one file.

Why one file written under a temporary name and renamed: a reader never sees half of it, and a
crash mid-save leaves the previous checkpoint as it was. The snapshot is taken in host memory, so
training may go on while an asynchronous save writes it. It is read with ``weights_only`` (tensors
and plain values: nothing unpickled), checked against the live model and optimizer, and applied
only when everything matched, so a bad checkpoint raises one line and changes nothing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from nrl_core.contracts import CheckpointOptions
from nrl_core.errors import NrlError
from nrl_core.sdk.rng import rng_state, set_rng_state

STATE_FILE = "state.pt"


def _host_copy(value: Any) -> Any:
    """``value`` with every tensor in it copied to host memory (the snapshot owns its tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return value


class StateFileCheckpoints:
    """Save and load a one-process worker's ``model``, ``optimizer``, ``scheduler`` (when it has
    one), ``step`` and the RNG, in ``file_name``; the worker's ``policy.model_name`` names the model
    in the one-line errors."""

    def __init__(self, worker: Any, file_name: str = STATE_FILE) -> None:
        self.worker, self.file_name = worker, file_name
        self._pending: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def model_name(self) -> str:
        return str(self.worker.policy["model_name"])

    def save(self, path: str, options: CheckpointOptions) -> None:
        """A snapshot now; written in a thread with ``options.async_save`` (one save at a time)."""
        self.finalize()
        scheduler = getattr(self.worker, "scheduler", None)
        state = _host_copy({"model": self.worker.model.state_dict(), "optimizer": self.worker.optimizer.state_dict(),
                            "scheduler": scheduler.state_dict() if scheduler is not None else None})
        state.update(step=self.worker.step, rng=rng_state(), model_name=self.model_name)

        def write() -> None:
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
                staging = os.path.join(path, self.file_name + ".tmp")
                torch.save(state, staging)
                os.replace(staging, os.path.join(path, self.file_name))
            except BaseException as exc:  # noqa: BLE001 - finalize() raises it in the caller's thread
                self._failure = exc

        if options.async_save:
            self._pending = threading.Thread(target=write, name="nrl-checkpoint")
            self._pending.start()
        else:
            write()
            self.finalize()

    def finalize(self) -> None:
        """Wait for an asynchronous save; a save that failed raises here, in one line."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise NrlError(f"checkpoint save failed: {type(failure).__name__}: {failure}") from failure

    def load(self, path: str, options: CheckpointOptions) -> None:
        self.finalize()
        file = Path(path) / self.file_name
        if not file.is_file():
            raise NrlError(f"checkpoint {path} does not exist or is incomplete (no {self.file_name})")
        try:
            state: dict[str, Any] = torch.load(file, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise NrlError(f"checkpoint {path} is truncated or corrupt ({type(exc).__name__})") from None
        self._check(path, state)
        self.worker.model.load_state_dict(state["model"])
        self.worker.optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler") is not None:
            self.worker.scheduler.load_state_dict(state["scheduler"])
        self.worker.step = int(state["step"])
        if options.load_rng:
            set_rng_state(state["rng"])

    def _check(self, path: str, state: dict[str, Any]) -> None:
        """Everything ``load`` applies fits the live worker, before anything changes."""
        current, saved = self.worker.model.state_dict(), state.get("model") or {}
        if saved.keys() != current.keys() or any(saved[k].shape != current[k].shape for k in current):
            raise NrlError(f"checkpoint {path} is from another model ({state.get('model_name')}); "
                           f"this run trains {self.model_name}")
        groups = [len(g["params"]) for g in self.worker.optimizer.param_groups]
        saved_groups = [len(g["params"]) for g in (state.get("optimizer") or {}).get("param_groups", [])]
        if groups != saved_groups:
            raise NrlError(f"checkpoint {path}: its optimizer has parameter groups of {saved_groups} tensors, this "
                           f"run's {groups}; it was written by another optimizer setup (LoRA, frozen layers)")
        if (state.get("scheduler") is not None) != (getattr(self.worker, "scheduler", None) is not None):
            raise NrlError(f"checkpoint {path}: saved {'with' if state.get('scheduler') is not None else 'without'} "
                           f"an LR scheduler, but this run has {'one' if state.get('scheduler') is None else 'none'}; "
                           "set policy.scheduler as the checkpointed run did")
