"""Metric sinks. Each takes a step's flat ``{name: float}`` metrics; names use ``/`` to group
(``train/loss``, ``timing/generation``, ``val/accuracy``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nrl_core.errors import NrlError


class JsonlSink:
    """``metrics.jsonl``: one JSON object per step, ``{"step": N, ...metrics}``, flushed each line
    so a killed run keeps every completed step."""

    def __init__(self, log_dir: Path, *, append: bool = False, keep_through: int | None = None) -> None:
        """``append`` continues the file; ``keep_through`` (a resumed run's step) first drops the
        rows of later steps, which the interrupted run logged after its last checkpoint and the
        resumed run is about to log again."""
        self.path = log_dir / "metrics.jsonl"
        if keep_through is not None and self.path.exists():
            _truncate_after(self.path, keep_through)
        self._handle = open(self.path, "a" if append or keep_through is not None else "w")

    def log(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        row = {"step": step, **{f"{prefix}{k}": _jsonable(v) for k, v in metrics.items()}}
        self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def _truncate_after(path: Path, step: int) -> None:
    """Keep the rows of ``path`` up to ``step`` (a torn last line goes too), replacing it atomically."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class TensorBoardSink:
    """TensorBoard event files under ``<log_dir>/tensorboard`` (``logger.tensorboard_enabled``)."""

    def __init__(self, log_dir: Path, options: Mapping[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(f"{prefix}{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases, when installed and ``logger.wandb_enabled``; ``logger.wandb`` holds
    ``wandb.init`` arguments (project, name, ...)."""

    def __init__(self, log_dir: Path, options: Mapping[str, Any]) -> None:
        wandb = _optional_import("wandb", "logger.wandb_enabled")
        self._run = wandb.init(dir=str(log_dir), **dict(options))

    def log(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        self._run.log({f"{prefix}{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """MLflow, when installed and ``logger.mlflow_enabled``; ``logger.mlflow`` may name
    ``experiment_name``, ``run_name`` and ``tracking_uri``."""

    def __init__(self, log_dir: Path, options: Mapping[str, Any]) -> None:
        self._mlflow = _optional_import("mlflow", "logger.mlflow_enabled")
        if options.get("tracking_uri"):
            self._mlflow.set_tracking_uri(options["tracking_uri"])
        if options.get("experiment_name"):
            self._mlflow.set_experiment(options["experiment_name"])
        self._mlflow.start_run(run_name=options.get("run_name"))

    def log(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        clean = {f"{prefix}{k}".replace("/", "_"): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self._mlflow.log_metrics(clean, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _optional_import(module: str, key: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise NrlError(f"{key}: is true but '{module}' is not installed; pip install {module} or set it to false") from None
