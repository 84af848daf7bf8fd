"""One sandbox run seen from the host: start the launcher, collect its output, kill at a limit, reap all.

The guarantee this module keeps is that when :meth:`Launch.finish` returns, nothing of the run is
alive. The sandbox's init reports its pid as soon as it exists; the host opens a pidfd on it and
checks that the pid is still the launcher's child (so a recycled pid is never signalled), and
kills the run by killing init, whose death makes the kernel kill everything else in its PID
namespace. The launcher reaps init, and the kernel lets init be reaped only once every process of
its namespace is gone; so the launcher's exit, and init's pidfd turning readable, mean the
namespace is empty. Until init's pid is known (during set-up) the launcher's process group is
killed instead, which takes init with it.
"""

from __future__ import annotations

import ast
import marshal
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nrl_core.api import NrlError

LAUNCHER = str(Path(__file__).resolve().with_name("_launcher.py"))
SETUP_SECONDS = 30.0
"""How long building a sandbox may take before the run is an error (a loaded machine takes tenths of a second)."""
REAP_SECONDS = 5.0
"""After a kill, how long the sandbox's processes may take to die before it is reported as an escape."""


class CgroupJoinError(Exception):
    """The launcher could not be moved into its run's cgroup (the sandbox names the layer)."""


class SandboxError(NrlError):
    """A run whose processes could not be accounted for (they outlived the kill): never ignored."""


class Launch:
    """The launcher process of one run, with its three pipes: stdout, stderr and the status reports."""

    def __init__(self, spec: dict[str, Any], output_cap: int, cgroups: list[str] | None = None) -> None:
        """Start the launcher; move it into the run's ``cgroups`` (their ``cgroup.procs`` files)
        before it reads its spec, so everything it starts is born inside them. Moving a process
        between cgroups can take milliseconds (the kernel waits for a grace period); the launcher's
        interpreter starts meanwhile."""
        self.cap = output_cap
        self.out, self.err, self._status = bytearray(), bytearray(), bytearray()
        self.messages: list[dict[str, Any]] = []
        self.over_cap = False
        self.init_fd: int | None = None
        self.killed_at: float | None = None
        self.start = time.monotonic()
        status_r, status_w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", LAUNCHER, str(status_w), str(os.getpid())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         pass_fds=(status_w,), close_fds=True, env={}, cwd="/",
                                         start_new_session=True)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        self.status_fd = status_r
        assert self.proc.stdin is not None
        for procs in cgroups or ():
            try:
                with open(procs, "w") as f:
                    f.write(str(self.proc.pid))
            except OSError as exc:
                self.proc.kill()
                self.finish()
                raise CgroupJoinError(f"moving the sandbox's launcher into {procs} failed: {exc.strerror}") from None
        try:
            self.proc.stdin.write(marshal.dumps(spec))
            self.proc.stdin.close()
        except BrokenPipeError:  # the launcher died at once; its status (or silence) says why
            pass

    def message(self, key: str) -> dict[str, Any] | None:
        return next((m for m in self.messages if key in m), None)

    # ------------------------------------------------------------------ collecting

    def collect(self, timeout: float) -> str | None:
        """Read the pipes until every holder of them is gone, killing the run at a limit: ``setup_time``,
        ``wall_time`` (``timeout`` seconds after the program started) or ``output``. Returns the limit hit."""
        assert self.proc.stdout is not None and self.proc.stderr is not None
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout.fileno(), selectors.EVENT_READ, "out")
        selector.register(self.proc.stderr.fileno(), selectors.EVENT_READ, "err")
        selector.register(self.status_fd, selectors.EVENT_READ, "status")
        deadline, limit = self.start + SETUP_SECONDS, None
        try:
            while selector.get_map():
                now = time.monotonic()
                if self.killed_at is None and now >= deadline:
                    limit = "wall_time" if self.message("ready") else "setup_time"
                    self.kill()
                if self.killed_at is not None and now >= self.killed_at + REAP_SECONDS:
                    raise SandboxError("env.code: a sandboxed program's processes kept its output open "
                                       f"{REAP_SECONDS:g} s after its sandbox was killed; refusing to go on")
                wait = (self.killed_at + REAP_SECONDS if self.killed_at is not None else deadline) - now
                for key, _ in selector.select(timeout=max(0.0, wait)):
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    started = self.message("ready") is not None
                    self._add(key.data, data)
                    if not started and self.message("ready") is not None:
                        deadline = time.monotonic() + timeout
                if self.over_cap and self.killed_at is None:
                    limit = "output"
                    self.kill()
        finally:
            selector.close()
        return limit

    def _add(self, stream: str, data: bytes) -> None:
        if stream == "status":
            self._status += data
            *lines, rest = self._status.split(b"\n")
            self._status = bytearray(rest)
            for line in lines:
                self._message(ast.literal_eval(line.decode()))
            return
        buf = self.out if stream == "out" else self.err
        if len(buf) + len(data) > self.cap:
            self.over_cap = True
            data = data[: max(0, self.cap - len(buf))]
        buf += data

    def _message(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if "init" in message and self.init_fd is None:
            self.init_fd = self._pidfd_of_init(int(message["init"]))

    def _pidfd_of_init(self, pid: int) -> int | None:
        """A pidfd on the sandbox's init, or None when it is already gone (reaped with its namespace).

        The pid is checked after the pidfd is opened: if it is still the launcher's child, the
        pidfd is init's; if not, init was reaped before and the pid may be someone else's now."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        if _parent_of(pid) != self.proc.pid:
            os.close(fd)
            return None
        return fd

    # ------------------------------------------------------------------ ending

    def kill(self) -> None:
        """SIGKILL the sandbox: its init if known (the namespace dies with it), else the launcher's group."""
        if self.killed_at is None:
            self.killed_at = time.monotonic()
        if self.init_fd is not None:
            try:
                signal.pidfd_send_signal(self.init_fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            _kill_group(self.proc.pid)

    def finish(self) -> None:
        """Make sure nothing of the run is left: kill it (a no-op once it ended), wait for init's
        namespace to empty and for the launcher to exit; raise :class:`SandboxError` if they do not."""
        try:
            self.kill()
            if self.init_fd is not None and not select.select([self.init_fd], [], [], REAP_SECONDS)[0]:
                raise SandboxError(f"env.code: the sandbox's init did not die within {REAP_SECONDS:g} s of SIGKILL")
            try:
                self.proc.wait(timeout=REAP_SECONDS)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
                self.proc.wait()
        finally:
            for fd in (self.init_fd, self.status_fd):
                if fd is not None:
                    os.close(fd)
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _kill_group(pid: int) -> None:
    """SIGKILL the launcher's process group (the launcher, and init when it exists)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
