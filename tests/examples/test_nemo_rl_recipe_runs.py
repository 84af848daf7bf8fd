"""NeMo RL's own grpo_math_1B.yaml, unmodified, trains: its data layout (OpenMathInstruct-2 with 5%
held out for validation, cot.txt, math_hf_data_processor, the math environment) read from a local
stand-in with the hub dataset's columns, at CPU scale: the overrides name a tiny model, small sizes,
the stand-in and a copy of cot.txt, and validate once at the start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_grpo import assert_ok, metrics, run_nrl
from tests.plugins.test_data_nemo_rl import COT, cot_rendered, write_stand_in

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parent / "nemo_rl_configs" / "configs" / "grpo_math_1B.yaml"


def samples(tmp: Path, kind: str, step: int) -> list[dict]:
    return [json.loads(line) for line in (tmp / "logs" / f"{kind}_data_step{step}.jsonl").read_text().splitlines()]


def test_grpo_math_1b_trains_on_its_dataset_and_validates_on_the_share_it_holds_out(tmp_path):
    import datasets
    from transformers import AutoTokenizer

    from nrl_core.testing.tiny_models import cached_tiny_model

    # the columns of nvidia/OpenMathInstruct-2 (NeMo RL reads problem and expected_answer)
    rows = [{"problem": f"{a}+{b}", "generated_solution": f"{a}+{b}={a + b}", "expected_answer": str(a + b),
             "problem_source": "augmented_math"} for a in range(6) for b in range(10)]
    stand_in = write_stand_in(tmp_path / "openmathinstruct2.parquet", rows)
    cot = tmp_path / "cot.txt"
    cot.write_text(COT)
    held_out = datasets.Dataset.from_list(rows).train_test_split(test_size=0.05, seed=42)["test"]["problem"]
    model = cached_tiny_model("llama", size="small")
    proc = run_nrl(tmp_path, RECIPE, "grpo", [
        f"policy.model_name={model}", "cluster.gpus_per_node=2", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=2", "policy.logprob_batch_size=2", "policy.max_total_sequence_length=512",
        "policy.precision=float32", "logger.wandb_enabled=false", "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=1", "grpo.val_at_start=true", "grpo.val_period=0",
        "grpo.max_val_samples=4", "grpo.val_batch_size=4", "policy.generation.max_new_tokens=8",
        "policy.generation.vllm_cfg.enforce_eager=true", "++env.math.num_workers=1", "checkpointing.enabled=false",
        f"data.train.data_path={stand_in}", f"data.default.prompt_file={cot}"])
    assert_ok(proc)
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1]
    val = samples(tmp_path, "val", 0)
    assert [s["prompt"] for s in val] == [cot_rendered(p) for p in held_out]  # 3 of 60, NeMo RL's 5%
    tokenizer = AutoTokenizer.from_pretrained(model)
    kept = {tuple(tokenizer(cot_rendered(r["problem"]), add_special_tokens=False)["input_ids"])
            for r in rows if r["problem"] not in held_out}
    trained = {tuple(s["prompt_token_ids"]) for s in samples(tmp_path, "train", 1)}
    assert len(trained) == 2 and trained <= kept  # two prompts a step, none of them held out
