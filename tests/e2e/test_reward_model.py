"""Reward models through ``nrl`` as a user runs them (nrl-reward-model).

``nrl train rm`` trains a Bradley-Terry model from the tiny Llama on generated arithmetic
preference pairs: its held-out preference accuracy reaches 0.8, a run resumed from its checkpoint
continues bit-exactly, and its HF export is a sequence classifier that ranks the held-out pairs as
the run did. GRPO scored by that model (``env.reward_model``, a worker group of its own) raises the
reward it gives.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nrl_core.testing.tiny_models import cached_tiny_model
from tests.e2e.test_grpo import TIMING, assert_ok, cached_export, finite, metrics, run_nrl

pytest.importorskip("nrl_reward_model")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RM = REPO / "examples" / "configs" / "rm_tiny_cpu.yaml"
GRPO_RM = REPO / "examples" / "configs" / "grpo_rm_tiny_cpu.yaml"
MEGATRON = REPO / "examples" / "configs" / "recipes" / "llm" / "rm-tinyllama-1n2cpu-megatron.yaml"
TRAINING = ["rm.max_num_steps=30", "rm.val_period=10", "checkpointing.save_period=10",
            "checkpointing.export_hf=true", "policy.dtensor_config.load_rng=true"]


def run(tmp: Path, config: Path, algorithm: str, *overrides: str) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    assert_ok(run_nrl(tmp, config, algorithm, [f"policy.model_name={cached_tiny_model('llama', 'small')}",
                                               *overrides]))
    rows = metrics(tmp)
    assert finite(rows)
    return rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The tiny recipe on DTensor: 30 steps, validated and checkpointed every 10, the best exported."""
    tmp = tmp_path_factory.mktemp("rm")
    run(tmp, RM, "rm", *TRAINING)
    return tmp


@pytest.mark.quick  # the algorithm's run in the quick tier
def test_the_reward_model_ranks_held_out_pairs(trained):
    val = [r for r in metrics(trained) if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 10, 20, 30]
    assert val[-1]["val/accuracy"] >= 0.8 and val[-1]["val/loss"] < val[0]["val/loss"], val
    assert val[-1]["val/rewards_chosen_mean"] > val[-1]["val/rewards_rejected_mean"]


def test_resuming_from_a_checkpoint_reproduces_the_next_step(trained, tmp_path):
    shutil.copytree(trained / "ckpt" / "step_20", tmp_path / "ckpt" / "step_20")
    resumed = run(tmp_path, RM, "rm", *TRAINING[1:], "rm.max_num_steps=21", "rm.val_at_start=false")
    assert [r["step"] for r in resumed] == [21]
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith(TIMING)}  # noqa: E731
    assert strip(resumed[0]) == strip(next(r for r in metrics(trained) if r["step"] == 21))


def test_the_export_is_an_hf_sequence_classifier_that_ranks_as_the_run_did(trained):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from nrl_core.data.preference import arithmetic_preference_splits, parse_preference, tokenize_preference

    export = trained / "ckpt" / "hf_export"
    model = AutoModelForSequenceClassification.from_pretrained(str(export)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    _, val = arithmetic_preference_splits(distractor="operand", num_train=640, num_val=128, min_operand=0,
                                          max_operand=19, ops=["+", "-"], seed=0)
    wins = 0
    for i, record in enumerate(val):
        pair = tokenize_preference(i, *parse_preference(record, "val"), tokenizer, use_chat_template=True)
        with torch.no_grad():
            chosen, rejected = (float(model(input_ids=torch.tensor([side.prompt_ids + side.response_ids])).logits)
                                for side in (pair.chosen, pair.rejected))
        wins += chosen > rejected
    best = max(r["val/accuracy"] for r in metrics(trained) if "val/accuracy" in r)
    assert wins / len(val) == pytest.approx(best, abs=1 / len(val))  # the exported checkpoint is the best one


def test_grpo_scored_by_the_reward_model_raises_its_reward(trained, tmp_path):
    rows = run(tmp_path, GRPO_RM, "grpo", f"env.reward_model.model_name={trained / 'ckpt' / 'hf_export'}",
               "grpo.max_num_steps=20", "checkpointing.enabled=false")
    val = [r["val/reward"] for r in rows if "val/reward" in r]
    assert len(val) == 3 and val[-1] > val[0] + 1.0, val
    train = [r["train/reward"] for r in rows if "train/reward" in r]
    assert sum(train[-5:]) > sum(train[:5]), train


def test_megatron_at_two_data_parallel_ranks_scores_the_export_as_dtensor_did_and_trains(trained, tmp_path):
    """The Megatron recipe (value head in place of its output layer, two data-parallel ranks) started
    from the DTensor run's export: its step-0 validation is that checkpoint's (float32, other
    kernels: 1e-5), and its steps train."""
    export = trained / "ckpt" / "hf_export"
    rows = run(tmp_path, MEGATRON, "rm", f"policy.model_name={export}", "rm.max_num_steps=4", "rm.val_period=4",
               "checkpointing.enabled=false")
    best = max((r for r in metrics(trained) if "val/accuracy" in r), key=lambda r: r["val/accuracy"])
    assert rows[0]["step"] == 0
    assert rows[0]["val/accuracy"] == best["val/accuracy"]
    assert rows[0]["val/loss"] == pytest.approx(best["val/loss"], rel=1e-5)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert rows[-1]["val/loss"] < 1.0


def reward_model_export() -> Path:
    """The tiny recipe's reward model (30 steps), exported once per cache directory: what other
    algorithms' tests score with (PPO's)."""
    base = cached_tiny_model("llama", "small")
    return cached_export("reward-model", [str(base), TRAINING, RM.read_text()],
                         lambda work: run(work, RM, "rm", *TRAINING, "checkpointing.save_period=30"))
