"""Checks of a validated config that relate several values, the filesystem or the selected backends.

The schema checks each value alone (types, choices, minimums). What is left is checked here, after
it, by :func:`check_config`, which ``validate_config`` runs, so ``nrl config check`` and
``nrl train`` refuse the same configs before any worker is built (``nrl train`` runs the
backends' own checks, :func:`check_backends`, while the policy's workers import their modules,
and stops those workers and its Ray when a check fails):

* sizes: the split of the cluster between training and generation (:mod:`nrl_core.config.topology`),
  the backend's model-parallel size against the training workers, the global batch against micro-batches and
  data-parallel ranks, GRPO's rollouts per step against the global batch;
* lengths: prompts and responses against ``policy.max_total_sequence_length``;
* directories: ``logger.log_dir`` and ``checkpointing.checkpoint_dir`` can be created and written
  (nothing is created here);
* data in NeMo RL's layout: every dataset name is registered, its split exists, its local files
  exist, and its processor is installed (nothing is loaded: :mod:`nrl_core.data.sources`);
* the selected backends' own checks (their spec's ``config_check``): sizes against the model's
  heads and layers, optimizer and scheduler names, engine lengths.

Algorithm sections are checked for the algorithm being run (``nrl train grpo``), or, for
``nrl config check``, for each algorithm section the config file sets: the algorithm's spec says
whether it generates (then an installed generation backend is required) and names its own check.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from nrl_core.config.loss_rules import loss_config_problem
from nrl_core.config.topology import cluster_topology
from nrl_core.contracts import AlgorithmSpec, ConfigCheck, GenerationBackendSpec, TrainingBackendSpec, import_object
from nrl_core.errors import ConfigError
from nrl_core.plugins import PluginManager

__all__ = ["check_backends", "check_config", "data_parallel_size", "directory_problem"]


def check_config(config: Mapping[str, Any], pm: PluginManager, *, algorithms: Collection[str],
                 training: TrainingBackendSpec | None, generation: GenerationBackendSpec | None,
                 backends: bool = True) -> None:
    """Everything in the module docstring; ``training``/``generation`` are the selected backends
    (None when none is selected yet: their checks are skipped). ``backends=False`` leaves out the
    backends' own checks, the ones that import transformers and read the model
    (:func:`check_backends` runs them later)."""
    specs = [pm.algorithms().get(name, "algorithm") for name in algorithms]
    for spec in specs:
        _check_algorithm_needs(config, pm, spec, generation)
        _check_value_sections(config, spec)
    _check_ranges(config)
    cluster_topology(config, pm)
    dp = data_parallel_size(config, training, pm)
    _check_capabilities(config, training, generation, dp, algorithms)
    _check_batches(config, dp)
    _check_lengths(config)
    _check_directories(config)
    for spec in specs:
        run_backend_check(spec.config_check, config)
    _check_datasets(config, pm, {spec.data_kind for spec in specs})
    if backends:
        check_backends(config, pm, algorithms=algorithms, training=training, generation=generation)


def check_model(model: Mapping[str, Any], training: TrainingBackendSpec, pm: PluginManager) -> None:
    """What a model beside the policy (:mod:`nrl_core.config.models`) asks of its training backend,
    checked as the policy's is; ``model`` is :func:`~nrl_core.config.models.model_config`'s."""
    _check_capabilities(model, training, None, data_parallel_size(model, training, pm), ())
    _check_lengths(model)


def check_backends(config: Mapping[str, Any], pm: PluginManager, *, algorithms: Collection[str],
                   training: TrainingBackendSpec | None, generation: GenerationBackendSpec | None) -> None:
    """The selected backends' own checks (their spec's ``config_check``); the generation backend's
    only when one of ``algorithms`` generates (or none is named)."""
    if training is not None:
        run_backend_check(training.config_check, config)
    specs = [pm.algorithms().get(name, "algorithm") for name in algorithms]
    uses_generation = not specs or any(spec.generates for spec in specs)
    if generation is not None and config["policy"]["generation"] is not None and uses_generation:
        run_backend_check(generation.config_check, config)


def _check_algorithm_needs(config: Mapping[str, Any], pm: PluginManager, spec: AlgorithmSpec,
                           generation: GenerationBackendSpec | None) -> None:
    """What an algorithm's spec declares it needs: a generating one needs an installed engine."""
    if not spec.generates:
        return
    section = config["policy"]["generation"]
    if section is None:
        raise ConfigError("policy.generation", f"{spec.name.upper()} generates rollouts; configure a "
                                               "generation backend (policy.generation.backend)")
    if generation is None:
        pm.generation_backends().get(section["backend"], "policy.generation.backend")  # raises: not installed


def _check_value_sections(config: Mapping[str, Any], spec: AlgorithmSpec) -> None:
    """A value head (``reward_model_cfg.enabled``) only where the algorithm's spec says it reads
    one (``value_sections``): any other algorithm would train a scoring model as a language model."""
    for key in ("policy", *spec.model_sections):
        section = config.get(key)
        if section and (section.get("reward_model_cfg") or {}).get("enabled") and key not in spec.value_sections:
            raise ConfigError(f"{key}.reward_model_cfg.enabled",
                              f"{spec.name} does not train or read a value head (reward model) in {key}; set it "
                              "to false, or run an algorithm that does (nrl train rm)")


def _check_capabilities(config: Mapping[str, Any], training: TrainingBackendSpec | None,
                        generation: GenerationBackendSpec | None, dp: int, algorithms: Collection[str]) -> None:
    """Refuse what the selected backends do not declare they can do (their spec's ``capabilities``),
    instead of letting a backend ignore it silently."""
    policy = config["policy"]
    if training is not None:
        needs = {"data_parallel": dp > 1, "sequence_packing": policy["sequence_packing"]["enabled"],
                 "dynamic_batching": policy["dynamic_batching"]["enabled"]}
        for capability, needed in needs.items():
            if needed and capability not in training.capabilities:
                key = {"data_parallel": "cluster.gpus_per_node",
                       "sequence_packing": "policy.sequence_packing.enabled",
                       "dynamic_batching": "policy.dynamic_batching.enabled"}[capability]
                what = f"{dp} data-parallel groups" if capability == "data_parallel" else capability.replace("_", " ")
                raise ConfigError(key, f"the {training.name} training backend ({training.distribution}) does not "
                                       f"support {what}; change the value or use a backend that declares it")
    if training is not None and policy["reward_model_cfg"]["enabled"] and "value_head" not in training.capabilities:
        raise ConfigError("policy.reward_model_cfg.enabled",
                          f"the {training.name} training backend ({training.distribution}) does not declare "
                          "value_head, which a reward model needs; use a backend that does")
    saving = config.get("checkpointing") or {}
    if (training is not None and saving.get("enabled") and saving.get("save_optimizer") is False
            and "skip_optimizer_state" not in training.capabilities):
        raise ConfigError("checkpointing.save_optimizer",
                          f"the {training.name} training backend ({training.distribution}) does not declare "
                          "skip_optimizer_state, so it would save the optimizer anyway; set it to true or use a "
                          "backend that declares it")
    if (training is not None and saving.get("model_save_format") == "safetensors"
            and "safetensors_checkpoints" not in training.capabilities):
        logging.getLogger(__name__).warning(
            "checkpointing.model_save_format: the %s training backend (%s) writes its own checkpoint format "
            "(NeMo RL's Megatron backend ignores this key too)", training.name, training.distribution)
    if policy["refit"]["adapters"] and policy["generation"] is not None:
        for spec, capability in ((training, "adapter_export"), (generation, "adapter_refit")):
            if spec is not None and capability not in spec.capabilities:
                role = "training" if capability == "adapter_export" else "generation"
                raise ConfigError("policy.refit.adapters", f"the {spec.name} {role} backend ({spec.distribution}) "
                                                           f"does not declare {capability}, which adapter-only "
                                                           "refit needs; set it to false (merged weights)")
    wants_streaming = "grpo" in algorithms or not algorithms
    if (generation is not None and policy["generation"] is not None and wants_streaming
            and (config.get("grpo") or {}).get("async_grpo", {}).get("enabled")
            and "streaming" not in generation.capabilities):
        raise ConfigError("grpo.async_grpo.enabled", f"the {generation.name} generation backend "
                                                     f"({generation.distribution}) cannot stream rollouts, which async "
                                                     "GRPO needs; set it to false or use a backend that can")
    if (generation is not None and policy["generation"] is not None and wants_streaming
            and (config.get("grpo") or {}).get("async_grpo", {}).get("enabled")):
        check_in_flight(config["grpo"]["async_grpo"], "grpo.async_grpo", generation, policy)


def check_in_flight(section: Mapping[str, Any], path: str, generation: Any, policy: Mapping[str, Any]) -> None:
    """An async section's ``in_flight_weight_updates`` (at ``path``) against the generation backend
    and the refit: the backend must declare ``in_flight_updates``, and adapter-only refits swap an
    adapter where a weight update would pause the engine."""
    if not section.get("in_flight_weight_updates"):
        return
    if "in_flight_updates" not in generation.capabilities:
        raise ConfigError(f"{path}.in_flight_weight_updates",
                          f"the {generation.name} generation backend ({generation.distribution}) does not declare "
                          "in_flight_updates (loading weights while requests are in flight); set it to false")
    if policy["refit"]["adapters"]:
        raise ConfigError(f"{path}.in_flight_weight_updates", "in-flight updates load merged weights; with "
                                                              "policy.refit.adapters: true set it to false")


def run_backend_check(path: str | None, config: Mapping[str, Any]) -> None:
    """The :data:`~nrl_core.contracts.ConfigCheck` at ``path`` (a spec's ``config_check``) on ``config``."""
    if path is None:
        return
    check: ConfigCheck = import_object(path)
    check(config)


def _check_ranges(config: Mapping[str, Any]) -> None:
    """Ranges a schema minimum cannot say."""
    problem = loss_config_problem(config["loss_fn"])
    if problem is not None:
        raise ConfigError(*problem)
    generation = config["policy"]["generation"]
    if generation is not None and not 0 < generation["top_p"] <= 1:
        raise ConfigError("policy.generation.top_p", f"must be in (0, 1], got {generation['top_p']}")
    val_temperature = None if generation is None else generation.get("val_temperature")
    if val_temperature not in (None, 0, generation and generation["temperature"]):
        raise ConfigError("policy.generation.val_temperature",
                          f"nrl validates greedily (0) or at policy.generation.temperature "
                          f"({generation['temperature']}), got {val_temperature}")
    for key, training in (("val_top_p", "top_p"), ("val_top_k", "top_k")):
        value = None if generation is None else generation.get(key)
        if value is not None and value != generation[training]:
            raise ConfigError(f"policy.generation.{key}", f"{value} differs from policy.generation.{training} "
                                                          f"({generation[training]}): validation sampling of its own "
                                                          "is NeMo RL's NeMo Gym path, which nrl lacks; set it to "
                                                          f"null or to {training}")
    if config["policy"]["refit"]["bucket_size_mb"] <= 0:
        raise ConfigError("policy.refit.bucket_size_mb", f"must be positive, got {config['policy']['refit']['bucket_size_mb']}")


# --------------------------------------------------------------------------- sizes


def data_parallel_size(config: Mapping[str, Any], spec: TrainingBackendSpec | None, pm: PluginManager) -> int:
    """Training workers over the ranks one model replica spans; refuses a model-parallel size the
    workers cannot hold or divide."""
    cluster = config["cluster"]
    world = cluster_topology(config, pm).train_world
    if spec is None:
        return world
    section = config["policy"][spec.config_key]
    model_parallel = spec.model_parallel_size(section)
    if world % model_parallel == 0:
        return world // model_parallel
    parallel = [key for key in spec.parallel_size_keys if int(section.get(key) or 1) > 1]
    key = f"policy.{spec.config_key}" + (f".{parallel[0]}" if len(parallel) == 1 else "")
    sizes = " x ".join(f"{k}={section.get(k)}" for k in parallel)
    workers = (f"the {world} training workers (cluster.gpus_per_node={cluster['gpus_per_node']} x "
               f"cluster.num_nodes={cluster['num_nodes']}, less non-colocated generation's)")
    if model_parallel > world:
        raise ConfigError(key, f"one model replica needs {model_parallel} ranks ({sizes}) but there are only "
                               f"{workers}; lower it or add workers")
    raise ConfigError(key, f"model-parallel size {model_parallel} ({sizes}) does not divide {workers}")


def _check_batches(config: Mapping[str, Any], dp: int) -> None:
    policy = config["policy"]
    gbs, mbs = policy["train_global_batch_size"], policy["train_micro_batch_size"]
    if gbs % mbs:
        raise ConfigError("policy.train_global_batch_size",
                          f"{gbs} is not a multiple of policy.train_micro_batch_size ({mbs}); change one of them")
    if gbs % dp:
        raise ConfigError("policy.train_global_batch_size",
                          f"{gbs} does not split over the {dp} data-parallel ranks; make it a multiple of {dp}")


# --------------------------------------------------------------------------- lengths


def _check_lengths(config: Mapping[str, Any]) -> None:
    policy = config["policy"]
    packing, dynamic = policy["sequence_packing"], policy["dynamic_batching"]
    if packing["enabled"] and dynamic["enabled"]:
        raise ConfigError("policy.sequence_packing.enabled",
                          "sequence packing and dynamic batching cannot both be enabled; pick one")
    for name, section in (("sequence_packing", packing), ("dynamic_batching", dynamic)):
        if not section["enabled"]:
            continue
        if section["train_mb_tokens"] is None:
            raise ConfigError(f"policy.{name}.train_mb_tokens", f"is required when policy.{name}.enabled is true")
        # A budget below policy.max_total_sequence_length is NeMo RL's to accept: only a sequence
        # that is longer than the budget fails, at packing time, in one line (nrl_core/data/packing.py).


# --------------------------------------------------------------------------- directories


def directory_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be used as a directory to write into, or None if it can (it exists and
    is writable, or it can be created: its nearest existing ancestor is a writable directory).
    Nothing is left behind."""
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        return f"'{p}' is a file, not a directory"
    ancestor = p
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    prefix = "" if ancestor == p else f"'{p}' cannot be created: "
    if not ancestor.is_dir():
        return f"{prefix}'{ancestor}' is a file"
    why = _refuses_writes(ancestor)
    return None if why is None else f"{prefix}'{ancestor}' {why}"


def _refuses_writes(directory: Path) -> str | None:
    """Why ``directory`` takes no new entries, or None. Tried with a probe removed at once: the
    permission bits do not bind root, and pseudo file systems (``/proc``) refuse what they allow."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable"
    try:
        tempfile.TemporaryDirectory(dir=directory, prefix=".nrl-probe-").cleanup()
    except OSError as exc:
        return f"refuses new directories ({exc.strerror or exc})"
    return None


def _check_datasets(config: Mapping[str, Any], pm: PluginManager, kinds: set[str]) -> None:
    """NeMo RL's data layout, resolved without loading: names, splits, local files, the record kind
    the algorithm reads, the processor and the prompt files (read and tried with str.format)."""
    from nrl_core.data.sources import resolve_datasets, uses_dataset_layout

    data = config["data"]
    if not uses_dataset_layout(data):
        return
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    train, val = resolve_datasets(data, kind, registry=pm.datasets())
    if not any(source.spec.kind == "prompt" for source in (*train, *val)):
        return  # preference pairs are tokenized as they are
    pm.data_processors().get(data["processor"], f"{train[0].key_path}.processor")
    for key in ("prompt_file", "system_prompt_file"):
        if not data[key]:
            continue
        path = Path(data[key]).expanduser()
        if not path.is_file():
            raise ConfigError(f"{train[0].key_path}.{key}", f"{data[key]}: no such file (a relative path is read "
                                                            f"from the directory nrl runs in; NeMo RL's "
                                                            f"examples/prompts/ are in its checkout)")
        if key == "prompt_file":
            try:
                path.read_text(encoding="utf-8").format("")
            except (IndexError, KeyError, ValueError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{train[0].key_path}.{key}", f"{data[key]}: not a template Python's str.format can "
                                                                f"fill with the problem ({type(exc).__name__}: {exc}); "
                                                                "write {} for the problem and {{ }} for a brace") from None


def _check_directories(config: Mapping[str, Any]) -> None:
    keys = [("logger", "log_dir")]
    if config["checkpointing"]["enabled"]:
        keys.append(("checkpointing", "checkpoint_dir"))
    for section, key in keys:
        problem = directory_problem(config[section][key])
        if problem is not None:
            raise ConfigError(f"{section}.{key}", f"{problem}; choose a directory you can write to")
