"""What a test's run left behind: a killed process frees its memory and is reaped on its own time
(Ray ends killed actors asynchronously), so "nothing is left" means nothing after a short grace."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

TEARDOWN_S = 5.0


def process_title(pid: int) -> str:
    """A process's title (its command line, as vLLM and Ray set it); ``?`` when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def left_after_teardown(alive: Callable[[], Iterable[int]], seconds: float = TEARDOWN_S) -> dict[int, str]:
    """The processes ``alive()`` still names after up to ``seconds``, each with its title."""
    gone_by = time.monotonic() + seconds
    while (left := list(alive())) and time.monotonic() < gone_by:
        time.sleep(0.2)
    return {pid: process_title(pid) for pid in left}
