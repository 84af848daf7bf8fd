"""Files in ``/dev/shm`` with their space reserved before the first byte is written.

Why: tmpfs hands out pages on first write, so a file whose size was merely set (``ftruncate``)
can be mapped past the space the mount has, and the process that writes there dies of SIGBUS
(Docker's default ``/dev/shm`` is 64 MB). Each file is therefore checked against the free space
and then allocated (``posix_fallocate``, which tmpfs refuses with ENOSPC instead of killing the
writer), and a file that cannot be reserved is removed, with one line naming the directory, the
bytes needed and free, and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator

from nrl_core.errors import NrlError

#: Caps the free space the check sees, in bytes: a refit budget on a shared ``/dev/shm``, or a
#: small one for tests.
FREE_BYTES_VARIABLE = "NRL_SHM_FREE_BYTES"


def shm_dir() -> str:
    """``/dev/shm`` where it is writable, else the temporary directory (the same answer on every
    process of a node)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def free_bytes(directory: str) -> int:
    """What ``directory``'s file system has free, capped by ``NRL_SHM_FREE_BYTES`` when set."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    cap = os.environ.get(FREE_BYTES_VARIABLE, "").strip()
    if not cap:
        return free
    if not cap.isdigit():
        raise NrlError(f"{FREE_BYTES_VARIABLE}={cap!r}: not a number of bytes; set it to one or unset it")
    return min(free, int(cap))


def space_error(directory: str, needed: int, free: int, what: str) -> NrlError:
    return NrlError(f"{what}: {directory} has {free / 2**20:.1f} MiB free but needs {needed / 2**20:.1f} MiB; give "
                    f"it more space (docker run --shm-size=..., or a larger tmpfs) or set "
                    f"policy.refit.transport: broadcast")


def reserve(fd: int, path: str, nbytes: int, what: str, held: int = 0) -> None:
    """Give the open file ``fd`` at ``path`` ``nbytes`` of backed space, or raise one line.
    ``held``: bytes the file already has, which count as free for it."""
    directory = os.path.dirname(path)
    free = free_bytes(directory) + held
    if nbytes > free:
        raise space_error(directory, nbytes, free, what)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG):
            raise space_error(directory, nbytes, free_bytes(directory) + held, what) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: size only
            raise
        os.ftruncate(fd, max(nbytes, 1))


@contextlib.contextmanager
def shared_file(nbytes: int, prefix: str, what: str) -> Iterator[str]:
    """A fresh file of ``nbytes`` reserved bytes under ``/dev/shm``, removed on exit (also when
    reserving it fails, so nothing is left half-written)."""
    fd, path = tempfile.mkstemp(prefix=prefix, dir=shm_dir())
    try:
        reserve(fd, path, nbytes, what)
        os.close(fd)
        fd = -1
        yield path
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
