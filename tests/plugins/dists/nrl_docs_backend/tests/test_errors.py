"""The docs backend's one-line errors for bad input that the conformance kit does not cover."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.errors import ConfigError, NrlError
from nrl_docs_backend import checkpoint
from nrl_docs_backend.checks import check_config

REPO = Path(__file__).resolve().parents[5]


def _policy(**changes):
    policy = {"optimizer": {"name": "torch.optim.AdamW", "kwargs": {}}, "scheduler": None}
    policy.update(changes)
    return {"policy": policy}


def test_valid_optimizer_passes():
    check_config(_policy(optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}}))


@pytest.mark.parametrize("policy, key, words", [
    (_policy(optimizer=None), "policy.optimizer", "needs an optimizer"),
    (_policy(optimizer={"name": "torch.optim.Nope"}), "policy.optimizer.name", "cannot import 'torch.optim.Nope'"),
    (_policy(optimizer={"name": "torch.nn.Linear"}), "policy.optimizer.name", "not a torch.optim.Optimizer"),
    (_policy(scheduler=[{"name": "torch.optim.lr_scheduler.LinearLR"}]), "policy.scheduler", "no LR schedulers"),
])
def test_config_check_refuses_in_one_line(policy, key, words):
    with pytest.raises(ConfigError) as info:
        check_config(policy)
    assert info.value.key_path == key and words in str(info.value) and "\n" not in str(info.value)


def test_the_core_runs_the_check_for_the_selected_backend():
    """Through `nrl config check`, so the spec's config_check path is the one the core imports."""
    nrl = Path(sys.executable).parent / "nrl"
    result = subprocess.run([str(nrl), "config", "check", str(REPO / "examples/configs/minimal/minimal.yaml"),
                             "policy.docs_cfg.enabled=true", "policy.scheduler=[{name: x}]"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: policy.scheduler: the docs backend has no LR")


def test_foreign_and_corrupt_checkpoints_are_one_line(tmp_path):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / checkpoint.META).write_text(json.dumps({"format": "someone-else/3", "files": {}}))
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / checkpoint.WEIGHTS).write_bytes(b"not safetensors")
    (tmp_path / "corrupt" / checkpoint.STATE).write_bytes(b"not a torch file")
    (tmp_path / "corrupt" / checkpoint.META).write_text(json.dumps(
        {"format": checkpoint.FORMAT, "files": {checkpoint.WEIGHTS: 15, checkpoint.STATE: 16}}))
    for name, words in [("foreign", "is missing"), ("other", "not a docs-backend checkpoint"), ("corrupt", "is corrupt")]:
        with pytest.raises(NrlError) as info:
            checkpoint.read(str(tmp_path / name))
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
