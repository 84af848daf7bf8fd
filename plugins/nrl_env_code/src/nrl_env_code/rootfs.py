"""The sandbox's filesystem, planned on the host: the interpreter, its standard library and the
shared libraries they load, read-only at their own paths; nothing else of the host.

The launcher builds a new root from the plan (an empty tmpfs, the planned paths bound in, the
symlinks on the way to them recreated) and pivots into it, so ``/etc``, home directories, the
project's checkout and the host's sockets are not hidden but absent. Site-packages are covered:
programs run with ``-I -S`` and import the standard library only.

The interpreter is asked for its own paths (it may not be the one running nrl), and ``ldd`` for
the libraries the interpreter and the standard library's extension modules load.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

__all__ = ["RootPlan", "RootUnavailable", "plan"]

WITHOUT_LIBRARIES = ("_tkinter", "_curses", "_curses_panel", "readline", "_dbm", "_gdbm", "nis", "_ssl")
"""Extension modules whose libraries stay out (a GUI toolkit, terminals, databases of the host's,
TLS without a network): importing them fails. Each library is a mount in every run."""

_PATHS = r"""
import json, os, sys, sysconfig
paths = sysconfig.get_paths()
dirs = [p for p in sys.path if p and os.path.isdir(p)]
hidden = [os.path.join(d, name) for d in dirs for name in ("site-packages", "dist-packages")
          if os.path.isdir(os.path.join(d, name))]
print(json.dumps({"executable": os.path.realpath(sys.executable), "dirs": [os.path.realpath(d) for d in dirs],
                  "hidden": [os.path.realpath(h) for h in hidden]}))
"""


class RootUnavailable(Exception):
    """The interpreter's files could not be found (the message says how it failed)."""


@dataclass(frozen=True)
class RootPlan:
    """What the new root holds: ``binds`` (real paths, files or directories, none inside another)
    bound read-only at their own place; ``links`` (symlink path, target) on the way to them;
    ``hidden`` directories inside a bind covered by an empty tmpfs; ``dirs``, empty mount points."""

    binds: tuple[str, ...]
    links: tuple[tuple[str, str], ...]
    hidden: tuple[str, ...]
    dirs: tuple[str, ...]

    def to_spec(self) -> dict[str, list]:
        return {"binds": list(self.binds), "links": [list(link) for link in self.links],
                "hidden": list(self.hidden), "dirs": list(self.dirs)}


def _real(path: str, links: dict[str, str], depth: int = 0) -> str:
    """``path`` with every symlink on the way resolved, recording each link met."""
    if depth > 40:
        raise RootUnavailable(f"too many symlinks resolving {path}")
    current = "/"
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            links[candidate] = target
            base = target if os.path.isabs(target) else os.path.join(current, target)
            return _real(os.path.normpath(os.path.join(base, *parts[i + 1:])), links, depth + 1)
        current = candidate
    return current


def _libraries(files: list[str]) -> list[str]:
    """The shared libraries ``files`` load, and the loader, as ``ldd`` resolves them."""
    if not files:
        return []
    try:
        # as the program's loader will resolve them: without this process's LD_LIBRARY_PATH or LD_PRELOAD
        out = subprocess.run(["ldd", *files], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin"}).stdout
    except FileNotFoundError:
        raise RootUnavailable("ldd is not installed (glibc's libc-bin has it)") from None
    found = set()
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].strip().split(" (")[0].strip()
        elif line.startswith("/") and " (" in line:
            target = line.split(" (")[0]
        else:
            continue
        if target.startswith("/"):
            found.add(target)
    return sorted(found)


def _outermost(paths: set[str]) -> list[str]:
    """``paths`` without those inside another of them."""
    kept: list[str] = []
    for path in sorted(paths):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def plan(python: str, mount_points: tuple[str, ...]) -> RootPlan:
    """The root for programs run by ``python``, with empty ``mount_points`` (the work directory, /proc)."""
    try:
        done = subprocess.run([python, "-I", "-S", "-c", _PATHS], capture_output=True, text=True, timeout=60,
                              env={})
        paths = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise RootUnavailable(f"asking {python} for its paths failed: {exc}") from None
    links: dict[str, str] = {}
    wanted = {_real(paths["executable"], links)} | {_real(d, links) for d in paths["dirs"]}
    extensions = [os.path.join(d, name) for d in paths["dirs"] for name in sorted(os.listdir(d))
                  if name.endswith(".so") and name.split(".")[0] not in WITHOUT_LIBRARIES]
    for library in _libraries([paths["executable"], *extensions]):
        wanted.add(_real(library, links))
    binds = _outermost(wanted)
    for path in binds:
        covered = next((m for m in mount_points if path == m or path.startswith(m.rstrip("/") + "/")), None)
        if covered is not None:
            raise RootUnavailable(f"{path}, which programs need, is under {covered}, which the sandbox mounts over; "
                                  "use an interpreter installed elsewhere (env.code.sandbox.python)")
    inside = lambda p: any(p == b or p.startswith(b.rstrip("/") + "/") for b in binds)  # noqa: E731
    return RootPlan(binds=tuple(binds), links=tuple(sorted((p, t) for p, t in links.items() if not inside(p))),
                    hidden=tuple(h for h in paths["hidden"] if inside(h)), dirs=tuple(mount_points))
