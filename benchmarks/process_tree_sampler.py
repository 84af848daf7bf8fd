"""Memory and per-thread CPU time of a process and all its descendants, sampled in a thread.

Why PSS: a tree of Python processes (Ray's workers, vLLM, the driver) shares most of its library
pages, so the sum of RSS counts each shared page once per process; the sum of PSS (each shared page
divided among the processes mapping it) counts the tree's memory once, and the sum of USS (pages
only one process maps) is its lower bound. Both come from ``/proc/<pid>/smaps_rollup`` through
psutil's ``memory_full_info``. A process that appears and exits between two samples is missed, so
the peak is a lower bound to within one interval (0.2 s by default).

Per-thread CPU seconds (``/proc/<pid>/task/*/stat`` through ``psutil.Process.threads``) let a
caller see how many threads a process kept busy over a time window (:func:`busy_threads`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class Sample:
    t: float  # time.time()
    pss: int  # bytes, summed over the tree
    uss: int
    processes: int
    thread_cpu: dict[tuple[int, int], float]  # (pid, tid) -> cumulative user+system CPU seconds


@dataclass
class TreeSampler:
    """``with TreeSampler(pid) as s: ...`` samples every ``interval`` seconds until the block ends."""

    pid: int
    interval: float = 0.2
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            sample = self.sample()
            if sample is None:
                return
            self.samples.append(sample)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - start)))

    def sample(self) -> Sample | None:
        """One sample of the tree; None once the root process is gone."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None
        pss = uss = 0
        cpu: dict[tuple[int, int], float] = {}
        alive = 0
        for proc in procs:
            try:
                mem = proc.memory_full_info()
                threads = proc.threads()
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            alive += 1
            pss += mem.pss
            uss += mem.uss
            for th in threads:
                cpu[(proc.pid, th.id)] = th.user_time + th.system_time
        return Sample(t=time.time(), pss=pss, uss=uss, processes=alive, thread_cpu=cpu)

    def peak(self, kind: str = "pss") -> int:
        return max((getattr(s, kind) for s in self.samples), default=0)


def busy_threads(samples: list[Sample], start: float, end: float, threshold: float = 0.5) -> dict[str, float]:
    """Over ``[start, end]`` (unix seconds): the process that used the most CPU, how many of its
    threads used at least ``threshold`` of the CPU time of its busiest thread (relative, so that
    other load on the machine, which slows every thread alike, does not hide a thread), and its
    CPU seconds per wall second. Uses the first and last sample inside the window; empty when
    fewer than two fall in it or the process used no CPU."""
    inside = [s for s in samples if start <= s.t <= end]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    wall = last.t - first.t
    per_pid: dict[int, list[float]] = {}
    for key, seconds in last.thread_cpu.items():
        per_pid.setdefault(key[0], []).append(seconds - first.thread_cpu.get(key, 0.0))
    pid, deltas = max(per_pid.items(), key=lambda item: sum(item[1]))
    if max(deltas) <= 0:
        return {}
    return {"pid": pid, "busy_threads": sum(d >= threshold * max(deltas) for d in deltas),
            "cores": sum(deltas) / wall, "window_s": wall}
