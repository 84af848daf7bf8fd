"""Plugin loading and the registries built from the registration hooks.

Plugins are modules named by entry points in the ``nrl`` group; first-party plugins are installed
and found exactly like third-party ones. Loading is lazy (the first time anything asks), happens
once per process, and is guarded: a plugin that fails to import is a warning naming the plugin,
its distribution and the error, and the others still load.

Environment switches:

* ``NRL_STRICT_PLUGINS=1``: a plugin that fails to load is an error (use in CI).
* ``NRL_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (only the core's built-ins).
* ``NRL_BLOCKED_PLUGINS=a,b``: skip these plugins (entry-point names, or modules named in ``NRL_PLUGINS``).
* ``NRL_PLUGINS=pkg.mod,other``: also register these importable modules as plugins, after the
  entry points (a run's own lifecycle hooks without packaging them; like ``PYTEST_PLUGINS``).
* ``NRL_TRACE_HOOKS=1``: print every hook call and result to stderr.

Each plugin is written for a version of the plugin contract (``NRL_CONTRACT`` in its entry-point
module, 1 when absent; :mod:`nrl_core.contract_versions`). The registries give the worker of a
backend written for an older contract through :mod:`nrl_core.contract_adapters`, and a plugin's
``nrl-core`` range is not held against it while the core still serves its contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata as md
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pluggy

from nrl_core import hookspecs
from nrl_core.contract_versions import SERVED_CONTRACTS, adapter_path, declared_contract, served_range
from nrl_core.contracts import (
    CONTRACT_VERSION,
    AdvantageEstimatorSpec,
    AlgorithmSpec,
    CommandSpec,
    DataProcessorSpec,
    DatasetGeneratorSpec,
    DatasetSpec,
    EnvironmentSpec,
    GenerationBackendSpec,
    LossFunctionSpec,
    MetricSinkSpec,
    RefitTransportSpec,
    RunInfo,
    TrainingBackendSpec,
)
from nrl_core.errors import ConfigError, NrlError, PluginError
from nrl_core.plugin_faults import PluginOwner

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "nrl"
hookimpl = hookspecs.hookimpl

BUILTIN_PLUGINS: tuple[str, ...] = ("nrl_core.builtin",)
"""Modules of the core registered directly: its algorithms, transports and metric sinks."""

FIRST_PARTY_DISTRIBUTIONS: dict[str, str] = {
    "dtensor": "nrl-backend-dtensor",
    "megatron": "nrl-backend-megatron",
    "vllm": "nrl-gen-vllm",
    "hf": "nrl-gen-hf",
    "math": "nrl-env-math",
    **{name: "nrl-data-nemo-rl" for name in (  # NeMo RL's dataset and processor names
        "OpenMathInstruct-2", "DAPOMath17K", "DAPOMathAIME2024", "AIME2024", "AIME2025", "AIME2026", "gsm8k", "GSM8K",
        "DeepScaler", "OpenR1-Math-220k", "squad", "tulu3_sft_mixture", "Nemotron-Cascade-2-SFT-Math", "ResponseDataset", "HelpSteer3",
        "Tulu3Preference", "PreferenceDataset", "BinaryPreferenceDataset", "math_hf_data_processor",
        "math_data_processor", "sft_processor")},
}
"""Where the first-party plugins come from, so a miss can say what to ``pip install``."""

NEMO_RL_FEATURES_NRL_LACKS: dict[tuple[str, str], str] = {
    ("generation backend", "megatron"): "generation with Megatron-Core's inference engine",
    ("generation backend", "sglang"): "SGLang generation backend",
    ("generation backend", "trtllm"): "TensorRT-LLM generation backend",
    ("generation backend", "dynamo"): "Dynamo generation backend",
    **{("dataset", name): "multimodal (vision/audio/video) training data dataset" for name in (
        "clevr-cogent", "geometry3k", "refcoco", "mmpr-tiny", "avqa", "audiomcq", "daily-omni", "intent-train",
        "intent-bench", "general-conversation-jsonl")},
    ("dataset", "NemoGymDataset"): "NeMo Gym environments' dataset",
    ("dataset", "arrow_text"): "cross-tokenizer distillation dataset",
}
"""NeMo RL's names no nrl distribution provides, by registry kind, so a miss names the feature
rather than a ``pip install`` (nrl-backend-megatron trains; it does not generate)."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_names(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


@dataclass(frozen=True)
class PluginInfo:
    """What ``nrl plugins`` shows about one registered plugin."""

    name: str
    distribution: str | None
    version: str | None
    hooks: list[str]
    contract: int | None = None


T = TypeVar("T")


class Registry(Generic[T]):
    """Descriptors of one kind keyed by ``name``, each with the plugin (entry-point name) that
    registered it.

    A name registered twice keeps its first registration, a warning names both, and :meth:`get`
    of that name fails in one line saying which entry point to block. ``nrl plugins`` and validation
    refuse any clash up front (:meth:`PluginManager.clashes`), since which registration comes first
    is load order.
    """

    def __init__(self, kind: str, specs: Iterable[tuple[str, T]], failed: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self._specs: dict[str, T] = {}
        self._owners: dict[str, str] = {}
        self.clashes: dict[str, str] = {}
        self._failed = dict(failed or {})
        for plugin, spec in specs:
            name = spec.name
            if name not in self._specs:
                self._specs[name], self._owners[name] = spec, plugin
                continue
            first = f"entry point '{self._owners[name]}' of {getattr(self._specs[name], 'distribution', '?')}"
            second = f"entry point '{plugin}' of {getattr(spec, 'distribution', '?')}"
            self.clashes[name] = (f"{kind} '{name}' is registered twice (by {first} and by {second}); uninstall one "
                                  f"distribution or block one entry point, e.g. NRL_BLOCKED_PLUGINS={plugin}")
            logger.warning("%s", self.clashes[name])

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[T]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def owner(self, name: str) -> str:
        """The plugin (entry-point name, or the core's module) that registered ``name``."""
        return self._owners[name]

    def plugin_owner(self, name: str) -> PluginOwner:
        """Who provides ``name``, as a plugin's fault names it (:mod:`nrl_core.plugin_faults`)."""
        return PluginOwner(self.kind, name, getattr(self._specs[name], "distribution", "?"), self._owners[name])

    def get(self, name: str, key_path: str) -> T:
        """The spec called ``name``; a miss is a :class:`ConfigError` at ``key_path`` that lists
        what is installed and which distribution would provide ``name``; a clash is a
        :class:`PluginError` naming both registrations."""
        if name in self.clashes:
            raise PluginError(self.clashes[name])
        try:
            return self._specs[name]
        except KeyError:
            raise ConfigError(key_path, self.missing_message(name)) from None

    def missing_message(self, name: str) -> str:
        installed = ", ".join(self.names()) or "none"
        lacking = NEMO_RL_FEATURES_NRL_LACKS.get((self.kind, name))
        if lacking is not None:
            return f"'{name}' is NeMo RL's {lacking}, which nrl lacks (installed: {installed})"
        hint = FIRST_PARTY_DISTRIBUTIONS.get(name)
        fix = f"pip install {hint}" if hint else "install the plugin that provides it"
        failed = "".join(f"; {message}" for message in self._failed.values())
        return f"{self.kind} '{name}' is not available (installed: {installed}); {fix}{failed}"


class PluginManager:
    """nrl's front-end over pluggy: the rest of the core calls these typed methods, never
    ``pm.hook.*`` directly."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._loaded = False
        self._distributions: dict[str, tuple[str, str]] = {}
        self._contracts: dict[str, int] = {}
        self._registries: dict[str, Registry[Any]] = {}
        self.failed: dict[str, str] = {}
        if _env_flag("NRL_TRACE_HOOKS"):
            self._pm.trace.root.setwriter(lambda text: sys.stderr.write(text))
            self._pm.enable_tracing()

    # ------------------------------------------------------------------ loading

    def load(self) -> None:
        """Register built-ins and entry-point plugins; idempotent."""
        if self._loaded:
            return
        self._loaded = True
        for module_name in BUILTIN_PLUGINS:
            self._pm.register(__import__(module_name, fromlist=["_"]), name=module_name)
        blocked = set(_env_names("NRL_BLOCKED_PLUGINS"))
        if not _env_flag("NRL_DISABLE_PLUGIN_AUTOLOAD"):
            for ep in _unique_entry_points():
                if ep.name in blocked:
                    logger.info("plugin '%s' is blocked by NRL_BLOCKED_PLUGINS", ep.name)
                    continue
                self._load_entry_point(ep)
        for module_name in _env_names("NRL_PLUGINS"):
            if module_name in blocked:
                logger.info("plugin '%s' is blocked by NRL_BLOCKED_PLUGINS", module_name)
                continue
            self._load_guarded(module_name, "named in NRL_PLUGINS", lambda m=module_name: importlib.import_module(m))
        self._check_pending()

    def _load_entry_point(self, ep: md.EntryPoint) -> None:
        dist_name = ep.dist.name if ep.dist else "unknown distribution"
        dist_version = ep.dist.version if ep.dist else "?"

        def load() -> object:
            _check_core_requirement(ep)  # a plugin that needs a newer core is refused before it imports
            module = ep.load()
            self._contracts[ep.name] = declared_contract(module, ep.name)
            _check_core_requirement(ep, contract=self._contracts[ep.name])
            return module

        if self._load_guarded(ep.name, f"{dist_name} {dist_version}", load):
            self._distributions[ep.name] = (dist_name, dist_version)

    def _load_guarded(self, name: str, origin: str, load: Callable[[], object]) -> bool:
        """Register what ``load()`` returns as plugin ``name``; a failure is a warning naming the
        plugin, ``origin`` and the error (an error under NRL_STRICT_PLUGINS)."""
        try:
            plugin = load()
            if name not in self._contracts:  # an entry point's load() has recorded it already
                self._contracts[name] = declared_contract(plugin, name)
            self._pm.register(plugin, name=name)
        except Exception as exc:  # a broken plugin must not take the others down
            self._contracts.pop(name, None)
            message = f"plugin '{name}' ({origin}) failed to load: {type(exc).__name__}: {exc}"
            if _env_flag("NRL_STRICT_PLUGINS"):
                raise PluginError(message + " (NRL_STRICT_PLUGINS is set)") from exc
            self.failed[name] = message
            logger.warning("%s", message)
            return False
        return True

    def _check_pending(self, *, strict: bool = False) -> None:
        """A plugin implementing a hook nrl does not define (a misspelling) would silently never
        run: it is unloaded with a warning naming the hook and the likely one (an error in strict
        mode and for plugins registered in-process), and the other plugins stay."""
        while True:
            try:
                self._pm.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                plugin_name = self._pm.get_name(exc.plugin) if exc.plugin is not None else "?"
                message = f"plugin '{plugin_name}' implements a hook nrl does not define: {_unknown_hooks(exc.plugin)}"
                if strict or _env_flag("NRL_STRICT_PLUGINS") or exc.plugin is None:
                    raise PluginError(message + (" (NRL_STRICT_PLUGINS is set)" if not strict else "")) from exc
                self._pm.unregister(exc.plugin)
                self._distributions.pop(plugin_name, None)
                self.failed[plugin_name] = message
                logger.warning("%s; it is not loaded", message)

    @contextlib.contextmanager
    def registered(self, plugin: object, name: str) -> Iterator[object]:
        """Register ``plugin`` in-process for the duration of a ``with`` block (tests, notebooks)."""
        self.load()
        contract = declared_contract(plugin, name)
        self._pm.register(plugin, name=name)
        self._contracts[name] = contract
        self._registries.clear()
        try:
            self._check_pending(strict=True)
            yield plugin
        finally:
            self._pm.unregister(name=name)
            self._contracts.pop(name, None)
            self._registries.clear()

    # ------------------------------------------------------------------ introspection

    def list_plugins(self) -> list[PluginInfo]:
        self.load()
        infos = []
        for name, plugin in self._pm.list_name_plugin():
            if plugin is None:
                continue
            hooks = sorted(caller.name for caller in self._pm.get_hookcallers(plugin) or [])
            dist, version = self._distributions.get(name, (None, None))
            if name in BUILTIN_PLUGINS:
                dist, version = "nrl-core", _own_version()
            infos.append(PluginInfo(name=name, distribution=dist, version=version, hooks=hooks,
                                    contract=self.contract_of(name)))
        return sorted(infos, key=lambda info: info.name)

    def contract_of(self, plugin: str) -> int:
        """The contract version plugin ``plugin`` (entry-point name) is written for; the core's
        built-ins meet the current one."""
        return CONTRACT_VERSION if plugin in BUILTIN_PLUGINS else self._contracts.get(plugin, SERVED_CONTRACTS[0])

    def versions(self) -> dict[str, str]:
        """``{distribution: version}`` of every loaded plugin, recorded in run metadata."""
        return {info.distribution: info.version for info in self.list_plugins() if info.distribution and info.version}

    # ------------------------------------------------------------------ registries

    def _registry(self, kind: str, hook: Any) -> Registry[Any]:
        """The registry of one collecting hook, each answer attributed to the plugin that gave it
        (built-ins first, then plugins in load order)."""
        self.load()
        if kind not in self._registries:
            specs = []
            for impl in hook.get_hookimpls():  # in registration order (pluggy calls them in reverse)
                result = self._answer(hook.name, impl)
                if _env_flag("NRL_TRACE_HOOKS"):
                    sys.stderr.write(f"nrl hook {hook.name} -> {impl.plugin_name}: {result!r}\n")
                specs.extend((impl.plugin_name, self._adapted(kind, impl.plugin_name, spec)) for spec in result or [])
            self._registries[kind] = Registry(kind, specs, self.failed)
        return self._registries[kind]

    def _answer(self, hook: str, impl: Any) -> Any:
        """What one plugin's implementation of a collecting hook returns: a list of specs. What it
        raises, or a result of another type, is one line naming the plugin (an ``NrlError`` it
        raises is its own message; the core's built-ins keep their traceback)."""
        plugin = impl.plugin_name
        try:
            result = impl.function()
        except NrlError:
            raise
        except Exception as exc:
            if plugin in BUILTIN_PLUGINS:
                raise
            message = " ".join(str(exc).split())
            raise PluginError(f"{self._describe(plugin)}: {hook} raised {type(exc).__name__}: {message} (NRL_DEBUG=1 "
                              f"shows its traceback)") from exc
        if result is not None and not isinstance(result, list | tuple):
            raise PluginError(f"{self._describe(plugin)}: {hook} returned {type(result).__name__}; it must return a "
                              "list of specs (or None)")
        return result

    def _describe(self, plugin: str) -> str:
        distribution = self._distributions.get(plugin, (None, None))[0]
        return f"plugin '{plugin}'" + (f" of {distribution}" if distribution else " (an NRL_PLUGINS module)")

    def _adapted(self, kind: str, plugin: str, spec: Any) -> Any:
        """``spec`` with its worker path through :mod:`nrl_core.contract_adapters` when its plugin
        is written for an older contract (nothing is imported here)."""
        role = {"training backend": "training", "generation backend": "generation"}.get(kind)
        if role is None or not isinstance(getattr(spec, "worker", None), str):
            return spec
        path = adapter_path(spec.worker, role, self.contract_of(plugin), plugin)
        return spec if path == spec.worker else dataclasses.replace(spec, worker=path)

    def clashes(self, *, commands: bool = True) -> list[str]:
        """One line for each name two plugins register in one registry, naming both distributions.
        Which of the two a lookup would get depends on load order, so ``nrl plugins`` and
        validation refuse an installation with any; ``commands=False`` leaves out the subcommands,
        which no config selects."""
        registries = [self.training_backends(), self.generation_backends(), self.environments(),
                      self.refit_transports(), self.metric_sinks(), self.data_processors(), self.dataset_generators(),
                      self.datasets(), self.algorithms(), self.advantage_estimators(), self.loss_functions()]
        if commands:
            registries.append(self.commands())
        return [message for registry in registries for message in registry.clashes.values()]

    def training_backends(self) -> Registry[TrainingBackendSpec]:
        return self._registry("training backend", self._pm.hook.nrl_training_backends)

    def generation_backends(self) -> Registry[GenerationBackendSpec]:
        return self._registry("generation backend", self._pm.hook.nrl_generation_backends)

    def environments(self) -> Registry[EnvironmentSpec]:
        return self._registry("environment", self._pm.hook.nrl_environments)

    def refit_transports(self) -> Registry[RefitTransportSpec]:
        return self._registry("refit transport", self._pm.hook.nrl_refit_transports)

    def metric_sinks(self) -> Registry[MetricSinkSpec]:
        return self._registry("metric sink", self._pm.hook.nrl_metric_sinks)

    def data_processors(self) -> Registry[DataProcessorSpec]:
        return self._registry("data processor", self._pm.hook.nrl_data_processors)

    def dataset_generators(self) -> Registry[DatasetGeneratorSpec]:
        return self._registry("dataset generator", self._pm.hook.nrl_dataset_generators)

    def datasets(self) -> Registry[DatasetSpec]:
        return self._registry("dataset", self._pm.hook.nrl_datasets)

    def algorithms(self) -> Registry[AlgorithmSpec]:
        return self._registry("algorithm", self._pm.hook.nrl_algorithms)

    def advantage_estimators(self) -> Registry[AdvantageEstimatorSpec]:
        return self._registry("advantage estimator", self._pm.hook.nrl_advantage_estimators)

    def loss_functions(self) -> Registry[LossFunctionSpec]:
        return self._registry("loss function", self._pm.hook.nrl_loss_functions)

    def commands(self) -> Registry[CommandSpec]:
        return self._registry("command", self._pm.hook.nrl_commands)

    # ------------------------------------------------------------------ dispatch hooks

    def checkpoint_save(self, worker: object, path: str, options: Any) -> None:
        self._dispatch("nrl_checkpoint_save", worker, path=path, options=options)

    def checkpoint_load(self, worker: object, path: str, options: Any) -> None:
        self._dispatch("nrl_checkpoint_load", worker, path=path, options=options)

    # ------------------------------------------------------------------ lifecycle hooks (driver only)

    def run_start(self, run: RunInfo) -> None:
        self.load()
        self._pm.hook.nrl_run_start(run=run)

    def step_end(self, run: RunInfo, step: int, metrics: dict[str, float]) -> str | None:
        """Why the run should stop after ``step`` (every reason given, joined), or ``None``."""
        self.load()
        reasons = [str(reason) for reason in self._pm.hook.nrl_step_end(run=run, step=step, metrics=metrics) if reason]
        return "; ".join(reasons) or None

    def checkpoint_saved(self, run: RunInfo, step: int, path: str, metrics: dict[str, float]) -> None:
        self.load()
        self._pm.hook.nrl_checkpoint_saved(run=run, step=step, path=path, metrics=metrics)

    def run_end(self, run: RunInfo, status: str, last_step: int, metrics: dict[str, float],
                outputs: dict[str, str]) -> None:
        self.load()
        self._pm.hook.nrl_run_end(run=run, status=status, last_step=last_step, metrics=metrics, outputs=outputs)

    def _dispatch(self, hook_name: str, worker: object, **kwargs: Any) -> None:
        """The deprecated checkpoint hooks, for a worker of contract 1-3 (whose adapter calls this)."""
        self.load()
        result = getattr(self._pm.hook, hook_name)(worker=worker, **kwargs)
        name = f"{type(worker).__module__}.{type(worker).__qualname__}"
        if result is None:
            raise PluginError(f"no installed plugin implements {hook_name} for {name}; give the worker "
                              "save_checkpoint(path, options) and load_checkpoint(path, options) methods")
        logger.debug("%s handled %s", hook_name, name)


def _unknown_hooks(plugin: object) -> str:
    """``nrl_training_backend (did you mean nrl_training_backends?)`` for each implementation in
    ``plugin`` that matches no hook specification."""
    import difflib

    known = [name for name in dir(hookspecs) if name.startswith("nrl_")]
    unknown = []
    for attr in dir(plugin):
        if not attr.startswith("nrl_") or attr in known or not callable(getattr(plugin, attr, None)):
            continue
        if getattr(getattr(plugin, attr), f"{hookspecs.PROJECT_NAME}_impl", None) is None:
            continue
        close = difflib.get_close_matches(attr, known, n=1)
        unknown.append(attr + (f" (did you mean {close[0]}?)" if close else ""))
    return ", ".join(unknown) or "unknown hook"


def _unique_entry_points() -> list[md.EntryPoint]:
    """Entry points of the group, once each even if a distribution is visible twice on sys.path."""
    seen: set[tuple[str, str]] = set()
    unique = []
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if (ep.name, ep.value) in seen:
            continue
        seen.add((ep.name, ep.value))
        unique.append(ep)
    return unique


def _own_version() -> str:
    """The running core's version (the source tree's, which an editable install's metadata may lag)."""
    from nrl_core import __version__

    return __version__


def _check_core_requirement(ep: md.EntryPoint, *, contract: int | None = None) -> None:
    """Refuse a plugin whose declared ``nrl-core`` range excludes the running core.

    Without ``contract`` (before the plugin is imported) only a range that needs a *newer* core
    refuses it. With the plugin's contract version, a range that excludes this core because the
    core is newer is not held against a plugin whose contract the core still serves: the contract
    version, not the package version, says what it needs (docs/plugins.md#8-contract-versions)."""
    if ep.dist is None:
        return
    from packaging.requirements import Requirement
    from packaging.version import Version

    running = Version(_own_version())
    for line in ep.dist.requires or []:
        req = Requirement(line)
        if req.name.replace("_", "-").lower() != "nrl-core" or req.marker is not None:
            continue
        if not req.specifier or req.specifier.contains(running, prereleases=True):
            continue
        failing = [s for s in req.specifier if not s.contains(running, prereleases=True)]
        needs_newer = any(s.operator in (">", ">=", "==", "~=", "===") and _spec_version(s.version) > running
                          for s in failing)
        if needs_newer:
            raise PluginError(f"needs nrl-core{req.specifier} but nrl-core {running} is installed; upgrade one of them")
        if contract is None:
            continue
        if contract not in SERVED_CONTRACTS:  # declared_contract refuses these first; kept for direct callers
            raise PluginError(f"needs nrl-core{req.specifier} but nrl-core {running} is installed and serves contracts "
                              f"{served_range()}, not its {contract}; upgrade the plugin")
        logger.debug("plugin '%s' asks for nrl-core%s; nrl-core %s still serves its contract %d, so it loads",
                     ep.name, req.specifier, running, contract)


def _spec_version(text: str) -> Any:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text.rstrip(".*"))
    except InvalidVersion:
        return Version("0")


_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (created on first use; plugins load lazily)."""
    global _manager
    if _manager is None:
        _manager = PluginManager()
    return _manager


@contextlib.contextmanager
def registered_plugin(plugin: object, name: str) -> Iterator[object]:
    """Register ``plugin`` (a module or an object with hook implementations) in-process for a ``with``
    block: how a plugin's own tests and notebooks use it without installing it."""
    with get_plugin_manager().registered(plugin, name) as registered:
        yield registered


def reset_plugin_manager() -> None:
    """Forget the process-wide manager so the next use reloads (tests that change the environment)."""
    global _manager
    _manager = None
