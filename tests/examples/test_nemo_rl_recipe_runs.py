"""NeMo RL's own grpo_math_1B.yaml trains through ``nrl twin``: its data layout (OpenMathInstruct-2
with 5% held out for validation, cot.txt, math_hf_data_processor, the math environment) read from
the stand-in the twin writes with the hub dataset's columns, on a tiny model of its family, with
only the twin's documented scale-down keys changed (no overrides of the test's own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_grpo import assert_ok, metrics
from tests.launch import nrl
from tests.plugins.test_data_nemo_rl import cot_rendered

pytestmark = pytest.mark.slow

CHECKOUT = Path(__file__).resolve().parent / "nemo_rl_configs"  # as a NeMo RL checkout: its prompt files resolve
RECIPE = CHECKOUT / "configs" / "grpo_math_1B.yaml"


def samples(tmp: Path, kind: str, step: int) -> list[dict]:
    return [json.loads(line) for line in (tmp / "logs" / f"{kind}_data_step{step}.jsonl").read_text().splitlines()]


def test_the_twin_of_grpo_math_1b_trains_on_its_dataset_and_validates_on_the_share_it_holds_out(tmp_path):
    import datasets
    from transformers import AutoTokenizer

    proc = nrl(["twin", str(RECIPE), "--out", str(tmp_path), "--steps", "1"], cwd=CHECKOUT, join_shared_ray=True)
    assert_ok(proc)
    twin = (tmp_path / "twin.yaml").read_text()
    assert f"defaults: {RECIPE}" in twin and "data.train.data_path: the stand-in" in twin
    assert [r["step"] for r in metrics(tmp_path)] == [1]  # validated once, at the last step
    rows = datasets.Dataset.from_parquet(str(tmp_path / "data" / "train0.parquet"))
    assert rows.column_names == ["problem", "generated_solution", "expected_answer", "problem_source"]
    held_out = rows.train_test_split(test_size=0.05, seed=42)["test"]["problem"]
    val = samples(tmp_path, "val", 1)
    assert [s["prompt"] for s in val] == [cot_rendered(p) for p in held_out]  # 8 of 160, NeMo RL's 5%
    model = next(line.split(": ", 1)[1] for line in twin.splitlines() if line.startswith("  model_name: "))
    assert "qwen2" in Path(model).name  # Qwen2.5-1.5B's family
    tokenizer = AutoTokenizer.from_pretrained(model)
    kept = {tuple(tokenizer(cot_rendered(p), add_special_tokens=False)["input_ids"])
            for p in rows["problem"] if p not in held_out}
    trained = {tuple(s["prompt_token_ids"]) for s in samples(tmp_path, "train", 1)}
    assert len(trained) == 2 and trained <= kept  # two prompts a step, none of them held out
    # the recipe's checkpointing.model_save_format: safetensors, the weights under their HF names
    [checkpoint] = (tmp_path / "checkpoints").glob("step_1/policy")
    assert list((checkpoint / "model").glob("*.safetensors")) and (checkpoint / "optim").is_dir()


def test_a_twin_with_dynamic_sampling_starts_from_its_warm_start_and_finds_groups_whose_rewards_differ(tmp_path):
    """NeMo RL's DAPO recipe for Gemma 4 keeps only prompts whose rewards differ. From the tiny
    model as built, no prompt had such rewards in ten generation batches; after the warm start
    (nrl_core/twin_warm_start.py) the twin fills its step."""
    recipe = CHECKOUT / "configs" / "recipes" / "llm" / "dapo-gemma4-e2b-it-1n8g-fsdp2-automodel.yaml"
    proc = nrl(["twin", str(recipe), "--out", str(tmp_path), "--steps", "1"], cwd=CHECKOUT, join_shared_ray=True)
    assert_ok(proc)
    warm = tmp_path / "warm_start"
    assert f"model_name: {warm / 'checkpoints' / 'hf_export'}" in (tmp_path / "twin.yaml").read_text()
    sft = [json.loads(line) for line in (warm / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert sft[-1]["step"] == 120 and sft[-1]["train/loss"] < sft[0]["train/loss"] / 5
    step, = metrics(tmp_path)
    assert step["dynamic_sampling/kept_fraction"] > 0 and 0 < step["env/accuracy"] < 1
