"""Who holds the device when training and generation share it (colocated generation).

NeMo RL's hand-off, in one object: before a refit the training state makes room (optimizer state
and gradients off the device), after the refit the weights leave too when
``policy.generation.colocated.offload_weights`` says so, and after generating everything comes back.
Each move happens once however often it is asked for, so callers say what they are about to do,
not what state the workers are in.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class Holder(Enum):
    TRAINING = "training"  # the training state is on the device
    REFIT = "refit"  # optimizer state and gradients are off; the weights are still there for the refit
    GENERATION = "generation"  # the weights are off too: the engines have the device


class DeviceHandOff:
    """The colocated policy's side of the hand-off; ``policy`` offers the three moves of
    :class:`~nrl_core.contracts.TrainingWorker` (offload before and after a refit, prepare)."""

    def __init__(self, policy: Any, *, offload_weights: bool) -> None:
        self.policy = policy
        self.offload_weights = offload_weights
        self.holder = Holder.TRAINING

    def before_refit(self) -> None:
        """The engines are about to take weights: move what neither needs off the device."""
        if self.holder is Holder.TRAINING:
            self.policy.offload_before_refit()
            self.holder = Holder.REFIT

    def before_generation(self) -> None:
        """The engines hold the weights now: the training copy leaves too, when configured."""
        self.before_refit()
        if self.offload_weights and self.holder is Holder.REFIT:
            self.policy.offload_after_refit()
            self.holder = Holder.GENERATION

    def before_training(self) -> None:
        """The engines released the device: bring the training state back."""
        self.policy.prepare_for_training()
        self.holder = Holder.TRAINING
