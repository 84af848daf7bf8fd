"""GRPO through ``nrl train`` with rollouts from the hf generation backend (nrl-gen-hf), as the GPU
acceptance run uses it where vLLM cannot be installed: examples/configs/grpo_tiny_cpu_hf.yaml for
two steps, colocated (refit by reference, sleep and wake) and not (refit through shared memory
between Ray actors). The check is the matrix's: the engines' sampled-token logprobs agree with the
policy's, and every validation answer after the last refit is HF ``generate``'s with the exported
weights, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import test_grpo
from tests.e2e.test_grpo_matrix import NON_COLOCATED, check_refit_after_training

pytest.importorskip("nrl_gen_hf")
pytest.importorskip("nrl_backend_dtensor")

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny_cpu_hf.yaml"
CHANGES_WEIGHTS = ["policy.optimizer.kwargs.lr=0.05", "policy.optimizer.kwargs.weight_decay=2.0"]
CASES = {
    "colocated": [],
    "noncolocated": ["cluster.gpus_per_node=2", *NON_COLOCATED],
}


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_with_hf_rollouts_trains_and_refits(case, tmp_path, model, monkeypatch):
    monkeypatch.setattr(test_grpo, "CONFIG", CONFIG)  # the tiny run's scaling, on the hf config
    check_refit_after_training(tmp_path, model, [*CHANGES_WEIGHTS, *CASES[case]])
    info = json.loads((tmp_path / "ckpt" / "step_2" / "training_info.json").read_text())
    assert info["config"]["policy"]["generation"]["backend"] == "hf"
    assert info["generation"] and all(state["weight_version"] == 2 for state in info["generation"])
