"""A cgroup per sandbox run: memory and process limits that count everything the run creates.

``RLIMIT_AS`` bounds one process's address space and ``RLIMIT_NPROC`` a uid's processes; neither
sees a file held in memory (a ``memfd``, a tmpfs the program mounted, the work directory's pages),
and a program may split its memory over several processes. A memory cgroup charges all of it to
the run: anonymous memory, shared memory and tmpfs pages, and the page cache its writes dirty; a
pids cgroup counts its processes and threads. The host makes the run's cgroups, moves the launcher
into them before the launcher builds the sandbox (so every process of the run is born inside),
reads from outside whether the memory limit ended the run, then removes them.

Two layouts exist. cgroup v1 (a hierarchy per controller, ``memory`` and ``pids``): the run's
groups are children of this process's own. cgroup v2 (one hierarchy): the run's group is a child
of this process's own, which needs ``memory`` and ``pids`` in its ``cgroup.subtree_control``
(a delegated subtree). :func:`find` says which is writable here, or why none is.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupUnavailable", "Hierarchy", "RunCgroup", "find"]

PREFIX = "nrl-sandbox-"
_counter = itertools.count()


class CgroupUnavailable(Exception):
    """No writable memory and pids cgroup here; the message says what was found."""


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's cgroups are: ``version`` 1 or 2, and the directory each controller's
    children are made in (``memory`` and ``pids``; the same directory on v2)."""

    version: int
    memory: Path
    pids: Path


def _mounts() -> list[tuple[str, str, str, str]]:
    """``(root, mount point, fstype, super options)`` of every cgroup mount, from mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], tail[0], tail[2]))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller, and ``""`` for v2, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _under(mount_root: str, mount_point: str, path: str) -> Path | None:
    """``path`` (a cgroup as /proc/self/cgroup names it) in a mount whose root is ``mount_root``."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        return None
    relative = path[len(mount_root):] if mount_root != "/" else path
    return Path(mount_point) / relative.lstrip("/")


def _writable_dir(path: Path | None) -> bool:
    return path is not None and path.is_dir() and os.access(path, os.W_OK)


def find() -> Hierarchy:
    """The writable cgroup hierarchy for per-run groups; :class:`CgroupUnavailable` if none."""
    own, mounts = _own_paths(), _mounts()
    v1: dict[str, Path | None] = {}
    for root, point, fstype, options in mounts:
        if fstype != "cgroup":
            continue
        for name in ("memory", "pids"):
            if name in options.split(",") and name in own:
                v1[name] = _under(root, point, own[name])
    if _writable_dir(v1.get("memory")) and _writable_dir(v1.get("pids")):
        return Hierarchy(1, v1["memory"], v1["pids"])  # type: ignore[arg-type]
    seen = [f"v1 {name} at {path}" for name, path in v1.items()]
    for root, point, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        path = _under(root, point, own[""])
        if path is None or not path.is_dir():
            continue
        try:
            delegated = set((path / "cgroup.subtree_control").read_text().split())
        except OSError:
            delegated = set()
        if {"memory", "pids"} <= delegated and _writable_dir(path):
            return Hierarchy(2, path, path)
        seen.append(f"v2 at {path} delegating {sorted(delegated) or 'no controller'}")
    raise CgroupUnavailable("no writable memory and pids cgroup (" + ("; ".join(seen) or "no cgroup mounted") + ")")


class RunCgroup:
    """The cgroups of one run: made with its limits, the launcher moved in, read and removed here."""

    def __init__(self, hierarchy: Hierarchy, memory_bytes: int, processes: int) -> None:
        self.hierarchy = hierarchy
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.dirs = [hierarchy.memory / name] if hierarchy.version == 2 else [hierarchy.memory / name,
                                                                              hierarchy.pids / name]
        made: list[Path] = []
        try:
            for directory in self.dirs:
                directory.mkdir()
                made.append(directory)
            if hierarchy.version == 1:
                memory, pids = self.dirs
                _write(memory / "memory.limit_in_bytes", memory_bytes)
                if (memory / "memory.memsw.limit_in_bytes").exists():  # swap is memory too
                    _write(memory / "memory.memsw.limit_in_bytes", memory_bytes)
                _write(pids / "pids.max", processes)
            else:
                (group,) = self.dirs
                _write(group / "memory.max", memory_bytes)
                if (group / "memory.swap.max").exists():
                    _write(group / "memory.swap.max", 0)
                _write(group / "pids.max", processes)
        except OSError:
            for directory in reversed(made):
                _rmdir(directory)
            raise

    @property
    def procs_files(self) -> list[str]:
        """Where the launcher's pid is written to move it into every group of the run."""
        return [str(directory / "cgroup.procs") for directory in self.dirs]

    def _read(self, index: int, name: str) -> str:
        try:
            return (self.dirs[index] / name).read_text()
        except OSError:
            return ""

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for the memory limit."""
        text = self._read(0, "memory.oom_control" if self.hierarchy.version == 1 else "memory.events")
        return _count(text, "oom_kill") > 0

    def peak_bytes(self) -> int:
        """The run's peak memory, as charged to its group (proof, from outside, that it was inside)."""
        if self.hierarchy.version == 1:
            return int(self._read(0, "memory.max_usage_in_bytes") or 0)
        return int(self._read(0, "memory.peak") or 0)

    def remove(self) -> bool:
        """Remove the groups; False while the run's last processes are still leaving them (the
        kernel takes a moment after they died: the caller tries again later instead of waiting)."""
        return all([_rmdir(directory) for directory in self.dirs])


def sweep(hierarchy: Hierarchy) -> None:
    """Remove the groups that hosts which died left behind (a group with a process in it cannot
    be removed, so a running one is never taken)."""
    for parent in {hierarchy.memory, hierarchy.pids}:
        for directory in parent.glob(f"{PREFIX}*"):
            pid = directory.name[len(PREFIX):].split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _rmdir(directory)


def _write(path: Path, value: int) -> None:
    path.write_text(str(value))


def _count(text: str, key: str) -> int:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _rmdir(directory: Path) -> bool:
    """Whether ``directory`` is gone (a cgroup cannot be removed while a process is in it)."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True
