"""The ``dpo`` config section (NeMo RL's ``examples/configs/dpo.yaml`` keys and defaults) and the
checks DPO needs of the rest of the config. Self-contained (it imports only the schema types), so
the config package can attach it without importing the algorithm."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.errors import ConfigError
from nrl_core.schema import Field, Section

NUMBER = (int, float)

DPO_SCHEMA = Section(doc="Direct Preference Optimization (NeMo RL's names and meaning). policy.train_global_batch_size "
                         "and train_micro_batch_size count preference pairs; the model sees twice as many sequences.",
                     fields={
    "max_num_epochs": Field(type=int, default=1, minimum=1),
    "max_num_steps": Field(type=int, default=150, minimum=1),
    "val_period": Field(type=int, default=25, doc="validate every N steps; 0 or less never (NeMo RL uses -1)"),
    "val_batches": Field(type=int, default=8, minimum=0, doc="validation batches per validation; 0: the whole set"),
    "val_global_batch_size": Field(type=int, default=8, minimum=1, doc="pairs per validation batch"),
    "val_micro_batch_size": Field(type=int, default=1, minimum=1, inert=True),
    "val_at_start": Field(type=bool, default=True),
    "val_at_end": Field(type=bool, default=False),
    "seed": Field(type=int, default=42),
    "reference_policy_kl_penalty": Field(type=NUMBER, default=0.05, minimum=0, doc="beta"),
    "preference_loss_weight": Field(type=NUMBER, default=1.0, minimum=0),
    "sft_loss_weight": Field(type=NUMBER, default=0.0, minimum=0, doc="NLL of the chosen responses"),
    "preference_average_log_probs": Field(type=bool, default=False,
                                          doc="rewards are the mean, not the sum, of the token log-ratios"),
    "sft_average_log_probs": Field(type=bool, default=False, doc="the SFT term is the mean, not the sum, per response"),
})


def check_dpo(config: Mapping[str, Any]) -> None:
    """What DPO needs beyond its section: pairs must stay together in every micro-batch, which
    reordering micro-batches (dynamic batching, sequence packing) would break, as in NeMo RL."""
    policy = config["policy"]
    for key in ("dynamic_batching", "sequence_packing"):
        if policy[key]["enabled"]:
            raise ConfigError(f"policy.{key}.enabled", "DPO keeps each (chosen, rejected) pair in one micro-batch, "
                                                      "which this reordering would break; set it to false")
    if config["dpo"]["preference_loss_weight"] == 0 and config["dpo"]["sft_loss_weight"] == 0:
        raise ConfigError("dpo.preference_loss_weight", "and dpo.sft_loss_weight are both 0: nothing to train")
