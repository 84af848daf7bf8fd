"""Validating a loaded config against the core's schema plus what installed plugins contribute,
and choosing the training and generation backends.

The result of :func:`validate_config` is a plain ``dict``: every key present, defaults filled,
NeMo RL aliases rewritten to nrl's spelling, short forms expanded. Algorithms and workers read it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nrl_core.config import checks
from nrl_core.config.checks import check_config
from nrl_core.config.core_schema import CORE_SCHEMA, ENV_CALL_TIMEOUT
from nrl_core.config.models import model_config, model_section_owners, renamed_error
from nrl_core.config.nemo_rl import refuse_missing_algorithm, with_nemo_rl_keys
from nrl_core.config.nemo_rl_inert import named_inert_keys
from nrl_core.config.runner_data import draw_runner_data
from nrl_core.contracts import GenerationBackendSpec, TrainingBackendSpec
from nrl_core.errors import ConfigError, PluginError
from nrl_core.plugins import PluginManager
from nrl_core.schema import Field, Section, note_inert, warn_inert_keys_once

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _KnownSection:
    """A first-party plugin section that may appear in a config whose plugin is not installed."""

    backend: str
    distribution: str
    aliases: Mapping[str, str]


DEFAULT_SEED = 42  # policy.seed when neither it nor the algorithm sets one

KNOWN_TRAINING_SECTIONS: dict[str, _KnownSection] = {
    "megatron_cfg": _KnownSection("megatron", "nrl-backend-megatron", {}),
    "dtensor_config": _KnownSection("dtensor", "nrl-backend-dtensor", {"dtensor_cfg": "dtensor_config"}),
}
KNOWN_GENERATION_SECTIONS: dict[str, _KnownSection] = {
    "vllm_cfg": _KnownSection("vllm", "nrl-gen-vllm", {}),
    "hf_cfg": _KnownSection("hf", "nrl-gen-hf", {}),
}

_UNINSTALLED = Section(open=True, nullable=True, doc="section of a plugin that is not installed")


@dataclass(frozen=True)
class BackendChoice:
    training: TrainingBackendSpec
    generation: GenerationBackendSpec | None
    overridden: tuple[str, ...] = ()


def build_schema(pm: PluginManager) -> Section:
    """The core schema with every installed plugin's section attached where it belongs (each
    algorithm's at the top level), then NeMo RL's other keys as inert fields."""
    schema = CORE_SCHEMA
    shared: dict[tuple[str, str], tuple[str, Any]] = {}
    for algorithm in pm.algorithms():
        if algorithm.config_schema is not None:
            schema = schema.attach("", algorithm.section, algorithm.config_schema)
        for path, section in algorithm.shared_keys.items():
            for key, spec in section.fields.items():
                owner, known = shared.setdefault((path, key), (algorithm.name, spec))
                if known != spec:
                    raise ConfigError(f"{path}.{key}", f"algorithms '{owner}' and '{algorithm.name}' declare it "
                                                       "differently; rename it in one of them")
                schema = schema.attach(path, key, spec)
    installed_keys: set[str] = set()
    for spec in pm.training_backends():
        schema = schema.attach("policy", spec.config_key, spec.config_schema, aliases=spec.config_aliases)
        installed_keys.add(spec.config_key)
    for key, known in KNOWN_TRAINING_SECTIONS.items():
        if key not in installed_keys:
            schema = schema.attach("policy", key, _UNINSTALLED, aliases=known.aliases)
    installed_keys.clear()
    for gspec in pm.generation_backends():
        schema = schema.attach("policy.generation", gspec.config_key, replace(gspec.config_schema, nullable=True))
        installed_keys.add(gspec.config_key)
    for key, known in KNOWN_GENERATION_SECTIONS.items():
        if key not in installed_keys:
            schema = schema.attach("policy.generation", key, _UNINSTALLED, aliases=known.aliases)
    for espec in pm.environments():
        env_schema = espec.config_schema
        if "call_timeout_s" not in env_schema.fields:
            env_schema = env_schema.with_fields(call_timeout_s=ENV_CALL_TIMEOUT)
        schema = schema.attach("env", espec.name, env_schema)
    for sink in pm.metric_sinks():  # logger.<name>_enabled switches it on; logger.<name> holds its options
        schema = schema.attach("logger", f"{sink.name}_enabled", Field(type=bool, default=False))
        schema = schema.attach("logger", sink.name, Section(open=True))
    schema = _attach_estimator_keys(schema, pm)
    for loss in pm.loss_functions():
        if loss.config_schema is not None:
            schema = schema.attach("loss_fn", loss.name, loss.config_schema)
    return with_nemo_rl_keys(schema)


def _attach_estimator_keys(schema: Section, pm: PluginManager) -> Section:
    """Each estimator's keys join ``grpo.adv_estimator`` flat, as NeMo RL lays them out; a key two
    estimators declare differently is an error naming both."""
    grpo = schema.fields.get("grpo")
    if not isinstance(grpo, Section) or "adv_estimator" not in grpo.fields:
        return schema
    declared: dict[str, tuple[str, Any]] = {}
    for spec in pm.advantage_estimators():
        for key, field in (spec.config_schema.fields.items() if spec.config_schema else ()):
            owner, known = declared.setdefault(key, (spec.name, field))
            if known != field:
                raise ConfigError("grpo.adv_estimator", f"advantage estimators '{owner}' and '{spec.name}' declare "
                                                        f"'{key}' differently; rename it in one of them")
            schema = schema.attach("grpo.adv_estimator", key, field)
    return schema


def algorithm_sections(pm: PluginManager) -> dict[str, str]:
    """Top-level section -> name of each installed algorithm that brings a schema."""
    return {spec.section: spec.name for spec in pm.algorithms() if spec.config_schema is not None}


def validate_config(raw: Mapping[str, Any], pm: PluginManager, *,
                    algorithm: str | None = None, backend_checks: bool = True) -> dict[str, Any]:
    """Check ``raw`` (from :func:`nrl_core.config.loader.load_config`) and return the full config.

    After the schema, :func:`nrl_core.config.checks.check_config` relates values to each other, to
    the filesystem and to the selected backends. Algorithm sections are checked for ``algorithm``
    (the one about to run) or, without one, for each installed algorithm whose section ``raw`` sets.
    A section of a NeMo RL algorithm nrl lacks is refused first, in one line. ``backend_checks=False``
    leaves out the selected backends' own checks, the slow part (they import transformers to read
    the model's config): ``nrl train`` runs them with :func:`check_selected_backends` while the
    policy's workers start.
    """
    clashes = pm.clashes(commands=False)
    if clashes:
        more = f" ({len(clashes) - 1} more: nrl plugins lists them)" if len(clashes) > 1 else ""
        raise PluginError(clashes[0] + more)
    try:
        return _validate(raw, pm, algorithm, backend_checks)
    except ConfigError as exc:
        raise _in_the_users_spelling(exc, raw, pm) from None


def _in_the_users_spelling(exc: ConfigError, raw: Mapping[str, Any], pm: PluginManager) -> ConfigError:
    """``exc`` with its key path in the spelling the config used (``policy.dtensor_cfg``, NeMo RL's,
    rather than ``policy.dtensor_config``), so the line names a key the user can find."""
    policy = raw.get("policy")
    if not isinstance(policy, Mapping):
        return exc
    for spec in pm.training_backends():
        for old, new in spec.config_aliases.items():
            prefix = f"policy.{new}"
            if old in policy and (exc.key_path == prefix or exc.key_path.startswith(prefix + ".")):
                return ConfigError(f"policy.{old}" + exc.key_path[len(prefix):], exc.message)
    return exc


def _validate(raw: Mapping[str, Any], pm: PluginManager, algorithm: str | None,
              backend_checks: bool) -> dict[str, Any]:
    sections = algorithm_sections(pm)
    refuse_missing_algorithm(raw, sections)
    if algorithm is not None:
        pm.algorithms().get(algorithm, "algorithm")  # an unknown name is refused with the installed ones
    _check_environments(raw, pm)
    owned = [key for key in model_section_owners(pm) if key in raw]
    models = {key: raw[key] for key in owned if raw[key] is not None}
    with warn_inert_keys_once(lambda noted: named_inert_keys(noted, raw)):
        schema = build_schema(pm)
        config = schema.validate({k: v for k, v in raw.items() if k not in owned})
        assert config is not None
        _note_situational_inert_keys(config)
        for key in owned:
            config[key] = None if raw[key] is None else schema.fields["policy"].validate(raw[key], key)
    _check_uninstalled_sections(config, pm)
    _enable_default_backend(raw, config, pm)
    _expand_short_forms(config, pm)
    training, generation = _selected_backends(config, pm)
    algorithms = [algorithm] if algorithm is not None else [name for key, name in sections.items() if key in raw]
    _resolve_seed(config, algorithms)
    _resolve_episode_environment(raw, config, pm)
    for key in models:
        config[key] = _completed_model(raw, config, key, pm)
    check_config(config, pm, algorithms=algorithms, training=training, generation=generation,
                 backends=backend_checks)
    if backend_checks:
        check_model_sections(config, pm)
    return config


def _completed_model(raw: Mapping[str, Any], config: dict[str, Any], key: str, pm: PluginManager) -> dict[str, Any]:
    """A model section (:mod:`nrl_core.config.models`) with its backend enabled and short forms
    expanded as the policy's, and the core's checks of it; errors name ``<key>.``."""
    model = model_config(config, key)
    try:
        _check_uninstalled_sections(model, pm)
        _enable_default_backend({"policy": raw[key]}, model, pm)
        _expand_short_forms(model, pm)
        checks.check_model(model, choose_backends(model, pm, generation=False, warn=False).training, pm)
    except ConfigError as exc:
        raise renamed_error(exc, key) from None
    return model["policy"]


def check_model_sections(config: Mapping[str, Any], pm: PluginManager) -> None:
    """The model sections' backend checks that ``validate_config(..., backend_checks=False)`` left out."""
    for key in model_section_owners(pm):
        if config.get(key) is not None:
            model = model_config(config, key)
            try:
                checks.run_backend_check(choose_backends(model, pm, generation=False, warn=False).training.config_check,
                                         model)
            except ConfigError as exc:
                raise renamed_error(exc, key) from None


def check_selected_backends(config: Mapping[str, Any], pm: PluginManager, *,
                            algorithm: str) -> None:
    """The backends' own checks that ``validate_config(..., backend_checks=False)`` left out, for a
    config it returned and the ``algorithm`` about to run."""
    training, generation = _selected_backends(config, pm)
    checks.check_backends(config, pm, algorithms=[algorithm], training=training, generation=generation)
    check_model_sections(config, pm)


def _resolve_seed(config: dict[str, Any], algorithms: Sequence[str]) -> None:
    """``policy.seed`` left null becomes the running algorithm's seed (42 without one), here and
    only here, so every backend and engine reads the same number from ``policy.seed``."""
    policy = config.get("policy")
    if not isinstance(policy, dict) or policy.get("seed") is not None:
        return
    seeds = [config[name]["seed"] for name in algorithms
             if isinstance(config.get(name), Mapping) and config[name].get("seed") is not None]
    policy["seed"] = int(seeds[0]) if seeds else DEFAULT_SEED


def _selected_backends(config: Mapping[str, Any],
                       pm: PluginManager) -> tuple[TrainingBackendSpec | None, GenerationBackendSpec | None]:
    """The backends a run would use, or None where the choice itself fails (that failure is
    reported when the run asks for the backend, with its own message)."""
    try:
        training: TrainingBackendSpec | None = choose_backends(config, pm, generation=False, warn=False).training
    except ConfigError:
        training = None
    generation = None
    if config["policy"]["generation"] is not None:
        registry = pm.generation_backends()
        name = config["policy"]["generation"]["backend"]
        generation = registry.get(name, "policy.generation.backend") if name in registry.names() else None
    return training, generation


def _note_situational_inert_keys(config: Mapping[str, Any]) -> None:
    """Keys that act in some configurations only: named in the inert-keys warning where they do not."""
    generation = config["policy"]["generation"]
    if generation is not None and generation["colocated"]["enabled"]:
        for key, value in generation["colocated"]["resources"].items():
            if value is not None:
                note_inert(f"policy.generation.colocated.resources.{key}", value)


#: Keys of NeMo RL's ``env`` section that switch on NeMo Gym rather than name an environment.
NEMO_GYM_KEYS = ("should_use_nemo_gym", "nemo_gym", "should_log_nemo_gym_responses")


def _check_environments(raw: Mapping[str, Any], pm: PluginManager) -> None:
    envs = raw.get("env")
    if not isinstance(envs, Mapping):
        return
    registry = pm.environments()
    for name in envs:
        if name in NEMO_GYM_KEYS and name not in registry:
            raise ConfigError(f"env.{name}", "is NeMo Gym's switch (its environments and rollout servers), a feature "
                                             "nrl lacks; remove env.should_use_nemo_gym and env.nemo_gym to use nrl's "
                                             "environments")
        if name not in registry:
            raise ConfigError(f"env.{name}", registry.missing_message(str(name)))


def _resolve_episode_environment(raw: Mapping[str, Any], config: dict[str, Any], pm: PluginManager) -> None:
    """With several turns (``grpo.max_rollout_turns``) and a ``data.env_name`` that scores single
    responses, the environment is the one multi-turn environment the config's ``env`` section
    names: NeMo RL's sliding-puzzle recipe names its game only there."""
    turns = int((config.get("grpo") or {}).get("max_rollout_turns") or 1)
    data = config.get("data")
    envs = raw.get("env")
    if turns == 1 or not isinstance(data, dict) or not isinstance(envs, Mapping):
        return
    registry = pm.environments()
    if data.get("env_name") in registry and registry.get(data["env_name"], "data.env_name").multi_turn:
        return
    named = [name for name in envs if name in registry and registry.get(name, "env").multi_turn]
    if len(named) == 1:
        data["env_name"] = named[0]
        spec = registry.get(named[0], "env")
        if spec.runner_data:
            draw_runner_data(config, named[0], spec)


def _check_uninstalled_sections(config: dict[str, Any], pm: PluginManager) -> None:
    policy = config["policy"]
    installed = {spec.config_key for spec in pm.training_backends()}
    for key, known in KNOWN_TRAINING_SECTIONS.items():
        section = policy.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True and key not in installed:
            raise ConfigError(f"policy.{key}.enabled",
                              f"is true but the {known.backend} backend is not installed; pip install {known.distribution}")


def _enable_default_backend(raw: Mapping[str, Any], config: dict[str, Any], pm: PluginManager) -> None:
    """A config that names no training backend section at all (the documented minimal shape)
    trains with the installed backend of *lowest* priority, the general-purpose one (DTensor
    when installed), as NeMo RL's base configs do. Naming any section, even disabled, opts out."""
    policy_raw = raw.get("policy") if isinstance(raw.get("policy"), Mapping) else {}
    registry = pm.training_backends()
    spellings = {key for spec in registry for key in (spec.config_key, *spec.config_aliases)}
    spellings |= {key for known_key, known in KNOWN_TRAINING_SECTIONS.items() for key in (known_key, *known.aliases)}
    if not len(registry) or any(key in policy_raw for key in spellings):
        return
    default = min(registry, key=lambda spec: spec.priority)
    config["policy"][default.config_key]["enabled"] = True
    logger.info("no training backend section in the config; using '%s' (set policy.<backend section>.enabled "
                "to choose)", default.name)


def _expand_short_forms(config: dict[str, Any], pm: PluginManager) -> None:
    """Map the documented minimal shape onto the full keys (see docs/configuration.md)."""
    policy = config["policy"]
    if policy.get("max_seq_length") is not None:
        policy["max_total_sequence_length"] = policy["max_seq_length"]
    if policy.get("refit_buffer_size_gb") is not None:
        policy["refit"]["bucket_size_mb"] = float(policy["refit_buffer_size_gb"]) * 1024
    generation = policy["generation"]
    if generation is not None:
        for gspec in pm.generation_backends():
            if gspec.name == generation["backend"] and generation.get(gspec.config_key) is None:
                generation[gspec.config_key] = gspec.config_schema.validate({}, f"policy.generation.{gspec.config_key}")
    if policy["tokenizer"]["name"] is None:
        policy["tokenizer"]["name"] = policy["model_name"]
    _flatten_dataset_layout(config["data"], pm)
    algorithm = config["algorithm"]
    if algorithm["batch_size"] is not None or algorithm["gradient_accumulation_steps"] is not None:
        micro = algorithm["batch_size"] or 1
        accumulation = algorithm["gradient_accumulation_steps"] or 1
        dp = data_parallel_size(config, pm)
        policy["train_micro_batch_size"] = micro
        policy["logprob_batch_size"] = micro
        policy["train_global_batch_size"] = micro * accumulation * dp


#: What a dataset of NeMo RL's layout says about its prompts and its environment, and the flat key
#: nrl's processors and algorithms read it from.
_PROMPTING_KEYS = ("prompt_file", "system_prompt_file", "processor", "env_name")
NEMO_RL_DEFAULT_PROCESSOR = "math_hf_data_processor"  # NeMo RL's processor when a dataset names none


def _flatten_dataset_layout(data: dict[str, Any], pm: PluginManager) -> None:
    """NeMo RL's layout prompts and scores each dataset by its own settings; nrl prompts and scores
    a run's data one way, so the datasets' settings, which must agree, become the flat keys."""
    if data["train"] is None:
        _refuse_half_a_layout(data, pm)
        if data["default"]["env_name"] is not None:
            data["env_name"] = data["default"]["env_name"]
        return
    if data["train_data_path"]:
        raise ConfigError("data.train_data_path", "names training data beside data.train (NeMo RL's layout); keep one")
    if data["dataset_name"]:
        raise ConfigError("data.dataset_name", "is NeMo RL's older spelling, which NeMo RL ignores beside data.train "
                                               f"(it would read {data['train'][0].get('dataset_name')}); move it to "
                                               "data.train.dataset_name or remove it")
    entries = [(f"data.{role}[{i}]", entry) for role in ("train", "validation")
               for i, entry in enumerate(data[role] or [])]
    first_path, first = entries[0]
    for key in _PROMPTING_KEYS:
        for path, entry in entries[1:]:
            if entry.get(key) != first.get(key):
                raise ConfigError(f"{path}.{key}", f"is {entry.get(key)!r} where {first_path}.{key} is "
                                                   f"{first.get(key)!r}: nrl prompts and scores a run's datasets one "
                                                   f"way (NeMo RL's per-dataset tasks, which nrl lacks); give every "
                                                   f"dataset the same {key}")
    data["prompt_file"], data["system_prompt_file"] = first.get("prompt_file"), first.get("system_prompt_file")
    data["processor"] = first.get("processor") or NEMO_RL_DEFAULT_PROCESSOR
    if first.get("env_name"):
        data["env_name"] = first["env_name"]
    data["input_key"], data["output_key"] = "problem", "expected_answer"  # what registered datasets' records hold


def _refuse_half_a_layout(data: dict[str, Any], pm: PluginManager) -> None:
    """NeMo RL's keys without ``data.train`` would do nothing: one line instead."""
    if data["validation"] is not None:
        raise ConfigError("data.validation", "names validation datasets but data.train names none; add data.train "
                                             "(NeMo RL's layout) or use data.val_data_path")
    unread = sorted(k for k, v in data["default"].items() if v is not None and k != "env_name")
    if unread:
        raise ConfigError(f"data.default.{unread[0]}", "applies to the datasets of data.train, and data.train names "
                                                      "none; add data.train or set the flat data key")
    name = data["dataset_name"]
    if name and name in pm.datasets() and name not in pm.dataset_generators():
        raise ConfigError("data.dataset_name", f"'{name}' is a named dataset of NeMo RL's layout; write it as "
                                               f"data.train.dataset_name (with data.train.data_path for a local copy)")


def data_parallel_size(config: Mapping[str, Any], pm: PluginManager) -> int:
    """Training ranks divided by the ranks one model replica spans under the selected backend."""
    try:
        spec: TrainingBackendSpec | None = choose_backends(config, pm, generation=False, warn=False).training
    except ConfigError:
        spec = None
    return checks.data_parallel_size(config, spec, pm)


# --------------------------------------------------------------------------- selection


def select_training_backend(config: Mapping[str, Any], pm: PluginManager) -> TrainingBackendSpec:
    """The enabled training backend of highest priority; a warning names what it overrode."""
    return choose_backends(config, pm, generation=False).training


def choose_backends(config: Mapping[str, Any], pm: PluginManager, *, generation: bool = True,
                    warn: bool = True) -> BackendChoice:
    """The enabled training backend of highest priority (with ``warn``, a warning names those it
    overrode: the run warns, validation does not repeat it) and the configured generation backend."""
    registry = pm.training_backends()
    policy = config["policy"]
    candidates = [spec for spec in registry
                  if isinstance(policy.get(spec.config_key), Mapping) and policy[spec.config_key].get("enabled") is True]
    if not candidates:
        if not len(registry):
            raise ConfigError("policy", "no training backend is installed; pip install nrl-backend-dtensor or nrl-backend-megatron")
        keys = " or ".join(f"policy.{spec.config_key}.enabled=true" for spec in sorted(registry, key=lambda s: s.name))
        raise ConfigError("policy", f"no training backend is enabled; set {keys}")
    candidates.sort(key=lambda spec: spec.priority, reverse=True)
    chosen, overridden = candidates[0], tuple(spec.name for spec in candidates[1:])
    if overridden and warn:
        logger.warning("policy.%s and %s are all enabled; using '%s' (highest priority), not %s",
                       chosen.config_key, ", ".join(f"policy.{s.config_key}" for s in candidates[1:]),
                       chosen.name, ", ".join(f"'{n}'" for n in overridden))
    gen_spec = None
    if generation and policy.get("generation") is not None:
        gen_spec = pm.generation_backends().get(policy["generation"]["backend"], "policy.generation.backend")
    return BackendChoice(training=chosen, generation=gen_spec, overridden=overridden)
