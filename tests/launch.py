"""``nrl`` commands as the tests run them: each in a new process, as a user's shell runs it, but
forked from the suite's fork server, which has imported the heavy libraries the command's driver
would import again (torch, transformers, Ray: seconds of every run's start on a small machine).

The forked process is made to look like ``python -m nrl_core.cli ARGS`` started in ``cwd`` with
``env``: that environment, that working directory first on ``sys.path`` followed by
``PYTHONPATH`` and the interpreter's own paths, standard output and error to pipes the caller
reads, and the interpreter's exit handlers run at the end (Ray's shutdown among them). Nothing of
the pytest process comes with it: the server is a fresh interpreter that only imported libraries.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from nrl_core.testing.distributed import adopt_environment, rank_context


@functools.cache
def _interpreter_path() -> tuple[str, ...]:
    """``sys.path`` of a bare ``python -c`` (no ``PYTHONPATH``): the standard library and site-packages."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         capture_output=True, text=True, env=env, check=True).stdout
    return tuple(json.loads(out))


def _run_cli(args: Sequence[str], environ: dict[str, str], cwd: str, base_path: Sequence[str], out: str,
             err: str) -> None:
    """The forked process: become ``python -m nrl_core.cli ARGS`` and exit with its status."""
    adopt_environment(environ)
    os.chdir(cwd)
    python_path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *python_path, *base_path]
    sys.argv = [str(Path(sys.executable).parent / "nrl"), *args]
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = 1
    try:
        from nrl_core.cli import main

        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def nrl(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
    """``nrl ARGS`` in a new process (see the module docstring), like ``subprocess.run(..., capture_output=True,
    text=True)``; ``env`` replaces the environment (default: this process's). A command still running
    after ``timeout`` seconds is killed and raises :class:`subprocess.TimeoutExpired`."""
    environ = dict(os.environ if env is None else env)
    directory = str(Path(cwd or os.getcwd()).resolve())
    with tempfile.TemporaryDirectory(prefix="nrl-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = rank_context().Process(target=_run_cli, args=(list(args), environ, directory, _interpreter_path(),
                                                                out, err), name="nrl")
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["nrl", *args], timeout, Path(out).read_text(), Path(err).read_text())
        return subprocess.CompletedProcess(["nrl", *args], process.exitcode, Path(out).read_text(errors="replace"),
                                           Path(err).read_text(errors="replace"))
