"""The public API: the one module a plugin imports.

Everything a plugin needs (hooks, specs, Protocols, data types, the backend SDK, the generation
kit, algorithm building blocks and the test kit) is a name here; every other ``nrl_core`` module is
internal and may change in any release. import-linter holds the first-party plugins to this module
(``.importlinter``); docs/api.md lists every name and ``api.pyi`` types them, both generated from
the table below by ``scripts/api_reference.py``.

A name loads its module on first use, so a plugin's entry-point module that takes ``hookimpl`` and
a few specs does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Section -> public name -> where it lives: ``module``, or ``module:attribute`` when the public
#: name differs from the internal one.
_SECTIONS: dict[str, dict[str, str]] = {
    "Hooks and the contract": {
        "CONTRACT_VERSION": "nrl_core.contracts",
        "hookimpl": "nrl_core.hookspecs",
        "import_object": "nrl_core.contracts",
        "logprob_temperature": "nrl_core.contracts",
    },
    "Errors": {
        "ConfigError": "nrl_core.errors",
        "first_line": "nrl_core.errors",
        "NonFiniteError": "nrl_core.nonfinite",
        "NrlError": "nrl_core.errors",
        "PluginError": "nrl_core.errors",
        "RefitError": "nrl_core.refit.manifest",
        "TornRefitError": "nrl_core.refit.manifest",
        "UnsafeCheckpointError": "nrl_core.sdk.safe_dcp",
        "WorkerError": "nrl_core.errors",
    },
    "Specs (what the hooks return)": {
        "AdvantageEstimatorSpec": "nrl_core.contracts",
        "AlgorithmSpec": "nrl_core.contracts",
        "CheckpointOptions": "nrl_core.contracts",
        "CommandSpec": "nrl_core.contracts",
        "DataProcessorSpec": "nrl_core.contracts",
        "DatasetGeneratorSpec": "nrl_core.contracts",
        "DatasetSpec": "nrl_core.contracts",
        "EnvironmentSpec": "nrl_core.contracts",
        "GenerationBackendSpec": "nrl_core.contracts",
        "LossFunctionSpec": "nrl_core.contracts",
        "MetricSinkSpec": "nrl_core.contracts",
        "RefitTransportSpec": "nrl_core.contracts",
        "RunInfo": "nrl_core.contracts",
        "TrainingBackendSpec": "nrl_core.contracts",
    },
    "Protocols (what a plugin's objects provide)": {
        "AdapterExporter": "nrl_core.contracts",
        "AdapterServer": "nrl_core.contracts",
        "AdvantageEstimator": "nrl_core.contracts",
        "Environment": "nrl_core.contracts",
        "GenerationWorker": "nrl_core.contracts",
        "InFlightUpdater": "nrl_core.contracts",
        "LossFunction": "nrl_core.contracts",
        "MetricSink": "nrl_core.contracts",
        "MultiTurnEnvironment": "nrl_core.contracts",
        "PartialImporter": "nrl_core.contracts",
        "PipelinedImporter": "nrl_core.contracts",
        "TopkScorer": "nrl_core.contracts",
        "TrainingWorker": "nrl_core.contracts",
        "ValueScorer": "nrl_core.contracts",
    },
    "Data types": {
        "AdvantageInputs": "nrl_core.contracts",
        "BatchShard": "nrl_core.contracts",
        "DatumSpec": "nrl_core.data",
        "EnvResult": "nrl_core.contracts",
        "EnvSample": "nrl_core.contracts",
        "EnvStep": "nrl_core.contracts",
        "Episode": "nrl_core.contracts",
        "GenerationOutput": "nrl_core.contracts",
        "ObservationTokens": "nrl_core.algorithms.multi_turn",
        "PackedRows": "nrl_core.data",
        "PreferencePair": "nrl_core.data.preference",
        "PromptConfig": "nrl_core.data",
        "RouterStats": "nrl_core.moe",
        "TokenBatch": "nrl_core.contracts",
        "TopkShard": "nrl_core.contracts",
        "WeightSpec": "nrl_core.contracts",
    },
    "Config sections and checks": {
        "check_in_flight": "nrl_core.config.checks",
        "choose_backends": "nrl_core.algorithms.installed",
        "cluster_topology": "nrl_core.algorithms.installed",
        "data_parallel_size": "nrl_core.algorithms.installed",
        "Field": "nrl_core.schema",
        "GRPO_SCHEMA": "nrl_core.algorithms.grpo_config:GRPO",
        "load_and_validate": "nrl_core.algorithms.installed",
        "has_recurrent_layers": "nrl_core.config.model_config",
        "local_model_config": "nrl_core.config.model_config",
        "model_config": "nrl_core.config.models",
        "read_model_config": "nrl_core.config.model_config",
        "renamed_error": "nrl_core.config.models",
        "run_backend_check": "nrl_core.config.checks",
        "Section": "nrl_core.schema",
        "validate_config": "nrl_core.algorithms.installed",
        "value_at": "nrl_core.config.loader",
    },
    "Data: prompts, processors, packing": {
        "build_prompt": "nrl_core.data.processors",
        "check_pairs": "nrl_core.data.preference",
        "dynamic_micro_batches": "nrl_core.data",
        "pack_bins": "nrl_core.data",
        "pack_sequences": "nrl_core.data",
        "parse_tool_calls": "nrl_core.tools",
        "prepare_data": "nrl_core.algorithms.installed",
        "prompt_batch": "nrl_core.data",
        "sft_processor": "nrl_core.data.processors",
        "TOOL_CALL_CLOSE": "nrl_core.tools:CLOSE",
        "TOOL_CALL_OPEN": "nrl_core.tools:OPEN",
        "tool_message": "nrl_core.tools",
        "ToolCall": "nrl_core.tools",
        "ToolCallError": "nrl_core.tools",
    },
    "Training backend SDK": {
        "all_gather": "nrl_core.device",
        "all_gather_into": "nrl_core.device",
        "all_reduce": "nrl_core.device",
        "all_reduce_values": "nrl_core.device",
        "balance_metrics": "nrl_core.moe",
        "base_model_identity": "nrl_core.sdk",
        "broadcast": "nrl_core.device",
        "check_batch_device": "nrl_core.device",
        "check_finite": "nrl_core.nonfinite",
        "copy_tokenizer": "nrl_core.sdk.hf_export",
        "describe_failure": "nrl_core.sdk",
        "first_failure": "nrl_core.sdk",
        "guard_enabled": "nrl_core.nonfinite",
        "head_has_bias": "nrl_core.sdk.value_head",
        "host_copy": "nrl_core.device",
        "last_token_values": "nrl_core.sdk.value_head",
        "LM_HEAD_SUFFIXES": "nrl_core.sdk.value_head",
        "load_bytes_item": "nrl_core.sdk.safe_dcp",
        "load_file": "nrl_core.sdk.safe_dcp",
        "logprob_tolerance": "nrl_core.checkpoint.to_hf",
        "main_group_timeout": "nrl_core.process_groups",
        "map_large_host_allocations": "nrl_core.device",
        "max_logprob_error": "nrl_core.checkpoint.to_hf",
        "model_device": "nrl_core.device",
        "move_optimizer_state": "nrl_core.device",
        "move_tensors": "nrl_core.device",
        "new_output_dir": "nrl_core.checkpoint.to_hf",
        "next_token_logprobs_at": "nrl_core.sdk.vocab",
        "next_token_topk": "nrl_core.sdk.vocab",
        "NONFINITE_KEY": "nrl_core.nonfinite:KEY",
        "probe_batch": "nrl_core.checkpoint.to_hf",
        "process_group_backend": "nrl_core.device",
        "publish_dir": "nrl_core.checkpoint.to_hf",
        "ReferenceWeights": "nrl_core.sdk",
        "init_reference_model": "nrl_core.sdk",
        "resolve_precision": "nrl_core.device",
        "rng_state": "nrl_core.sdk",
        "SafeFileSystemReader": "nrl_core.sdk.safe_dcp",
        "set_rng_state": "nrl_core.sdk",
        "staging_dir": "nrl_core.checkpoint.to_hf",
        "to_device": "nrl_core.device",
        "trim_host_heap": "nrl_core.device",
        "training_precision": "nrl_core.sdk",
        "TrainingWorkerBase": "nrl_core.sdk",
        "TrainingEngine": "nrl_core.engine",
        "Consume": "nrl_core.engine",
        "KINDS": "nrl_core.engine",
        "ForwardRequest": "nrl_core.engine",
        "MicroBatch": "nrl_core.engine",
        "plan_micro_batches": "nrl_core.engine",
        "token_budget": "nrl_core.engine",
        "StateFileCheckpoints": "nrl_core.engine.state_file",
        "StateLayout": "nrl_core.plan.layout",
        "value_head_type": "nrl_core.sdk.value_head",
        "value_model_config": "nrl_core.sdk.value_head",
        "worker_checkpoint_hooks": "nrl_core.checkpoint.hooks",
    },
    "Weights and refit": {
        "Bucket": "nrl_core.refit.buckets",
        "checkpoint_layout": "nrl_core.refit.hf_source",
        "collect_lent_buffers": "nrl_core.refit.device_share",
        "dtype_name": "nrl_core.refit.buckets",
        "HFWeightSource": "nrl_core.refit.hf_source",
        "is_owned_region": "nrl_core.refit.slices",
        "iter_buckets": "nrl_core.refit.buckets",
        "lend_device_buffer": "nrl_core.refit.device_share",
        "open_lent_buffer": "nrl_core.refit.device_share",
        "parse_dtype": "nrl_core.refit.buckets",
        "plain_config": "nrl_core.refit.adapters",
        "shared_file": "nrl_core.refit.shm_space",
        "spec_of": "nrl_core.refit.buckets",
        "verified_stream": "nrl_core.refit.manifest",
        "verify_manifest": "nrl_core.refit.manifest:verify",
        "WeightSlice": "nrl_core.refit.slices",
    },
    "Generation backend kit": {
        "derive_seed": "nrl_core.generation_kit",
        "environment_variables": "nrl_core.env_vars:environment",
        "in_flight_section": "nrl_core.generation_kit",
        "SamplingSettings": "nrl_core.generation_kit",
        "SamplingState": "nrl_core.generation_kit",
        "SleepState": "nrl_core.generation_kit",
        "stop_string_end": "nrl_core.generation_kit",
        "timeline_mark": "nrl_core.timeline:mark",
    },
    "Algorithm building blocks": {
        "AlgorithmRun": "nrl_core.algorithms.base",
        "Runtime": "nrl_core.algorithms.runtime",
        "AsyncRollouts": "nrl_core.algorithms.async_rollouts",
        "build_environment": "nrl_core.algorithms.setup",
        "build_loss": "nrl_core.algorithms.setup",
        "check_async_rollouts": "nrl_core.algorithms.grpo_config",
        "env_metrics": "nrl_core.algorithms.rollout_sources",
        "generalized_advantages": "nrl_core.algorithms.estimators",
        "Generation": "nrl_core.algorithms.generation",
        "generation_spec": "nrl_core.algorithms.setup",
        "group_advantages": "nrl_core.algorithms.advantages",
        "init_ray": "nrl_core.cluster",
        "load_tokenizer": "nrl_core.algorithms.setup",
        "merge_groups": "nrl_core.algorithms.scoring",
        "PhaseTimer": "nrl_core.algorithms.setup",
        "Policy": "nrl_core.algorithms.policy",
        "PreferenceRun": "nrl_core.algorithms.preference_run",
        "prompt_limits": "nrl_core.algorithms.grpo",
        "repeat_prompts": "nrl_core.algorithms.rollouts",
        "RewardKL": "nrl_core.algorithms.estimators",
        "rollout_batch": "nrl_core.algorithms.rollouts",
        "RolloutBatch": "nrl_core.algorithms.rollout_sources",
        "RolloutGroup": "nrl_core.algorithms.scoring",
        "Scorer": "nrl_core.algorithms.scoring",
        "shaping_problem": "nrl_core.algorithms.rewards",
        "SingleTurnSampler": "nrl_core.algorithms.rollout_sources",
        "validates_greedily": "nrl_core.algorithms.rollout_sources",
        "whiten": "nrl_core.algorithms.estimators",
    },
    "Test kit": {
        "cached_tiny_model": "nrl_core.testing.tiny_models",
        "gather_shards": "nrl_core.testing.distributed",
        "generation_backend_suite": "nrl_core.testing.conformance",
        "hf_logprobs": "nrl_core.checkpoint.to_hf",
        "hf_model": "nrl_core.checkpoint.to_hf",
        "init_local_group": "nrl_core.testing.distributed",
        "registered_plugin": "nrl_core.plugins",
        "run_distributed": "nrl_core.testing.distributed",
        "training_backend_suite": "nrl_core.testing.conformance",
    },
}


def _exports() -> dict[str, tuple[str, str]]:
    """Each public name's module and attribute."""
    return {name: (where.partition(":")[0], where.partition(":")[2] or name)
            for names in _SECTIONS.values() for name, where in names.items()}


_EXPORTS = _exports()
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"nrl_core.api has no name {name!r}; docs/api.md lists them")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
