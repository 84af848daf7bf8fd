"""Ray's worker set-up step for the suite's Rays, without importing Ray.

Raylet starts each worker of a job that has a runtime environment (every nrl run has one: it
forwards its variables that way) through Ray's ``setup_worker.py``. That script imports Ray's
runtime-environment code, about 0.4 CPU-s, only to set the variables and exec the worker command
(tests/ray_worker_launcher.py here), and the suite starts hundreds of workers. For a context that
holds variables and an interpreter alone, this does what it does: the variables set as Ray's
``update_envs`` sets them (``${X}`` expanded, unknown ones emptied), then the worker command
exec'd with the context's interpreter. Any other context (a command prefix, another entry point,
Java) goes to Ray's own script, as it came.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from typing import NoReturn

PLAIN = {"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint", "java_jars"}


def rays_own(argv: list[str]) -> NoReturn:
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    script = os.path.join(os.path.dirname(spec.origin), "_private", "workers", "setup_worker.py")
    os.execv(sys.executable, [sys.executable, script, *argv])


def main(argv: list[str]) -> NoReturn:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, worker = parser.parse_known_args(argv)
    context = json.loads(args.serialized_runtime_env_context or "{}")
    plain = (args.language == "PYTHON" and set(context) <= PLAIN and not context.get("command_prefix")
             and not context.get("override_worker_entrypoint") and not context.get("java_jars") and worker)
    if not plain:
        rays_own(argv)
    for key, value in (context.get("env_vars") or {}).items():
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    python = context.get("py_executable") or sys.executable
    os.execv(python, [python, *worker])


if __name__ == "__main__":
    main(sys.argv[1:])
