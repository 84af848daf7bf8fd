"""A worker for tests/core/test_watchdog_hangs.py whose chosen rank never returns from one step:
building itself (a start-up where one worker never reports), ``generate`` (an engine whose
generate never returns) or ``offload`` (a hand-off that deadlocks). ``train`` waits for every rank
as a collective does, ``ask_child`` for a process the worker started (as vLLM's engine core is),
and :class:`ScoringWorker` is an actor outside any worker group (as an environment's are). It
lives in its own module because Ray actors import it by path; it imports no torch, so its actors
start in a moment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: The child's program: it names itself (as vLLM's engine core does) and echoes each line it reads.
CHILD = ("import ctypes, sys; ctypes.CDLL(None).prctl(15, b'EngineCore_0', 0, 0, 0)\n"
         "for line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()\n")


def _forever() -> None:
    while True:
        time.sleep(0.5)


class HangWorker:
    def __init__(self, *, rank: int, world_size: int, stuck_rank: int = -1, stuck_in: str = "") -> None:
        self.rank, self.world_size, self.stuck = rank, world_size, stuck_in if rank == stuck_rank else ""
        self.child: subprocess.Popen[str] | None = None
        if self.stuck == "init":
            _forever()

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[str]) -> list[str]:
        if self.stuck == "generate":
            _forever()
        return [p + "!" for p in prompts]

    def offload(self) -> dict[str, Any]:
        if self.stuck == "offload":
            _forever()
        return {"rank": self.rank, "offloaded": True}

    def train(self, barrier: str) -> int:
        """Arrive at ``barrier`` (a directory) and wait for every rank there, as ranks meet in a
        collective: a rank that never arrives keeps the others waiting."""
        Path(barrier, f"rank{self.rank}").touch()
        while len(list(Path(barrier).iterdir())) < self.world_size:
            time.sleep(0.05)
        return self.rank

    def start_child(self) -> int:
        self.child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        return self.child.pid

    def ask_child(self, line: str) -> str:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(line + "\n")
        self.child.stdin.flush()
        return self.child.stdout.readline().strip()


class ScoringWorker:
    """An actor no worker group holds; ``score`` waits until ``release`` exists."""

    def pid(self) -> int:
        return os.getpid()

    def score(self, release: str) -> float:
        while not os.path.exists(release):
            time.sleep(0.05)
        return 1.0
