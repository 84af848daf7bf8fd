"""Multi-turn GRPO through ``nrl train``: every pair of training backend, sync or async rollouts,
colocated or not and data-parallel 1 or 2 is covered (async runs need their own engines, so
async-colocated does not exist), one case with sequence packing. The environment
(``tests/e2e/talking_env.py``) keeps every episode going for ``grpo.max_rollout_turns`` turns.

What each run proves end to end: every episode ran two turns with the environment's tokens in
its context; the engines' logprobs of what they sampled equal the policy's
(``train/token_mult_prob_error`` = 1), which holds only if the loss mask keeps the environment's
tokens (with no sampled logprob) out; and validation records the whole conversation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.test_grpo import assert_ok, finite, metrics, nrl_train

pytestmark = pytest.mark.slow

MEGATRON = ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
            "policy.megatron_cfg.optimizer.lr=1e-3"]
NON_COLOCATED = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=1"]
ASYNC = ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
         "loss_fn.use_importance_sampling_correction=true", "policy.generation.vllm_cfg.async_engine=true"]
CASES = {
    "dtensor-sync-colocated-dp1": [],
    "megatron-sync-colocated-dp2": [*MEGATRON, "cluster.gpus_per_node=2"],
    "dtensor-async-noncolocated-dp2-packed": [*ASYNC, *NON_COLOCATED, "cluster.gpus_per_node=3",
                                              "policy.sequence_packing.enabled=true",
                                              "policy.sequence_packing.train_mb_tokens=192",
                                              "policy.sequence_packing.logprob_mb_tokens=192"],
    "megatron-async-noncolocated-dp1": [*MEGATRON, *ASYNC, *NON_COLOCATED, "cluster.gpus_per_node=2"],
    "dtensor-sync-noncolocated-dp2": [*NON_COLOCATED, "cluster.gpus_per_node=3"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_multi_turn_grpo_runs_two_turn_episodes_with_the_environment_out_of_the_loss(case, tmp_path, model):
    env = {"NRL_PLUGINS": "tests.e2e.talking_env", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = nrl_train(tmp_path, model, "grpo.max_num_steps=1", "grpo.max_rollout_turns=2", "data.env_name=talking",
                     "grpo.val_period=1", "policy.max_total_sequence_length=96", "policy.generation.vllm_cfg.max_model_len=96",
                     "checkpointing.enabled=false", *CASES[case], env=env)
    assert_ok(proc)
    rows = [r for r in metrics(tmp_path) if "train/loss" in r]
    assert len(rows) == 1 and finite(rows)
    for row in rows:
        assert row["env/multi_turn/avg_turns_per_sample"] == 2.0 and row["env/multi_turn/truncation_rate"] == 0.0
        assert row["env/multi_turn/mean_env_tokens_per_sample"] > 0 and row["env/follow_ups"] == 1.0
        assert abs(row["train/token_mult_prob_error"] - 1.0) < 1e-3  # sampled tokens only in the loss
    records = [json.loads(line) for line in (tmp_path / "logs" / "val_data_step1.jsonl").read_text().splitlines()]
    assert records and all([m["role"] for m in r["messages"]] == ["assistant", "environment", "assistant"]
                           for r in records)
