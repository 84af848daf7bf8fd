"""The schema of the sections the core owns.

Key names and defaults follow NeMo RL's ``examples/configs/grpo_math_1B.yaml`` so its configs
carry over. Plugins add ``policy.<backend section>``, ``policy.generation.<engine section>`` and
``env.<name>``; see :func:`nrl_core.config.validate.build_schema`.
"""

from __future__ import annotations

from nrl_core.config.schema import Field, Section

NUMBER = (int, float)

GRPO = Section(doc="GRPO algorithm settings (NeMo RL's names and meaning).", fields={
    "num_prompts_per_step": Field(type=int, default=32, doc="distinct prompts per step"),
    "num_generations_per_prompt": Field(type=int, default=16, doc="responses per prompt (the group)"),
    "max_rollout_turns": Field(type=int, default=1, doc="turns per rollout; nrl runs single-turn", choices=(1,)),
    "max_num_epochs": Field(type=int, default=1),
    "max_num_steps": Field(type=int, default=1000000),
    "normalize_rewards": Field(type=bool, default=True, doc="divide advantages by the group's reward std"),
    "use_leave_one_out_baseline": Field(type=bool, default=True),
    "val_period": Field(type=int, default=10, doc="validate every N steps; 0 never"),
    "val_at_start": Field(type=bool, default=False),
    "val_at_end": Field(type=bool, default=False),
    "overlong_filtering": Field(type=bool, default=False, doc="zero the loss of truncated responses"),
    "max_val_samples": Field(type=int, default=256),
    "val_batch_size": Field(type=int, default=256),
    "seed": Field(type=int, default=42),
    "async_grpo": Section(fields={
        "enabled": Field(type=bool, default=False, inert=True),
        "max_trajectory_age_steps": Field(type=int, default=1, inert=True),
    }),
})

SFT = Section(doc="Supervised fine-tuning settings.", fields={
    "max_num_epochs": Field(type=int, default=1),
    "max_num_steps": Field(type=int, default=100),
    "val_period": Field(type=int, default=10),
    "val_batches": Field(type=int, default=8),
    "val_global_batch_size": Field(type=int, default=32),
    "val_micro_batch_size": Field(type=int, default=1),
    "val_at_start": Field(type=bool, default=False),
    "seed": Field(type=int, default=42),
})

ALGORITHM = Section(doc="The short form from the backend documentation; mapped onto policy batch sizes.", fields={
    "batch_size": Field(type=int, default=None, nullable=True, doc="sequences per data-parallel rank per micro-batch"),
    "gradient_accumulation_steps": Field(type=int, default=None, nullable=True),
})

LOSS_FN = Section(doc="Clipped policy-gradient loss (GRPO).", fields={
    "reference_policy_kl_penalty": Field(type=NUMBER, default=0.01),
    "reference_policy_kl_type": Field(type=str, default="k3", choices=("k1", "k2", "k3")),
    "kl_input_clamp_value": Field(type=NUMBER, default=20.0, nullable=True),
    "kl_output_clamp_value": Field(type=NUMBER, default=10.0, nullable=True),
    "ratio_clip_min": Field(type=NUMBER, default=0.2),
    "ratio_clip_max": Field(type=NUMBER, default=0.2),
    "ratio_clip_c": Field(type=NUMBER, default=None, nullable=True, doc="dual-clip constant (> 1) or null"),
    "use_on_policy_kl_approximation": Field(type=bool, default=False),
    "use_importance_sampling_correction": Field(type=bool, default=False),
    "truncated_importance_sampling_ratio": Field(type=NUMBER, default=None, nullable=True),
    "token_level_loss": Field(type=bool, default=True),
    "sequence_level_importance_ratios": Field(type=bool, default=False, doc="GSPO"),
})

OPTIMIZER = Section(nullable=True, doc="torch optimizer by import name (DTensor backend).", fields={
    "name": Field(type=str, default="torch.optim.AdamW"),
    "kwargs": Section(open=True),
})

SEQUENCE_PACKING = Section(fields={
    "enabled": Field(type=bool, default=False),
    "train_mb_tokens": Field(type=int, default=None, nullable=True, doc="token budget of a packed training micro-batch"),
    "logprob_mb_tokens": Field(type=int, default=None, nullable=True),
    "algorithm": Field(type=str, default="modified_first_fit_decreasing",
                       choices=("modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle")),
    "sequence_length_round": Field(type=int, default=64),
})

DYNAMIC_BATCHING = Section(fields={
    "enabled": Field(type=bool, default=False),
    "train_mb_tokens": Field(type=int, default=None, nullable=True),
    "logprob_mb_tokens": Field(type=int, default=None, nullable=True),
    "sequence_length_round": Field(type=int, default=64),
})

RESOURCES = Section(fields={
    "gpus_per_node": Field(type=int, default=None, nullable=True),
    "num_nodes": Field(type=int, default=None, nullable=True),
    "num_workers": Field(type=int, default=1, doc="generation workers when not colocated (CPU)"),
})

GENERATION = Section(nullable=True, doc="Rollout generation; null for algorithms that do not generate.", fields={
    "backend": Field(type=str, default="vllm", doc="a generation backend's name (nrl plugins lists them)"),
    "max_new_tokens": Field(type=int, default=512),
    "temperature": Field(type=NUMBER, default=1.0),
    "top_p": Field(type=NUMBER, default=1.0),
    "top_k": Field(type=int, default=None, nullable=True),
    "stop_token_ids": Field(type=list, default=None, nullable=True, item_type=int),
    "stop_strings": Field(type=list, default=None, nullable=True, item_type=str),
    "model_name": Field(type=str, default=None, nullable=True, inert=True),
    "colocated": Section(fields={
        "enabled": Field(type=bool, default=True, doc="share the training workers' resources"),
        "resources": RESOURCES,
    }),
})

REFIT = Section(doc="Moving trained weights into the generation engine.", fields={
    "transport": Field(type=str, default=None, nullable=True, doc="null: chosen by placement"),
    "bucket_size_mb": Field(type=NUMBER, default=256.0),
    "verify": Field(type=bool, default=True, doc="check every weight against the manifest"),
})

POLICY = Section(required=True, doc="The model being trained and how.", aliases={}, fields={
    "model_name": Field(type=str, doc="Hugging Face checkpoint directory (or hub id where a hub is reachable)"),
    "tokenizer": Section(fields={
        "name": Field(type=str, default=None, nullable=True, doc="defaults to policy.model_name"),
        "chat_template": Field(type=str, default=None, nullable=True),
    }),
    "trust_remote_code": Field(type=bool, default=False),
    "hf_config_overrides": Section(nullable=True, open=True),
    "train_global_batch_size": Field(type=int, default=32),
    "train_micro_batch_size": Field(type=int, default=4),
    "generation_batch_size": Field(type=int, default=32, inert=True),
    "logprob_batch_size": Field(type=int, default=4),
    "max_total_sequence_length": Field(type=int, default=512),
    "max_seq_length": Field(type=int, default=None, nullable=True, doc="short form: sets max_total_sequence_length"),
    "precision": Field(type=str, default="float32", choices=("float32", "bfloat16", "float16")),
    "logprob_chunk_size": Field(type=int, default=None, nullable=True),
    "make_sequence_length_divisible_by": Field(type=int, default=1),
    "max_grad_norm": Field(type=NUMBER, default=1.0, nullable=True),
    "seed": Field(type=int, default=None, nullable=True, doc="defaults to the algorithm's seed"),
    "optimizer": OPTIMIZER,
    "scheduler": Field(type=list, default=None, nullable=True, doc="NeMo RL's list of {name, kwargs} and {milestones}"),
    "sequence_packing": SEQUENCE_PACKING,
    "dynamic_batching": DYNAMIC_BATCHING,
    "generation": GENERATION,
    "refit": REFIT,
    "refit_buffer_size_gb": Field(type=NUMBER, default=None, nullable=True, doc="NeMo RL spelling of refit.bucket_size_mb"),
})

DATA = Section(fields={
    "dataset_name": Field(type=str, default=None, nullable=True, doc="a registered dataset or a local file/dir"),
    "train_data_path": Field(type=str, default=None, nullable=True),
    "val_data_path": Field(type=str, default=None, nullable=True),
    "input_key": Field(type=str, default="problem"),
    "output_key": Field(type=str, default="expected_answer"),
    "max_input_seq_length": Field(type=int, default=None, nullable=True),
    "prompt_file": Field(type=str, default=None, nullable=True),
    "system_prompt_file": Field(type=str, default=None, nullable=True),
    "use_chat_template": Field(type=bool, default=True),
    "shuffle": Field(type=bool, default=True),
    "num_workers": Field(type=int, default=1, inert=True),
    "processor": Field(type=str, default="math", doc="prompt processor name"),
    "env_name": Field(type=str, default="math", doc="environment that scores this data"),
    "generate": Section(nullable=True, open=True, doc="arguments of a built-in dataset generator"),
})

LOGGER = Section(fields={
    "log_dir": Field(type=str, default="logs"),
    "num_val_samples_to_print": Field(type=int, default=0),
    "console": Field(type=bool, default=True),
    "jsonl_enabled": Field(type=bool, default=True),
    "wandb_enabled": Field(type=bool, default=False),
    "tensorboard_enabled": Field(type=bool, default=False),
    "mlflow_enabled": Field(type=bool, default=False),
    "swanlab_enabled": Field(type=bool, default=False, inert=True),
    "monitor_gpus": Field(type=bool, default=False, inert=True),
    "plot": Field(type=bool, default=True, doc="write a PNG of reward and loss at the end"),
    "wandb": Section(open=True),
    "tensorboard": Section(open=True),
    "mlflow": Section(open=True),
    "swanlab": Section(open=True),
    "gpu_monitoring": Section(open=True),
})

CHECKPOINTING = Section(fields={
    "enabled": Field(type=bool, default=False),
    "checkpoint_dir": Field(type=str, default="results/checkpoints"),
    "metric_name": Field(type=str, default="val_reward", nullable=True),
    "higher_is_better": Field(type=bool, default=True),
    "keep_top_k": Field(type=int, default=None, nullable=True),
    "save_period": Field(type=int, default=10),
    "checkpoint_must_save_by": Field(type=str, default=None, nullable=True, inert=True),
    "export_hf": Field(type=bool, default=True, doc="export the best checkpoint as a Hugging Face model"),
})

CLUSTER = Section(doc="Where workers run. On a CPU machine gpus_per_node counts training workers per node.", fields={
    "gpus_per_node": Field(type=int, default=1),
    "num_nodes": Field(type=int, default=1),
    "ray_address": Field(type=str, default=None, nullable=True, doc="join this Ray cluster; null starts a local one"),
    "num_cpus": Field(type=int, default=None, nullable=True, doc="CPUs a local Ray may use; null: all"),
    "num_gpus": Field(type=int, default=None, nullable=True, doc="GPUs a local Ray may use; null: all"),
    "cpus_per_worker": Field(type=NUMBER, default=0.1, doc="CPU reservation per worker (small: CPUs are shared)"),
    "placement_strategy": Field(type=str, default="PACK", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")),
    "env_vars": Section(nullable=True, open=True, doc="extra environment variables for every worker"),
    "log_to_driver": Field(type=bool, default=True),
    "namespace": Field(type=str, default=None, nullable=True),
})

ENV = Section(doc="Reward environments by name; plugins add their sections.")

CORE_SCHEMA = Section(fields={
    "grpo": GRPO,
    "sft": SFT,
    "algorithm": ALGORITHM,
    "loss_fn": LOSS_FN,
    "policy": POLICY,
    "data": DATA,
    "env": ENV,
    "logger": LOGGER,
    "checkpointing": CHECKPOINTING,
    "cluster": CLUSTER,
})
