"""Runs that both ``nrl eval``'s and ``nrl convert``'s tests read: training once serves both."""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core.testing.tiny_models import cached_tiny_model
from tests.e2e.test_grpo import assert_ok, nrl_train
from tests.e2e.test_grpo_matrix import MEGATRON

VAL = ["data.generate.num_val=12", "grpo.max_val_samples=12", "grpo.val_batch_size=12"]
# Two GRPO steps that change the greedy answers, checkpointed, validated greedily after the last
# step, and the last step exported as a Hugging Face model.
TWO_STEPS = ["grpo.max_num_steps=2", "checkpointing.export_hf=true", "checkpointing.metric_name=null", *VAL]


@pytest.fixture(scope="session")
def model() -> Path:
    return cached_tiny_model("llama", size="small")


@pytest.fixture(scope="session")
def dtensor_run(model, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dtensor_run")
    assert_ok(nrl_train(tmp, model, *TWO_STEPS, "policy.optimizer.kwargs.lr=0.05",
                        "policy.optimizer.kwargs.weight_decay=2.0"))
    return tmp


@pytest.fixture(scope="session")
def megatron_run(model, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("megatron_run")
    assert_ok(nrl_train(tmp, model, *MEGATRON, *TWO_STEPS, "grpo.val_period=0", "grpo.val_at_end=false"))
    return tmp
