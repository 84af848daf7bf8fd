"""GRPO through ``nrl train`` in the shapes users run. With the 1n8g recipes' twins
(tests/examples/test_recipe_twins.py: DTensor at DP=2 colocated and not, Megatron TP=2 x DP=2
colocated and not, all with the check below) this covers both training backends, colocated and
not, at data-parallel 2, Megatron tensor-parallel 2 colocated and pipeline-parallel 2 not; here
run the Megatron shapes no recipe has: DP=2 at TP=1 colocated and not, and PP=2 not colocated.

Each run trains two steps with a weight decay large enough to change the greedy answers, then
validates (greedy) after step 2 and exports the step-2 checkpoint as a Hugging Face model. The
refit check is end to end: every validation answer the engines gave after the last refit equals
HF ``generate`` with the exported weights, token for token, and differs from the answers before
training somewhere. A hang (the DP=2 colocated run used to hang in vLLM's start-up) fails the
subprocess timeout instead of blocking the suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_grpo import assert_ok, finite, metrics, nrl_train, run_nrl
from tests.vllm.helpers import hf_greedy, hf_model

pytestmark = pytest.mark.slow

MEGATRON = ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
            "policy.megatron_cfg.optimizer.lr=0.05", "policy.megatron_cfg.optimizer.min_lr=0.05",
            "policy.megatron_cfg.optimizer.weight_decay=2.0"]
NON_COLOCATED = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]
CASES = {
    "megatron-dp2-colocated": [*MEGATRON, "cluster.gpus_per_node=2"],
    "megatron-dp2-noncolocated": [*MEGATRON, "cluster.gpus_per_node=3", *NON_COLOCATED],
    "megatron-pp2-noncolocated": [*MEGATRON, "cluster.gpus_per_node=3", *NON_COLOCATED,
                                  "policy.megatron_cfg.pipeline_model_parallel_size=2"],
}
MAX_NEW_TOKENS = 8  # grpo_tiny_cpu.yaml


def val_samples(tmp: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (tmp / "logs" / f"val_data_step{step}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_shape_trains_and_refits(case, tmp_path, model):
    check_refit_after_training(tmp_path, model, ["grpo.max_num_steps=2", *CASES[case]])


def check_refit_after_training(tmp: Path, model: Path, overrides: list[str], config: Path | None = None) -> None:
    """Run GRPO for two steps with greedy validation before and after and the step-2 HF export; the
    engines' greedy answers after the last refit must be HF ``generate``'s with the exported weights."""
    tail = ["grpo.max_num_steps=2", "grpo.val_at_start=true", "grpo.val_period=2", "policy.generation.val_temperature=0",
            "checkpointing.enabled=true",
            "checkpointing.save_period=2", "checkpointing.export_hf=true", "checkpointing.metric_name=null"]
    proc = nrl_train(tmp, model, *overrides, *tail) if config is None else \
        run_nrl(tmp, config, "grpo", [*overrides, *tail])
    assert_ok(proc)
    rows = metrics(tmp)
    assert [r["step"] for r in rows] == [0, 1, 2] and finite(rows)
    assert all(abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3 for r in rows[1:])  # engines = policy
    before, after = val_samples(tmp, 0), val_samples(tmp, 2)
    assert {s["weight_version"] for s in after} == {2}  # refit before step 2's rollouts and before validation
    prompts = [s["prompt_token_ids"] for s in after]
    exported = hf_greedy(hf_model(tmp / "ckpt" / "hf_export"), prompts, max_new_tokens=MAX_NEW_TOKENS)
    assert [s["response_token_ids"] for s in after] == exported
    assert [s["response_token_ids"] for s in before] != exported, "training should have changed the greedy answers"
