"""The schema of the sections the core owns.

Key names and defaults follow NeMo RL's ``examples/configs/grpo_math_1B.yaml`` so its configs
carry over. Plugins add ``policy.<backend section>``, ``policy.generation.<engine section>`` and
``env.<name>``, and each algorithm its own top-level section (``grpo``, ``sft``: see
``nrl_core/algorithms/*_config.py``); see :func:`nrl_core.config.validate.build_schema`.
"""

from __future__ import annotations

from typing import Any

from nrl_core.errors import ConfigError
from nrl_core.schema import Field, Section, SectionList

NUMBER = (int, float)

ALGORITHM = Section(doc="The short form from the backend documentation; mapped onto policy batch sizes.", fields={
    "batch_size": Field(type=int, default=None, nullable=True, minimum=1, doc="sequences per data-parallel rank per micro-batch"),
    "gradient_accumulation_steps": Field(type=int, default=None, nullable=True, minimum=1),
})

LOSS_FN = Section(doc="The policy loss (GRPO): NeMo RL's ClippedPGLossFn keys; docs/configuration.md.", fields={
    "name": Field(type=str, default="clipped_pg", doc="the loss, from the nrl_loss_functions hook"),
    "reference_policy_kl_penalty": Field(type=NUMBER, default=0.01, minimum=0),
    "reference_policy_kl_type": Field(type=str, default="k3", choices=("k1", "k2", "k3")),
    "kl_input_clamp_value": Field(type=NUMBER, default=20.0, nullable=True, minimum=0),
    "kl_output_clamp_value": Field(type=NUMBER, default=10.0, nullable=True, minimum=0),
    "ratio_clip_min": Field(type=NUMBER, default=0.2, minimum=0),
    "ratio_clip_max": Field(type=NUMBER, default=0.2, minimum=0),
    "ratio_clip_c": Field(type=NUMBER, default=None, nullable=True, doc="dual-clip constant (> 1) or null"),
    "use_on_policy_kl_approximation": Field(type=bool, default=False),
    "use_kl_in_reward": Field(type=bool, default=False,
                              doc="the KL penalty goes into the reward (an estimator that does so, e.g. "
                                  "reinforce_plus_plus), not the loss"),
    "use_importance_sampling_correction": Field(type=bool, default=False),
    "truncated_importance_sampling_type": Field(type=str, default=None, nullable=True,
                                                choices=("tis", "icepop", "seq-mask-tis"),
                                                doc="tis: clamp the weights to [min, max]; icepop: drop tokens outside; "
                                                    "seq-mask-tis: drop sequences whose geometric-mean weight is outside"),
    "truncated_importance_sampling_ratio": Field(type=NUMBER, default=None, nullable=True, minimum=0,
                                                 doc="upper bound of the weights (with a null type: tis)"),
    "truncated_importance_sampling_ratio_min": Field(type=NUMBER, default=None, nullable=True, minimum=0,
                                                     doc="lower bound (tis: default 0)"),
    "disable_ppo_ratio": Field(type=bool, default=False, doc="REINFORCE/RLOO: -A logprobs, no ratio or clipping"),
    "use_cispo": Field(type=bool, default=False, doc="CISPO: -A sg(clip(ratio)) logprobs (token-level)"),
    "token_level_loss": Field(type=bool, default=True),
    "sequence_level_importance_ratios": Field(type=bool, default=False, doc="GSPO"),
    "force_on_policy_ratio": Field(type=bool, default=None, nullable=True,
                                   doc="take the previous-policy logprobs from the training forward (ratio exactly 1, "
                                       "no separate logprob pass); needs one optimizer step per GRPO step. null: "
                                       "whenever that holds; false: always the separate pass (NeMo RL's default)"),
})

OPTIMIZER = Section(nullable=True, doc="torch optimizer by import name (DTensor backend).", fields={
    "name": Field(type=str, default="torch.optim.AdamW"),
    "kwargs": Section(open=True),
})

SEQUENCE_PACKING = Section(fields={
    "enabled": Field(type=bool, default=False),
    "train_mb_tokens": Field(type=int, default=None, nullable=True, minimum=1, doc="token budget of a packed training micro-batch"),
    "logprob_mb_tokens": Field(type=int, default=None, nullable=True, minimum=1),
    "algorithm": Field(type=str, default="modified_first_fit_decreasing",
                       choices=("modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle")),
    "sequence_length_round": Field(type=int, default=64, minimum=1),
})

DYNAMIC_BATCHING = Section(fields={
    "enabled": Field(type=bool, default=False),
    "train_mb_tokens": Field(type=int, default=None, nullable=True, minimum=1),
    "logprob_mb_tokens": Field(type=int, default=None, nullable=True, minimum=1),
    "sequence_length_round": Field(type=int, default=64, minimum=1),
})

RESOURCES = Section(doc="What non-colocated generation takes from the cluster (NeMo RL's semantics: training gets "
                         "the rest; see nrl_core/config/topology.py).", fields={
    "gpus_per_node": Field(type=int, default=None, nullable=True, minimum=1,
                           doc="one node: devices (on CPU: workers) generation takes from it"),
    "num_nodes": Field(type=int, default=None, nullable=True, minimum=1, doc="several nodes: whole nodes generation takes"),
})

GENERATION = Section(nullable=True, doc="Rollout generation; null for algorithms that do not generate.", fields={
    "backend": Field(type=str, default="vllm", doc="a generation backend's name (nrl plugins lists them)"),
    "max_new_tokens": Field(type=int, default=512, minimum=1),
    "temperature": Field(type=NUMBER, default=1.0, minimum=0),
    "top_p": Field(type=NUMBER, default=1.0),
    "top_k": Field(type=int, default=None, nullable=True),
    "val_temperature": Field(type=NUMBER, default=None, nullable=True, minimum=0,
                             doc="validation: null or the training temperature samples as training does "
                                 "(NeMo RL); 0 is greedy"),
    "val_top_p": Field(type=NUMBER, default=None, nullable=True,
                       doc="validation: null or top_p; validation samples with training's top-p, as NeMo RL's does"),
    "val_top_k": Field(type=int, default=None, nullable=True,
                       doc="validation: null or top_k; validation samples with training's top-k, as NeMo RL's does"),
    "stop_token_ids": Field(type=list, default=None, nullable=True, item_type=int),
    "stop_strings": Field(type=list, default=None, nullable=True, item_type=str),
    "model_name": Field(type=str, default=None, nullable=True, inert=True),
    "vllm_kwargs": Section(nullable=True, open=True,
                           doc="vLLM's own engine arguments, passed as given (NeMo RL's key; the vllm backend reads "
                               "it and refuses the ones nrl sets)"),
    "colocated": Section(fields={
        "enabled": Field(type=bool, default=True, doc="share the training workers' resources"),
        "offload_weights": Field(type=bool, default=True,
                                 doc="colocated: move the policy's weights off the device while the engines "
                                     "generate (optimizer state and gradients always move)"),
        "resources": RESOURCES,
    }),
})

REFIT = Section(doc="Moving trained weights into the generation engine.", fields={
    "transport": Field(type=str, default=None, nullable=True, doc="null: chosen by placement and device"),
    "bucket_size_mb": Field(type=NUMBER, default=256.0),
    "verify": Field(type=bool, default=True, doc="check every weight against the manifest"),
    "pipelined": Field(type=bool, default=True,
                       doc="engines that declare pipelined_import load each bucket as it arrives (colocated, over "
                           "broadcast, and over shared memory each chunk while the next is written); a transfer that fails part-way then leaves them refusing to generate "
                           "until a refit succeeds (false: stage the whole model first, a failed refit keeps the old "
                           "weights)"),
    "adapters": Field(type=bool, default=False,
                      doc="LoRA: send the adapters alone, the engine applies them to its base model (false: "
                          "merged weights); both backends must declare it (adapter_export, adapter_refit)"),
})

REWARD_MODEL = Section(doc="A scalar head in place of the LM head (NeMo RL's names): the model scores instead of "
                           "generating. For algorithms that train or read one (rm's policy, a critic); the training "
                           "backend must declare value_head.", fields={
    "enabled": Field(type=bool, default=False),
    "reward_model_type": Field(type=str, default="bradley_terry", choices=("bradley_terry", "regression"),
                               doc="bradley_terry: one score per sequence (HF *ForSequenceClassification); "
                                   "regression: a value per token (HF *ForTokenClassification)"),
})

POLICY = Section(required=True, doc="The model being trained and how.", aliases={}, fields={
    "model_name": Field(type=str, doc="Hugging Face checkpoint directory (or hub id where a hub is reachable)"),
    "tokenizer": Section(fields={
        "name": Field(type=str, default=None, nullable=True, doc="defaults to policy.model_name"),
        "chat_template": Field(type=str, default=None, nullable=True),
    }),
    "trust_remote_code": Field(type=bool, default=False),
    "hf_config_overrides": Section(nullable=True, open=True),
    "train_global_batch_size": Field(type=int, default=32, minimum=1),
    "train_micro_batch_size": Field(type=int, default=4, minimum=1),
    "generation_batch_size": Field(type=int, default=32, inert=True),
    "logprob_batch_size": Field(type=int, default=4, minimum=1),
    "max_total_sequence_length": Field(type=int, default=512, minimum=2),
    "max_seq_length": Field(type=int, default=None, nullable=True, minimum=2, doc="short form: sets max_total_sequence_length"),
    "precision": Field(type=str, default=None, nullable=True, choices=("float32", "bfloat16", "float16"),
                       doc="null: bfloat16 on a bf16-capable GPU, float32 elsewhere (resolved on each worker)"),
    "logprob_chunk_size": Field(type=int, default=None, nullable=True, minimum=1),
    "make_sequence_length_divisible_by": Field(type=int, default=1, minimum=1, inert=True,
                                               doc="NeMo RL pads to a multiple of the tensor-parallel size; nrl's "
                                                   "backends pad as they need, so this has no effect"),
    "max_grad_norm": Field(type=NUMBER, default=1.0, nullable=True, minimum=0, doc="0 or null: no clipping"),
    "seed": Field(type=int, default=None, nullable=True, doc="null: the algorithm's seed (42 without one), resolved at validation"),
    "check_for_nan": Field(type=bool, default=True,
                           doc="stop before the optimizer step when the loss or gradient norm is NaN/Inf"),
    "optimizer": OPTIMIZER,
    "scheduler": Field(type=list, default=None, nullable=True, doc="NeMo RL's list of {name, kwargs} and {milestones}"),
    "sequence_packing": SEQUENCE_PACKING,
    "dynamic_batching": DYNAMIC_BATCHING,
    "generation": GENERATION,
    "refit": REFIT,
    "refit_buffer_size_gb": Field(type=NUMBER, default=None, nullable=True, doc="NeMo RL spelling of refit.bucket_size_mb"),
    "reward_model_cfg": REWARD_MODEL,
})

def _text(doc: str) -> Field:
    return Field(type=str, default=None, nullable=True, doc=doc)


#: One dataset of NeMo RL's data layout (``data.train``, ``data.validation``, ``data.default``):
#: the union of the keys NeMo RL's dataset classes read. Which of them a dataset reads is its
#: spec's business (:class:`~nrl_core.contracts.DatasetSpec`); docs/data.md has the table.
DATASET = Section(doc="One dataset: a registered name (nrl_datasets) with where it loads from and how it is prompted.",
                  fields={
    "dataset_name": _text("a registered dataset (`nrl plugins` lists them)"),
    "data_path": _text("a local file or directory with the dataset's columns (stands in for the hub), or the "
                       "file or hub id of ResponseDataset, PreferenceDataset and BinaryPreferenceDataset"),
    "subset": _text("the hub dataset's configuration name"),
    "split": _text("the split to read; null: the dataset's default"),
    "input_key": _text("ResponseDataset: the prompt column (NeMo RL's default: input)"),
    "output_key": _text("the answer column (ResponseDataset: output; OpenMathInstruct-2: expected_answer)"),
    "prompt_key": _text("BinaryPreferenceDataset: the prompt column"),
    "chosen_key": _text("BinaryPreferenceDataset: the chosen response's column"),
    "rejected_key": _text("BinaryPreferenceDataset: the rejected response's column"),
    "extract_answer": Field(type=bool, default=None, nullable=True,
                            doc="gsm8k: the number after '####' as the answer (default), or the whole solution"),
    "prompt_file": _text("prompt template with one {} for the problem, read with Python's str.format"),
    "system_prompt_file": _text("system prompt"),
    "processor": _text("prompt processor (`math_hf_data_processor` when null)"),
    "env_name": _text("environment that scores this data (env.<env_name>)"),
    "split_validation_size": Field(type=NUMBER, default=None, nullable=True, minimum=0,
                                   doc="hold out this share (below 1) or number of rows for validation; "
                                       "null: the dataset's default"),
    "seed": Field(type=int, default=None, nullable=True, doc="seed of the held-out split (42 when null)"),
    "repeat": Field(type=int, default=None, nullable=True, minimum=1, doc="AIME: the dataset this many times over"),
    "max_samples": Field(type=int, default=None, nullable=True, minimum=1,
                         doc="tulu3_sft_mixture: this many rows, drawn at random with seed"),
    # NeMo RL's arrow_text dataset (cross-tokenizer distillation, which nrl lacks): accepted here so
    # the refusal names the dataset, not its keys
    "data_files": _text("arrow_text's files"),
    "text_key": _text("arrow_text's text column"),
    "characters_per_sample": Field(type=int, default=None, nullable=True, doc="arrow_text's sample length"),
})


def _fill_dataset_defaults(data: dict[str, Any], path: str) -> dict[str, Any]:
    """NeMo RL's rule for ``data.default``: every dataset of ``train`` and ``validation`` takes each
    key of ``default`` it does not set itself (a key set to null stays null)."""
    default = data.get("default")
    if not isinstance(default, dict):
        return data
    for split in ("train", "validation"):
        entries = data.get(split)
        if isinstance(entries, dict):
            data[split] = {**default, **entries}
        elif isinstance(entries, list):
            data[split] = [{**default, **e} if isinstance(e, dict) else e for e in entries]
    return data


DATA = Section(preprocess=_fill_dataset_defaults, fields={
    "train": SectionList(type=(dict, list), default=None, nullable=True, section=DATASET,
                         doc="NeMo RL's layout: one dataset or a list of them (their records concatenated)"),
    "validation": SectionList(type=(dict, list), default=None, nullable=True, section=DATASET,
                              doc="NeMo RL's layout: validation datasets, beside what train datasets hold out"),
    "default": DATASET.with_fields(),
    "dataset_name": Field(type=str, default=None, nullable=True,
                          doc="a dataset generator, a registered dataset or a local file/dir"),
    "train_data_path": Field(type=str, default=None, nullable=True),
    "val_data_path": Field(type=str, default=None, nullable=True),
    "input_key": Field(type=str, default="problem"),
    "output_key": Field(type=str, default="expected_answer"),
    "max_input_seq_length": Field(type=int, default=None, nullable=True, minimum=1,
                                  doc="drop prompts longer than this many tokens"),
    "prompt_file": Field(type=str, default=None, nullable=True),
    "system_prompt_file": Field(type=str, default=None, nullable=True),
    "use_chat_template": Field(type=bool, default=True),
    "add_bos": Field(type=bool, default=True, doc="NeMo RL's sft_processor: begin with the BOS token"),
    "add_eos": Field(type=bool, default=True, doc="NeMo RL's sft_processor: end with the EOS token"),
    "add_generation_prompt": Field(type=bool, default=False,
                                   doc="NeMo RL's sft_processor: the generation prompt after user turns"),
    "shuffle": Field(type=bool, default=True),
    "num_workers": Field(type=int, default=1, inert=True),
    "processor": Field(type=str, default="math", doc="prompt processor name"),
    "env_name": Field(type=str, default="math", doc="environment that scores this data"),
    "generate": Section(nullable=True, open=True, doc="arguments of a built-in dataset generator"),
})

LOGGER = Section(doc="Console and metrics.jsonl; each metric sink plugin (the core's tensorboard, wandb, mlflow) "
                     "adds <name>_enabled and <name> (its options).", fields={
    "log_dir": Field(type=str, default="logs"),
    "num_val_samples_to_print": Field(type=int, default=0, minimum=0),
    "console": Field(type=bool, default=True),
    "jsonl_enabled": Field(type=bool, default=True),
    "swanlab_enabled": Field(type=bool, default=False, inert=True),
    "monitor_gpus": Field(type=bool, default=False, inert=True),
    "plot": Field(type=bool, default=True, doc="write a PNG of reward and loss at the end"),
    "swanlab": Section(open=True),
    "gpu_monitoring": Section(open=True),
})

CHECKPOINTING = Section(fields={
    "enabled": Field(type=bool, default=False),
    "checkpoint_dir": Field(type=str, default="results/checkpoints"),
    "metric_name": Field(type=str, default="val_reward", nullable=True),
    "higher_is_better": Field(type=bool, default=True),
    "keep_top_k": Field(type=int, default=None, nullable=True, minimum=1, doc="null: keep every checkpoint"),
    "save_period": Field(type=int, default=10, minimum=0, doc="save every N steps (and at the end); 0: only at the end"),
    "checkpoint_must_save_by": Field(type=str, default=None, nullable=True, inert=True,
                                     doc="NeMo RL saves before this wall-clock deadline; nrl does not (named in the "
                                         "inert-keys warning when set)"),
    "export_hf": Field(type=bool, default=True, doc="export the best checkpoint as a Hugging Face model"),
    "save_optimizer": Field(type=bool, default=True,
                            doc="false: checkpoints hold no optimizer or LR-scheduler state (smaller); a resume "
                                "from one starts both fresh, as NeMo RL does (backends declaring "
                                "skip_optimizer_state)"),
    "model_save_format": Field(type=str, default=None, nullable=True, choices=("safetensors", "torch_save"),
                               doc="safetensors: the weights as safetensors shards under their Hugging Face names, "
                                   "the optimizer in torch's distributed format (NeMo RL's DTensor format; backends "
                                   "declaring safetensors_checkpoints); torch_save or null: the backend's own format"),
})

CLUSTER = Section(doc="Where workers run. On a CPU machine gpus_per_node counts training workers per node.", fields={
    "gpus_per_node": Field(type=int, default=1, minimum=1),
    "num_nodes": Field(type=int, default=1, minimum=1),
    "ray_address": Field(type=str, default=None, nullable=True, doc="join this Ray cluster; null starts a local one"),
    "num_cpus": Field(type=int, default=None, nullable=True, minimum=1, doc="CPUs a local Ray may use; null: all"),
    "num_gpus": Field(type=int, default=None, nullable=True, minimum=0, doc="GPUs a local Ray may use; null: all"),
    "cpus_per_worker": Field(type=NUMBER, default=0.1, minimum=0, doc="CPU reservation per worker (small: CPUs are shared)"),
    "placement_strategy": Field(type=str, default="PACK", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")),
    "env_vars": Section(nullable=True, open=True, doc="extra environment variables for every worker"),
    "log_to_driver": Field(type=bool, default=True),
    "namespace": Field(type=str, default=None, nullable=True),
})

ENV = Section(doc="Reward environments by name; plugins add their sections.")

#: What one call of an environment (a batch's ``score``, a turn's ``step``) may take by default.
DEFAULT_ENV_CALL_TIMEOUT_S = 600.0
#: The core's key in every environment's section: past it the watchdog names the call and stops the run.
ENV_CALL_TIMEOUT = Field(type=NUMBER, default=DEFAULT_ENV_CALL_TIMEOUT_S, minimum=0.001,
                         doc="seconds one score or step call may take before the watchdog stops the run")

PHASES = ("start_up", "step", "refit", "generation", "hand_off", "reward", "logprobs", "reference_logprobs",
          "training", "checkpoint_save", "checkpoint_load", "validation")


def _check_phase_limits(section: dict[str, Any], path: str) -> dict[str, Any]:
    for name, limit in (section.get("phases") or {}).items():
        key = f"{path}.phases.{name}"
        if name not in PHASES:
            raise ConfigError(key, f"unknown phase; the phases are {', '.join(PHASES)}")
        if isinstance(limit, bool) or not isinstance(limit, NUMBER) or limit <= 0:
            raise ConfigError(key, f"must be a limit in seconds above 0, got {limit!r}")
    return section


WATCHDOG = Section(preprocess=_check_phase_limits, doc="Time limits per phase and the run's trace (docs/watchdog.md).",
                   fields={
    "enabled": Field(type=bool, default=True, doc="end a run whose phase passes its limit, with every stack"),
    "floor_s": Field(type=NUMBER, default=1800, minimum=1,
                     doc="limit of a phase seen for the first time, and the least limit of any phase"),
    "multiple": Field(type=NUMBER, default=5, minimum=1, doc="a phase's limit: this times the slowest it took"),
    "startup_s": Field(type=NUMBER, default=3600, minimum=1, doc="limit of the start-up"),
    "phases": Section(open=True, doc="fixed limits in seconds by phase name (start_up, generation, training, ...)"),
    "trace": Field(type=bool, default=True, doc="write every phase of every step to <log_dir>/trace.json"),
})

CORE_SCHEMA = Section(fields={
    "algorithm": ALGORITHM,
    "loss_fn": LOSS_FN,
    "policy": POLICY,
    "data": DATA,
    "env": ENV,
    "logger": LOGGER,
    "checkpointing": CHECKPOINTING,
    "cluster": CLUSTER,
    "watchdog": WATCHDOG,
})
