"""Killing the GCS of a run's private Ray mid-run: a one-line error within seconds, nothing left behind.

Before, actors kept answering so the run went on, the first call that needed the GCS blocked for
Ray's 60 s reconnect timeout, and the raylet's agents outlived the driver.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nrl_core.cluster.gcs_watch import _descendants
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
def test_killed_gcs_is_one_line_within_seconds_and_leaves_nothing_running(tmp_path: Path) -> None:
    model = cached_tiny_model("llama", size="small")
    env = {**os.environ, "NRL_STRICT_PLUGINS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nrl_core.cli", "train", "sft", "--config", str(CONFIG), f"policy.model_name={model}",
         "sft.max_num_steps=100000", "sft.val_period=0", "checkpointing.enabled=false",
         f"logger.log_dir={tmp_path / 'logs'}", "logger.plot=false", "policy.train_global_batch_size=8",
         "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    try:
        metrics = tmp_path / "logs" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training is under way
            assert proc.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
            time.sleep(0.5)
        [gcs] = _children_named(proc.pid, "gcs_server")
        ray_processes = _descendants([proc.pid])  # raylet, its agents, the workers: all must go
        assert len(ray_processes) >= 5
        killed_at = time.monotonic()
        os.kill(gcs, signal.SIGKILL)
        proc.wait(timeout=120)
        exited_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)  # let the stderr reader finish
    text = "".join(stderr)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, text[-3000:]
    assert errors == [f"error: cluster: the local Ray's GCS (gcs_server pid {gcs}) was killed by SIGKILL; the run "
                      "cannot continue without it (complete checkpoints are intact: rerun to resume)"], text[-3000:]
    assert exited_after < 30, f"took {exited_after:.1f} s to stop after the GCS died"
    assert [pid for pid in ray_processes if _alive(pid)] == []
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows and rows[-1]["step"] >= 2
