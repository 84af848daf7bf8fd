"""Checkpoint hook implementations for a backend whose worker saves and loads itself.

Most backends answer ``nrl_checkpoint_save``/``nrl_checkpoint_load`` the same way: if the worker
is (a subclass of) theirs, call its ``save_checkpoint``/``load_checkpoint``; otherwise ``None``.
A plugin module writes ``nrl_checkpoint_save, nrl_checkpoint_load = worker_checkpoint_hooks(PATH)``.
The worker is recognised by class path, so a foreign worker never imports the backend's module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nrl_core.contracts import CheckpointOptions
from nrl_core.hookspecs import hookimpl

Hook = Callable[[Any, str, CheckpointOptions], "bool | None"]


def worker_checkpoint_hooks(worker_path: str) -> tuple[Hook, Hook]:
    """``(save, load)`` hook implementations for workers of the class at ``worker_path``."""

    def owns(worker: Any) -> bool:
        return any(f"{c.__module__}:{c.__qualname__}" == worker_path for c in type(worker).__mro__)

    @hookimpl
    def nrl_checkpoint_save(worker: Any, path: str, options: CheckpointOptions) -> bool | None:
        if not owns(worker):
            return None
        worker.save_checkpoint(path, options)
        return True

    @hookimpl
    def nrl_checkpoint_load(worker: Any, path: str, options: CheckpointOptions) -> bool | None:
        if not owns(worker):
            return None
        worker.load_checkpoint(path, options)
        return True

    return nrl_checkpoint_save, nrl_checkpoint_load
