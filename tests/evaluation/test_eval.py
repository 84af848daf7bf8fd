"""``nrl eval`` as a user runs it: on a GRPO run's checkpoint with the run's config it reproduces the
run's last validation answer for answer, and so does NeMo RL's eval layout on the same problems;
sampled evaluation reports pass@k and majority vote; bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_grpo import CONFIG, assert_ok, metrics
from tests.evaluation.conftest import VAL
from tests.launch import nrl

pytestmark = pytest.mark.slow

NEMO_RL_LAYOUT = Path(__file__).with_name("nemo_rl_layout.yaml")


def nrl_eval(cwd: Path, config: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "NRL_STRICT_PLUGINS": "1"}
    return nrl(["eval", "--config", str(config), *overrides], env=env, cwd=cwd, timeout=600, join_shared_ray=True)


def table(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The score lines ``nrl eval`` prints after its ``model ...`` line (workers log to stdout too)."""
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("model "))
    return [line for line in lines[start + 1:] if line.startswith("  ")]


def samples(save_path: Path) -> list[dict]:
    return [json.loads(line) for line in (save_path / "samples.jsonl").read_text().splitlines()]


def run_config(*extra: str) -> list[str]:
    """The run's own overrides (tests/e2e/test_grpo.py's nrl_train) that shape its data."""
    return ["data.generate.num_train=64", *VAL, *extra]


@pytest.mark.parametrize("engines", [1, 2])
def test_eval_of_a_checkpoint_reproduces_the_runs_last_validation(dtensor_run, tmp_path, engines):
    """With one engine, and with the problems split over two."""
    proc = nrl_eval(tmp_path, CONFIG, f"policy.model_name={dtensor_run / 'ckpt'}", *run_config(),
                    f"cluster.gpus_per_node={engines}", f"++eval.save_path={tmp_path / 'out'}")
    assert_ok(proc)
    [engine_group] = [line for line in proc.stderr.splitlines() if "eval-vllm: rank 0 pid" in line]
    assert engine_group.count(" pid ") == engines
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    last = metrics(dtensor_run)[-1]
    assert result["scores"]["accuracy"]["value"] == last["val/accuracy"]
    assert result["scores"]["pass@1"]["value"] == last["val/accuracy"] and result["temperature"] == 0.0
    logged = [json.loads(line) for line in (dtensor_run / "logs" / "val_data_step2.jsonl").read_text().splitlines()]
    evaluated = samples(tmp_path / "out")
    assert [s["prompt_token_ids"] for s in evaluated] == [s["prompt_token_ids"] for s in logged]
    assert [s["response_token_ids"] for s in evaluated] == [s["response_token_ids"] for s in logged]
    assert [s["reward"] for s in evaluated] == [s["reward"] for s in logged]
    assert table(proc)[0].split()[0] == "pass@1"  # the table, headline first


def test_nemo_rl_layout_evaluates_the_same_answers(dtensor_run, tmp_path):
    from nrl_core.data.arithmetic import arithmetic_splits

    _, val = arithmetic_splits(num_train=64, num_val=12, min_operand=0, max_operand=19, ops=["+", "-"], seed=0)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": r["problem"], "answer": r["expected_answer"]}) + "\n" for r in val))
    hf = dtensor_run / "ckpt" / "hf_export"
    proc = nrl_eval(tmp_path, NEMO_RL_LAYOUT, f"generation.model_name={hf}", f"data.dataset_name={data}",
                    f"eval.save_path={tmp_path / 'out'}")
    assert_ok(proc)
    logged = [json.loads(line) for line in (dtensor_run / "logs" / "val_data_step2.jsonl").read_text().splitlines()]
    evaluated = samples(tmp_path / "out")
    assert [s["prompt_token_ids"] for s in evaluated] == [s["prompt_token_ids"] for s in logged]
    assert [s["response_token_ids"] for s in evaluated] == [s["response_token_ids"] for s in logged]


def test_sampled_eval_reports_pass_at_k_and_majority_vote(dtensor_run, tmp_path):
    proc = nrl_eval(tmp_path, CONFIG, f"policy.model_name={dtensor_run / 'ckpt' / 'hf_export'}", *run_config(),
                    "policy.generation.val_temperature=null", "++eval.num_tests_per_prompt=4", "++eval.k_value=2",
                    "++eval.metric=cons@k", f"++eval.save_path={tmp_path / 'out'}")
    assert_ok(proc)
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    scores = {name: s["value"] for name, s in result["scores"].items()}
    assert set(scores) == {"accuracy", "reward", "pass@1", "pass@2", "pass@4", "maj@2", "maj@4"}
    assert result["temperature"] == 1.0 and result["samples_per_problem"] == 4
    assert scores["pass@1"] == pytest.approx(scores["accuracy"]) and scores["pass@1"] <= scores["pass@2"] <= scores["pass@4"]
    rows = samples(tmp_path / "out")
    assert len(rows) == 12 * 4 and all(r["answer"] is None or isinstance(r["answer"], str) for r in rows)
    per_problem = [[tuple(r["response_token_ids"]) for r in rows if r["problem"] == i] for i in range(12)]
    assert any(len(set(group)) > 1 for group in per_problem)  # sampled: a problem's samples differ
    assert table(proc)[0].split()[0] == "maj@2"  # the headline: cons@k at k_value


@pytest.mark.parametrize("overrides, expected", [
    (["policy.model_name={tmp}"], "holds no Hugging Face model (config.json) and no hf_export"),
    (["++eval.num_tests_per_prompt=2", "++eval.k_value=3"], "eval.k_value: 3 is more than the 2 samples per problem"),
    (["++eval.metric=best@k"], "eval.metric"),
])
def test_bad_input_is_one_line(overrides, expected, tmp_path, model):
    proc = nrl_eval(tmp_path, CONFIG, f"policy.model_name={model}", *[o.format(tmp=tmp_path) for o in overrides])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize("overrides, expected", [
    (["data.dataset_name=gpqa"], "data.dataset_name: 'gpqa' is NeMo RL's GPQA, scored by its multiple-choice "
                                 "processor and environment, which nrl lacks"),
    (["data.repeat=4"], "data.repeat: is not supported for a local file; sample each problem several times with "
                        "eval.num_tests_per_prompt"),
])
def test_nemo_rl_layout_refusals_are_one_line(overrides, expected, tmp_path, model):
    proc = nrl_eval(tmp_path, NEMO_RL_LAYOUT, f"generation.model_name={model}", *overrides)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
