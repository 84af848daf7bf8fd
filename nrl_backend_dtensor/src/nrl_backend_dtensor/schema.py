"""The schema of ``policy.dtensor_config`` (NeMo RL's ``policy.dtensor_cfg``).

Kept apart from the worker so that validating a config never imports torch.
"""

from __future__ import annotations

from nrl_core.config.schema import Field, Section

DTENSOR_CONFIG_SCHEMA = Section(
    doc="FSDP2 (fully_shard) training with optional DTensor tensor parallelism.",
    fields={
        "enabled": Field(type=bool, default=False, doc="make this backend a candidate for training"),
        "cpu_offload": Field(type=bool, default=False, doc="keep sharded parameters and optimizer state on the CPU"),
        "sequence_parallel": Field(type=bool, default=False,
                                   doc="shard norms and residuals over the sequence inside tensor-parallel layers"),
        "activation_checkpointing": Field(type=bool, default=False,
                                          doc="recompute decoder-layer activations in backward"),
        "tensor_parallel_size": Field(type=int, default=1, minimum=1, doc="tensor-parallel ranks; must divide the world size"),
        "context_parallel_size": Field(type=int, default=1, minimum=1, doc="context parallelism (only 1 is supported)"),
        "custom_parallel_plan": Field(type=str, default=None, nullable=True,
                                      doc="'module:function' returning a tensor-parallel plan for a decoder layer"),
        "fully_parallel_save": Field(type=bool, default=True, doc="every rank writes its shard (else rank 0 one file)"),
        "fully_parallel_load": Field(type=bool, default=True, doc="every rank reads its shard (else rank 0 broadcasts)"),
        "async_save": Field(type=bool, default=False, doc="save in the background; waited on at the next save"),
        "load_rng": Field(type=bool, default=False, doc="save and restore RNG states for bit-identical resume"),
        "_v2": Field(type=bool, default=True, inert=True, doc="NeMo RL worker version switch"),
        "clear_cache_every_n_steps": Field(type=int, default=None, nullable=True, inert=True,
                                           doc="NeMo RL CUDA cache clearing period"),
        "env_vars": Field(type=dict, default=None, nullable=True, inert=True, doc="NeMo RL per-worker env vars"),
    },
)
