"""A worker for tests/core/test_watchdog_hangs.py whose chosen rank never returns from one step:
building itself (a start-up where one worker never reports), ``generate`` (an engine whose
generate never returns) or ``offload`` (a hand-off that deadlocks). It lives in its own module
because Ray actors import it by path; it imports no torch, so its actors start in a moment."""

from __future__ import annotations

import os
import time
from typing import Any


def _forever() -> None:
    while True:
        time.sleep(0.5)


class HangWorker:
    def __init__(self, *, rank: int, world_size: int, stuck_rank: int = -1, stuck_in: str = "") -> None:
        self.rank, self.stuck = rank, stuck_in if rank == stuck_rank else ""
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
