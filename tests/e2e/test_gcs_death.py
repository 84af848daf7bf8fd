"""Killing or freezing (SIGSTOP) the GCS or the raylet of a run's private Ray mid-run: a one-line
error within seconds, nothing left behind.

Before, actors kept answering so the run went on, the first call that needed the GCS blocked for
Ray's 60 s reconnect timeout, and the raylet's agents outlived the driver; without its raylet, a
10-step run ended with exit 0, and a 40-step one failed 32 steps later blaming the policy worker;
with either frozen, a run finished its steps and then hung in Ray's shutdown for 90 to 200 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nrl_core.cluster.gcs_watch import FROZEN_S, _descendants
from nrl_core.testing.tiny_models import cached_tiny_model

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _children_named(pid: int, name: str) -> list[int]:
    found = []
    for child in _descendants([pid]):
        try:
            with open(f"/proc/{child}/comm") as f:
                if f.read().strip() == name:
                    found.append(child)
        except OSError:
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["gcs_server", "raylet"])
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_killed_or_frozen_gcs_or_raylet_is_one_line_within_seconds_and_leaves_nothing_running(
        tmp_path: Path, victim: str, signal_name: str) -> None:
    """SIGKILL: the process is gone. SIGSTOP: it is frozen (as a debugger or a stuck host leaves
    it), which Ray would wait on for minutes, its shutdown too; it is named with its state once
    it has been so for FROZEN_S, and killed with the rest."""
    model = cached_tiny_model("llama", size="small")
    env = {**os.environ, "NRL_STRICT_PLUGINS": "1"}
    env.pop("RAY_ADDRESS", None)  # a Ray of the run's own
    proc = subprocess.Popen(
        [sys.executable, "-m", "nrl_core.cli", "train", "sft", "--config", str(CONFIG), f"policy.model_name={model}",
         "sft.max_num_steps=100000", "sft.val_period=0", "checkpointing.enabled=false",
         f"logger.log_dir={tmp_path / 'logs'}", "logger.plot=false", "policy.train_global_batch_size=8",
         "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    victim_pid = None
    victim_outlived_the_run = False
    try:
        metrics = tmp_path / "logs" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training is under way
            assert proc.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
            time.sleep(0.5)
        [victim_pid] = _children_named(proc.pid, victim)
        ray_processes = _descendants([proc.pid])  # raylet, its agents, the workers: all must go
        assert len(ray_processes) >= 5
        signalled_at = time.monotonic()
        os.kill(victim_pid, getattr(signal, signal_name))
        proc.wait(timeout=120)
        exited_after = time.monotonic() - signalled_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        time.sleep(0.5)  # the run's last kill lands
        victim_outlived_the_run = victim_pid is not None and _alive(victim_pid)
        if victim_outlived_the_run:  # nrl failed to end it: resume it, then end it, so nothing is left
            os.kill(victim_pid, signal.SIGCONT)
            os.kill(victim_pid, signal.SIGKILL)
    text = "".join(stderr)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, text[-3000:]
    named = (re.escape(f"GCS (gcs_server pid {victim_pid})") if victim == "gcs_server" else
             rf"raylet \(raylet pid {victim_pid}, node [0-9a-f]{{12}} at 127\.0\.0\.1\)")
    what = "was killed by SIGKILL" if signal_name == "SIGKILL" else re.escape(f"is stopped (state T) for {FROZEN_S:.0f} s")
    assert len(errors) == 1 and re.fullmatch(
        rf"error: cluster: the local Ray's {named} {what}; the run cannot continue without it "
        r"\(complete checkpoints are intact: rerun to resume\)", errors[0]), text[-3000:]
    limit = 30 + (FROZEN_S if signal_name == "SIGSTOP" else 0)
    assert exited_after < limit, f"took {exited_after:.1f} s to stop after the {victim} got {signal_name}"
    assert not victim_outlived_the_run, f"the {signal_name} {victim} was left to the test to end"
    assert [pid for pid in ray_processes if _alive(pid)] == []
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows and rows[-1]["step"] >= 2


SHUTDOWN_SCRIPT = """
import os, signal, sys, time
from nrl_core.suspects import descendants
from nrl_core.cluster.ray_cluster import init_ray, shutdown_ray
import ray

init_ray({"num_cpus": 1, "log_to_driver": False})
node = ray._private.worker._global_node
[victim] = [info.process.pid for info in node.all_processes[sys.argv[1]]]
everything = descendants([os.getpid()])
os.kill(victim, signal.SIGSTOP)
started = time.monotonic()
shutdown_ray()
print(victim, round(time.monotonic() - started, 1), *everything, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["gcs_server", "raylet"])
def test_a_control_plane_frozen_when_the_run_ends_is_killed_not_waited_on(victim: str) -> None:
    """The case the run's watcher cannot see: the GCS or the raylet stopped after the last step,
    as the run shuts down (before, Ray's shutdown waited on it for 90 to 200 s, silently)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    done = subprocess.run([sys.executable, "-c", SHUTDOWN_SCRIPT, victim], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    victim_pid, took, *everything = done.stdout.split()
    left = [int(pid) for pid in everything if _alive(int(pid))]
    for pid in left:  # resume and end whatever is left, so that nothing outlives the test
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    assert float(took) < 10, f"shutdown took {took} s with the {victim} frozen"
    assert int(victim_pid) in map(int, everything) and left == [], left
