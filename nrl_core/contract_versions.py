"""Which plugin contract each version is, and how a worker class is checked against one.

The contract (the hooks, the specs and the worker Protocols of :mod:`nrl_core.contracts`) has its
own version, :data:`nrl_core.contracts.CONTRACT_VERSION`, apart from nrl-core's package version. A
plugin states the version it was written for as ``NRL_CONTRACT = N`` in its entry-point module;
one that states nothing was written for contract 1. The core serves every version in
:data:`SERVED_CONTRACTS`: it checks a plugin's worker classes against the methods of *its* version
(:func:`worker_gaps`) and fills in what later versions added (:mod:`nrl_core.contract_adapters`).
docs/plugins.md#8-contract-versions is the policy and the changelog for plugin authors.

Standard library only: ``nrl plugins`` imports this without torch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from nrl_core.contract_marks import capability_of, since_of
from nrl_core.contracts import CAPABILITY_PROTOCOLS, CONTRACT_VERSION, GenerationWorker, TrainingWorker
from nrl_core.errors import PluginError

DOCS = "docs/plugins.md"
WORKER_DOCS = f"{DOCS}#4-the-worker"
GENERATION_DOCS = "docs/plugin_reference.md#a-generation-backend-nrl_coregeneration_kit"
VERSIONS_DOCS = f"{DOCS}#8-contract-versions"


@dataclass(frozen=True)
class ContractVersion:
    """One version of the plugin contract: the nrl-core release that first served it, and what it changed."""

    version: int
    release: str
    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    renamed: tuple[str, ...] = ()


CONTRACT_HISTORY: tuple[ContractVersion, ...] = (
    ContractVersion(1, "1.0.0", added=(
        "hooks nrl_training_backends, nrl_generation_backends, nrl_environments, nrl_refit_transports, "
        "nrl_metric_sinks, nrl_algorithms, nrl_checkpoint_save, nrl_checkpoint_load",
        "TrainingWorker: train, get_logprobs -> Tensor [B, T] (every rank, the whole batch), "
        "get_reference_logprobs, weight_manifest, export_weights, export_hf, finalize_checkpoint",
        "GenerationWorker: weight_version, generate, import_weights")),
    ContractVersion(2, "1.0.0", added=(
        "TrainingWorker.offload_before_refit, offload_after_refit, prepare_for_training (colocated hand-off)",
        "GenerationWorker.prepare_for_generation, finish_generation, sampling_state, load_sampling_state, shutdown",
        "hooks nrl_data_processors, nrl_dataset_generators; capabilities on backend specs",
        "lifecycle hooks nrl_run_start, nrl_step_end, nrl_checkpoint_saved, nrl_run_end (fd0ce25)",
        "AlgorithmSpec config_key/config_schema/config_check (ce2ff60), early_policy_start and spec preload "
        "(71b64cb); an engine may start at weight_version -1 (839cc97)"),
        changed=("get_logprobs/get_reference_logprobs return a BatchShard from one rank per data-parallel "
                 "group and None from the others, instead of a tensor from every rank",)),
    ContractVersion(3, "1.0.0", added=(
        "hooks nrl_advantage_estimators, nrl_loss_functions with AdvantageEstimatorSpec, AdvantageInputs, "
        "LossFunctionSpec",
        "EnvResult.components and EnvironmentSpec.reward_components (d0b2cbb)")),
    ContractVersion(4, "1.1.0", added=(
        "TrainingWorker.save_checkpoint(path, options), load_checkpoint(path, options): the core calls them on "
        "every rank",),
        changed=("the nrl_checkpoint_save/nrl_checkpoint_load hooks are deprecated: the core reaches them only "
                 "through the adapter of a contract 1-3 worker",)),
    ContractVersion(5, "1.2.0", added=(
        "worker classes may name modules they import lazily in lazy_imports; the core imports them early",
        "each TrainingWorker/GenerationWorker method declares how the core calls it (nrl_core.dispatch): "
        "fan-out and gather, read by WorkerGroup.call"),
        removed=("AlgorithmSpec.early_policy_start (nrl train starts every algorithm's policy early) and the "
                 "preload field of TrainingBackendSpec/GenerationBackendSpec: both still accepted with a "
                 "deprecation warning, preload still honoured",)),
    ContractVersion(6, "1.3.0", added=(
        "environments that talk back: MultiTurnEnvironment.step(episodes) -> EnvStep per episode, with "
        "Episode and EnvStep; EnvironmentSpec.multi_turn",)),
    ContractVersion(7, "1.4.0", added=(
        "EnvResult.sample_metadata: per-sample details, logged beside each rollout",)),
    ContractVersion(8, "1.5.0", added=(
        "hook nrl_commands with CommandSpec: a plugin's subcommands of nrl (nrl convert NAME)",)),
    ContractVersion(9, "1.6.0", added=(
        "adapter-only refit: capabilities adapter_export (training: AdapterExporter.adapter_config, "
        "adapter_manifest, export_adapter) and adapter_refit (generation: AdapterServer.import_adapter), "
        "chosen by policy.refit.adapters",)),
    ContractVersion(10, "1.7.0", added=(
        "models beside the policy: AlgorithmSpec.model_sections (a teacher's policy-shaped section, validated "
        "with the policy schema; its workers share the policy's devices) and AlgorithmSpec.shared_keys (keys in "
        "shared sections such as loss_fn)",
        "capability topk_logprobs (training: TopkScorer.get_topk_logprobs -> TopkShard, get_gathered_logprobs "
        "-> BatchShard [n, T, k]); a loss with gather_ids_field gets [b, t, k] logprobs at those ids",)),
    ContractVersion(11, "1.8.0", added=(
        "capability value_head (training: ValueScorer.get_values -> BatchShard [n, T]), chosen by "
        "policy.reward_model_cfg.enabled; a loss with reads_values gets the head's [b, t] values",
        "AlgorithmSpec.value_sections: the policy-shaped sections whose model has a value head",
        "EnvironmentSpec.resources_key: an environment's devices, taken from the cluster (a reward model)",)),
    ContractVersion(12, "1.9.0", added=(
        "capability in_flight_updates (generation: import_weights while generate_groups streams, chosen by "
        "grpo.async_grpo.in_flight_weight_updates) and GenerationOutput.token_weight_versions: each token's "
        "weight version",)),
    ContractVersion(13, "1.10.0", added=(
        "capability pipelined_import (generation: PipelinedImporter.import_weights_pipelined(buckets, manifest) "
        "loads each bucket as it arrives; a transfer that fails part-way raises TornRefitError and the engine "
        "refuses to generate until a refit succeeds)",)),
    ContractVersion(14, "1.11.0", added=(
        "capability partial_import (generation: PartialImporter.refit_wants(manifest) names the tensors a rank "
        "loads; its imports get only those and a manifest of only those, and the broadcast transport sends a "
        "tensor only one rank loads to that rank alone); RefitSession.options['skips'] tells a collective "
        "transport's sender what each receiver does not load",)),
)
"""Every contract version, oldest first: the one place the history is kept (docs/contract.md is
generated from it by scripts/api_reference.py)."""

SERVED_CONTRACTS: tuple[int, ...] = tuple(v.version for v in CONTRACT_HISTORY)
"""The versions this core still loads; dropping one is a major version of nrl-core."""

assert SERVED_CONTRACTS[-1] == CONTRACT_VERSION


@dataclass(frozen=True)
class Method:
    """A worker method as the core calls it: positional arguments, keywords, what it returns."""

    name: str
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    since: int = 1
    returns: str = ""  # checked where it matters: "BatchShard" from contract 2 on
    adaptable: bool = False  # a worker of an older contract without it gets a default

    def call(self) -> str:
        return f"{self.name}({', '.join([*self.args, *(f'{k}=...' for k in self.kwargs)])})"


def _annotation_text(annotation: Any) -> str:
    if annotation is inspect.Signature.empty:
        return ""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return text.strip("'\"")


def protocol_methods(protocol: type) -> tuple[Method, ...]:
    """The methods ``protocol`` declares, as the core calls them: positional and keyword-only
    parameters from its signatures, the version from its :func:`~nrl_core.contract_marks.since`
    marks (a capability's from the capability), the return type checked where it is a shard."""
    mark = capability_of(protocol)
    methods = []
    for name, function in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(function):
            continue
        signature = inspect.signature(function)
        parameters = list(signature.parameters.values())[1:]
        marked = since_of(function)
        returned = _annotation_text(signature.return_annotation)
        methods.append(Method(
            name,
            tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
            tuple(p.name for p in parameters if p.kind is p.KEYWORD_ONLY),
            since=mark.since if mark is not None else marked.version,
            returns=next((shard for shard in ("BatchShard", "TopkShard") if shard in returned), ""),
            adaptable=marked.adaptable,
        ))
    return tuple(methods)


TRAINING_METHODS: tuple[Method, ...] = protocol_methods(TrainingWorker)
GENERATION_METHODS: tuple[Method, ...] = protocol_methods(GenerationWorker)

HOOK_CHECKPOINT_METHODS = ("save_checkpoint", "load_checkpoint")
"""What a contract 1-3 worker reaches through its plugin's checkpoint hooks, even where its class
has methods of those names (the hooks decided how it saved)."""

CAPABILITY_METHODS: dict[str, tuple[Method, ...]] = {
    mark.name: protocol_methods(protocol)
    for protocol in CAPABILITY_PROTOCOLS if (mark := capability_of(protocol)) is not None
}
"""The methods a worker must have when its backend's spec declares the capability."""

ROLES: dict[str, tuple[str, tuple[Method, ...], str]] = {
    "training": ("TrainingWorker", TRAINING_METHODS, WORKER_DOCS),
    "generation": ("GenerationWorker", GENERATION_METHODS, GENERATION_DOCS),
}


ADAPTERS_MODULE = "nrl_core.contract_adapters"
ADAPTER_SEPARATOR = "@"


def adapter_path(worker: str, role: str, version: int, plugin: str) -> str:
    """The worker path the core uses for ``worker``: itself when its contract needs nothing
    adapted, else :mod:`nrl_core.contract_adapters`' adapter for it (resolved there by name)."""
    if not any(m.since > version for m in ROLES[role][1]) and not (role == "training" and version < 2):
        return worker
    return f"{ADAPTERS_MODULE}:{ADAPTER_SEPARATOR.join((role, str(version), plugin, worker))}"


def unwrap_path(path: str) -> tuple[str, str | None, int, str | None]:
    """``(worker path, role, contract, plugin)`` of a path :func:`adapter_path` made; a plain path
    is its own worker, of the current contract."""
    module, _, attr = path.partition(":")
    if module != ADAPTERS_MODULE or attr.count(ADAPTER_SEPARATOR) < 3:
        return path, None, CONTRACT_VERSION, None
    role, version, plugin, worker = attr.split(ADAPTER_SEPARATOR, 3)
    return worker, role, int(version), plugin


def served_range() -> str:
    return f"{SERVED_CONTRACTS[0]}-{SERVED_CONTRACTS[-1]}"


def declared_contract(plugin: object, name: str) -> int:
    """The contract ``plugin`` (its entry-point module) states with ``NRL_CONTRACT``; 1 when it
    states none. A version the core does not serve is a one-line :class:`PluginError`."""
    version = getattr(plugin, "NRL_CONTRACT", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise PluginError(f"plugin '{name}' sets NRL_CONTRACT = {version!r}; it must be an int among the served "
                          f"contract versions {served_range()} ({VERSIONS_DOCS})")
    if version > CONTRACT_VERSION:
        raise PluginError(f"plugin '{name}' is written for contract {version} but this nrl-core serves "
                          f"{served_range()}; upgrade nrl-core ({VERSIONS_DOCS})")
    if version not in SERVED_CONTRACTS:
        raise PluginError(f"plugin '{name}' is written for contract {version}, which this nrl-core no longer "
                          f"serves ({served_range()}); move it to contract {CONTRACT_VERSION} ({VERSIONS_DOCS})")
    return version


def methods_of(role: str, version: int) -> tuple[Method, ...]:
    """The methods a ``role`` worker of contract ``version`` must have."""
    return tuple(m for m in ROLES[role][1] if m.since <= version)


def adapted_methods(cls: type, role: str, version: int) -> list[str]:
    """What the core fills in for a worker of an older contract (defaults for later methods it
    lacks, a tensor wrapped into a ``BatchShard``), as short phrases for ``nrl config check``."""
    notes = [f"no-op {m.name}" for m in ROLES[role][1] if m.since > version and m.adaptable
             and not hasattr(cls, m.name) and m.name not in HOOK_CHECKPOINT_METHODS]
    if role == "training" and version < 2:
        notes.append("tensor logprobs wrapped into BatchShard")
    if role == "training" and version < 4:
        notes.append("checkpoints through the plugin's (deprecated) checkpoint hooks")
    return notes


def _signature_gap(cls: type, method: Method) -> str | None:
    """Why ``cls``'s method cannot be called as the core calls it, or None."""
    raw = inspect.getattr_static(cls, method.name)
    function = getattr(cls, method.name)
    if not callable(function):
        return f"is not a method (found {type(raw).__name__})"
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin or C method: nothing to check
    placeholders = [object()] * len(method.args)
    bound_self = () if isinstance(raw, (staticmethod, classmethod)) else (object(),)
    try:
        signature.bind(*bound_self, *placeholders, **{k: object() for k in method.kwargs})
    except TypeError as exc:
        return f"has signature {method.name}{signature} and cannot be called as {method.call()} ({exc})"
    return None


def worker_gaps(cls: type, role: str, version: int, plugin: str,
                capabilities: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """One line per method of contract ``version`` (and of the ``capabilities`` its spec declares)
    that ``cls`` lacks, cannot be called as the core calls it, or is annotated to return the wrong
    type. Methods a later contract added are not gaps: :mod:`nrl_core.contract_adapters` fills them in."""
    protocol, _, docs = ROLES[role]
    where = f"plugin '{plugin}', {cls.__module__}.{cls.__qualname__}"
    lines = []
    for capability in sorted(set(capabilities) & set(CAPABILITY_METHODS)):
        for method in CAPABILITY_METHODS[capability]:
            if not hasattr(cls, method.name):
                lines.append(f"{where}: declares '{capability}' but {method.call()} is missing ({docs})")
            elif gap := _signature_gap(cls, method):
                lines.append(f"{where}: {method.name} {gap}; '{capability}' requires {method.call()} ({docs})")
    for method in methods_of(role, version):
        if not hasattr(cls, method.name):
            lines.append(f"{where}: {protocol}.{method.call()} is missing; contract {method.since} requires it "
                         f"({docs})")
            continue
        gap = _signature_gap(cls, method)
        if gap:
            lines.append(f"{where}: {method.name} {gap}; contract {method.since} requires {method.call()} ({docs})")
            continue
        if method.returns and version >= 2:
            returned = _annotation_text(inspect.signature(getattr(cls, method.name)).return_annotation)
            if returned and method.returns not in returned and "Tensor" in returned:
                lines.append(f"{where}: {method.name} is annotated to return {returned}; contract {max(2, method.since)} "
                             f"and later require {method.returns} | None (nrl_core.contracts.{method.returns}) ({docs})")
    return lines


def check_result(method: str, value: Any, expected: str = "BatchShard", since: int = 2) -> Any:
    """``value`` when it is what ``method`` must return from contract ``since`` on (the
    :mod:`nrl_core.contracts` dataclass ``expected``, or None), else a one-line
    :class:`PluginError` naming the method and the type expected."""
    import dataclasses

    from nrl_core import contracts

    cls = getattr(contracts, expected)
    if value is None or isinstance(value, cls):
        return value
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    fields = ", ".join(f"{f.name}=..." for f in dataclasses.fields(cls))
    raise PluginError(f"{method} returned {kind}; contract {since} and later require a {expected} or None "
                      f"(nrl_core.contracts.{expected}({fields}); {WORKER_DOCS})")
