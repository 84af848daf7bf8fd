"""DPO through ``nrl train dpo`` as a user runs it: both training backends take the same steps,
and the tiny CPU recipe learns its preferences.

Backends: the DTensor recipe at one data-parallel rank with one micro-batch of 32 pairs, the
Megatron recipe (same optimizer in Megatron's spelling) at two data-parallel ranks with micro-batches
of 8 pairs, so pairs cross the data-parallel split and the micro-batch split. From the same
weights and data the two agree on every step's loss and metrics within 1e-5 relative (float32:
different kernels and reduction orders; measured differences are below 1e-6 on the losses and
1e-5 on the rewards). Step 1 is exactly log 2 on both (policy = reference: every reward is 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_grpo import TIMING, assert_ok, finite, metrics, run_nrl

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "configs" / "recipes" / "llm"
COMPARED = ("loss", "preference_loss", "sft_loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean",
            "num_valid_samples")


def train_dpo(tmp: Path, model: Path, backend: str, *overrides: str) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    proc = run_nrl(tmp, RECIPES / f"dpo-tinyllama-1n1cpu-{backend}.yaml", "dpo",
                   [f"policy.model_name={model}", "checkpointing.enabled=false", *overrides],
                   env={"NRL_TIMELINE": str(tmp / "timeline.jsonl")})
    assert_ok(proc)
    rows = metrics(tmp)
    assert finite(rows)
    return rows


def kept_references(run: Path) -> set[int]:
    """The ranks whose worker took a copy of the reference weights (their timeline marks)."""
    events = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    return {e["rank"] for e in events if e["event"] == "reference_kept"}


def test_dtensor_and_megatron_take_the_same_dpo_steps(tmp_path, model):
    """Three steps on each backend agree; and on Megatron, a run that finished after one step
    (validating at its end) and is then extended to three takes steps 2 and 3 exactly as the
    unbroken run did."""
    steps = ["dpo.max_num_steps=3", "dpo.val_at_start=false", "dpo.val_period=0", "data.shuffle=false",
             "dpo.sft_loss_weight=0.1"]
    on_megatron = ["cluster.gpus_per_node=2", "policy.train_micro_batch_size=8"]
    dtensor = train_dpo(tmp_path / "dtensor", model, "dtensor", *steps)
    megatron = train_dpo(tmp_path / "megatron", model, "megatron", *steps, *on_megatron)
    assert [r["step"] for r in dtensor] == [r["step"] for r in megatron] == [1, 2, 3]
    assert dtensor[0]["train/preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for d, m in zip(dtensor, megatron):
        for key in COMPARED:
            assert m[f"train/{key}"] == pytest.approx(d[f"train/{key}"], rel=1e-5, abs=1e-5), (d["step"], key)
    assert dtensor[-1]["train/loss"] < dtensor[0]["train/loss"]
    # DPO scores with the reference policy: each rank of either backend keeps its weights
    assert kept_references(tmp_path / "dtensor") == {0}
    assert kept_references(tmp_path / "megatron") == {0, 1}
    extended = tmp_path / "extended"
    saved = ["checkpointing.enabled=true", "dpo.val_at_end=true"]
    finished = train_dpo(extended, model, "megatron", *steps, *on_megatron, *saved, "dpo.max_num_steps=1")
    assert "val/loss" in finished[0]
    rows = train_dpo(extended, model, "megatron", *steps, *on_megatron, *saved)
    trained = lambda row: {k: v for k, v in row.items() if k.startswith("train/") and not k.startswith(TIMING)}  # noqa: E731
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [trained(r) for r in rows[1:]] == [trained(r) for r in megatron[1:]]


def test_tiny_cpu_recipe_learns_its_preferences(tmp_path, model):
    rows = train_dpo(tmp_path, model, "dtensor", "dpo.max_num_steps=20", "dpo.val_period=10")
    val = [r for r in rows if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 10, 20]
    assert val[0]["val/accuracy"] == 0.0  # policy = reference: no pair is preferred yet
    assert val[-1]["val/accuracy"] >= 0.8, [r["val/accuracy"] for r in val]  # held-out pairs
    assert val[-1]["val/loss"] < math.log(2) - 0.2
    assert val[-1]["val/rewards_chosen_mean"] > val[-1]["val/rewards_rejected_mean"]
