"""``MetricLogger``: fans each step's metrics out to the configured sinks."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nrl_core.contracts import MetricSink, import_object
from nrl_core.errors import NrlError
from nrl_core.logging.console import ConsoleView
from nrl_core.logging.plot import plot_metrics
from nrl_core.logging.sinks import JsonlSink

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

logger = logging.getLogger(__name__)


class MetricLogger:
    """Built from the ``logger`` config section. ``log_step`` writes one step (every sink);
    ``close`` stops the console view and draws ``metrics.png``."""

    def __init__(self, section: Mapping[str, Any], *, plugins: PluginManager, total_steps: int, resume: bool = False,
                 resume_step: int | None = None) -> None:
        self.log_dir = Path(section["log_dir"]).expanduser()
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # config check saw a usable path; something changed since
            raise NrlError(f"logger.log_dir: cannot create '{self.log_dir}' ({exc.strerror}); "
                           "choose a directory you can write to") from None
        self.plot_enabled = bool(section.get("plot", True))
        self.sinks: list[MetricSink] = []
        if section.get("jsonl_enabled", True):
            self.sinks.append(JsonlSink(self.log_dir, append=resume, keep_through=resume_step))
        if section.get("console", True):
            self.sinks.append(ConsoleView(total_steps))
        for spec in plugins.metric_sinks():  # TensorBoard, W&B and MLflow among them
            if section.get(f"{spec.name}_enabled"):
                self.sinks.append(import_object(spec.sink)(self.log_dir, section.get(spec.name) or {}))

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / "metrics.jsonl"

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_samples(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> Path:
        """Write ``rows`` (one JSON object each) to ``<log_dir>/<name>_step<step>.jsonl``, as NeMo RL
        writes its validation samples (``val_data_step<N>.jsonl``); returns the path."""
        path = self.log_dir / f"{name}_step{step}.jsonl"
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")  # an environment's metadata may hold any value
        return path

    def close(self) -> Path | None:
        for sink in self.sinks:
            sink.close()
        if self.plot_enabled and self.metrics_path.exists():
            return plot_metrics(self.metrics_path, self.log_dir / "metrics.png")
        return None
