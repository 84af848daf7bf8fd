"""A Linux sandbox for untrusted Python programs: namespaces, an unprivileged uid, rlimits, timeouts.

Each :meth:`Sandbox.run` starts one launcher process (:mod:`nrl_env_code._launcher`, root, a fresh
interpreter with an empty environment and no inherited descriptors) that builds the sandbox and
runs the program in it; :mod:`nrl_env_code.launch` watches it from here. What each layer stops,
and where it stops nothing, is in docs/reliability.md ("Code sandbox"). In short:

* PID namespace: the program's whole tree dies with the sandbox's init (``setsid`` does not help),
  and it sees no process outside;
* network namespace: no interface but a loopback that is down: no connection anywhere;
* mount namespace: a root holding only the interpreter's files (:mod:`nrl_env_code.rootfs`),
  everything read-only, nosuid, nodev; the only writable place is a size-capped tmpfs work
  directory that vanishes with the run; a fresh ``/proc`` that shows the program itself only;
* an unprivileged uid in a user namespace of its own that may hold no namespace, no capabilities,
  ``no_new_privs``, a seccomp filter: it can change none of the above, and ``RLIMIT_NPROC``
  binds (it does not for root);
* a memory cgroup and a pids cgroup per run (:mod:`nrl_env_code.cgroups`): the run's memory, files
  in memory included, and its processes, counted together whatever it does;
* rlimits on CPU time, address space, file size, open files and processes; a wall-time limit and
  an output cap enforced here, which kill the whole tree.

A layer this machine cannot provide is a :class:`SandboxUnavailable` at start-up (:meth:`probe`),
one line naming it; nothing falls back silently. ``unsafe_no_isolation_trusted_code_only`` runs
programs with rlimits and timeouts only, for trusted code, with a warning;
``unsafe_without_cgroup`` runs them isolated but without the cgroups, where none is writable.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nrl_core.api import NrlError
from nrl_env_code import cgroups, rootfs
from nrl_env_code.launch import SETUP_SECONDS, CgroupJoinError, Launch, SandboxError
from nrl_env_code.probe import INNER_UID, PROBE, problems

__all__ = ["Program", "RunResult", "Sandbox", "SandboxConfig", "SandboxError", "SandboxUnavailable"]

logger = logging.getLogger(__name__)

WORKDIR = "/tmp"
"""The work directory inside the sandbox: a size-capped tmpfs, the only writable place."""
UNSAFE_KEY = "unsafe_no_isolation_trusted_code_only"
NO_CGROUP_KEY = "unsafe_without_cgroup"
_CAP_SYS_ADMIN = "run as root with CAP_SYS_ADMIN (in Docker: --cap-add SYS_ADMIN, or --privileged)"
FIXES = {
    "namespaces": "run on Linux",
    "mount namespace": _CAP_SYS_ADMIN,
    "PID namespace": _CAP_SYS_ADMIN,
    "network namespace": _CAP_SYS_ADMIN,
    "IPC namespace": _CAP_SYS_ADMIN,
    "UTS namespace": _CAP_SYS_ADMIN,
    "user namespace": "allow user namespaces (sysctl user.max_user_namespaces > 0; no seccomp profile or AppArmor "
                      "rule blocking unshare(CLONE_NEWUSER))",
    "read-only filesystem": "needs mount_setattr (Linux >= 5.12) and " + _CAP_SYS_ADMIN,
    "workdir tmpfs": "needs tmpfs and CAP_SYS_ADMIN, and the program's files must fit in sandbox.workdir_mb",
    "fresh /proc": "needs CAP_SYS_ADMIN (`unshare --pid --fork --mount-proc true` must work)",
    "non-root uid": "run the environment as root (CAP_SETUID, CAP_SETGID) so programs can run as sandbox.uid",
    "rlimits": "check the hard limits of the worker's process (ulimit -H -a)",
    "no_new_privs": "needs Linux >= 3.5",
    "cgroup namespace": _CAP_SYS_ADMIN,
    "memory cgroup": "give the environment a writable memory and pids cgroup (cgroup v1: both hierarchies mounted "
                     "read-write; v2: a delegated subtree with memory and pids in cgroup.subtree_control, e.g. "
                     "systemd-run --scope -p Delegate=yes); where none can be had, env.code.sandbox."
                     f"{NO_CGROUP_KEY}: true keeps every other layer (docs/reliability.md says what it loses)",
    "no nested namespaces": "needs Linux >= 4.9 (per-namespace user.max_user_namespaces)",
    "seccomp": "needs Linux with seccomp filters (CONFIG_SECCOMP_FILTER) on x86_64 or aarch64",
    "empty environment": "a bug in nrl_env_code; please report it",
    "inherited descriptors": "a bug in nrl_env_code; please report it",
    "interpreter": "set env.code.sandbox.python to an interpreter the sandbox can execute",
    "minimal filesystem": "needs pivot_root, bind mounts and CAP_SYS_ADMIN, and the interpreter's files (ldd must be "
                          "installed to find its libraries)",
    "sandbox": "see the detail; a launcher failure is a bug in nrl_env_code",
}


class SandboxUnavailable(NrlError):
    """This machine cannot provide a layer of the sandbox (one line: the layer and the fix)."""

    def __init__(self, layer: str, detail: str) -> None:
        self.layer = layer
        fallback = "" if layer == "memory cgroup" else (f"; for trusted code only, env.code.sandbox.{UNSAFE_KEY}: "
                                                         "true runs programs without isolation")
        super().__init__(f"env.code.sandbox: the sandbox layer '{layer}' is unavailable ({detail}); "
                         f"{FIXES.get(layer, 'see docs/reliability.md')}{fallback}")


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """The ``sandbox`` section: limits per run, and who the program runs as."""

    uid: int = 1999999
    cpu_seconds: int = 10
    memory_mb: int = 512
    max_processes: int = 16
    max_open_files: int = 64
    file_size_mb: int = 16
    workdir_mb: int = 64
    output_limit_bytes: int = 1 << 16
    python: str | None = None
    unsafe_no_isolation_trusted_code_only: bool = False
    unsafe_without_cgroup: bool = False

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None) -> SandboxConfig:
        return cls(**{k: v for k, v in (section or {}).items() if k in cls.__dataclass_fields__})

    @property
    def interpreter(self) -> str:
        """The program's interpreter: ``python``, or the real file behind this process's."""
        return self.python or os.path.realpath(sys.executable)

    def limits(self) -> dict[str, int]:
        return {"cpu_seconds": int(self.cpu_seconds), "memory_bytes": self.memory_mb << 20,
                "file_size_bytes": self.file_size_mb << 20, "open_files": int(self.max_open_files),
                "processes": int(self.max_processes), "workdir_bytes": self.workdir_mb << 20}


@dataclass(kw_only=True)
class Program:
    """One run: ``files`` written to the work directory, then ``argv`` (after the interpreter,
    e.g. ``["main.py"]``) with ``stdin``; ``timeout`` seconds of wall time from its start."""

    files: dict[str, str]
    argv: list[str]
    stdin: str = ""
    timeout: float = 5.0


@dataclass(kw_only=True)
class RunResult:
    """How a run ended. ``limit`` names the limit that ended it (``wall_time``, ``cpu_time``,
    ``output``, ``memory``: the run's cgroup killed it), if one did; ``exit_code`` is None when
    a signal ended the program."""

    exit_code: int | None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    limit: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Sandbox:
    """Runs programs one at a time, each in a fresh sandbox; :meth:`probe` first proves every layer."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.isolate = not self.config.unsafe_no_isolation_trusted_code_only
        if not self.isolate:
            logger.warning("env.code.sandbox.%s is true: generated code runs WITHOUT isolation (no namespaces, as "
                           "this process's user, with the network and the whole filesystem); use it only for "
                           "trusted code", UNSAFE_KEY)
        self.hierarchy: cgroups.Hierarchy | None = None
        self._cgroup_checked = False
        self.last_peak_bytes: int | None = None
        self._leaving: list[cgroups.RunCgroup] = []  # groups of ended runs whose processes were still leaving
        self._root: dict[str, list] | None = None

    def _root_plan(self) -> dict[str, list]:
        """What the program's filesystem holds (planned once): the interpreter and its libraries."""
        if self._root is None:
            python = self.config.interpreter
            if not os.access(python, os.X_OK):
                raise SandboxUnavailable("interpreter", f"{python} is not an executable file")
            try:
                self._root = rootfs.plan(python, ("/proc", WORKDIR)).to_spec()
            except rootfs.RootUnavailable as exc:
                raise SandboxUnavailable("minimal filesystem", str(exc)) from None
        return self._root

    def _cgroups(self) -> cgroups.Hierarchy | None:
        """Where each run's cgroups are made (found once); None only where the config allows it."""
        if not self._cgroup_checked:
            try:
                self.hierarchy = cgroups.find()
                cgroups.sweep(self.hierarchy)
            except cgroups.CgroupUnavailable as exc:
                if self.isolate and not self.config.unsafe_without_cgroup:
                    raise SandboxUnavailable("memory cgroup", str(exc)) from None
                if self.isolate:
                    logger.warning("env.code.sandbox.%s is true: %s; a program's memory is bounded per process "
                                   "(RLIMIT_AS), not with its files in memory or over several processes",
                                   NO_CGROUP_KEY, exc)
            self._cgroup_checked = True
        return self.hierarchy

    # ------------------------------------------------------------------ running

    def run(self, program: Program) -> RunResult:
        """Run ``program``; whatever happens, nothing of it is left running when this returns.

        Raises :class:`SandboxUnavailable` when a layer could not be set up, and
        :class:`SandboxError` when the run's processes could not be accounted for."""
        hierarchy = self._cgroups()
        self._leaving = [group for group in self._leaving if not group.remove()]
        workdir = WORKDIR if self.isolate else tempfile.mkdtemp(prefix="nrl-code-")
        group = None
        try:
            spec = self._spec(program, workdir)
            if hierarchy is not None:
                group = cgroups.RunCgroup(hierarchy, self.config.memory_mb << 20, int(self.config.max_processes))
            try:
                launch = Launch(spec, int(self.config.output_limit_bytes), group.procs_files if group else None)
            except CgroupJoinError as exc:
                raise SandboxUnavailable("memory cgroup", str(exc)) from None
            try:
                limit = launch.collect(float(program.timeout))
            finally:
                launch.finish()
            if limit is None and group is not None and group.oom_killed():
                limit = "memory"
            self.last_peak_bytes = group.peak_bytes() if group is not None else None
        finally:
            if group is not None and not group.remove():
                self._leaving.append(group)
            if not self.isolate:
                shutil.rmtree(workdir, ignore_errors=True)
        error = launch.message("error")
        if error is not None:
            raise SandboxUnavailable(error.get("layer", "sandbox"), error["error"])
        if limit == "setup_time":
            raise SandboxUnavailable("sandbox", f"the sandbox did not start within {SETUP_SECONDS:g} s")
        ended = launch.message("exit")
        code, sig = (ended["exit"], ended["signal"]) if ended else (None, signal.SIGKILL)
        if limit is None and sig == signal.SIGXCPU:
            limit = "cpu_time"
        return RunResult(exit_code=code, signal=sig, stdout=launch.out.decode(errors="replace"),
                         stderr=launch.err.decode(errors="replace"), limit=limit,
                         seconds=time.monotonic() - launch.start)

    def _spec(self, program: Program, workdir: str) -> dict[str, Any]:
        """What the launcher reads: the files, the command, the limits, the program's filesystem."""
        python = self.config.interpreter
        return {"isolate": self.isolate, "uid": self.config.uid, "gid": self.config.uid, "inner_uid": INNER_UID,
                "workdir": workdir, "files": program.files, "stdin": program.stdin,
                "argv": [python, "-I", "-S", "-B", *program.argv], "limits": self.config.limits(),
                "root": self._root_plan() if self.isolate else {}}

    # ------------------------------------------------------------------ probing

    def probe(self) -> dict[str, Any]:
        """Run :data:`~nrl_env_code.probe.PROBE` in the sandbox and check every layer against the config.

        Raises :class:`SandboxUnavailable` naming the first layer missing; returns what the probe saw."""
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailable("namespaces", f"they are Linux's and this is {sys.platform}")
        if not self.isolate:
            return {}
        if os.geteuid() != 0:
            raise SandboxUnavailable("non-root uid", f"the sandbox is set up by root and this process runs as uid "
                                                     f"{os.geteuid()}")
        here = str(Path(__file__).resolve().parent)
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            args = {"port": listener.getsockname()[1], "host_pid": os.getpid(),
                    "outside": [os.path.join(p, "nrl_probe_write") for p in ("/", "/etc", "/var/tmp", "/dev/shm", here)]}
            result = self.run(Program(files={"probe.py": PROBE}, argv=["probe.py", json.dumps(args)], timeout=30.0))
        if not result.ok:
            raise SandboxUnavailable("sandbox", f"the probe program failed (exit {result.exit_code}, signal "
                                                f"{result.signal}, limit {result.limit}): "
                                                f"{' '.join(result.stderr.split())[-300:]}")
        seen = json.loads(result.stdout)
        seen["cgroup_peak_bytes"] = self.last_peak_bytes  # from outside: the probe was charged to its run's group
        for layer, detail in problems(seen, self.config.uid, self.config.limits(), cgroup=self.hierarchy is not None):
            raise SandboxUnavailable(layer, detail)
        return seen
