"""The inside of the sandbox: run as root in a fresh interpreter, ``python -I -S -B _launcher.py STATUS_FD HOST_PID``.

It reads one spec from stdin (the files, the command, the limits; ``marshal``-ed, since the host runs
this same interpreter), builds the sandbox and runs the program in it. It reports on ``STATUS_FD``,
one ``repr``-ed dict a line: ``{"init": pid}`` once the sandbox's init exists, ``{"ready": True}``
when the program is about to start, ``{"exit": code, "signal": sig}`` when it ended, or
``{"error": ..., "layer": ...}`` when a layer could not be set up. stdout and stderr are the
program's; nothing else writes to them. (Not ``json`` and not ``signal``: their imports would
double the launcher's start-up, which every run pays.)

Why a separate interpreter: the steps run between ``fork`` and ``exec`` and change the process for
good (namespaces, uid, rlimits). In a Ray worker, which has threads, ``subprocess``'s
``preexec_fn`` is unsafe; a fresh single-threaded process may fork freely.

Why ctypes and not util-linux's ``unshare``: the order of the steps is the protection. Mounts are
made by root before the program drops to an unprivileged uid (so it can change none of them),
its user namespace is made after that drop (so its ``RLIMIT_NPROC`` counts only its own
processes), and the whole tree is read-only at once with ``mount_setattr(AT_RECURSIVE)``, which
the ``mount`` binary of util-linux 2.38 cannot do. No binary offers that sequence; the libc calls
do, and this module uses nothing but the standard library.

Layout of a run (isolated)::

    launcher (root, outside)       in the run's cgroups (memory, pids: everything below is
                                   counted; the host moved it there before it read its spec);
                                   dies with the host; reports init's pid, waits for it; its
                                   death kills init
      init (root, PID 1 of a new PID, mount, network, IPC, UTS and cgroup namespace)
        mounts: a new root (pivot_root) holding only the interpreter's files, bound in as
        nrl_env_code.rootfs planned them; everything read-only, nosuid, nodev; a size-capped tmpfs
        at the workdir; a fresh /proc showing the program its own processes only
        program (uid ``uid`` outside, ``inner_uid`` in its own user namespace, which may hold no
        namespace of its own; no capabilities, no_new_privs, a seccomp filter, rlimits, empty
        environment, fds 0-2 only)

When init exits (the program ended, or init was killed) the kernel kills every process left in
its PID namespace, and the mount namespace (the workdir with it) goes when the last one is gone.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import select
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000

MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added after the syscall tables merged)

SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
MNT_DETACH = 0x2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38

# The seccomp filter: system calls a program has no use for, denied with EPERM (clone3 with ENOSYS,
# so the C library falls back to clone, whose namespace flags the user namespace limit refuses).
# Kernel interfaces with a history of exploits (io_uring, bpf, perf events, userfaultfd), keyrings
# (not namespaced: runs of one uid could pass data through them), tracing of other processes, and
# everything that mounts, makes namespaces or changes the machine. memfd_create stays: the memory
# cgroup counts what it holds. A call from another architecture's table kills the process.
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
SECCOMP_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
DENIED = {  # name: (x86_64, aarch64)
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "mount_setattr": (442, 442),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "unshare": (272, 97), "setns": (308, 268),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142),
    "acct": (163, 89),
}
CLONE3 = 435
SIGKILL = 9

NAMESPACES = (
    (CLONE_NEWNS, "mount namespace"),
    (CLONE_NEWPID, "PID namespace"),
    (CLONE_NEWNET, "network namespace"),
    (CLONE_NEWIPC, "IPC namespace"),
    (CLONE_NEWUTS, "UTS namespace"),
    (CLONE_NEWCGROUP, "cgroup namespace"),  # after joining the run's cgroups: it sees them as its root
)


class LayerError(Exception):
    """A layer could not be set up: ``layer`` names it, the message says which call failed."""

    def __init__(self, layer: str, message: str) -> None:
        super().__init__(message)
        self.layer = layer


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


def _check(result: int, layer: str, call: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise LayerError(layer, f"{call} failed: {os.strerror(errno)}")


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None, layer: str) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), layer,
           f"mount({source or fstype}, {target})")


def _prctl(option: int, value: int, layer: str, call: str) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), layer, call)


def _write(path: str, text: str, layer: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise LayerError(layer, f"writing {path} failed: {exc.strerror}") from None


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as classic BPF ``(code, jt, jf, k)``: the architecture, then each denied number."""
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    column = 0 if machine == "x86_64" else 1
    prog = [(load, 0, 0, 4), (jeq, 1, 0, SECCOMP_ARCH[machine]), (ret, 0, 0, SECCOMP_RET_KILL_PROCESS),
            (load, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(jge, 0, 1, X32_SYSCALL_BIT), (ret, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    prog += [(jeq, 0, 1, CLONE3), (ret, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]
    for numbers in DENIED.values():
        prog += [(jeq, 0, 1, numbers[column]), (ret, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    return prog + [(ret, 0, 0, SECCOMP_RET_ALLOW)]


def _install_seccomp() -> None:
    machine = os.uname().machine
    if machine not in SECCOMP_ARCH:
        raise LayerError("seccomp", f"no system call table for {machine} here")
    prog = seccomp_program(machine)
    filters = (_SockFilter * len(prog))(*(_SockFilter(*op) for op in prog))
    fprog = _SockFprog(len(prog), filters)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp",
           "prctl(PR_SET_SECCOMP)")


class Reporter:
    """One ``repr``-ed dict a line on the status pipe (the host reads them with ``ast.literal_eval``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, **message: object) -> None:
        os.write(self.fd, (repr(message) + "\n").encode())


# --------------------------------------------------------------------------- init's mounts


def _inside(base: str, path: str) -> str:
    """``base + path``, refused unless its parent resolves inside ``base`` (a link recreated in the
    new root must never lead a write out to the host)."""
    inner = base + path
    if not os.path.realpath(os.path.dirname(inner)).startswith(base + "/") and os.path.dirname(inner) != base:
        raise LayerError("minimal filesystem", f"{path} leads outside the new root")
    return inner


def build_root(root: dict, base: str) -> None:
    """A new root at ``base``: an empty tmpfs with the planned links, mount points and read-only
    binds of the host's paths (nrl_env_code.rootfs plans them); nothing is created inside a bind.
    The paths are opened first, so one that lives under ``base`` itself is still bound from there."""
    layer = "minimal filesystem"
    sources = {}
    for path in root["binds"]:
        try:
            sources[path] = os.open(path, os.O_PATH)
        except OSError as exc:
            raise LayerError(layer, f"opening {path} failed: {exc.strerror}") from None
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=8192,mode=0755", layer)
    for path, target in root["links"]:
        inner = _inside(base, path)
        os.makedirs(os.path.dirname(inner), mode=0o755, exist_ok=True)
        os.symlink(target, inner)
    for path in root["dirs"]:
        os.makedirs(_inside(base, path), mode=0o755, exist_ok=True)
    for path, fd in sources.items():
        inner = _inside(base, path)
        os.makedirs(os.path.dirname(inner), mode=0o755, exist_ok=True)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(inner, mode=0o755, exist_ok=True)
        else:
            os.close(os.open(inner, os.O_CREAT | os.O_WRONLY, 0o644))
    for path, fd in sources.items():
        _mount(f"/proc/self/fd/{fd}", base + path, None, MS_BIND | MS_REC, None, layer)
        os.close(fd)
    for path in root["hidden"]:
        _mount("tmpfs", base + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0755", layer)


def _pivot_into(base: str) -> None:
    """Make ``base`` the root and let go of the host's (pivot_root(".", "."), then detach the old)."""
    layer = "minimal filesystem"
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise LayerError(layer, f"pivot_root's number on {os.uname().machine} is not known here")
    os.chdir(base)
    _check(0 if _libc.syscall(number, b".", b".") == 0 else -1, layer, "pivot_root(., .)")
    _check(_libc.umount2(b".", MNT_DETACH), layer, "umount2(old root, MNT_DETACH)")
    os.chdir("/")


def _read_only_tree() -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    result = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(0 if result == 0 else -1, "read-only filesystem", "mount_setattr(/, AT_RECURSIVE, RDONLY)")


def build_mounts(spec: dict) -> None:
    """Every mount of the sandbox, in the order that keeps each one in force (see module doc)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "mount namespace")
    build_root(spec["root"], spec["workdir"])  # on the host's work directory, hidden from then on
    _pivot_into(spec["workdir"])
    _read_only_tree()
    limits = spec["limits"]
    options = f"size={limits['workdir_bytes']},nr_inodes=4096,mode=0700,uid={spec['uid']},gid={spec['gid']}"
    _mount("tmpfs", spec["workdir"], "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options, "workdir tmpfs")
    # hidepid: the program sees its own processes only, not init (the launcher's command line)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible", "fresh /proc")


def write_files(spec: dict) -> None:
    for name, text in spec["files"].items():
        path = os.path.join(spec["workdir"], name)
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            raise LayerError("workdir tmpfs", f"writing the program's file {name} failed: {exc.strerror} "
                                              "(raise sandbox.workdir_mb)") from None
        if spec["isolate"]:
            os.chown(path, spec["uid"], spec["gid"])


# --------------------------------------------------------------------------- the program


def _rlimits(limits: dict) -> None:
    pairs = {
        resource.RLIMIT_CPU: (limits["cpu_seconds"], limits["cpu_seconds"] + 1),
        resource.RLIMIT_AS: (limits["memory_bytes"],) * 2,
        resource.RLIMIT_FSIZE: (limits["file_size_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (limits["open_files"],) * 2,
        resource.RLIMIT_NPROC: (limits["processes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in pairs.items():
        try:
            resource.setrlimit(which, value)
        except (OSError, ValueError) as exc:
            raise LayerError("rlimits", f"setrlimit({which}, {value}) failed: {exc}") from None


def _drop_to_user(spec: dict) -> None:
    """Become ``uid`` (no capabilities outside), then ``inner_uid`` in a user namespace of its own.

    The namespace comes after the drop and the rlimits after the namespace, so the kernel counts
    ``RLIMIT_NPROC`` for this sandbox's processes alone (ucounts are per namespace)."""
    uid, gid, inner = spec["uid"], spec["gid"], spec["inner_uid"]
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        raise LayerError("non-root uid", f"setresuid({uid}) failed: {exc.strerror}") from None
    _prctl(PR_SET_DUMPABLE, 1, "user namespace", "prctl(PR_SET_DUMPABLE)")  # so it may write its own maps
    _check(_libc.unshare(CLONE_NEWUSER), "user namespace", "unshare(CLONE_NEWUSER)")
    _write("/proc/self/setgroups", "deny", "user namespace")
    _write("/proc/self/uid_map", f"{inner} {uid} 1", "user namespace")
    _write("/proc/self/gid_map", f"{inner} {gid} 1", "user namespace")
    # No namespace from inside: this namespace may hold no user namespace of its own, and without
    # one an unprivileged process can make no other kind. Written while this process still has
    # its capabilities in the namespace; the program, another uid, loses them at exec and cannot
    # write it back (bubblewrap's --disable-userns).
    _write("/proc/sys/user/max_user_namespaces", "0", "no nested namespaces")


def exec_program(spec: dict, stdin_fd: int, reporter: Reporter) -> None:
    """In the forked child: take on every restriction, then become the program. Never returns."""
    try:
        if spec["isolate"]:
            _drop_to_user(spec)
        _rlimits(spec["limits"])
        _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs", "prctl(PR_SET_NO_NEW_PRIVS)")
        if spec["isolate"]:
            _install_seccomp()
        os.dup2(stdin_fd, 0)
        os.chdir(spec["workdir"])
        argv = spec["argv"]
        report = reporter.fd
        os.closerange(3, report)
        os.closerange(report + 1, 1 << 20)
        os.set_inheritable(report, False)
        os.execve(argv[0], argv, {})
    except LayerError as exc:
        reporter.send(error=str(exc), layer=exc.layer)
    except OSError as exc:
        reporter.send(error=f"exec {spec['argv'][0]} failed: {exc.strerror}", layer="interpreter")
    except BaseException as exc:  # never let the child run on into its parent's code
        reporter.send(error=f"{type(exc).__name__}: {exc}", layer="sandbox")
    finally:
        os._exit(127)


def _stdin(data: str) -> int:
    fd = os.memfd_create("stdin", 0)
    os.write(fd, data.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_program(spec: dict, reporter: Reporter) -> None:
    """Write the files, start the program, report how it ended."""
    write_files(spec)
    stdin_fd = _stdin(spec["stdin"])
    pid = os.fork()
    if pid == 0:
        exec_program(spec, stdin_fd, reporter)
    os.close(stdin_fd)
    reporter.send(ready=True)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        reporter.send(exit=None, signal=os.WTERMSIG(status))
    else:
        reporter.send(exit=os.WEXITSTATUS(status), signal=None)


# --------------------------------------------------------------------------- the two processes


def init(spec: dict, reporter: Reporter, lifeline: int) -> None:
    """PID 1 of the sandbox's namespaces. Dies with the launcher; the kernel then kills the rest."""
    _prctl(PR_SET_PDEATHSIG, SIGKILL, "PID namespace", "prctl(PR_SET_PDEATHSIG)")
    if select.select([lifeline], [], [], 0)[0]:  # the launcher died before the line above
        os._exit(1)
    build_mounts(spec)
    run_program(spec, reporter)


def isolated(spec: dict, reporter: Reporter) -> None:
    for flag, layer in NAMESPACES:
        _check(_libc.unshare(flag), layer, f"unshare({layer})")
    lifeline_r, lifeline_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(lifeline_w)
        try:
            init(spec, reporter, lifeline_r)
        except LayerError as exc:
            reporter.send(error=str(exc), layer=exc.layer)
        except Exception as exc:  # a bug here must reach the host as a report, not vanish
            reporter.send(error=f"{type(exc).__name__}: {exc}", layer="sandbox")
        os._exit(0)
    os.close(lifeline_r)
    reporter.send(init=pid)
    os.waitpid(pid, 0)  # returns once init is reaped, which the kernel allows only when its namespace is empty


def main() -> None:
    reporter = Reporter(int(sys.argv[1]))
    # Die with the host (a sandbox worker may be killed mid-run): the launcher's death kills init,
    # and init's the whole sandbox, so nothing outlives the process that started it.
    _prctl(PR_SET_PDEATHSIG, SIGKILL, "sandbox", "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != int(sys.argv[2]):  # the host died before the line above
        os._exit(1)
    spec = marshal.loads(sys.stdin.buffer.read())
    os.umask(0o022)  # the new root's directories must be traversable whatever mask the host runs with
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        if spec["isolate"]:
            isolated(spec, reporter)
        else:
            os.makedirs(spec["workdir"], exist_ok=True)
            run_program(spec, reporter)
    except LayerError as exc:
        reporter.send(error=str(exc), layer=exc.layer)


if __name__ == "__main__":
    main()
