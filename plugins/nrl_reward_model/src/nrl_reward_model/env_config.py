"""The ``env.reward_model`` section with NeMo RL's keys (``examples/configs/grpo_rm_1B.yaml``): a
policy-shaped description of the reward model, where it runs (``resources``) and how many
sequences one scoring pass takes (``batch_size``). Free of torch."""

from __future__ import annotations

from nrl_core.api import Field, Section

OPEN = dict(nullable=True, open=True)

REWARD_MODEL_ENV_SCHEMA = Section(doc="Rewards from a trained Bradley-Terry reward model (nrl-reward-model).", fields={
    "model_name": Field(type=str, default=None, nullable=True,
                        doc="the reward model: an HF *ForSequenceClassification directory (nrl train rm's export)"),
    "tokenizer": Section(fields={"name": Field(type=str, default=None, nullable=True,
                                               doc="defaults to model_name")}),
    "precision": Field(type=str, default=None, nullable=True, choices=("float32", "bfloat16", "float16")),
    "batch_size": Field(type=int, default=8, minimum=1, doc="sequences per scoring micro-batch"),
    "checkpoint_path": Field(type=str, default=None, nullable=True,
                             doc="an nrl checkpoint's policy directory to load over model_name"),
    "max_model_len": Field(type=int, default=2048, minimum=2, doc="longer conversations are cut to their end"),
    "offload_optimizer_for_logprob": Field(type=bool, default=False, inert=True),
    "processor": Field(type=str, default=None, nullable=True, inert=True),
    "resources": Section(fields={
        "gpus_per_node": Field(type=int, default=1, minimum=1, doc="reward-model workers per node (on CPU: workers)"),
        "num_nodes": Field(type=int, default=1, minimum=1),
    }),
    "reward_model_cfg": Section(fields={
        "enabled": Field(type=bool, default=True),
        "reward_model_type": Field(type=str, default="bradley_terry", choices=("bradley_terry",)),
    }),
    "dtensor_cfg": Section(**OPEN),
    "megatron_cfg": Section(**OPEN),
    "dynamic_batching": Section(**OPEN),
    "sequence_packing": Section(**OPEN),
    "max_grad_norm": Field(type=(int, float), default=None, nullable=True, inert=True),
    "generation": Section(**OPEN),
})
