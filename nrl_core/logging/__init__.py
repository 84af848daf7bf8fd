"""Metric logging: console view, metrics.jsonl, TensorBoard, optional W&B/MLflow, plugin sinks."""

from nrl_core.logging.logger import MetricLogger

__all__ = ["MetricLogger"]
