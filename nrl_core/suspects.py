"""Which process a hang waits on.

When the watchdog fires, the driver is waiting on worker ranks, but the process that stopped may
be another: one rank of several that all look "in train()" (its peers wait in the collective for
it), a process a rank spawned (vLLM's engine core), or an actor no worker group lists (an
environment's workers). This module lists every process of the run on this machine (each rank,
the job's other Ray actors, and every process any of them started) with its kernel state, and
names as suspects those that cannot be making progress: stopped or traced (``T``, ``t``) in two
samples taken around the stack dump, or in uninterruptible I/O (``D``) in both and silent to the
stack signal meanwhile (a healthy process passes through ``D`` on every disk read).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nrl_core.stacks import StackTarget, process_state

__all__ = ["STATES", "RunProcess", "descendants", "ranks_of", "run_processes", "suspects"]

#: The states of a process that cannot be making progress, and how a message says each.
STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible I/O"}  # and silent
#: How long the driver waits for Ray's actor table: a frozen control plane does not answer.
ACTOR_TABLE_WAIT_S = 5.0


@dataclass(frozen=True)
class RunProcess:
    """A process of the run: ``label`` as messages name it, ``stack_label`` for its stack file."""

    label: str
    stack_label: str
    pid: int
    local: bool = True

    def target(self) -> StackTarget:
        return StackTarget(self.stack_label, self.pid, local=self.local)


def run_processes(groups: Sequence[Any]) -> list[RunProcess]:
    """Every rank of ``groups`` (worker groups), then the job's Ray actors that none of them holds
    (named by class and actor name), then every process any of those started on this machine."""
    found = [process for group in groups for process in ranks_of(group)]
    here = _node_id()
    known = {p.pid for p in found}
    for actor in _job_actors():
        pid = int(actor.get("Pid") or 0)
        if pid <= 0 or pid in known:
            continue
        local = (actor.get("Address") or {}).get("NodeID") == here
        if local and not _is_ray_worker(pid):  # another pid namespace's pid, or one reused since
            continue
        name = actor.get("Name") or ""
        kind = actor.get("ActorClassName") or "actor"
        label = f"{kind} actor{f' {name!r}' if name else ''} pid {pid}"
        found.append(RunProcess(label, f"actor-{_slug(name or kind)}-pid{pid}", pid, local=local))
        known.add(pid)
    for parent in [p for p in found if p.local]:
        for child in descendants([parent.pid]):
            if child in known:
                continue
            known.add(child)
            name = _process_name(child)
            found.append(RunProcess(f"{name} pid {child} (started by {parent.label})",
                                    f"{parent.stack_label}-child-{_slug(name)}-pid{child}", child))
    return found


def ranks_of(group: Any) -> list[RunProcess]:
    """The ranks of a worker group whose process is known."""
    here = _node_id()
    return [RunProcess(group.label(info.rank), f"{group.name}-rank{info.rank}-pid{info.pid}", info.pid,
                       local=info.node_id == here) for info in group.infos if info.pid is not None]


def suspects(processes: Iterable[RunProcess], earlier: Iterable[tuple[RunProcess, str]] | None = None,
             answered: Iterable[str] = ()) -> list[tuple[RunProcess, str]]:
    """The local processes that cannot be making progress, each with its state in words; given
    ``earlier`` (this function's answer from before), only those in it too, and none in ``D``
    whose stack label is in ``answered`` (it dumped its stack meanwhile, so it runs)."""
    before = None if earlier is None else {process.pid for process, _ in earlier}
    spoke = set(answered)
    found = []
    for process in processes:
        state = process_state(process.pid) if process.local else None
        if state not in STATES or (before is not None and process.pid not in before):
            continue
        if state == "D" and process.stack_label in spoke:
            continue
        found.append((process, f"{STATES[state]}, state {state}"))
    return found


def descendants(roots: Iterable[int]) -> list[int]:
    """Every descendant of ``roots``, from ``/proc`` (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _slug(name: str) -> str:
    """``name`` as part of a file name: safe characters only, and short."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "process"


def _is_ray_worker(pid: int) -> bool:
    """Whether ``pid`` here is a Ray worker process (Ray titles them ``ray::<class>``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


def _process_name(pid: int) -> str:
    """The kernel's name of ``pid`` (``/proc/<pid>/comm``: vLLM names its engine core there)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "process"
    except OSError:
        return "process"


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _job_actors() -> list[dict[str, Any]]:
    """The live actors of this driver's Ray job, from the GCS's actor table; none when Ray is not
    connected or the table does not come within :data:`ACTOR_TABLE_WAIT_S` (a frozen GCS)."""
    import ray

    if not ray.is_initialized():
        return []
    job = ray.get_runtime_context().get_job_id()
    answer: list[list[dict[str, Any]]] = []

    def read() -> None:
        from ray._private import state

        try:
            table = state.actors(job_id=ray.JobID.from_hex(job), actor_state_name="ALIVE")
        except Exception:  # the table is a diagnostic: a failure to read it names nobody
            return
        answer.append(list(table.values()))

    reader = threading.Thread(target=read, name="nrl-actor-table", daemon=True)
    reader.start()
    reader.join(ACTOR_TABLE_WAIT_S)
    return answer[0] if answer else []
