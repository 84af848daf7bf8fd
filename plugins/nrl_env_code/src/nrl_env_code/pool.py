"""A pool of sandbox workers (Ray actors) that runs a batch of programs in parallel.

Why actors and not tasks: each worker probes its sandbox once, at start-up, and a probe costs a
sandbox run; tasks would pay it again and again, or not at all. Programs are handed out a few at a
time to whichever worker is free, so a batch where some programs hit their wall-time limit and
others end in milliseconds still keeps every worker busy.

Failures, as in nrl_env_math: a worker that dies, raises something other than an
:class:`~nrl_core.errors.NrlError`, or stays silent past its chunk's limits plus
``hang_grace_seconds`` is replaced by a fresh one and reported as a
:class:`~nrl_core.errors.WorkerError` naming it. An ``NrlError`` from a worker (a layer that went
missing, processes that outlived their sandbox) is raised as it is.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nrl_core.api import NrlError, WorkerError, first_line
from nrl_env_code.sandbox import Program, RunResult
from nrl_env_code.worker import SandboxWorker

__all__ = ["LocalRunner", "SandboxPool"]

PER_PROGRAM_SLACK = 2.0
"""Seconds a program may take beyond its wall-time limit (building and tearing down its sandbox)
before its worker counts as hung."""


class LocalRunner:
    """The programs one by one in this process (``num_workers: 0``; the benchmark's baseline)."""

    def __init__(self, sandbox_section: Mapping[str, Any] | None) -> None:
        self.worker = SandboxWorker("sandbox[local]", sandbox_section)
        self.info = [self.worker.start()]

    def run(self, programs: Sequence[Program]) -> list[RunResult]:
        return self.worker.run(list(programs))

    def shutdown(self) -> None:
        pass


@dataclass
class _Slot:
    label: str
    actor: Any
    pid: int | None = None

    @property
    def name(self) -> str:
        return f"{self.label} pid {self.pid}" if self.pid is not None else self.label


class SandboxPool:
    """``num_workers`` actors, each running sandboxes; started (and probed) when built."""

    def __init__(self, sandbox_section: Mapping[str, Any] | None, num_workers: int, *, section: str = "env.code",
                 cpus_per_worker: float = 0.1, startup_timeout: float = 120.0, hang_grace: float = 30.0) -> None:
        import ray

        from nrl_core.api import init_ray

        init_ray()
        self.section, self.sandbox_section = section, dict(sandbox_section or {})
        self.cpus, self.startup_timeout, self.hang_grace = float(cpus_per_worker), float(startup_timeout), float(hang_grace)
        self._actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(SandboxWorker)
        self._slots = [self._spawn(i) for i in range(int(num_workers))]
        self.info = self._start(range(len(self._slots)))

    # ------------------------------------------------------------------ workers

    def _spawn(self, index: int) -> _Slot:
        label = f"code-sandbox[{index}]"
        return _Slot(label=label, actor=self._actor_cls.options(num_cpus=self.cpus).remote(label, self.sandbox_section))

    def _start(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Probe the workers at ``indices`` together; the first failure is raised (a missing layer as it is)."""
        import ray

        refs = {i: self._slots[i].actor.start.remote() for i in indices}
        infos = []
        for i, ref in refs.items():
            label = self._slots[i].label
            try:
                info = ray.get(ref, timeout=self.startup_timeout)
            except ray.exceptions.GetTimeoutError:
                self.shutdown()
                raise WorkerError(f"{self.section}: sandbox worker {label} did not start within "
                                  f"{self.startup_timeout:g} s; raise {self.section}.startup_timeout_seconds") from None
            except Exception as exc:
                self.shutdown()
                raise _as_error(exc, f"{self.section}: sandbox worker {label} failed to start") from None
            self._slots[i].pid = info["pid"]
            infos.append(info)
        return infos

    def _replace(self, index: int) -> None:
        import ray

        try:
            ray.kill(self._slots[index].actor, no_restart=True)
        except Exception:  # already gone
            pass
        self._slots[index] = self._spawn(index)

    # ------------------------------------------------------------------ running

    def run(self, programs: Sequence[Program]) -> list[RunResult]:
        """Every program's result, in order; each worker takes the next few programs when it is free.

        After a failure no more programs are handed out; the others are waited for (up to their
        limits), so nothing stale is left queued in front of the next batch; then the failed workers
        are replaced and the failure is raised."""
        import ray

        if not self._slots:
            raise WorkerError(f"{self.section}: the sandbox pool was shut down")
        results: list[RunResult | None] = [None] * len(programs)
        size = max(1, min(8, math.ceil(len(programs) / (4 * len(self._slots)))))
        queue = deque(list(range(start, min(start + size, len(programs)))) for start in range(0, len(programs), size))
        idle = list(range(len(self._slots)))
        pending: dict[Any, tuple[int, list[int], float]] = {}
        failed: dict[int, BaseException | str] = {}
        while True:
            while idle and queue and not failed:
                worker, take = idle.pop(), queue.popleft()
                limit = sum(programs[j].timeout + PER_PROGRAM_SLACK for j in take) + self.hang_grace
                ref = self._slots[worker].actor.run.remote([programs[j] for j in take])
                pending[ref] = (worker, take, time.monotonic() + limit)
            if not pending:
                break
            wait = max(0.0, min(deadline for _, _, deadline in pending.values()) - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            for ref in done:
                worker, take, _ = pending.pop(ref)
                try:
                    for j, result in zip(take, ray.get(ref)):
                        results[j] = result
                    idle.append(worker)
                except Exception as exc:
                    failed[worker] = exc
            now = time.monotonic()
            for ref, (worker, take, deadline) in list(pending.items()):
                if now >= deadline:
                    del pending[ref]
                    failed[worker] = f"hung: no answer for {len(take)} programs within their limits"
        if failed:
            self._fail(failed)
        return results  # type: ignore[return-value]

    def _fail(self, failed: Mapping[int, BaseException | str]) -> None:
        """Replace the failed workers, then raise: an NrlError from a worker as it is, else a WorkerError."""
        names = {i: self._slots[i].name for i in failed}
        for i in failed:
            self._replace(i)
        self._start(list(failed))
        for reason in failed.values():
            if isinstance(reason, BaseException):
                error = _as_error(reason, "")
                if not isinstance(error, WorkerError):
                    raise error
        first = min(failed)
        reason = failed[first]
        detail = reason if isinstance(reason, str) else f"failed: {first_line(reason)}"
        raise WorkerError(f"{self.section}: sandbox worker {names[first]} {detail}; it was replaced by a fresh worker")

    def shutdown(self) -> None:
        """Kill every worker. Idempotent."""
        import ray

        for slot in self._slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
        self._slots = []


def _as_error(exc: BaseException, context: str) -> BaseException:
    """An ``NrlError`` inside Ray's wrapper as it is; anything else as a one-line WorkerError."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, NrlError):
        return cause
    if isinstance(exc, NrlError):
        return exc
    return WorkerError(f"{context}: {first_line(exc)}" if context else first_line(exc))

