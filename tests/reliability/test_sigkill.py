"""Kill -9 during training, automated: a SIGKILL of the whole ``nrl train sft`` process tree during a sync
and during an async DTensor save leaves only complete, verifying checkpoints and a restart resumes to the
uninterrupted run's metrics bit for bit (``benchmarks/reliability_trials.py`` runs many such trials); a
SIGKILLed training worker ends the run in one line naming it, with nothing left running."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.reliability_trials import LEFT_GRACE_S, Mode, kill_mid_run, metric_rows, reference, train_command, trial
from nrl_core.testing.tiny_models import cached_tiny_model

pytestmark = pytest.mark.slow
STEPS = 3
PID_LINE = "policy-dtensor: rank 0 pid "  # logged by the worker group when it starts


@pytest.fixture(scope="module")
def model() -> Path:
    return cached_tiny_model("llama")


@pytest.fixture(scope="module")
def uninterrupted(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    return reference(tmp_path_factory.mktemp("reference"), model, Mode("dtensor", async_save=False), STEPS)


@pytest.mark.parametrize("mode", ["dtensor-sync", "dtensor-async"])
def test_sigkill_during_a_save_leaves_complete_checkpoints_and_resumes_bit_for_bit(
        tmp_path: Path, model: Path, uninterrupted: list[tuple], mode: str) -> None:
    # sync and async saves compute the same steps: one uninterrupted run is the reference of both
    result = trial(tmp_path, model, Mode.parse(mode), STEPS, seed=1, expected=uninterrupted)
    assert result.held, result.problems
    assert not result.left, f"alive {LEFT_GRACE_S} s after the kill: {result.left}"
    assert len(uninterrupted) == STEPS


def test_a_killed_training_worker_ends_the_run_in_one_line_naming_it(tmp_path: Path, model: Path) -> None:
    cmd = train_command(model, tmp_path, Mode("dtensor", async_save=False), steps=100000)

    def worker_once_two_steps_trained(lines: list[str]) -> int | None:
        pids = [int(line.split(PID_LINE)[1].split()[0]) for line in lines if PID_LINE in line]
        return pids[0] if pids and len(metric_rows(tmp_path)) >= 2 else None

    killed = kill_mid_run(cmd, tmp_path, worker_once_two_steps_trained)
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert killed.returncode == 2 and len(errors) == 1, killed.stderr[-3000:]
    assert f"policy-dtensor[rank 0] pid {killed.victim} died" in errors[0], errors[0]
    assert killed.exited_after_s < 30, killed.exited_after_s
    assert not killed.left, "processes of the run left running"
