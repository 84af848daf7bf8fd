"""Where a process tree's memory grows, by kind of mapping: the main heap, anonymous mappings, the
async engine's refit parts in ``/dev/shm``, other shared-memory files and other files.

Why: a peak of PSS says how much a refit added, not what: the C allocator's heap (``brk``, which
glibc gives back only from its top), buffers mapped on their own pages (anonymous), and the files
a refit maps are each fixed by different means. Reads ``/proc/<pid>/smaps`` (every mapping's PSS),
which costs the kernel a walk of the page tables per read: a few milliseconds per process here.
The sampler is a thread of the calling process, which on the colocated paths is the one refitting:
its parsing holds the interpreter lock, so refits are slower under it, the more so the more
mappings the tree has. Time refits without it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import psutil

REFIT_PARTS = "/dev/shm/nrl-async-refit-"


def _kind(path: str) -> str:
    if path == "[heap]":
        return "heap"
    if not path or path.startswith("[anon"):
        return "anonymous"
    if path.startswith(REFIT_PARTS):
        return "refit parts"
    if path.startswith("/dev/shm/"):
        return "other shared memory"
    if path.startswith("["):
        return "other"  # stacks, vdso
    return "files"


def pss_by_kind(pid: int) -> Counter[str]:
    """PSS in bytes of ``pid`` and its descendants, by kind of mapping; the descendants' kinds are
    named apart (``heap, children``), so that an actor's heap is not taken for its engine core's."""
    kinds: Counter[str] = Counter()
    try:
        root = psutil.Process(pid)
        pids = [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return kinds
    for each in pids:
        whose = "" if each == pid else ", children"
        try:
            with open(f"/proc/{each}/smaps") as smaps:
                kind = "other"
                for line in smaps:
                    fields = line.split()
                    if fields and not fields[0].endswith(":"):  # a mapping's header line
                        kind = _kind(fields[5] if len(fields) > 5 else "") + whose
                    elif fields and fields[0] == "Pss:":
                        kinds[kind] += int(fields[1]) * 1024
        except OSError:
            continue
    return kinds


class PeakByKind:
    """``with PeakByKind(pid) as p: ...``: the tree's PSS by kind before the block (``before``), at
    the sample with the largest total (``peak``) and after it (``after``), sampled every ``interval``."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval = pid, interval
        self.before: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.after: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakByKind:
        self.before = self.peak = pss_by_kind(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = pss_by_kind(self.pid)

    def _loop(self) -> None:
        while not self._stop.is_set():
            sample = pss_by_kind(self.pid)
            if sample.total() > self.peak.total():
                self.peak = sample
            time.sleep(self.interval)

    def growth(self, at: str = "peak") -> dict[str, int]:
        """Bytes by kind above ``before``, at the peak or after the block; kinds that moved by less than a page left out."""
        then = self.peak if at == "peak" else self.after
        moved = {kind: then[kind] - self.before[kind] for kind in set(then) | set(self.before)}
        return {kind: delta for kind, delta in sorted(moved.items()) if abs(delta) >= 4096}
