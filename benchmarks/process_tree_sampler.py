"""Memory and per-thread CPU time of a process and all its descendants, sampled in a thread.

Why PSS: a tree of Python processes (Ray's workers, vLLM, the driver) shares most of its library
pages, so the sum of RSS counts each shared page once per process; the sum of PSS (each shared page
divided among the processes mapping it) counts the tree's memory once, and the sum of USS (pages
only one process maps) is its lower bound. Both come from ``/proc/<pid>/smaps_rollup`` through
psutil's ``memory_full_info``, which makes the kernel walk the page tables: about 10 ms of CPU per
GB mapped (a 4.4 GB tree of 13 processes: about 45 ms per sample, with the per-thread CPU times
another 5-10 ms). The defaults (memory every ``mem_interval`` 1 s, CPU times every ``interval``
0.5 s) keep the sampler's own load (``cpu_s``, reported) near 10% of one core on such a tree and
under 3% on one 1.5 GB process. A process that appears and exits between two samples is missed,
and the peak is a lower bound to within one memory interval; a step's large allocations (weights,
optimizer state, KV cache) live for seconds.

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
    processes: int
    pss: int | None  # bytes, summed over the tree; None in a sample that read CPU times only
    uss: int | None
    thread_cpu: dict[tuple[int, int], float]  # (pid, tid) -> cumulative user+system CPU seconds


@dataclass
class TreeSampler:
    """``with TreeSampler(pid) as s: ...`` samples CPU times every ``interval`` seconds and memory
    every ``mem_interval`` until the block ends; ``cpu_s`` is the CPU time the sampling took."""

    pid: int
    interval: float = 0.5
    mem_interval: float = 1.0
    samples: list[Sample] = field(default_factory=list)
    cpu_s: float = 0.0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        next_mem = 0.0
        while not self._stop.is_set():
            start, cpu = time.monotonic(), time.thread_time()
            sample = self.sample(memory=start >= next_mem)
            self.cpu_s += time.thread_time() - cpu
            if sample is None:
                return
            if sample.pss is not None:
                next_mem = start + self.mem_interval
            self.samples.append(sample)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - start)))

    def sample(self, memory: bool = True) -> Sample | None:
        """One sample of the tree (with its memory if ``memory``); None once the root process is gone."""
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
                mem = proc.memory_full_info() if memory else None
                threads = proc.threads()
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            alive += 1
            if mem is not None:
                pss += mem.pss
                uss += mem.uss
            for th in threads:
                cpu[(proc.pid, th.id)] = th.user_time + th.system_time
        return Sample(t=time.time(), processes=alive, pss=pss if memory else None, uss=uss if memory else None,
                      thread_cpu=cpu)

    def peak(self, kind: str = "pss") -> int:
        """The largest ``pss``, ``uss`` or ``processes`` over the samples that have it."""
        return max((v for s in self.samples if (v := getattr(s, kind)) is not None), default=0)


def busy_threads(samples: list[Sample], start: float, end: float, threshold: float = 0.5) -> dict[str, float]:
    """Over ``[start, end]`` (unix seconds): the process that used the most CPU, how many of its
    threads used at least ``threshold`` of the CPU time of its busiest thread (relative, so that
    other load on the machine, which slows every thread alike, does not hide a thread), and its
    CPU seconds per wall second. Uses the first and last sample inside the window; empty when
    fewer than two fall in it or the process used no CPU."""
    inside = [s for s in samples if start <= s.t <= end]
    if len(inside) < 2:
        return {}
    first, wall = inside[0], inside[-1].t - inside[0].t
    latest: dict[tuple[int, int], float] = {}
    for s in inside:  # a thread's last reading, also for one that ended inside the window
        latest.update(s.thread_cpu)
    per_pid: dict[int, list[float]] = {}
    for key, seconds in latest.items():
        per_pid.setdefault(key[0], []).append(seconds - first.thread_cpu.get(key, 0.0))
    pid, deltas = max(per_pid.items(), key=lambda item: sum(item[1]))
    if max(deltas) <= 0:
        return {}
    return {"pid": pid, "busy_threads": sum(d >= threshold * max(deltas) for d in deltas),
            "cores": sum(deltas) / wall, "window_s": wall}
