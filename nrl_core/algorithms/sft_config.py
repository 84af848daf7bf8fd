"""SFT's config section, registered with its :class:`~nrl_core.contracts.AlgorithmSpec`."""

from __future__ import annotations

from nrl_core.schema import Field, Section

SFT = Section(doc="Supervised fine-tuning settings.", fields={
    "max_num_epochs": Field(type=int, default=1, minimum=1),
    "max_num_steps": Field(type=int, default=100, minimum=1),
    "val_period": Field(type=int, default=10, doc="validate every N steps; 0 or less never (NeMo RL uses -1)"),
    "val_batches": Field(type=int, default=8, minimum=1),
    "val_global_batch_size": Field(type=int, default=32, minimum=1),
    "val_micro_batch_size": Field(type=int, default=1, minimum=1),
    "val_at_start": Field(type=bool, default=False),
    "val_at_end": Field(type=bool, default=False, doc="validate after the last step"),
    "seed": Field(type=int, default=42),
})
