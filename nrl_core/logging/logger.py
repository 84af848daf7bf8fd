"""``MetricLogger``: fans each step's metrics out to the configured sinks."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from nrl_core.contracts import MetricSink, import_object
from nrl_core.logging.console import ConsoleView
from nrl_core.logging.plot import plot_metrics
from nrl_core.logging.sinks import JsonlSink, MlflowSink, TensorBoardSink, WandbSink
from nrl_core.plugins import get_plugin_manager

logger = logging.getLogger(__name__)


class MetricLogger:
    """Built from the ``logger`` config section. ``log_step`` writes one step (every sink);
    ``close`` stops the console view and draws ``metrics.png``."""

    def __init__(self, section: Mapping[str, Any], *, total_steps: int, resume: bool = False) -> None:
        self.log_dir = Path(section["log_dir"]).expanduser()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.plot_enabled = bool(section.get("plot", True))
        self.sinks: list[MetricSink] = []
        if section.get("jsonl_enabled", True):
            self.sinks.append(JsonlSink(self.log_dir, append=resume))
        if section.get("console", True):
            self.sinks.append(ConsoleView(total_steps))
        if section.get("tensorboard_enabled"):
            self.sinks.append(TensorBoardSink(self.log_dir))
        if section.get("wandb_enabled"):
            self.sinks.append(WandbSink(self.log_dir, section.get("wandb") or {}))
        if section.get("mlflow_enabled"):
            self.sinks.append(MlflowSink(self.log_dir, section.get("mlflow") or {}))
        for spec in get_plugin_manager().metric_sinks():
            if section.get(f"{spec.name}_enabled"):
                self.sinks.append(import_object(spec.sink)(self.log_dir, section.get(spec.name) or {}))

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / "metrics.jsonl"

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> Path | None:
        for sink in self.sinks:
            sink.close()
        if self.plot_enabled and self.metrics_path.exists():
            return plot_metrics(self.metrics_path, self.log_dir / "metrics.png")
        return None
