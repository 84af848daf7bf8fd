"""Comparing runs by their validation logs: accuracy with binomial standard errors, the
tool-call rate of validation episodes, and how far apart two runs end."""

from __future__ import annotations

import json
import math

import pytest

from nrl_core.logging.compare import evaluations, main, reward_windows, separation


def write(log_dir, step, rewards, tools):
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"reward": r, "messages": [{"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>' if t
                                        else "The answer is 3"}]} for r, t in zip(rewards, tools)]
    (log_dir / f"val_data_step{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_accuracy_standard_error_and_tool_calls_per_validation(tmp_path, capsys):
    write(tmp_path / "a", 0, [0, 0, 0, 1], [0, 0, 1, 1])
    write(tmp_path / "a", 10, [1, 1, 1, 0], [1, 1, 1, 1])
    write(tmp_path / "b", 10, [0, 0, 0, 0], [0, 0, 0, 0])
    first, last = evaluations(tmp_path / "a")
    assert (first.step, first.accuracy, first.n, first.tool_call_rate) == (0, 0.25, 4, 0.5)
    assert last.stderr == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    (other,) = evaluations(tmp_path / "b")
    assert separation(last, other) == pytest.approx(0.75 / last.stderr)
    assert separation(other, other) == 0.0
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "multi", "single"]) == 0
    out = capsys.readouterr().out
    assert "multi: validation accuracy 0.250 ± 0.217 (step 0) -> 0.750 ± 0.217 (step 10, 4 episodes)" in out
    assert "tool-call rate 0.500 -> 1.000" in out and "multi vs single at the end: +0.750, 3.5 standard errors" in out


def test_training_reward_of_the_first_and_last_steps(tmp_path, capsys):
    for step, rewards in {1: [0, 0], 2: [0, 1], 3: [1, 0], 4: [1, 1], 5: [1, 1]}.items():
        (tmp_path / f"train_data_step{step}.jsonl").write_text("".join(json.dumps({"reward": r}) + "\n" for r in rewards))
    start, end = reward_windows(tmp_path, 2)
    assert (start.first, start.last, start.mean, end.first, end.last, end.mean) == (1, 2, 0.25, 4, 5, 1.0)
    assert start.stderr == pytest.approx(math.sqrt(0.25 / 4)) and end.stderr == 0.0  # sample variance 1/4 over 4
    assert reward_windows(tmp_path, 3) is None  # five steps hold no two windows of three
    write(tmp_path, 0, [1], [0])
    assert main([str(tmp_path), "--labels", "run", "--window", "2"]) == 0
    out = capsys.readouterr().out
    assert "run: training reward 0.250 ± 0.250 (steps 1-2) -> 1.000 ± 0.000 (steps 4-5)" in out
    assert "tool-call rate" not in out  # a run whose model never called a tool says nothing about tools
