"""The issue's divergence repro end to end: ``nrl train sft`` with a diverging learning rate stops with exit 2 and one
line from the worker, and no checkpoint holds the non-finite state."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nrl_core.checkpoint.manager import CheckpointManager
from nrl_core.testing.tiny_models import cached_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_diverging_sft_exits_2_before_any_nonfinite_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nrl_core.cli", "train", "sft", "--config",
           str(REPO / "examples/configs/sft_tiny_cpu.yaml"), f"policy.model_name={cached_tiny_model('llama')}",
           f"checkpointing.checkpoint_dir={out}", f"logger.log_dir={out}/logs", "logger.plot=false",
           "policy.optimizer.kwargs.lr=1.0e30", "sft.max_num_steps=6", "checkpointing.save_period=1",
           "checkpointing.export_hf=false", "sft.val_period=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "NRL_STRICT_PLUGINS": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "(dtensor): non-finite" in errors[0] and "policy.check_for_nan" in errors[0]
    step = int(errors[0].split("training step ")[1].split(" ")[0])
    manager = CheckpointManager({"enabled": True, "checkpoint_dir": str(out), "save_period": 1})
    saved = manager.checkpoints()
    assert saved and saved[-1].name == f"step_{step - 1}"  # keep_top_k=1 in the recipe prunes older ones
    for path in saved:
        manager.verify(path)
        assert all(math.isfinite(v) for v in manager.load_info(path)["metrics"].values())
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step))
