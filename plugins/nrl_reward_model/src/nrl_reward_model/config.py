"""The ``rm`` section (NeMo RL's ``examples/configs/rm.yaml`` keys and defaults) and what reward-model
training needs of the rest of the config. Free of torch: ``nrl config check`` stays fast."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import ConfigError, Field, Section

RM_SCHEMA = Section(doc="Bradley-Terry reward-model training (nrl-reward-model). policy.train_global_batch_size and "
                        "train_micro_batch_size count preference pairs; the model sees twice as many sequences.",
                    fields={
    "max_num_epochs": Field(type=int, default=1, minimum=1),
    "max_num_steps": Field(type=int, default=-1, minimum=-1,
                           doc="-1: as many as max_num_epochs allow (NeMo RL's default)"),
    "val_period": Field(type=int, default=16, doc="validate every N steps; 0 or less never (NeMo RL uses -1)"),
    "val_batches": Field(type=int, default=-1, minimum=-1, doc="validation batches per validation; -1 or 0: all"),
    "val_global_batch_size": Field(type=int, default=32, minimum=1, doc="pairs per validation batch"),
    "val_micro_batch_size": Field(type=int, default=1, minimum=1, inert=True),
    "val_at_start": Field(type=bool, default=False),
    "val_at_end": Field(type=bool, default=False),
    "seed": Field(type=int, default=42),
})


def check_rm(config: Mapping[str, Any]) -> None:
    """A reward model needs its value head (``policy.reward_model_cfg``, Bradley-Terry) and pairs kept
    whole in every micro-batch, which reordering micro-batches would break (as in NeMo RL)."""
    policy = config["policy"]
    head = policy["reward_model_cfg"]
    if not head["enabled"]:
        raise ConfigError("policy.reward_model_cfg.enabled", "reward-model training builds the model with a value "
                                                             "head; set it to true")
    if head["reward_model_type"] != "bradley_terry":
        raise ConfigError("policy.reward_model_cfg.reward_model_type",
                          f"rm trains Bradley-Terry models; got '{head['reward_model_type']}' (regression heads "
                          "are critics, trained by PPO)")
    for key in ("dynamic_batching", "sequence_packing"):
        if policy[key]["enabled"]:
            raise ConfigError(f"policy.{key}.enabled", "a reward model compares each (chosen, rejected) pair within "
                                                      "one micro-batch, which this reordering would break; set it "
                                                      "to false")
