"""``nrl convert checkpoint``: an nrl training checkpoint of either backend as a Hugging Face model,
checked against the checkpoint's logprobs; bad input is one line and writes nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_grpo import assert_ok
from tests.launch import nrl

pytestmark = pytest.mark.slow


@pytest.fixture(params=["dtensor", "megatron"])
def run(request) -> Path:
    """Either backend's two GRPO steps, checkpointed, and the last step's HF export (conftest)."""
    return request.getfixturevalue(f"{request.param}_run")


def nrl_convert(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NRL_STRICT_PLUGINS": "1"}
    return nrl(["convert", "checkpoint", *args], env=env, cwd=cwd, timeout=600, join_shared_ray=True)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_checkpoint_converts_to_the_model_the_run_exported(run, tmp_path, model):
    proc = nrl_convert(tmp_path, str(run / "ckpt"), "--out", str(tmp_path / "hf"))
    assert_ok(proc)
    assert "from" in proc.stdout and "step_2" in proc.stdout and "within" in proc.stdout
    converted, exported, base = weights(tmp_path / "hf"), weights(run / "ckpt" / "hf_export"), weights(model)
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[k], exported[k]) for k in converted)
    assert any(not torch.equal(converted[k], base[k]) for k in converted if k in base)  # trained weights
    assert (tmp_path / "hf" / "tokenizer.json").is_file() or (tmp_path / "hf" / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob(".tmp_*"))


def test_bad_input_is_one_line_and_writes_nothing(run, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [
        ([str(tmp_path), "--out", str(tmp_path / "a")], "not an nrl checkpoint"),
        ([str(run / "ckpt"), "--out", str(taken)], "exists and is not empty"),
    ]
    for args, expected in cases:
        proc = nrl_convert(tmp_path, *args)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert (taken / "keep.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_a_corrupted_checkpoint_is_one_line(run, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(run / "ckpt" / "step_2", copy / "step_2")
    shard = max((p for p in (copy / "step_2" / "policy").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = nrl_convert(tmp_path, str(copy / "step_2"), "--out", str(tmp_path / "hf"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and shard.name in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "hf").exists()
