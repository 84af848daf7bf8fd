"""Two installed third-party training backends train colocated GRPO steps on today's core.

One is written to the first plugin contract (tests/plugins/dists/nrl_first_contract_plugin: no
memory hand-off, logprobs as a bare tensor, no ``NRL_CONTRACT``): the core adapts it (no-op
offload, the tensor wrapped into a ``BatchShard``) and its checkpoint hooks still recognise the
adapted worker. The other is the example plugin's engine backend (the smallest that passes the
whole kit), with the reference policy's KL penalty, checkpoints and the HF export."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nrl_core.contracts import CONTRACT_VERSION
from tests.e2e.test_grpo import assert_ok, finite, metrics, nrl_train
from tests.plugins.test_contract_versions import FIRST, install

pytestmark = pytest.mark.slow
EXAMPLE = "nrl_example_plugin"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("first-contract-site"), FIRST, EXAMPLE)


def test_two_colocated_grpo_steps_on_a_first_contract_backend(model, site, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = nrl_train(tmp_path, model, "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_end=false",
                     "policy.dtensor_config.enabled=false", "++policy.first_contract_cfg.enabled=true",
                     "policy.generation.colocated.enabled=true", "checkpointing.metric_name=null", env=env)
    assert_ok(proc)
    assert f"training backend 'first_contract' is written for contract 1 (this core: {CONTRACT_VERSION})" in proc.stderr
    assert "colocated generation: the training backend does not hand its memory back" in proc.stderr
    rows = [row for row in metrics(tmp_path) if "train/loss" in row]
    assert len(rows) == 2 and finite(rows)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_1", "step_2"]
    assert (tmp_path / "ckpt" / "step_2" / "policy" / "first_contract_state.pt").is_file()  # through its hooks


def test_grpo_on_the_example_engine_backend_with_the_kl_penalty_checkpoints_and_export(model, site, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = nrl_train(tmp_path, model, "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_end=false",
                     "policy.dtensor_config.enabled=false", "++policy.example_cfg.enabled=true",
                     "loss_fn.reference_policy_kl_penalty=0.05", "checkpointing.metric_name=null",
                     "checkpointing.export_hf=true", env=env)
    assert_ok(proc)
    rows = [row for row in metrics(tmp_path) if "train/loss" in row]
    assert len(rows) == 2 and finite(rows)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_1", "step_2"]
    assert (tmp_path / "ckpt" / "step_2" / "policy" / "example_state.pt").is_file()  # the example backend's own
    assert list((tmp_path / "ckpt").rglob("model.safetensors")), "no HF export"
