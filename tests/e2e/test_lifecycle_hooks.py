"""Lifecycle hooks through ``nrl train sft``: a plugin named in ``NRL_PLUGINS`` sees the run start,
every step's metrics (and adds one), each published checkpoint and the end, and stops the run
early; the stopped step is checkpointed and a resume continues after it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from nrl_core.testing.tiny_models import cached_tiny_model
from tests.launch import nrl

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"


def sft(tmp: Path, *overrides: str, stop_after: int | None = None) -> subprocess.CompletedProcess[str]:
    model = cached_tiny_model("llama", size="small")
    args = [f"policy.model_name={model}", "sft.max_num_steps=4", "sft.val_period=0", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8", "data.generate.num_train=64",
            "data.generate.num_val=8", f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.save_period=1",
            "checkpointing.metric_name=null", "checkpointing.keep_top_k=null", "checkpointing.export_hf=false",
            f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false", "logger.plot=false", *overrides]
    env = {**os.environ, "NRL_PLUGINS": "tests.e2e.lifecycle_recorder", "NRL_STRICT_PLUGINS": "1",
           "NRL_TEST_EVENTS": str(tmp / "events.jsonl"), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("NRL_TEST_STOP_AFTER", None)
    env["NRL_TIMELINE"] = str(tmp / "timeline.jsonl")
    if stop_after is not None:
        env["NRL_TEST_STOP_AFTER"] = str(stop_after)
    return nrl(["train", "sft", "--config", str(CONFIG), *args], env=env, cwd=tmp, timeout=600, join_shared_ray=True)


def events(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_hooks_observe_stop_early_and_a_resume_starts_after_the_stop(tmp_path):
    first = sft(tmp_path, stop_after=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "the recorder stops after step 2" in first.stderr
    seen = events(tmp_path)
    assert [e["event"] for e in seen] == ["run_start", "step_end", "checkpoint_saved", "step_end", "checkpoint_saved",
                                          "run_end"]
    assert seen[0] == {"event": "run_start", "algorithm": "sft", "first_step": 1, "max_steps": 4,
                       "checkpoint_dir": str(tmp_path / "ckpt")}
    assert [e["step"] for e in seen if e["event"] == "step_end"] == [1, 2]
    assert all("train/loss" in e["keys"] and "recorder/step_squared" in e["keys"] for e in seen if e["event"] == "step_end")
    assert [(e["step"], e["name"], e["exists"], e["has_metrics"]) for e in seen if e["event"] == "checkpoint_saved"] == [
        (1, "step_1", True, True), (2, "step_2", True, True)]
    assert seen[-1] == {"event": "run_end", "status": "stopped", "last_step": 2, "outputs": ["checkpoints", "metrics"]}
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["recorder/step_squared"] for row in rows] == [1.0, 4.0]
    # SFT never asks for reference logprobs (AlgorithmSpec.reference_policy): its worker keeps no
    # copy of the initial weights, as DPO's does (tests/e2e/test_dpo.py)
    marks = [json.loads(line)["event"] for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert "model_loaded" in marks and "reference_kept" not in marks

    (tmp_path / "events.jsonl").unlink()
    resumed = sft(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    seen = events(tmp_path)
    assert seen[0]["first_step"] == 3
    assert [e["step"] for e in seen if e["event"] == "step_end"] == [3, 4]
    assert seen[-1]["status"] == "completed" and seen[-1]["last_step"] == 4


def test_a_lifecycle_plugin_that_fails_to_import_is_named(tmp_path):
    env = {**os.environ, "NRL_PLUGINS": "no_such_lifecycle_module", "NRL_STRICT_PLUGINS": "0"}
    proc = nrl(["plugins"], env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0
    assert ("plugin 'no_such_lifecycle_module' (named in NRL_PLUGINS) failed to load: ModuleNotFoundError"
            in proc.stderr)
