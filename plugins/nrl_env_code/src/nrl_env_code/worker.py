"""The sandbox worker: runs programs one after another, each in a fresh sandbox.

A plain class, made a Ray actor by :class:`~nrl_env_code.pool.SandboxPool` (and called directly when
``num_workers`` is 0). It probes the sandbox when asked to ``start``, so a machine missing a layer
fails there, by name, before any program runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nrl_env_code.sandbox import Program, RunResult, Sandbox, SandboxConfig


class SandboxWorker:
    def __init__(self, label: str, sandbox_section: Mapping[str, Any] | None) -> None:
        self.label = label
        self.sandbox = Sandbox(SandboxConfig.from_section(sandbox_section))

    def start(self) -> dict[str, Any]:
        """Probe every layer (raises :class:`~nrl_env_code.sandbox.SandboxUnavailable`); who this worker is."""
        return {"label": self.label, "pid": os.getpid(), "probe": self.sandbox.probe()}

    def run(self, programs: list[Program]) -> list[RunResult]:
        return [self.sandbox.run(p) for p in programs]
