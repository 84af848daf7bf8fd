"""The watchdog through ``nrl train sft`` on two real ranks: while rank 1's checkpoint save never
returns, ``nrl stacks`` dumps every stack and the run goes on; then the save's limit passes and the
run ends with one line naming the phase and the rank, every rank's stack on disk, no worker left,
the previous checkpoint the latest, and a trace of every phase (and every rank's own calls) that
parses as JSON; the same command without the hang then resumes from that checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nrl_core.checkpoint.manager import CheckpointManager
from nrl_core.stacks import process_state
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.launch import nrl
from tests.processes import left_after_teardown

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"


@pytest.mark.slow
def test_a_blocked_save_is_dumped_on_demand_then_ends_the_run_with_the_last_checkpoint_resumable(
        tmp_path: Path) -> None:
    logs, ckpt, mark = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "hanging"
    args = [f"policy.model_name={cached_tiny_model('llama', size='small')}", "cluster.gpus_per_node=2",
            "sft.max_num_steps=4", "sft.val_period=0", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8", "data.generate.num_train=64",
            "data.generate.num_val=8", f"checkpointing.checkpoint_dir={ckpt}", "checkpointing.save_period=1",
            "checkpointing.metric_name=null", "checkpointing.keep_top_k=null", "checkpointing.export_hf=false",
            f"logger.log_dir={logs}", "logger.tensorboard_enabled=false", "logger.plot=false",
            "watchdog.phases.checkpoint_save=20"]
    env = {**os.environ, "NRL_PLUGINS": "tests.e2e.hang_plugin", "NRL_STRICT_PLUGINS": "1",
           "NRL_TEST_HANG_RANK": "1", "NRL_TEST_HANG_STEP": "2", "NRL_TEST_HANG_MARK": str(mark),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    train = ["train", "sft", "--config", str(CONFIG), *args]
    with ThreadPoolExecutor(1) as pool:  # the run on the suite's shared Ray, in the background
        run = pool.submit(nrl, train, env=env, cwd=tmp_path, timeout=700, join_shared_ray=True)
        deadline = time.monotonic() + 400
        while not mark.exists() and not run.done() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert mark.exists(), run.result().stderr[-3000:] if run.done() else "the hang never started"

        asked = subprocess.run([sys.executable, "-m", "nrl_core.cli", "stacks", str(logs)], capture_output=True,
                               text=True, env=env, timeout=120)
        assert asked.returncode == 0, asked.stderr
        dump = Path(asked.stdout.strip())
        assert not run.done()  # the dump did not stop the run
        assert list(dump.glob("driver-pid*.txt"))
        stuck = next(p for p in dump.glob("*-rank1-pid*.txt") if not p.name.endswith(".native.txt")).read_text()
        assert "hang_plugin.py" in stuck, (dump / "status.txt").read_text()
        ended = run.result()
    stderr = ended.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert ended.returncode == 2 and len(errors) == 1, stderr[-3000:]
    assert "phase 'checkpoint_save'" in errors[0] and "[rank 1]" in errors[0] and "limit of 20 s" in errors[0]

    hang = next((logs / "stacks").glob("*-hang-checkpoint_save"))
    rank_files = sorted(p for p in hang.glob("*-rank*-pid*.txt") if not p.name.endswith(".native.txt"))  # py-spy's, where installed
    assert [p.name.split("-pid")[0].rsplit("-", 1)[1] for p in rank_files] == ["rank0", "rank1"]
    assert (hang / "error.txt").read_text().strip() == errors[0].removeprefix("error: ")
    pids = [int(p.name.split("-pid")[1].split(".")[0]) for p in rank_files]
    left = left_after_teardown(lambda: [pid for pid in pids if process_state(pid) not in (None, "Z")])
    assert not left, left
    assert not (logs / "driver.pid").exists()

    manager = CheckpointManager({"enabled": True, "checkpoint_dir": str(ckpt), "save_period": 1})
    latest = manager.latest_verified()
    assert latest is not None and latest.name == "step_1"

    trace = json.loads((logs / "trace.json").read_text())
    names = {event["name"] for event in trace}
    assert {"start_up", "step", "training", "checkpoint_save"} <= names
    assert all(event["ph"] == "X" and event["dur"] >= 0 for event in trace if event["ph"] != "M")
    rows = {event["pid"]: event["args"]["name"] for event in trace if event["name"] == "process_name"}
    assert sorted(rows) == sorted(pids) and sorted(name.rsplit(" rank ", 1)[1] for name in rows.values()) == ["0", "1"]
    for pid in pids:  # each rank's own calls on its own row
        assert "train" in {event["name"] for event in trace if event["pid"] == pid and event["ph"] == "X"}

    # The same command with the hang gone resumes from step_1 and completes step 2.
    del env["NRL_PLUGINS"]
    again = nrl([*train, "sft.max_num_steps=2"], env=env, cwd=tmp_path, timeout=400, join_shared_ray=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout + again.stderr and "step_1" in again.stdout + again.stderr
    latest = manager.latest_verified()
    assert latest is not None and latest.name == "step_2"


@pytest.mark.slow
def test_a_stopped_rank_of_two_is_named_as_the_cause_and_its_peer_as_waiting(tmp_path: Path) -> None:
    """Rank 1 of a two-rank ``nrl train sft`` stopped (SIGSTOP) mid-run: rank 0 waits for it in the
    gradient all-reduce, and to the driver both are "in train()"; the line names rank 1, stopped,
    as the cause and rank 0 as waiting on it, and neither is left."""
    logs = tmp_path / "logs"
    train = ["train", "sft", "--config", str(CONFIG), f"policy.model_name={cached_tiny_model('llama', size='small')}",
             "cluster.gpus_per_node=2", "sft.max_num_steps=100000", "sft.val_period=0",
             "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4", "data.generate.num_train=64",
             "data.generate.num_val=8", "checkpointing.enabled=false", f"logger.log_dir={logs}",
             "logger.tensorboard_enabled=false", "logger.plot=false", "watchdog.floor_s=30"]
    env = {**os.environ, "NRL_STRICT_PLUGINS": "1"}
    with ThreadPoolExecutor(1) as pool:  # the run on the suite's shared Ray, in the background
        run = pool.submit(nrl, train, env=env, cwd=tmp_path, timeout=400, join_shared_ray=True)
        deadline = time.monotonic() + 300
        metrics = logs / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and not run.done():
            assert time.monotonic() < deadline, "training never got under way"
            time.sleep(0.5)
        assert not run.done(), run.result().stderr[-3000:]
        asked = subprocess.run([sys.executable, "-m", "nrl_core.cli", "stacks", str(logs)], capture_output=True,
                               text=True, env=env, timeout=120)  # the ranks' pids, from their stack files
        assert asked.returncode == 0, asked.stderr
        ranks = {p.name.split("-pid")[0].rsplit("-", 1)[1]: int(p.name.split("-pid")[1].split(".")[0])
                 for p in Path(asked.stdout.strip()).glob("policy-dtensor-rank*-pid*.txt")}
        os.kill(ranks["rank1"], signal.SIGSTOP)
        try:
            ended = run.result()
        finally:
            left = process_state(ranks["rank1"]) not in (None, "Z")
            if left:  # nrl left it: end it, then fail below
                os.kill(ranks["rank1"], signal.SIGCONT)
                os.kill(ranks["rank1"], signal.SIGKILL)
    errors = [line for line in ended.stderr.splitlines() if line.startswith("error:")]
    assert ended.returncode == 2 and len(errors) == 1, ended.stderr[-3000:]
    assert re.search(rf"policy-dtensor\[rank 1\] pid {ranks['rank1']} is stopped, state T: the likely cause; "
                     rf"waiting on it: policy-dtensor\[rank 0\] pid {ranks['rank0']}\b", errors[0]), errors[0]
    assert not left and process_state(ranks["rank0"]) in (None, "Z")
