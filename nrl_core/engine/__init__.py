"""Training backends as engine primitives: a backend writes a forward over one micro-batch and an
optimizer step, and :class:`TrainingEngine` writes the rest of the training-worker contract."""

from nrl_core.engine.micro_batches import KINDS, ForwardRequest, MicroBatch, plan_micro_batches, token_budget
from nrl_core.engine.worker import Consume, TrainingEngine

__all__ = ["KINDS", "Consume", "ForwardRequest", "MicroBatch", "TrainingEngine", "plan_micro_batches", "token_budget"]
