"""Hangs are never silent: a time limit on every phase of a run, and every stack when one passes.

The driver runs each phase (start-up, refit, generation, hand-off, reward, logprobs, training,
checkpoint save and load, validation, and the step around them) inside :func:`phase`. A phase's
limit comes from its own history, ``max(floor_s, multiple x the slowest it has taken)``, so a run
whose phases grow steadily longer raises its limits with them; a phase never seen before gets
``floor_s`` (start-up ``startup_s``); ``watchdog.phases.<name>`` fixes a limit outright.

A monitor thread checks the limits. When one passes it writes every process's stack (the driver,
each rank of every worker group, the job's other actors and what any of them started,
:mod:`nrl_core.stacks`) and the one-line error into ``<log_dir>/stacks/``. The line names a
process that cannot be making progress (stopped, in uninterruptible I/O: :mod:`nrl_core.suspects`)
as the likely cause and the ranks waiting on it, or else the ranks still running. It kills those
processes and the workers (a driver blocked on them wakes with their death; one blocked in itself
is interrupted) and the phase raises :class:`HangError`: the run ends with nothing left running
and no checkpoint published after the last complete one. ``SIGUSR1`` to the
driver (``nrl stacks <log_dir>``) writes the same stacks without stopping anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nrl_core import interrupt, stacks, timeline
from nrl_core.config.core_schema import PHASES
from nrl_core.errors import NrlError
from nrl_core.suspects import STATES, RunProcess, ranks_of, run_processes, suspects

__all__ = ["HangError", "PHASES", "PhaseLimits", "PluginCall", "Watchdog", "WatchdogSettings", "fired", "phase", "request_stacks"]

logger = logging.getLogger(__name__)

PID_FILE = "driver.pid"
#: The least time between the two looks at the processes' states: one moment in ``D`` is I/O.
SUSPECT_GAP_S = 2.0


class HangError(NrlError):
    """A phase passed its watchdog limit; the message is the one line the user sees."""


@dataclass(frozen=True)
class WatchdogSettings:
    """The ``watchdog`` section."""

    enabled: bool = True
    floor_s: float = 1800.0
    multiple: float = 5.0
    startup_s: float = 3600.0
    phases: Mapping[str, float] = field(default_factory=dict)
    trace: bool = True

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None) -> WatchdogSettings:
        section = dict(section or {})
        return cls(**{k: section[k] for k in ("enabled", "floor_s", "multiple", "startup_s", "trace") if k in section},
                   phases=dict(section.get("phases") or {}))


class PhaseLimits:
    """Each phase's limit from the slowest it has taken so far (see the module docstring)."""

    def __init__(self, settings: WatchdogSettings) -> None:
        self.settings = settings
        self.slowest: dict[str, float] = {}

    def limit(self, name: str) -> float:
        fixed = self.settings.phases.get(name)
        if fixed is not None:
            return float(fixed)
        if name == "start_up":
            return float(self.settings.startup_s)
        seen = self.slowest.get(name)
        floor = float(self.settings.floor_s)
        return floor if seen is None else max(floor, self.settings.multiple * seen)

    def record(self, name: str, seconds: float) -> None:
        self.slowest[name] = max(seconds, self.slowest.get(name, 0.0))


@dataclass(eq=False)
class _Running:
    name: str
    started: float  # monotonic
    limit: float
    thread: int
    call: PluginCall | None = None


@dataclass(frozen=True)
class PluginCall:
    """A phase that is one call into a plugin, with a limit of its own: ``who`` names the plugin and
    its method, ``setting`` is the key that holds the limit (``env.<name>.call_timeout_s``)."""

    who: str
    setting: str
    limit_s: float


class Watchdog:
    """The run's monitor: enter it around the whole run (it becomes the one :func:`phase` uses)."""

    tick_s = 0.5
    interrupt_after_s = 5.0  # a phase blocked in the driver itself is interrupted after its workers were killed
    merge_s = 10.0  # how often the workers' spans are merged into trace.json while the run goes on

    def __init__(self, settings: WatchdogSettings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.limits = PhaseLimits(settings)
        self.error: str | None = None
        self._running: list[_Running] = []
        self._phase_ended = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._own_stacks: Path | None = None
        self._own_stacks_size = 0
        self._dumps = 0

    @classmethod
    def for_run(cls, config: Mapping[str, Any]) -> Watchdog:
        return cls(WatchdogSettings.from_section(config.get("watchdog")), Path(config["logger"]["log_dir"]).expanduser())

    def __enter__(self) -> Watchdog:
        global _active
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._own_stacks = stacks.install_stack_dump()  # before the pid file: SIGUSR1 would end us otherwise
        self._own_stacks_size = self._own_stacks.stat().st_size
        (self.log_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        if self.settings.trace:
            timeline.start_trace(self.log_dir / "trace.json")
        interrupt.install()  # a phase blocked in the driver is ended whatever SIGINT does here
        self._thread = threading.Thread(target=self._watch, name="nrl-watchdog", daemon=True)
        self._thread.start()
        _active = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _active
        _active = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        timeline.stop_trace()
        with contextlib.suppress(OSError):
            (self.log_dir / PID_FILE).unlink()
        if self.error is not None:
            from nrl_core.cluster import shutdown_ray

            shutdown_ray()

    @contextlib.contextmanager
    def phase(self, name: str, call: PluginCall | None = None, **args: Any) -> Iterator[None]:
        limit = call.limit_s if call is not None else self.limits.limit(name)
        running = _Running(name, time.monotonic(), limit, threading.get_ident(), call)
        wall = time.time()
        self._running.append(running)
        try:
            yield
        except BaseException:
            if self.error is not None:
                raise HangError(self.error) from None
            raise
        else:
            self.limits.record(name, time.monotonic() - running.started)
            if self.error is not None:
                raise HangError(self.error)
        finally:
            self._running.remove(running)
            self._phase_ended.set()
            timeline.span(name, wall, time.monotonic() - running.started, **args)

    # ------------------------------------------------------------------ the monitor thread

    def _watch(self) -> None:
        merged = time.monotonic()
        while not self._stop.wait(self.tick_s):
            if self._dump_requested():
                self.dump("on_demand")
            if time.monotonic() - merged >= self.merge_s:
                merged = time.monotonic()
                timeline.merge_workers()
            now = time.monotonic()
            running = list(self._running)
            late = [r for r in running if now - r.started > r.limit and not _inside_a_live_phase(r, running, now)]
            if late and self.settings.enabled:
                self._fire(late[-1], now - late[-1].started)
                return

    def _dump_requested(self) -> bool:
        """``SIGUSR1`` made faulthandler append the driver's stacks to its stack file."""
        assert self._own_stacks is not None
        size = self._own_stacks.stat().st_size
        requested, self._own_stacks_size = size > self._own_stacks_size, size
        return requested

    def dump(self, reason: str) -> Path:
        """Every process's stacks into ``<log_dir>/stacks/<time>-<reason>/``: the driver's, each
        worker rank's, the job's other actors' and what any of them started, with ``status.txt``
        (which answered, which calls are pending, which process cannot be making progress)."""
        return self._dump(reason)[0]

    def _dump(self, reason: str) -> tuple[Path, list[RunProcess], list[tuple[RunProcess, str]]]:
        from nrl_core.cluster.worker_group import live_groups

        self._dumps += 1
        dest = self.log_dir / "stacks" / f"{time.strftime('%Y%m%d-%H%M%S')}-{self._dumps}-{reason}"
        dest.mkdir(parents=True, exist_ok=True)
        with open(dest / f"driver-pid{os.getpid()}.txt", "w") as f:
            import faulthandler

            faulthandler.dump_traceback(file=f, all_threads=True)
        assert self._own_stacks is not None
        self._own_stacks_size = self._own_stacks.stat().st_size
        try:
            processes = run_processes(live_groups())
        except Exception as exc:  # listing the run's other processes is a diagnostic: the ranks still count
            logger.warning("the run's processes beyond its worker ranks could not be listed: %s", exc)
            processes = [p for group in live_groups() for p in ranks_of(group)]
        before, sampled = suspects(processes), time.monotonic()
        status = stacks.dump_processes([p.target() for p in processes], dest)
        time.sleep(max(0.0, SUSPECT_GAP_S - (time.monotonic() - sampled)))
        stuck = suspects(processes, before, answered=[label for label, what in status.items() if what == "written"])
        lines = [f"{label}: {what}" for label, what in status.items()]
        lines += [f"pending: {group.label(rank)} {what}" for group in live_groups()
                  for what, ranks in group.pending_calls() for rank in ranks]
        lines += [f"cannot be making progress: {p.label} ({state})" for p, state in stuck]
        (dest / "status.txt").write_text("".join(line + "\n" for line in lines))
        logger.warning("stacks of the driver and %d other processes written to %s", len(status), dest)
        return dest, processes, stuck

    def _fire(self, late: _Running, waited: float) -> None:
        from nrl_core.cluster.worker_group import live_groups

        groups = live_groups()
        dest, processes, stuck = self._dump(f"hang-{late.name}")
        stuck_pids = {p.pid for p, _ in stuck}
        waiting = [f"{group.label(rank)} in {what}" for group in groups for what, ranks in group.pending_calls()
                   for rank in ranks if group.infos[rank].pid not in stuck_pids]
        if stuck:
            causes = "; ".join(f"{p.label} is {state}" for p, state in stuck)
            who = f"{causes}: the likely cause" + (f"; waiting on it: {', '.join(waiting)}" if waiting else "")
        elif waiting:
            who = f"still running: {', '.join(waiting)}"
        else:
            who = f"the driver (pid {os.getpid()}) itself"
        if late.call is not None:
            self.error = (f"watchdog: {late.call.who} did not return within {late.call.setting} = {late.limit:g} s "
                          f"(waited {waited:.0f} s); {_plugin_processes(groups, processes, stuck) or who}; every stack is in "
                          f"{dest}; if it is legitimately this slow, raise {late.call.setting}")
        else:
            self.error = (f"watchdog: phase '{late.name}' did not finish within its limit of {late.limit:.0f} s "
                          f"(waited {waited:.0f} s); {who}; every stack is in {dest}; if the phase is legitimately "
                          f"this slow, raise watchdog.phases.{late.name}")
        (dest / "error.txt").write_text(self.error + "\n")
        logger.error("%s", self.error)
        _kill_processes([p for p, _ in stuck if p.pid != os.getpid()])
        _kill(groups)
        self._phase_ended.clear()
        if not self._phase_ended.wait(self.interrupt_after_s) and any(r is late for r in self._running):
            interrupt.interrupt(late.thread)  # blocked in itself, not on a worker


def _plugin_processes(groups: list[Any], processes: list[RunProcess], stuck: list[tuple[RunProcess, str]]) -> str:
    """Of the run's ``processes`` (the dump's list), those outside its worker groups (an
    environment's workers) with their state, for a plugin call that passed its limit; empty when
    there are none (the call ran in the driver)."""
    ranks = {p.pid for group in groups for p in ranks_of(group)}
    states = {p.pid: state for p, state in stuck}
    named = [f"{p.label} ({states.get(p.pid) or _state_words(p)})" for p in processes if p.pid not in ranks]
    return f"its processes: {', '.join(named)}" if named else ""


def _state_words(process: RunProcess) -> str:
    state = stacks.process_state(process.pid) if process.local else None
    if state is None:
        return "state unknown"
    words = {"R": "running", "S": "sleeping", **STATES}.get(state)
    return f"{words}, state {state}" if words else f"state {state}"


def _inside_a_live_phase(outer: _Running, running: list[_Running], now: float) -> bool:
    """Whether a phase entered inside ``outer`` (later, on its thread) is still within its own
    limit: the innermost phase names a hang, so an outer phase (``step``) whose limit passes first
    waits for the inner one (``training``) to pass its own."""
    return any(inner is not outer and inner.thread == outer.thread and inner.started >= outer.started
               and now - inner.started <= inner.limit for inner in running)


def _kill_processes(processes: list[RunProcess]) -> None:
    """End the processes that cannot be making progress (a stopped one never resumes by itself):
    those the run's workers started die with nothing waiting on them, and a killed actor wakes
    whoever waits on it."""
    for process in processes:
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGKILL)


def _kill(groups: list[Any]) -> None:
    import ray

    for group in groups:
        for actor in group.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)


_active: Watchdog | None = None


def phase(name: str, call: PluginCall | None = None, **args: Any) -> contextlib.AbstractContextManager[None]:
    """Run a phase under the run's watchdog and into its trace (nothing outside a watched run);
    ``call`` makes it one call into a plugin, under that call's own limit."""
    return _active.phase(name, call, **args) if _active is not None else contextlib.nullcontext()


def fired() -> str | None:
    """The watchdog's error once it fired: the run cannot talk to its workers any more."""
    return _active.error if _active is not None else None


def request_stacks(log_dir: Path, timeout_s: float = 60.0) -> Path:
    """Signal the driver of the run logging to ``log_dir`` (its pid is in ``driver.pid``) and
    wait for the dump it writes; returns the dump's directory (``nrl stacks``)."""
    pid_file = log_dir / PID_FILE
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        raise NrlError(f"{log_dir}: no running nrl run logs here ({pid_file} is missing); pass the run's "
                       "logger.log_dir") from None
    before = set((log_dir / "stacks").glob("*-on_demand"))
    if not stacks.answers_stack_signal(pid):  # a pid file left by a killed run: the pid may be another process's now
        raise NrlError(f"{pid_file}: the driver (pid {pid}) is gone; the run is not running")
    try:
        os.kill(pid, stacks.SIGNAL)
    except ProcessLookupError:
        raise NrlError(f"{pid_file}: the driver (pid {pid}) is gone; the run is not running") from None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [d for d in (log_dir / "stacks").glob("*-on_demand") if d not in before and (d / "status.txt").exists()]
        if done:
            return done[0]
        time.sleep(0.2)
    raise NrlError(f"the driver (pid {pid}) wrote no stacks within {timeout_s:.0f} s; its own stack file is "
                   f"{stacks.stack_file(pid)}")
