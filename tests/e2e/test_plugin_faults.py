"""A faulty plugin in a real GRPO run (``nrl train``, a Ray of the run's own, its workers forked
from the suite's worker zygote): an environment (raising, answering wrongly, or silent past its
``call_timeout_s``), an advantage estimator, a loss or a training backend's ``train`` that raises;
the run exits 2 with one line naming the plugin's distribution, entry point and method, and
nothing of it is left running. The environment's faults in-process, with every message:
tests/core/test_guarded_env.py; a data processor's: tests/core/test_processor_faults.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest

from nrl_core.stacks import process_state
from tests.e2e.test_grpo import nrl_train
from tests.processes import left_after_teardown

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NAMED = "error: {kind} '{name}' of nrl-faulty-plugins (entry point 'tests.e2e.faulty_plugins'): "
FAULTS = {  # case: (overrides, what the plugin is, the line after NAMED)
    "environment-raises": (["data.env_name=raising"], ("environment", "raising"),
                           "RaisingEnvironment.score raised ZeroDivisionError: the grader divided by the empty "
                           "answer; traceback in "),
    "environment-too-few": (["data.env_name=short"], ("environment", "short"),
                            "ShortEnvironment.score returned {short} rewards for {n} samples; it must score each "
                            "sample once, in order"),
    "environment-wrong-type": (["data.env_name=wrong_type", "grpo.max_rollout_turns=2"], ("environment", "wrong_type"),
                               "WrongTypeEnvironment.step returned dict for episode 0; it must return an EnvStep for "
                               "each episode"),
    "estimator-raises": (["grpo.adv_estimator.name=raising"], ("advantage estimator", "raising"),
                         "RaisingEstimator.__call__ raised IndexError: group 3 of 2; traceback in "),
    "loss-raises": (["loss_fn.name=raising"], ("loss function", "raising"),
                    "RaisingLoss.__call__ raised KeyError: 'advantages_v2'; traceback in "),
    "backend-train-raises": (["++policy.raising_train_cfg.enabled=true"], ("training backend", "raising_train"),
                             "RaisingTrainWorker.train on rank 0 raised RuntimeError: the optimizer lost its state; "
                             "traceback in "),
    "environment-outlives-its-timeout": (["data.env_name=silent", "++env.silent.call_timeout_s=3"],
                                         ("watchdog: environment", "silent"),  # the watchdog's line
                                         "SilentEnvironment.score did not return within env.silent.call_timeout_s = 3 s"),
    "environment-worker-outlives-its-timeout": (["data.env_name=silent_actor", "++env.silent_actor.call_timeout_s=3"],
                                                ("watchdog: environment", "silent_actor"),
                                                "ActorEnvironment.score did not return within "
                                                "env.silent_actor.call_timeout_s = 3 s"),
}


def _working_in(tmp: Path) -> list[int]:
    """Live processes working in ``tmp``: the run's driver, Ray and workers all start there."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and Path(os.readlink(entry / "cwd")).is_relative_to(tmp) and \
                    process_state(int(entry.name)) not in (None, "Z"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("case", list(FAULTS))
def test_a_faulty_plugin_stops_the_run_in_one_line_naming_it(case, tmp_path, model):
    overrides, (kind, name), line = FAULTS[case]
    env = {"NRL_PLUGINS": "tests.e2e.faulty_plugins", "RAY_ADDRESS": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = nrl_train(tmp_path, model, "grpo.max_num_steps=1", "checkpointing.enabled=false", *overrides, env=env,
                     own_ray_from_zygote=True)
    left = left_after_teardown(lambda: _working_in(tmp_path))
    for pid in left:  # end what the run left, so that nothing outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, left
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if case == "environment-too-few":
        n = int(errors[0].split(" samples;")[0].rsplit(" ", 1)[1])
        line = line.format(short=n - 1, n=n)
    assert errors[0].startswith(NAMED.format(kind=kind, name=name) + line), errors[0]
    if case == "environment-outlives-its-timeout":  # the watchdog's dump: the stuck call in the driver's stack
        dump = Path(errors[0].split("every stack is in ", 1)[1].split(";")[0])
        driver = "".join(path.read_text() for path in dump.glob("driver-pid*.txt"))
        assert re.search(r'faulty_plugins\.py", line \d+ in score', driver), driver
    if case == "environment-worker-outlives-its-timeout":  # the grader's process, named with its state and stack
        assert re.search(r"; its processes: _Grader actor 'nrl-faulty-grader' pid \d+ \(sleeping, state S\); ",
                         errors[0]), errors[0]
        dump = Path(errors[0].split("every stack is in ", 1)[1].split(";")[0])
        grader = [path for path in dump.iterdir() if "nrl-faulty-grader" in path.name]
        assert grader and "grade" in grader[0].read_text(), sorted(dump.iterdir())
    if line.endswith("traceback in "):
        trace = Path(errors[0].rsplit("traceback in ", 1)[1])
        assert trace.is_relative_to(tmp_path / "logs" / "faults"), trace
        assert line.split(" raised ")[1].split(":")[0] in trace.read_text()
