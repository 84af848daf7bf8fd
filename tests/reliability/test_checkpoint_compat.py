"""Checkpoints written before a change to a backend resume after it (see checkpoint_compat.py):
the fixtures were written by nrl-core 1.0.0's backends, before they were rebuilt on the SDK."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nrl_core.testing.distributed import run_distributed
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.reliability.checkpoint_compat import BACKENDS, FIXTURES, resume


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_from_before_resumes_exactly(backend: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip(f"nrl_backend_{backend}")
    monkeypatch.setenv("NRL_MEGATRON_CHECKPOINT_DIR", str(tmp_path / "converted"))
    checkpoint = shutil.copytree(FIXTURES / backend / "checkpoint", tmp_path / "checkpoint")
    marker = checkpoint / "nrl_megatron_checkpoint.json"
    if marker.exists():  # the Megatron marker names the model's path, which differs between machines
        meta = json.loads(marker.read_text())
        marker.write_text(json.dumps({**meta, "model_name": str(cached_tiny_model("llama", size="tiny"))}))
    (result,) = run_distributed(resume, 1, backend, str(checkpoint))
    # The same weights: exactly equal on the CPU that wrote the fixture; another CPU's float32
    # kernels round differently (an AVX2-only AMD EPYC: 9.5e-7 on DTensor, 4.8e-7 on Megatron),
    # while a wrong restore moves logprobs by far more.
    assert result["logprob_gap"] <= 1e-5
    assert result["next_loss"] == pytest.approx(result["expected_next_loss"], rel=1e-6, abs=1e-7)  # optimizer, step
