"""The schema of ``policy.dtensor_config`` (NeMo RL's ``policy.dtensor_cfg``).

Kept apart from the worker so that validating a config never imports torch.
"""

from __future__ import annotations

from nrl_core.api import Field, Section

LORA_SCHEMA = Section(doc="LoRA adapters (NeMo RL's keys), with Hugging Face PEFT (docs/lora.md).", fields={
    "enabled": Field(type=bool, default=False, doc="train LoRA adapters instead of the full weights"),
    "target_modules": Field(type=list, default=[], doc="module names (a name's last parts, or globs with *) that "
                                                      "get adapters; ignored when match_all_linear is true"),
    "exclude_modules": Field(type=list, default=[], doc="module names (or globs) never given an adapter"),
    "match_all_linear": Field(type=bool, default=True, doc="every linear layer but the output head"),
    "dim": Field(type=int, default=8, minimum=1, doc="the rank r"),
    "alpha": Field(type=(int, float), default=32, doc="scale: the adapter adds alpha/dim * B @ A"),
    "dropout": Field(type=float, default=0.0, minimum=0, doc="dropout on the adapter's input while training"),
    "dropout_position": Field(type=str, default="post", choices=("pre", "post"),
                              doc="PEFT drops the adapter's input ('pre'); 'post' is refused unless dropout is 0"),
    "lora_A_init": Field(type=str, default="xavier", choices=("xavier", "uniform"),
                         doc="xavier: Xavier-uniform A; uniform: PEFT's Kaiming-uniform A; B starts at zero"),
    "use_triton": Field(type=bool, default=True, inert=True, doc="NeMo RL's Triton LoRA kernels"),
    "export": Field(type=str, default="adapter", choices=("adapter", "merged"),
                    doc="nrl's: the HF export is a PEFT adapter (adapter_config.json, adapter_model.safetensors) "
                        "or the base model with the adapters merged in"),
})

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
        "lora_cfg": LORA_SCHEMA,
        "_v2": Field(type=bool, default=True, inert=True, doc="NeMo RL worker version switch"),
        "clear_cache_every_n_steps": Field(type=int, default=None, nullable=True, inert=True,
                                           doc="NeMo RL CUDA cache clearing period"),
        "env_vars": Field(type=dict, default=None, nullable=True, inert=True, doc="NeMo RL per-worker env vars"),
    },
)
