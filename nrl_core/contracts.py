"""The typed contracts between the nrl core and its plugins.

Hook *names* live in :mod:`nrl_core.hookspecs`; what flows through them lives here:

* descriptor dataclasses that registration hooks return (``TrainingBackendSpec`` and friends);
  the core keeps them in registries keyed by ``name`` and resolves config values against them;
* option types the core hands to plugins (``CheckpointOptions``);
* the batch and weight types that cross process boundaries (``TokenBatch``, ``WeightSpec``);
* ``Protocol``s for the objects plugins build: training and generation workers, environments,
  refit transports, metric sinks, loss functions.

Classes are referenced by import path strings (``"pkg.module:Class"``), not by object, so listing
plugins or checking a config never imports torch-heavy engine code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from nrl_core.contract_marks import capability, capability_of, since
from nrl_core.dispatch import Fanout, Gather, dispatch
from nrl_core.errors import PluginError

if TYPE_CHECKING:
    import torch

    from nrl_core.schema import Section

CONTRACT_VERSION: int = 14
"""The version of the plugin contract this module defines, apart from nrl-core's package version.
A plugin states the version it was written for as ``NRL_CONTRACT = N`` in its entry-point module;
:mod:`nrl_core.contract_versions` lists every version the core still serves and what each changed."""


LEGACY_PRELOAD: dict[str, tuple[str, ...]] = {}
"""Modules a contract 1-4 spec named in ``preload``, by worker import path: still imported early."""


def _deprecated(message: str) -> None:
    import warnings

    warnings.warn(message, FutureWarning, stacklevel=4)


def _keep_legacy_preload(kind: str, worker: str, preload: Sequence[str] | None) -> None:
    if preload is None:
        return
    LEGACY_PRELOAD[worker] = tuple(preload)
    _deprecated(f"{kind}(preload=...) for {worker} is deprecated since contract 5: name the modules in the "
                f"worker class's lazy_imports instead (docs/plugins.md#8-contract-versions)")


def import_object(path: str) -> Any:
    """Resolve ``"package.module:attr"`` (the form every spec uses for classes) to the object."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise PluginError(f"'{path}' is not an import path; write it as 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"cannot import '{module_name}' for '{path}': {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"module '{module_name}' has no attribute '{attr}' (from '{path}')") from None


# --------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a backend saves and loads its worker state. Every backend must honour the first four.

    * ``fully_parallel_save``: every rank writes its own shard (else one consolidated write).
    * ``fully_parallel_load``: every rank reads its own shard (else one rank reads and broadcasts).
    * ``async_save``: return before the files are complete; the backend finishes the write before
      its next save and at shutdown (:meth:`TrainingWorker.finalize_checkpoint`).
    * ``load_rng``: save and restore every RNG state so a resumed run is bit-identical.
    * ``save_optimizer`` (``checkpointing.save_optimizer``): false writes no optimizer or
      learning-rate scheduler state, and loading such a checkpoint starts both fresh (NeMo RL's
      rule). Only a backend that declares the capability ``skip_optimizer_state`` is ever handed
      false (the config check refuses the key for any other), so a backend that ignores the field
      keeps saving everything, as before it existed.
    * ``model_save_format`` (``checkpointing.model_save_format``): ``"safetensors"`` writes the
      model's weights as safetensors shards under their Hugging Face names (NeMo RL's DTensor
      format); ``"torch_save"`` or None, the backend's own. Only a backend that declares
      ``safetensors_checkpoints`` is ever handed ``"safetensors"``. A load reads the format the
      checkpoint records.
    """

    fully_parallel_save: bool = True
    fully_parallel_load: bool = True
    async_save: bool = False
    load_rng: bool = False
    save_optimizer: bool = True
    model_save_format: str | None = None

    def __post_init__(self) -> None:
        for name in ("fully_parallel_save", "fully_parallel_load", "async_save", "load_rng", "save_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CheckpointOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.model_save_format not in (None, "safetensors", "torch_save"):
            raise TypeError(f"CheckpointOptions.model_save_format must be 'safetensors', 'torch_save' or None, got "
                            f"{self.model_save_format!r}")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> CheckpointOptions:
        """Read the four options from a backend's (validated) config section, defaults when absent."""
        names = ("fully_parallel_save", "fully_parallel_load", "async_save", "load_rng")
        return cls(**{n: section[n] for n in names if section.get(n) is not None})


# --------------------------------------------------------------------------- descriptors

TRAINING_FLAGS: Mapping[str, str] = {
    "data_parallel": "more than one data-parallel group (training workers / model-parallel size > 1)",
    "sequence_packing": "policy.sequence_packing.enabled: true",
    "dynamic_batching": "policy.dynamic_batching.enabled: true",
    "skip_optimizer_state": "checkpointing.save_optimizer: false (CheckpointOptions.save_optimizer false: a checkpoint "
                            "without optimizer and scheduler state, whose load starts both fresh)",
    "safetensors_checkpoints": "checkpointing.model_save_format: safetensors (CheckpointOptions.model_save_format: the "
                               "weights as safetensors shards under their Hugging Face names)",
}
"""Training capabilities that add no method: what the worker's existing methods then handle.
The others are Protocols marked with :func:`~nrl_core.contract_marks.capability` (below), and
:data:`TRAINING_CAPABILITIES` holds both."""

GENERATION_FLAGS: Mapping[str, str] = {
    "sliced_import": "partial_import where a rank loads a block of a tensor (its rows or columns under tensor "
                     "parallelism): refit_wants may name a WeightSlice, and the rank receives only the block",
}
"""The same for generation backends."""


def _check_capabilities(kind: str, name: str, declared: frozenset[str], known: Mapping[str, str]) -> None:
    unknown = sorted(set(declared) - set(known))
    if unknown:
        raise PluginError(f"{kind} '{name}' declares unknown capabilities {unknown}; known: {', '.join(known)}")

ConfigCheck = Callable[[Mapping[str, Any]], None]
"""A backend's config check, named by ``config_check`` in its spec: it gets the whole validated
config after the schema and the core's own checks passed, and raises
:class:`~nrl_core.errors.ConfigError` naming the key. ``nrl config check`` and ``nrl train`` call
it for the *selected* backends only, before any worker is built (``nrl train`` runs it while the
policy's workers import their modules), so it must be cheap: it may import torch and read the
model's ``config.json``, never build a model or start an engine."""


@dataclass(frozen=True, kw_only=True)
class TrainingBackendSpec:
    """A training backend, returned by ``nrl_training_backends``.

    ``config_key`` is its section under ``policy`` (``megatron_cfg``); the backend is a candidate
    when that section says ``enabled: true``; among candidates the highest ``priority`` wins.
    ``worker`` is the import path of the class the core instantiates once per rank (see
    :class:`TrainingWorker`). ``config_aliases`` are other spellings of ``config_key``;
    ``parallel_size_keys`` name the section's model-parallel sizes (tensor, pipeline, context).
    ``config_check`` is the import path of a :data:`ConfigCheck`: the backend's own checks of
    values only it can judge (sizes against the model's heads and layers, optimizer names).
    ``capabilities`` names what it supports among :data:`TRAINING_CAPABILITIES`; validation refuses
    a config that needs one it does not declare. ``memory_layout`` (optional) is the import path of a
    function ``(policy_section, world_size, device) -> StateLayout`` (``device``: ``cuda`` or ``cpu``) telling ``nrl plan`` how the backend
    lays a model's state over its ranks; without it the plan counts the model whole on every rank.
    ``twin`` (optional, in no contract version) maps keys of its section to the values a CPU twin
    sets (``nrl twin``): what a CPU lacks, such as an optimizer that keeps CUDA tensors.

    Start-up overlap is the core's business (contract 5): every worker process imports ``worker``
    and the modules its class names in ``lazy_imports`` while ``nrl train`` still checks the config
    (:mod:`nrl_core.algorithms.policy_launch`). ``preload``, the spec field that named them up to
    contract 4, is still accepted from older plugins (with a deprecation warning) and honoured.
    """

    name: str
    config_key: str
    priority: int
    worker: str
    config_schema: Section
    distribution: str
    config_aliases: Mapping[str, str] = field(default_factory=dict)
    parallel_size_keys: tuple[str, ...] = ()
    config_check: str | None = None
    capabilities: frozenset[str] = frozenset()
    description: str = ""
    memory_layout: str | None = None
    twin: Mapping[str, Any] = field(default_factory=dict)
    preload: InitVar[Sequence[str] | None] = None

    def __post_init__(self, preload: Sequence[str] | None) -> None:
        _check_capabilities("training backend", self.name, self.capabilities, TRAINING_CAPABILITIES)
        _keep_legacy_preload("TrainingBackendSpec", self.worker, preload)

    def model_parallel_size(self, section: Mapping[str, Any]) -> int:
        """Ranks one model replica spans (the product of ``parallel_size_keys`` in its section), so
        the core can derive the data-parallel size without knowing the backend."""
        size = 1
        for key in self.parallel_size_keys:
            size *= int(section.get(key) or 1)
        return size


@dataclass(frozen=True, kw_only=True)
class GenerationBackendSpec:
    """A generation backend, returned by ``nrl_generation_backends``.

    Chosen by ``policy.generation.backend == name``; its section is
    ``policy.generation.<config_key>`` (``vllm_cfg``). ``worker`` is the import path of a
    :class:`GenerationWorker` class; ``config_check`` and start-up overlap as for
    :class:`TrainingBackendSpec` (a colocated engine's modules are imported early in the training workers).
    ``twin`` (optional, in no contract version) maps keys under ``policy.generation`` to the values
    a CPU twin sets where the recipe sets them (``nrl twin``): engine arguments that pick GPU kernels.
    """

    name: str
    config_key: str
    worker: str
    config_schema: Section
    distribution: str
    parallel_size_keys: tuple[str, ...] = ()
    config_check: str | None = None
    capabilities: frozenset[str] = frozenset()
    description: str = ""
    twin: Mapping[str, Any] = field(default_factory=dict)
    preload: InitVar[Sequence[str] | None] = None

    def __post_init__(self, preload: Sequence[str] | None) -> None:
        _check_capabilities("generation backend", self.name, self.capabilities, GENERATION_CAPABILITIES)
        _keep_legacy_preload("GenerationBackendSpec", self.worker, preload)

    def engine_size(self, section: Mapping[str, Any]) -> int:
        """Ranks one engine spans (the product of ``parallel_size_keys`` in its section): the core
        gives each engine that many consecutive ranks and the same prompts on all of them."""
        size = 1
        for key in self.parallel_size_keys:
            size *= int(section.get(key) or 1)
        return size


@dataclass(frozen=True, kw_only=True)
class EnvironmentSpec:
    """A reward environment, returned by ``nrl_environments``; configured under ``env.<name>``.
    ``reward_components`` names the rewards it reports per sample in ``EnvResult.components``
    (none for a single reward), so a config whose estimator needs them is checked before it runs.
    ``resources_key`` (contract 11) names the key of its section, NeMo RL's ``resources``
    (``gpus_per_node``, ``num_nodes``), whose devices it takes from the cluster for workers of its
    own (a reward model): training gets the rest, as with generation that is not colocated.
    ``runner_data`` (optional, in no contract version) is for an environment NeMo RL runs with a
    script of its own that draws the prompts and reads no ``data`` section (the sliding puzzle's):
    the import path of a function ``(env_section, config) -> {data key: value}`` giving that data.
    A recipe that names the environment only in ``env`` trains on it, as under NeMo RL."""

    name: str
    environment: str
    config_schema: Section
    distribution: str
    description: str = ""
    reward_components: tuple[str, ...] = ()
    multi_turn: bool = False  # its environment offers ``step`` (contract 6): episodes of many turns
    resources_key: str | None = None  # contract 11: its section's key of devices it takes from the cluster
    runner_data: str | None = None


REFIT_DEVICES = ("cpu", "cuda")
"""Where a refit's weights live: host memory, or GPUs."""


@dataclass(frozen=True, kw_only=True)
class RefitTransportSpec:
    """A way to move weight buckets from training to generation, returned by ``nrl_refit_transports``.

    ``placements`` lists where it works: ``"same_process"``, ``"same_node"``, ``"cross_node"``.
    ``devices`` lists where the weights live when the core may pick it: ``"cpu"``, ``"cuda"``
    (both when not given). Unless the config names one (``policy.refit.transport``, used wherever
    its placements allow), the core picks the transport of highest ``priority`` that works for the
    placement and the device (the core's own: 30, 20, 10; shared memory, a copy through host
    memory, is picked on the CPU only).

    ``collective`` says how the bytes travel. False (``in_process``, ``shared_memory``): the sender
    turns every bucket into a handle that stays valid until the refit's cleanup, so the training
    side exports once and every generation worker reads the same handles. True (``broadcast``):
    sender and receivers must run at the same time (a process group) and the sender returns no
    handles.
    """

    name: str
    transport: str
    placements: tuple[str, ...]
    distribution: str
    priority: int = 0
    collective: bool = False
    description: str = ""
    devices: tuple[str, ...] = REFIT_DEVICES

    def __post_init__(self) -> None:
        if isinstance(self.devices, str) or not set(self.devices) <= set(REFIT_DEVICES):
            raise PluginError(f"refit transport '{self.name}': devices must be a tuple of "
                              f"{', '.join(map(repr, REFIT_DEVICES))}, got {self.devices!r}")


@dataclass(frozen=True, kw_only=True)
class MetricSinkSpec:
    """A metric logger, returned by ``nrl_metric_sinks``; enabled by ``logger.<name>_enabled``, its
    options in ``logger.<name>``. ``sink`` is the import path of a :class:`MetricSink` class built as
    ``Sink(log_dir, options)``. The core's TensorBoard, W&B and MLflow sinks register this way."""

    name: str
    sink: str
    distribution: str
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class CommandSpec:
    """A subcommand a plugin adds to ``nrl``, returned by ``nrl_commands``: ``nrl <group> <name>``.

    Only ``group`` ``"convert"`` is offered, so conversions that belong to one engine (Megatron's
    checkpoint layouts) live in that engine's distribution. ``arguments`` is the import path of a
    function that adds the command's arguments to an ``argparse.ArgumentParser``; it is imported
    when ``nrl`` builds its parser, so its module must import nothing heavy. ``entry`` is the
    import path of a function taking the parsed ``argparse.Namespace`` and returning an exit code;
    it is imported only when the command runs. An :class:`~nrl_core.errors.NrlError` it raises is
    printed as one line, as for every ``nrl`` command.
    """

    name: str
    group: str
    arguments: str
    entry: str
    distribution: str
    help: str = ""


@dataclass(frozen=True, kw_only=True)
class DataProcessorSpec:
    """A prompt processor selectable as ``data.processor``, returned by ``nrl_data_processors``;
    ``processor`` is the import path of a function ``(record, index, tokenizer, prompt_config) ->
    DatumSpec`` (see nrl_core/data/processors.py)."""

    name: str
    processor: str
    distribution: str
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class DatasetGeneratorSpec:
    """A dataset generator selectable as ``data.dataset_name``, returned by
    ``nrl_dataset_generators``; ``generator`` is the import path of a function taking the
    ``data.generate`` mapping as keyword arguments and returning ``(train, val)`` record lists."""

    name: str
    generator: str
    distribution: str
    description: str = ""


DATASET_KINDS = ("prompt", "preference")
"""What a named dataset's records are: ``prompt`` records carry ``problem`` and ``expected_answer``
(the prompt and the ground truth, or the response SFT learns); ``preference`` records are NeMo
RL's ``{"context", "completions"}`` pairs (nrl_core/data/preference.py)."""


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A dataset selectable by name in NeMo RL's data layout (``data.train.dataset_name``), returned
    by ``nrl_datasets``.

    The core loads it (docs/data.md): from the Hugging Face hub repository ``hub`` (its
    ``subsets``, concatenated, and ``split``; HF's offline cache serves an offline machine), or from
    a local file or directory the config names as ``data_path``, which stands in with the same
    columns. ``hub=None`` means the config's ``data_path`` always names the data (a local file or a
    hub id), as for NeMo RL's ``ResponseDataset``. ``format`` is the import path of a function
    ``(row, entry) -> record | None`` turning one source row into a record of ``kind`` (``entry``:
    the dataset's config with ``data.default`` filled in; ``None`` skips the row). ``keys`` are the
    entry keys the dataset reads beyond the common ones; another one set is named in a warning,
    as NeMo RL does. ``split_validation_size`` is the share (or, at 1 or more, the count) held out
    for validation by default; ``None``: the dataset never splits (a set size is named in that
    warning). ``splits`` lists the splits it accepts (empty: any). ``stand_in`` (optional, in no
    contract version) is the import path of a function ``(problem, answer, wrong, entry) -> row``
    giving one source row with the hub dataset's columns around those texts: ``nrl twin`` writes a
    recipe's data with it; without one, a twin of a recipe reading this dataset is refused.
    """

    name: str
    format: str
    distribution: str
    hub: str | None = None
    subsets: tuple[str, ...] = ()
    split: str = "train"
    splits: tuple[str, ...] = ()
    kind: str = "prompt"
    keys: tuple[str, ...] = ()
    split_validation_size: float | None = None
    description: str = ""
    stand_in: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in DATASET_KINDS:
            raise PluginError(f"dataset '{self.name}' ({self.distribution}): kind {self.kind!r} is not one of "
                              f"{', '.join(DATASET_KINDS)}")


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """A training algorithm runnable as ``nrl train <name>``; ``entry`` is ``"module:function"``
    taking the validated config (a ``dict``) and returning a process exit code.

    The algorithm owns its config section, so a third-party algorithm brings its keys the way a
    backend does: ``config_schema`` is attached at the top level as ``config_key`` (default: the
    algorithm's name). A config that sets that section names the algorithm for ``nrl config check``.
    ``config_check`` is the import path of a :data:`ConfigCheck` for rules that relate the section to
    the rest of the config; it runs only when this algorithm is the one checked. ``generates`` says it
    samples from ``policy.generation``, so a config without an installed generation backend is
    refused at check time, not at run time.

    ``model_sections`` (contract 10) are top-level sections that configure another model the
    algorithm runs beside the policy (distillation's ``teacher``): each is validated with the
    ``policy`` schema and the selected backend's checks, and its workers share the policy's devices
    (:func:`~nrl_core.config.models.model_config`, ``Policy(..., beside=policy)``).
    ``shared_keys`` (contract 10) adds keys to sections the algorithm shares with others, by path:
    NeMo RL's distillation reads ``loss_fn.kl_type``. Two algorithms declaring one key differently
    is an error naming both. ``value_sections`` (contract 11) names the policy-shaped sections
    (``policy`` or one of ``model_sections``) whose model the algorithm trains or reads with a value
    head (``reward_model_cfg.enabled``, capability ``value_head``): a reward model, a critic. A value
    head enabled anywhere else is refused at check time. ``data_kind`` says which records the
    algorithm reads from a named dataset (:data:`DATASET_KINDS`: ``preference`` for DPO and reward
    models), so a dataset of the other kind is refused at check time; optional, in no contract
    version. ``twin`` (optional, in no contract version) maps keys of the algorithm's section to
    the values its CPU twin sets (``nrl twin``), such as prompts a step; steps and validation sizes
    the core sets itself. ``reference_policy`` (optional, in no contract version) says whether a run
    asks its policy for reference logprobs: ``True`` (the default), ``False``, or the import path
    of a function of the validated config that answers. The policy of a run that never asks keeps
    no host copy of its initial weights, as NeMo RL's ``init_reference_model=False`` does for SFT
    (:meth:`uses_reference_policy`; ``nrl plan`` counts the copy by the same answer).

    ``nrl train`` launches the policy's training workers before it checks the model and the run
    loads its data, for every algorithm, so their imports overlap; a run that builds no
    :class:`~nrl_core.algorithms.policy.Policy` leaves them untaken and they stop with it
    (:mod:`nrl_core.algorithms.policy_launch`). ``early_policy_start``, the field that asked for
    this up to contract 4, is still accepted (with a deprecation warning) and has no effect.
    """

    name: str
    entry: str
    distribution: str
    description: str = ""
    config_key: str | None = None
    config_schema: Section | None = None
    config_check: str | None = None
    generates: bool = False
    model_sections: tuple[str, ...] = ()
    shared_keys: Mapping[str, Section] = field(default_factory=dict)
    value_sections: tuple[str, ...] = ()
    data_kind: str = "prompt"
    twin: Mapping[str, Any] = field(default_factory=dict)
    reference_policy: bool | str = True
    early_policy_start: InitVar[bool | None] = None

    def __post_init__(self, early_policy_start: bool | None) -> None:
        if early_policy_start is not None:
            _deprecated(f"AlgorithmSpec(early_policy_start=...) of algorithm '{self.name}' has no effect since "
                        f"contract 5 (nrl train starts every algorithm's policy early); remove it")
        if not isinstance(self.reference_policy, (bool, str)):
            raise PluginError(f"AlgorithmSpec(reference_policy=...) of algorithm '{self.name}' must be True, False "
                              f"or the import path of a function of the config, got {self.reference_policy!r}")

    def uses_reference_policy(self, config: Mapping[str, Any]) -> bool:
        """Whether a run of this algorithm with ``config`` asks its policy for reference logprobs
        (a function's answer that is not a bool is a one-line ``PluginError``)."""
        if isinstance(self.reference_policy, bool):
            return self.reference_policy
        answer = import_object(self.reference_policy)(config)
        if not isinstance(answer, bool):
            raise PluginError(f"'{self.reference_policy}' (algorithm '{self.name}''s reference_policy) returned "
                              f"{type(answer).__name__}, not a bool")
        return answer

    @property
    def section(self) -> str:
        """The top-level key of this algorithm's section."""
        return self.config_key or self.name


@dataclass(frozen=True, kw_only=True)
class AdvantageEstimatorSpec:
    """An advantage estimator selectable as ``grpo.adv_estimator.name``, returned by
    ``nrl_advantage_estimators``.

    ``estimator`` is the import path of a class built once per run as ``Estimator(section,
    config)``: ``section`` is ``grpo.adv_estimator``, where ``config_schema``'s keys join the others
    (flat, as in NeMo RL's configs; a key two estimators declare differently is an error when the
    schema is built), ``config`` the whole validated config. It is called once per step in the driver with :class:`AdvantageInputs` and
    returns one advantage per response (``[b]``) or per token (``[b, t]``, aligned with
    ``input_ids``). ``needs`` names the batch fields it reads that the algorithm must compute
    before advantages (``"reference_logprobs"``, ``"prev_logprobs"``), or ``"reward_components"``
    when it reads an environment's named rewards; ``uses_kl_in_reward`` says it
    takes the KL penalty into the reward (``loss_fn.use_kl_in_reward``), which the loss then leaves
    out.
    """

    name: str
    estimator: str
    distribution: str
    config_schema: Section | None = None
    needs: tuple[str, ...] = ()
    uses_kl_in_reward: bool = False
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class LossFunctionSpec:
    """A policy loss selectable as ``loss_fn.name``, returned by ``nrl_loss_functions``.

    ``loss`` is the import path of a class with ``from_config(section) -> LossFunction``, where
    ``section`` is the whole ``loss_fn`` mapping (NeMo RL's keys at its top, this loss's own
    ``config_schema`` keys under ``loss_fn.<name>``). The built loss is pickled to the training
    workers, so its module must import there (an installed distribution's does). ``algorithms``
    lists the algorithms whose batches it understands.
    """

    name: str
    loss: str
    distribution: str
    algorithms: tuple[str, ...] = ("grpo",)
    config_schema: Section | None = None
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """The run a lifecycle hook observes (``nrl_run_start``, ``nrl_step_end``,
    ``nrl_checkpoint_saved``, ``nrl_run_end``); the same object for every call of one run."""

    algorithm: str  # "grpo", "sft", ...
    config: Mapping[str, Any]  # the validated config, every default filled
    first_step: int  # 1 for a fresh run, the resumed step + 1 otherwise
    max_steps: int
    log_dir: str
    checkpoint_dir: str | None  # None when checkpointing is off


# --------------------------------------------------------------------------- data that crosses processes


@dataclass(kw_only=True)
class TokenBatch:
    """Right-padded token sequences and aligned per-token or per-sequence tensors.

    ``input_ids`` is ``[B, T]``; ``input_lengths`` is ``[B]``; each tensor in ``fields`` has
    leading dimension ``B`` and, when per-token, second dimension ``T`` aligned with ``input_ids``:
    position ``t`` describes token ``t`` (so a logprob at ``t`` is log p(token_t | tokens_<t), and
    position 0 is always 0). ``token_mask`` in ``fields`` marks the tokens a loss counts.
    """

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor | Sequence[int]) -> TokenBatch:
        """The sub-batch of the given row indices, trimmed to its longest sequence."""
        import torch

        idx = torch.as_tensor(index, dtype=torch.long)
        lengths = self.input_lengths[idx]
        width = int(lengths.max()) if len(idx) else 0
        fields = {k: (v[idx, :width] if v.dim() > 1 and v.shape[1] == self.input_ids.shape[1] else v[idx])
                  for k, v in self.fields.items()}
        return TokenBatch(input_ids=self.input_ids[idx, :width], input_lengths=lengths, fields=fields)

    def loss_counts(self) -> tuple[float, float]:
        """``(valid tokens, valid sequences)``: the normalisers a :class:`LossFunction` gets.

        A token counts when ``token_mask`` is set and its sequence's ``sample_mask`` (when
        present) is 1; a sequence counts when its ``sample_mask`` is 1 (every sequence without
        one), as in NeMo RL. Every backend uses this one definition (summed over data-parallel
        ranks), so losses mean the same on all of them.
        """
        import torch

        mask = self.fields.get("token_mask")
        if mask is None:
            mask = (torch.arange(self.input_ids.shape[1])[None, :] < self.input_lengths[:, None]).float()
        sample_mask = self.fields.get("sample_mask")
        if sample_mask is None:
            return float(mask.sum()), float(self.size)
        return float((mask * sample_mask.to(mask.dtype).unsqueeze(1)).sum()), float(sample_mask.sum())

    def shard_rows(self, rank: int, world_size: int) -> list[int]:
        """Rows ``rank::world_size`` of data-parallel rank ``rank``: a strided split, so every
        rank gets a share of each GRPO group's neighbours and the shards stay balanced."""
        if self.size % world_size:
            raise ValueError(f"batch of {self.size} sequences does not divide over {world_size} data-parallel ranks")
        return list(range(rank, self.size, world_size))

    def shard(self, rank: int, world_size: int) -> TokenBatch:
        """The sub-batch of :meth:`shard_rows`."""
        return self.select(self.shard_rows(rank, world_size))


@dataclass(kw_only=True)
class BatchShard:
    """One data-parallel group's part of a per-sequence result over a global batch.

    ``values[i]`` belongs to row ``rows[i]`` of the batch; ``values`` may be narrower than the
    batch (trimmed to the shard's longest sequence). One rank of each data-parallel group returns
    its shard and the others return ``None``, so a result crosses to the driver once per group,
    not once per rank; the driver checks that the shards cover every row exactly once.
    """

    rows: list[int]
    values: torch.Tensor

    @staticmethod
    def assemble(shards: Sequence[BatchShard | None], size: int, width: int) -> torch.Tensor:
        """The ``[size, width, ...]`` result the shards make up together (zeros past each row's
        values); trailing dimensions of the values are kept."""
        import torch

        present = [s for s in shards if s is not None]
        trailing = tuple(present[0].values.shape[2:]) if present else ()
        out = torch.zeros((size, width, *trailing), dtype=present[0].values.dtype if present else torch.float32)
        seen = torch.zeros(size, dtype=torch.long)
        for shard in present:
            index = torch.as_tensor(shard.rows, dtype=torch.long)
            out[index, : shard.values.shape[1]] = shard.values
            seen[index] += 1
        if not bool((seen == 1).all()):
            missing = (seen == 0).nonzero().flatten().tolist()[:8]
            repeated = (seen > 1).nonzero().flatten().tolist()[:8]
            raise ValueError(f"data-parallel shards do not cover the batch of {size} rows once each "
                             f"(missing rows {missing}, repeated rows {repeated}): a backend's shard reporting is wrong")
        return out


@dataclass
class TopkShard:
    """One data-parallel group's part of a top-k result (contract 10): ``logprobs`` float32 and
    ``ids`` int64, both ``[len(rows), width, k]``, row ``i`` being row ``rows[i]`` of the batch."""

    rows: list[int]
    logprobs: torch.Tensor
    ids: torch.Tensor

    @staticmethod
    def assemble(shards: Sequence[TopkShard | None], size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([size, width, k] logprobs, [size, width, k] ids)``, each row covered once."""
        present = [s for s in shards if s is not None]
        logprobs = BatchShard.assemble([BatchShard(rows=s.rows, values=s.logprobs) for s in present], size, width)
        ids = BatchShard.assemble([BatchShard(rows=s.rows, values=s.ids) for s in present], size, width)
        return logprobs, ids


@dataclass(frozen=True, kw_only=True)
class WeightSpec:
    """Name (Hugging Face convention), shape and dtype of one exported weight: a manifest entry."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        import torch

        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        n = 1
        for d in self.shape:
            n *= d
        return n * size


@dataclass(kw_only=True)
class GenerationOutput:
    """What a generation worker returns for a batch of prompts, one entry per prompt.

    ``weight_version`` is the oldest weight version any token was sampled with.
    ``token_weight_versions`` (contract 12), one list per response, names each token's version: an
    engine that declares ``in_flight_updates`` loads new weights while requests are in flight, so
    one response may carry two versions. None means every token is ``weight_version``'s."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    weight_version: int
    token_weight_versions: list[list[int]] | None = None

    def slice(self, start: int, stop: int) -> GenerationOutput:
        """The outputs of prompts ``start:stop``."""
        versions = None if self.token_weight_versions is None else self.token_weight_versions[start:stop]
        oldest = min((v for per_token in versions or () for v in per_token), default=self.weight_version)
        return GenerationOutput(token_ids=self.token_ids[start:stop], logprobs=self.logprobs[start:stop],
                                finish_reasons=self.finish_reasons[start:stop],
                                weight_version=max(oldest, self.weight_version), token_weight_versions=versions)

    @staticmethod
    def concatenate(outputs: Sequence[GenerationOutput]) -> GenerationOutput:
        """``outputs`` one after the other (engines' chunks, a step's groups); the oldest version."""
        return GenerationOutput(token_ids=[t for o in outputs for t in o.token_ids],
                                logprobs=[lp for o in outputs for lp in o.logprobs],
                                finish_reasons=[r for o in outputs for r in o.finish_reasons],
                                weight_version=min(o.weight_version for o in outputs),
                                token_weight_versions=[o.versions_of(i) for o in outputs
                                                       for i in range(len(o.token_ids))])

    def versions_of(self, index: int) -> list[int]:
        """The weight version of each token of response ``index``: as the engine reported them,
        or ``weight_version`` for all (an engine that never updates weights mid-generation)."""
        if self.token_weight_versions is not None:
            return list(self.token_weight_versions[index])
        return [self.weight_version] * len(self.token_ids[index])


@dataclass(kw_only=True)
class EnvSample:
    """One scored interaction: the prompt text, the model's response text, and dataset metadata
    (for math: ``{"ground_truth": "42"}``)."""

    prompt: str
    response: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class EnvResult:
    """Rewards in the order of the samples, and metrics over them: means, except the keys named in
    ``counts``, which are totals (timeouts, sample counts). That distinction lets results of parts
    of a batch (async GRPO scores each group as it completes) combine into the batch's.

    A multi-reward environment also reports each named reward per sample in ``components``
    (NeMo RL's ``reward/<name>`` keys, e.g. ``{"correctness": [...], "format": [...]}``); its
    ``rewards`` are then their sum, as NeMo RL totals them, and estimators such as GDPO read the parts.

    ``sample_metadata`` (contract 7), one JSON-serialisable mapping per sample, is what a user
    needs to see why a sample scored as it did (a code environment's test results and stderr); the
    core writes it beside each rollout in ``train_data_step<N>.jsonl`` and ``val_data_step<N>.jsonl``."""

    rewards: list[float]
    metrics: dict[str, float] = field(default_factory=dict)
    counts: tuple[str, ...] = ()
    components: dict[str, list[float]] = field(default_factory=dict)
    sample_metadata: list[dict[str, Any]] | None = None

    @staticmethod
    def combine(results: Sequence[EnvResult]) -> EnvResult:
        """One result for the concatenated samples: counts add up, means are weighted by samples."""
        total = sum(len(r.rewards) for r in results)
        counts = tuple(dict.fromkeys(k for r in results for k in r.counts))
        keys = list(dict.fromkeys(k for r in results for k in r.metrics))
        metrics = {k: sum(r.metrics.get(k, 0.0) if k in counts else r.metrics.get(k, 0.0) * len(r.rewards)
                          for r in results) / (1 if k in counts else max(total, 1)) for k in keys}
        names = list(dict.fromkeys(k for r in results for k in r.components))
        components = {name: [x for r in results for x in r.components.get(name, [0.0] * len(r.rewards))]
                      for name in names}
        described = any(r.sample_metadata is not None for r in results)
        sample_metadata = [m for r in results for m in (r.sample_metadata or [{}] * len(r.rewards))] if described else None
        return EnvResult(rewards=[x for r in results for x in r.rewards], metrics=metrics, counts=counts,
                         components=components, sample_metadata=sample_metadata)

    def slice(self, start: int, stop: int) -> EnvResult:
        """Samples ``start:stop``'s rewards, components and metadata (metrics belong to the whole batch)."""
        return EnvResult(rewards=self.rewards[start:stop], counts=self.counts,
                         components={k: v[start:stop] for k, v in self.components.items()},
                         sample_metadata=None if self.sample_metadata is None else self.sample_metadata[start:stop])


@dataclass(kw_only=True)
class Episode:
    """One multi-turn episode as an environment sees it at its turn (contract 6).

    ``prompt`` is the prompt's text as the model saw it (chat template applied), ``messages`` what
    followed: the model's turns (``{"role": "assistant", "content": ...}``, decoded from the tokens
    it sampled) and the environment's observations, oldest first; ``metadata`` the episode's state
    (the dataset's, then whatever the environment last returned); ``turn`` the model turns so far."""

    prompt: str
    messages: list[dict[str, Any]]
    metadata: dict[str, Any]
    turn: int

    @property
    def last_response(self) -> str:
        """The text of the model's latest turn."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


@dataclass(kw_only=True)
class EnvStep:
    """An environment's answer to one episode's turn (contract 6).

    ``observation`` continues the conversation: text is appended as its tokens (no chat template,
    NeMo RL's way), a list of messages (``{"role": "tool", "content": ...}``) is rendered with the
    tokenizer's chat template, generation prompt included. Its tokens are in the context of later
    turns and never in the loss. ``reward`` is this turn's (an episode's reward is the sum over its
    turns), ``components`` this turn's named rewards. ``done`` ends the episode (no observation is
    then appended); ``metadata`` replaces the episode's state (None keeps it); ``stop_strings``
    end the model's next turn (None: the run's ``policy.generation.stop_strings``); ``metrics``
    are averaged over the steps that report them and logged as ``env/<name>``."""

    observation: str | list[dict[str, Any]] = ""
    reward: float = 0.0
    done: bool = False
    metadata: dict[str, Any] | None = None
    stop_strings: list[str] | None = None
    components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- protocols


@dataclass(kw_only=True)
class AdvantageInputs:
    """What an :class:`AdvantageEstimator` sees of one step's rollouts, in batch order."""

    rewards: torch.Tensor  # [b] the environment's rewards (after any reward shaping)
    group_ids: torch.Tensor  # [b] long: responses to one prompt share an id
    batch: TokenBatch  # token_mask, sample_mask, response_lengths and the fields the spec ``needs``
    reward_components: Mapping[str, torch.Tensor] = field(default_factory=dict)  # name -> [b], when reported


class AdvantageEstimator(Protocol):
    """Turns a step's rewards into advantages: ``[b]`` per response or ``[b, t]`` per token."""

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor: ...


class LossFunction(Protocol):
    """A loss the core owns and a backend calls once per micro-batch.

    ``logprobs`` is ``[b, t]`` float32, aligned as in :class:`TokenBatch` and computed with
    gradients by the backend. A loss with a ``gather_ids_field`` attribute (contract 10; the
    backend must declare ``topk_logprobs``) gets ``[b, t, k]`` instead: the full-vocabulary logprobs
    of the token ids in that ``[B, T, k]`` batch field, as :meth:`TopkScorer.get_gathered_logprobs`.
    A loss with ``reads_values = True`` (contract 11) is for a model with a value head
    (``value_head``): it gets the head's ``[b, t]`` float32 outputs, as :meth:`ValueScorer.get_values`,
    where other losses get logprobs; the driver refuses either kind of loss on the other kind of
    model. ``global_valid_tokens`` and ``global_valid_seqs`` are totals over the
    whole global batch on every data-parallel rank, so the sum of micro-batch losses equals the
    global-batch loss whatever the split. Returns the scalar loss and float metrics.
    """

    def __call__(
        self, logprobs: torch.Tensor, batch: TokenBatch, *, global_valid_tokens: float, global_valid_seqs: float
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def logprob_temperature(config: Mapping[str, Any]) -> float:
    """The temperature a training backend divides its logits by before the softmax:
    ``policy.generation.temperature`` when the config generates (GRPO), else 1.

    Rollouts are sampled from ``softmax(logits / T)`` and the generation engine reports the
    sampled tokens' logprobs under that distribution, so the policy's logprobs (importance ratios,
    KL) must use the same ``T``. A temperature of 0 (greedy) leaves the logits alone."""
    generation = (config.get("policy") or {}).get("generation") or {}
    temperature = generation.get("temperature")
    return float(temperature) if temperature else 1.0


@runtime_checkable
class TrainingWorker(Protocol):
    """One rank of a training backend. The core builds it (usually inside a Ray actor after
    ``torch.distributed`` is initialised) as ``WorkerCls(config, rank=..., world_size=...)``
    where ``config`` is the whole validated config.

    Every rank receives the whole global batch and takes its data-parallel shard
    (:meth:`TokenBatch.shard_rows`), since only the backend knows its parallel layout.

    Saving and loading are methods (contract 4): the core calls ``save_checkpoint`` and
    ``load_checkpoint`` on every rank. A worker of contracts 1-3 is adapted to reach its plugin's
    deprecated ``nrl_checkpoint_save``/``nrl_checkpoint_load`` hooks through them."""

    @dispatch(Fanout.ALL, Gather.FIRST)
    def train(self, batch: TokenBatch, loss_fn: LossFunction) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; metrics reduced over ranks.
        The loss sees logprobs as :meth:`get_logprobs` computes them. Returns the loss function's
        metrics (``loss`` among them) summed over micro-batches and ranks, plus ``grad_norm``
        (before clipping); with ``policy.check_for_nan`` a non-finite loss or norm raises before
        the optimizer step (:mod:`nrl_core.nonfinite`)."""

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def get_logprobs(self, batch: TokenBatch) -> BatchShard | None:
        """Per-token float32 logprobs of this rank's data-parallel shard of ``batch`` under the
        current weights (aligned as in :class:`TokenBatch`), from the logits divided by
        :func:`logprob_temperature` (the distribution rollouts are sampled from). One rank per
        data-parallel group returns its shard; the others return ``None``."""

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def get_reference_logprobs(self, batch: TokenBatch) -> BatchShard | None:
        """The same under the initial (reference) weights, for the KL penalty: ``policy.model_name``
        as the constructor loaded it, also after a resume (the reference is not checkpointed)."""

    @dispatch(Fanout.ALL, Gather.NONE)
    @since(2, adaptable=True)
    def offload_before_refit(self) -> None:
        """Colocated generation is about to take the device: move what neither the refit nor
        generation needs (optimizer state, gradients) off it. A no-op where nothing is on a device."""

    @dispatch(Fanout.ALL, Gather.NONE)
    @since(2, adaptable=True)
    def offload_after_refit(self) -> None:
        """The engines hold a copy of the weights now: move the weights off the device too (called
        only with ``policy.generation.colocated.offload_weights``)."""

    @dispatch(Fanout.ALL, Gather.NONE)
    @since(2, adaptable=True)
    def prepare_for_training(self) -> None:
        """Bring back whatever the offload calls moved; the core calls it before the next
        ``get_logprobs``/``train`` after a colocated generation."""

    @dispatch(Fanout.RANK0)
    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        """Every weight ``export_weights`` will yield, HF names, full (unsharded) shapes."""

    @dispatch(Fanout.ALL)
    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors cast to ``dtype``, in buckets of at most ``bucket_bytes`` (a single
        larger tensor forms its own bucket). Collective: every rank must iterate."""

    @dispatch(Fanout.ALL, Gather.NONE)
    def export_hf(self, path: str) -> None:
        """Write a ``save_pretrained``-compatible checkpoint (safetensors and tokenizer)."""

    @dispatch(Fanout.ALL, Gather.NONE)
    @since(4, adaptable=True)
    def save_checkpoint(self, path: str, options: CheckpointOptions) -> None:
        """Write this rank's part of a checkpoint under ``path`` (the core creates nothing there;
        every rank gets the same path). Contract 4."""

    @dispatch(Fanout.ALL, Gather.NONE)
    @since(4, adaptable=True)
    def load_checkpoint(self, path: str, options: CheckpointOptions) -> None:
        """Restore what :meth:`save_checkpoint` wrote; a bad checkpoint raises one line and
        changes nothing. Contract 4."""

    @dispatch(Fanout.ALL, Gather.NONE)
    def finalize_checkpoint(self) -> None:
        """Wait for any asynchronous checkpoint save to complete."""


@runtime_checkable
class GenerationWorker(Protocol):
    """One rank of a generation engine, built as ``WorkerCls(config, rank=..., world_size=...)``
    from the same HF checkpoint as the policy. ``world_size`` is the ranks of the group hosting it:
    the training ranks when colocated (the engine lives in their actors), else the generation
    group; every ``GenerationBackendSpec.engine_size`` consecutive ranks form one engine and get the
    same prompts. An engine may start without the checkpoint's weights (vLLM's ``load_format:
    dummy``) and say so with a negative ``weight_version``: the core then loads the policy's into
    it before its first generation."""

    weight_version: int

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def generate(self, prompts: list[list[int]], *, greedy: bool = False) -> GenerationOutput:
        """One sample per prompt (token ids in, a :class:`GenerationOutput` out), sampled with the
        config's ``policy.generation`` settings, or greedily with ``greedy``."""

    @dispatch(Fanout.DP)
    def import_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], manifest: list[WeightSpec]) -> int:
        """Load the buckets atomically against ``manifest``; return the new weight version."""

    @dispatch(Fanout.ALL, Gather.NONE)
    @since(2, adaptable=True)
    def prepare_for_generation(self, tags: list[str] | None = None) -> None:
        """Colocated: wake what ``tags`` name (``"weights"`` before a refit, ``"kv_cache"`` before
        generating; everything when None) after :meth:`finish_generation`."""

    @dispatch(Fanout.ALL, Gather.LIST)
    @since(2, adaptable=True)
    def finish_generation(self) -> bool:
        """Colocated: release the device's memory for training until the next
        :meth:`prepare_for_generation`. True when the engine dropped its weights, so the core
        refits it before it generates again."""

    @dispatch(Fanout.DP)
    @since(2, adaptable=True)
    def sampling_state(self) -> dict[str, int]:
        """What, with the weights, determines the next samples; saved with checkpoints."""

    @dispatch(Fanout.ALL, Gather.NONE)
    @since(2, adaptable=True)
    def load_sampling_state(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`sampling_state` so a resumed run samples as the uninterrupted one."""

    @since(2, adaptable=True)
    def shutdown(self) -> None:
        """Stop the engine and free its memory (safe to call twice)."""


@capability("adapter_export", role="training", since=9,
            asks="policy.refit.adapters: true (LoRA adapters leave alone at each refit)")
class AdapterExporter(Protocol):
    """What a training worker adds to declare ``adapter_export`` (contract 9): a LoRA run whose
    generation engine applies the adapters itself (``policy.refit.adapters: true``) sends only
    these tensors at each refit, through the same transports and manifest check as weights."""

    def adapter_config(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` for the tensors :meth:`export_adapter` yields (``r``,
        ``lora_alpha``, ``target_modules``, ...). Fixed for a run; the core asks rank 0 once."""

    def adapter_manifest(self, dtype: str) -> list[WeightSpec]:
        """Every tensor :meth:`export_adapter` will yield: PEFT names
        (``base_model.model.<module>.lora_A.weight``), full shapes."""

    def export_adapter(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The adapters as :meth:`TrainingWorker.export_weights` yields weights: full tensors cast
        to ``dtype``, in buckets. Collective: every rank must iterate."""


@capability("topk_logprobs", role="training", since=10,
            asks="next-token top-k and logprobs at given ids (distillation)")
class TopkScorer(Protocol):
    """What a training worker adds to declare ``topk_logprobs`` (contract 10): the next-token
    distribution beyond the sampled token, for distillation. Where a backend splits its logits over
    the vocabulary (Megatron's tensor parallelism), neither method gathers them on a rank
    (:mod:`nrl_core.sdk.vocab`). Both use :func:`logprob_temperature`, as
    :meth:`TrainingWorker.get_logprobs` does."""

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def get_topk_logprobs(self, batch: TokenBatch, k: int) -> TopkShard | None:
        """The ``k`` likeliest tokens at every position of this rank's data-parallel shard
        (aligned as in :class:`TokenBatch`), their full-vocabulary logprobs descending; one rank
        per data-parallel group returns its shard, the others ``None``."""

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def get_gathered_logprobs(self, batch: TokenBatch, ids_field: str) -> BatchShard | None:
        """Full-vocabulary logprobs ``[n, T, k]`` of the ids in ``batch.fields[ids_field]``
        (``[B, T, k]``, aligned) under the current weights; returned as :meth:`get_logprobs`."""


@capability("value_head", role="training", since=11,
            asks="policy.reward_model_cfg.enabled: true (a scalar head in place of the LM head: reward models "
                 "and critics)")
class ValueScorer(Protocol):
    """What a training worker adds to declare ``value_head`` (contract 11). With
    ``policy.reward_model_cfg.enabled`` it builds its model with a scalar head (Hugging Face's
    ``score`` layer, one output) where the LM head would be, trains it with losses that read values
    (:class:`LossFunction`) and exports it as the HF class for ``reward_model_type``:
    ``*ForSequenceClassification`` for ``bradley_terry``, ``*ForTokenClassification`` for
    ``regression``. Such a model has no logprobs."""

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def get_values(self, batch: TokenBatch) -> BatchShard | None:
        """The head's output at every position of this rank's data-parallel shard, float32
        ``[n, T]``: ``values[:, t]`` reads tokens ``0..t`` (not shifted as logprobs are; a sequence's
        score is its value at its last token). Returned as :meth:`TrainingWorker.get_logprobs`."""


@capability("in_flight_updates", role="generation", since=12,
            asks="grpo.async_grpo.in_flight_weight_updates: true (import_weights may run while generate_groups "
                 "streams, in another thread: requests in flight finish with the new weights, and every output "
                 "names each token's weight version in token_weight_versions)")
class InFlightUpdater(Protocol):
    """What a generation worker adds to declare ``in_flight_updates`` (contract 12): the core may
    call :meth:`GenerationWorker.import_weights` from another thread while ``generate_groups``
    streams, and the requests in flight finish with the new weights. Its outputs name each token's
    version (:attr:`GenerationOutput.token_weight_versions`)."""

    def configure_in_flight(self, recompute_kv_cache: bool) -> None:
        """Called once before the first in-flight import. ``recompute_kv_cache``: after an update
        the requests in flight recompute their KV cache with the new weights (and cached prefixes
        are dropped), else they keep the cache the old weights computed (NeMo RL's default)."""


@capability("pipelined_import", role="generation", since=13,
            asks="refits between processes load each bucket while the next is exported (a transfer that fails "
                 "part-way leaves it refusing to generate until a refit succeeds)")
class PipelinedImporter(Protocol):
    """What a generation worker adds to declare ``pipelined_import`` (contract 13): the core may
    hand a refit's buckets as they arrive, so the engine loads bucket k while the training side
    exports bucket k+1, rather than staging the whole model first."""

    def import_weights_pipelined(self, buckets: Iterable[list[tuple[str, torch.Tensor]]],
                                 manifest: list[WeightSpec]) -> int:
        """Check ``manifest`` against the engine before loading anything (a mismatch raises
        :class:`~nrl_core.refit.manifest.RefitError` and changes nothing), then load each tensor
        once it is proven to be the manifest's (:func:`~nrl_core.refit.manifest.verified_stream`).
        A bucket that fails or never comes after the first load raises
        :class:`~nrl_core.refit.manifest.TornRefitError`, and the engine refuses to generate until
        a refit succeeds. May stage and load atomically where the engine cannot stream. Returns the
        new weight version."""


@capability("partial_import", role="generation", since=14,
            asks="each rank names the refit's tensors it loads and receives only those (a rank of vLLM's expert "
                 "parallelism gets only its experts)")
class PartialImporter(Protocol):
    """What a generation worker adds to declare ``partial_import`` (contract 14): a rank that loads
    only part of the model (its experts under expert parallelism) says which part, and every refit
    then hands its imports only those tensors and a manifest of only those, whatever the transport;
    the broadcast transport sends a tensor only one rank loads to that rank alone."""

    def refit_wants(self, manifest: list[WeightSpec]) -> list[Any]:
        """The names in ``manifest`` (the whole model's) this rank loads; called before the rank
        loads anything (over a collective transport, before anything is sent), so a manifest the
        engine cannot take may raise :class:`~nrl_core.refit.manifest.RefitError` here. A name
        outside ``manifest`` is refused.
        The imports that follow (``import_weights``, ``import_weights_pipelined``) get a manifest of
        exactly these names. A worker that also declares ``sliced_import`` may name a
        :class:`~nrl_core.refit.slices.WeightSlice` instead of a name: it then receives only that
        block, handed as a tensor of the manifest's shape that refuses reads outside the block."""


@capability("adapter_refit", role="generation", since=9,
            asks="policy.refit.adapters: true (it applies LoRA adapters itself)")
class AdapterServer(Protocol):
    """What a generation worker adds to declare ``adapter_refit`` (contract 9): its engine holds the
    base model (read from ``policy.model_name``) and applies the policy's LoRA adapters itself."""

    def import_adapter(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], manifest: list[WeightSpec],
                       adapter_config: Mapping[str, Any]) -> int:
        """Load the adapter atomically against ``manifest`` (PEFT names, ``adapter_config`` as
        :meth:`AdapterExporter.adapter_config` gave it); generation uses it from now on. Returns
        the new weight version, counted with :meth:`GenerationWorker.import_weights`'."""


@runtime_checkable
class Environment(Protocol):
    def score(self, samples: list[EnvSample]) -> EnvResult: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    """An environment that talks back (contract 6; its spec says ``multi_turn=True``): the core
    calls ``step`` once per turn with every episode still running, and the episodes continue
    with the observations it returns until each is done, cut at ``policy.max_total_sequence_length``
    or out of ``grpo.max_rollout_turns``."""

    def step(self, episodes: list[Episode]) -> list[EnvStep]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None: ...

    def close(self) -> None: ...


@capability("streaming", role="generation", since=2,
            asks="grpo.async_grpo.enabled: true (generate_groups yields each group as it finishes)")
class StreamingGenerator(Protocol):
    """What a generation worker adds to declare ``streaming``: async GRPO scores each prompt's
    group the moment its last sample is done, rather than waiting for the whole batch."""

    def generate_groups(self, prompts: list[list[int]], group_size: int, *,
                        greedy: bool = False) -> Iterator[tuple[int, GenerationOutput]]:
        """``group_size`` samples of each prompt, yielded as ``(prompt index, output)`` when the
        group's last sample is done, in any order; every prompt exactly once."""


CAPABILITY_PROTOCOLS: tuple[type, ...] = (AdapterExporter, TopkScorer, ValueScorer, StreamingGenerator, AdapterServer,
                                         InFlightUpdater, PipelinedImporter, PartialImporter)
"""Every capability that adds methods, as the Protocol that declares them."""


def _capabilities(role: str, flags: Mapping[str, str]) -> dict[str, str]:
    marked = [capability_of(protocol) for protocol in CAPABILITY_PROTOCOLS]
    return {**flags, **{mark.name: mark.asks for mark in marked if mark is not None and mark.role == role}}


TRAINING_CAPABILITIES: Mapping[str, str] = _capabilities("training", TRAINING_FLAGS)
"""What a training backend may declare it supports beyond one rank training padded micro-batches;
a config that asks for something the selected backend does not declare fails validation."""

GENERATION_CAPABILITIES: Mapping[str, str] = _capabilities("generation", GENERATION_FLAGS)
"""The same for generation backends."""
