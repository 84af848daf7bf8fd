"""Metric logging writes metrics.jsonl per step, TensorBoard events and the end-of-run plot."""

from __future__ import annotations

import json

import pytest

from nrl_core.errors import NrlError
from nrl_core.logging import MetricLogger
from nrl_core.plugins import get_plugin_manager


def _section(tmp_path, **overrides):
    return {"log_dir": str(tmp_path / "logs"), "console": True, "jsonl_enabled": True, "tensorboard_enabled": True,
            "wandb_enabled": False, "mlflow_enabled": False, "plot": True, **overrides}


def test_one_jsonl_object_per_step_and_a_plot(tmp_path):
    metrics_logger = MetricLogger(_section(tmp_path), plugins=get_plugin_manager(), total_steps=3)
    for step in (1, 2, 3):
        metrics_logger.log_step(step, {"train/reward": 0.1 * step, "train/loss": 1.0 / step, "timing/generation": 0.5})
    png = metrics_logger.close()
    rows = [json.loads(line) for line in metrics_logger.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1] == {"step": 2, "train/reward": pytest.approx(0.2), "train/loss": 0.5, "timing/generation": 0.5}
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((tmp_path / "logs" / "tensorboard").iterdir())


def test_resume_appends(tmp_path):
    first = MetricLogger(_section(tmp_path, console=False), plugins=get_plugin_manager(), total_steps=2)
    first.log_step(1, {"train/loss": 1.0})
    first.close()
    second = MetricLogger(_section(tmp_path, console=False), plugins=get_plugin_manager(), total_steps=2, resume=True)
    second.log_step(2, {"train/loss": 0.5})
    second.close()
    assert [json.loads(x)["step"] for x in second.metrics_path.read_text().splitlines()] == [1, 2]


def test_enabled_but_missing_wandb_is_one_line(tmp_path):
    try:  # wandb is deliberately not part of the pinned stack
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    with pytest.raises(NrlError, match="logger.wandb_enabled: is true but 'wandb' is not installed"):
        MetricLogger(_section(tmp_path, wandb_enabled=True), plugins=get_plugin_manager(), total_steps=1)


def test_a_log_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NrlError, match=r"^logger.log_dir: cannot create '.*a_file/logs' \(Not a directory\)"):
        MetricLogger(_section(tmp_path, log_dir=str(tmp_path / "a_file" / "logs")), plugins=get_plugin_manager(), total_steps=1)


def test_resume_cuts_metrics_back_to_the_resumed_step(tmp_path):
    first = MetricLogger(_section(tmp_path, console=False), plugins=get_plugin_manager(), total_steps=4)
    for step in (1, 2, 3):  # the checkpoint was at step 2; step 3 was logged, then the run was killed
        first.log_step(step, {"train/loss": 1.0 / step})
    first.close()
    with open(first.metrics_path, "a") as torn:
        torn.write('{"step": 4, "train/lo')
    second = MetricLogger(_section(tmp_path, console=False), plugins=get_plugin_manager(), total_steps=4, resume_step=2)
    for step in (3, 4):
        second.log_step(step, {"train/loss": 0.1})
    second.close()
    rows = [json.loads(x) for x in second.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["train/loss"] == 0.1
