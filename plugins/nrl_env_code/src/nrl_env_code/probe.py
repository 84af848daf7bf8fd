"""The probe: a program run in the sandbox that reports what it can see and do, and what each layer
should have made it see.

Every worker runs it once at start-up. A layer that is missing shows in the report (the host's
pids in /proc, an interface besides ``lo``, a write that worked, a capability), and
:func:`problems` names it; nothing about the sandbox is taken on trust from the set-up code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

INNER_UID = 1000
"""The program's uid inside its user namespace."""
INTERPRETER_ENV = {"LC_CTYPE"}
"""Set by the program's own interpreter at start-up (PEP 538 coerces the C locale), not inherited."""

PROBE = r"""
import ctypes, json, os, resource, socket, sys
args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)

def denied(number):
    libc.syscall(number, 1, None)
    return ctypes.get_errno() == 1  # EPERM

def can_unshare(flag):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.unshare(flag) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return line.split()[1]

def connect():
    try:
        socket.create_connection(("127.0.0.1", args["port"]), timeout=2).close()
        return "connected"
    except OSError as exc:
        return exc.strerror or type(exc).__name__

def writable(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return True
    except OSError:
        return False

def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False

try:
    parent_environ = open("/proc/%d/environ" % os.getppid(), "rb").read().decode()
except OSError:
    parent_environ = ""
mounts = {line.split()[1]: line.split()[2] for line in open("/proc/self/mounts")}
vfs = os.statvfs(".")
names = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC")
print(json.dumps({
    "uid": os.getuid(), "uid_map": [int(x) for x in open("/proc/self/uid_map").read().split()],
    "cap_eff": int(status("CapEff"), 16), "no_new_privs": int(status("NoNewPrivs")),
    "pid": os.getpid(), "host_pid_visible": os.path.exists("/proc/%d" % args["host_pid"]) and args["host_pid"] > 3,
    "proc_pids": sum(name.isdigit() for name in os.listdir("/proc")),
    "interfaces": sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]),
    "connect": connect(), "outside_writes": [p for p in args["outside"] if writable(p)],
    "workdir_fs": mounts.get(os.getcwd()), "workdir_bytes": vfs.f_blocks * vfs.f_frsize,
    "rlimits": {n: resource.getrlimit(getattr(resource, n))[0] for n in names},
    "environ": sorted(os.environ), "parent_environ": parent_environ,
    "fds": [fd for fd in range(256) if is_open(fd)],
    "nested_namespaces": [name for name, flag in (("user", 0x10000000), ("mount", 0x00020000)) if can_unshare(flag)],
    "init_visible": os.path.exists("/proc/1"),
    "cgroups": sorted({line.rstrip("\n").split(":", 2)[2] for line in open("/proc/self/cgroup")}),
    "seccomp": int(status("Seccomp")), "io_uring_setup": denied(425),
}))
"""
"""Arguments (one JSON argv): ``port`` listening on the host's 127.0.0.1, the host's ``host_pid``,
and ``outside`` paths to try writing."""


def problems(seen: Mapping[str, Any], uid: int, limits: Mapping[str, int], cgroup: bool = True) -> list[tuple[str, str]]:
    """``(layer, what the probe saw)`` for every layer the probe's report shows missing (``cgroup``:
    whether the run had cgroups; the host adds their peak charge as ``cgroup_peak_bytes``)."""
    rlimits = {"RLIMIT_CPU": limits["cpu_seconds"], "RLIMIT_AS": limits["memory_bytes"],
               "RLIMIT_FSIZE": limits["file_size_bytes"], "RLIMIT_NOFILE": limits["open_files"],
               "RLIMIT_NPROC": limits["processes"]}
    workdir_ok = seen["workdir_fs"] == "tmpfs" and abs(seen["workdir_bytes"] - limits["workdir_bytes"]) <= 1 << 20
    checks = [
        ("user namespace", seen["uid_map"] == [INNER_UID, uid, 1], f"uid map {seen['uid_map']}"),
        ("non-root uid", seen["uid"] == INNER_UID and seen["cap_eff"] == 0,
         f"uid {seen['uid']}, effective capabilities {seen['cap_eff']:#x}"),
        ("no_new_privs", seen["no_new_privs"] == 1, "NoNewPrivs is not set"),
        ("PID namespace", seen["pid"] <= 3 and seen["host_pid_visible"] is False,
         f"pid {seen['pid']}, the host's pid visible: {seen['host_pid_visible']}"),
        ("fresh /proc", seen["proc_pids"] <= 2 and not seen["init_visible"],
         f"{seen['proc_pids']} processes in /proc, the sandbox's init visible: {seen['init_visible']}"),
        ("no nested namespaces", seen["nested_namespaces"] == [], f"it made {seen['nested_namespaces']} namespaces"),
        ("cgroup namespace", seen["cgroups"] == ["/"], f"its cgroups are {seen['cgroups']}"),
        ("seccomp", seen["seccomp"] == 2 and seen["io_uring_setup"],
         f"seccomp mode {seen['seccomp']}, io_uring_setup refused: {seen['io_uring_setup']}"),
        ("memory cgroup", not cgroup or (seen.get("cgroup_peak_bytes") or 0) > 0,
         f"the run's memory cgroup was charged {seen.get('cgroup_peak_bytes')} bytes"),
        ("network namespace", seen["interfaces"] == ["lo"] and seen["connect"] != "connected",
         f"interfaces {seen['interfaces']}, connecting to the host's 127.0.0.1: {seen['connect']}"),
        ("read-only filesystem", seen["outside_writes"] == [], f"it wrote {seen['outside_writes']}"),
        ("workdir tmpfs", workdir_ok, f"the workdir is {seen['workdir_fs']} of {seen['workdir_bytes']} bytes"),
        ("rlimits", seen["rlimits"] == rlimits, f"rlimits {seen['rlimits']}"),
        ("empty environment", set(seen["environ"]) <= INTERPRETER_ENV and seen["parent_environ"] == "",
         f"environment {seen['environ']}"),
        ("inherited descriptors", seen["fds"] == [0, 1, 2], f"open descriptors {seen['fds']}"),
    ]
    return [(layer, detail) for layer, ok, detail in checks if not ok]
