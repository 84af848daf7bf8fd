"""The shared Ray's workers start through the worker zygote (tests/zygote.py) and are what a fresh
interpreter would be: the run's environment, Raylet's directory and the run's paths; ``multiprocessing`` spawns
through it too with its exit status intact; an import-time variable that differs gets a fresh
interpreter; a killed worker leaves no process behind.

A driver of its own joins the shared Ray, as ``nrl train`` does in the suite, and asks each actor
whether torch was imported before it imported anything (the zygote's workers have it, Ray's own do
not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.launch import shared_ray

HERE = Path(__file__).resolve().parent

_DRIVER = """
import json, multiprocessing, os, sys, time
import ray
from nrl_core.cluster import worker_env_vars
from nrl_core.cluster.ray_cluster import _use_token_auth_if_available

_use_token_auth_if_available()
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self):
        self.preloaded = "torch" in sys.modules  # before this actor imported anything itself

    def report(self):
        import zygote_probe

        spawned = multiprocessing.get_context("spawn").Process(target=zygote_probe.exit_with_what_was_imported)
        spawned.start()
        spawned.join(120)
        return {"preloaded": self.preloaded, "pid": os.getpid(), "cwd": os.getcwd(),
                "mark": os.environ.get("ZYGOTE_TEST_MARK"), "path": sys.path,
                "spawned_exit": spawned.exitcode}


def start(**extra):
    env = worker_env_vars({"ZYGOTE_TEST_MARK": "from-the-run", **extra})
    return Probe.options(runtime_env={"env_vars": env}).remote()


forked, fresh = start(), start(HF_HUB_OFFLINE="0")
reports = ray.get([forked.report.remote(), fresh.report.remote()], timeout=300)
ray.kill(forked)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and os.path.exists(f"/proc/{reports[0]['pid']}"):
    time.sleep(0.2)
reports.append({"killed_worker_gone": not os.path.exists(f"/proc/{reports[0]['pid']}")})
print(json.dumps(reports))
"""


def test_workers_start_from_the_zygote_as_a_fresh_interpreter_would(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": shared_ray(), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", _DRIVER], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    forked, fresh, end = json.loads(run.stdout.strip().splitlines()[-1])
    assert forked["preloaded"] and not fresh["preloaded"]  # HF_HUB_OFFLINE is read when transformers loads
    assert forked["cwd"] == fresh["cwd"]  # where Raylet starts its workers
    for report in (forked, fresh):
        assert report["mark"] == "from-the-run" and str(HERE) in report["path"]
    assert forked["spawned_exit"] == 3  # spawned through the zygote (torch already there), status intact
    assert fresh["spawned_exit"] == 4  # a fresh worker spawns a fresh interpreter
    assert end["killed_worker_gone"]


def _set_up(context: dict, worker: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HERE.parent / "ray_setup_worker.py"),
                           f"--serialized-runtime-env-context={json.dumps(context)}", "--language=PYTHON", *worker],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "SETUP_TEST_HOME": "/h"})


def test_the_set_up_step_sets_the_runs_variables_as_rays_does_and_leaves_the_rest_to_ray(tmp_path):
    """tests/ray_setup_worker.py in place of Ray's setup_worker.py: the context's variables with
    ``${X}`` expanded and unknown ones emptied, then the worker command; a context it does not
    handle (here another entry point) goes to Ray's own script, which runs that entry point."""
    show = "import os; print(os.environ['A'], repr(os.environ['B']))"
    run = _set_up({"env_vars": {"A": "x${SETUP_TEST_HOME}y", "B": "${SETUP_TEST_NOT_SET}"}}, ["-c", show], tmp_path)
    assert run.returncode == 0 and run.stdout == "x/hy ''\n", run.stderr
    entry = tmp_path / "entry.py"
    entry.write_text("print('entry point')\n")
    run = _set_up({"override_worker_entrypoint": str(entry)}, [str(tmp_path / "not_there.py")], tmp_path)
    assert run.returncode == 0 and run.stdout == "entry point\n", run.stderr
