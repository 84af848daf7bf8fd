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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from nrl_core.config.schema import Section
from nrl_core.errors import PluginError

if TYPE_CHECKING:
    import torch


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
    """How a backend saves and loads its worker state. Every backend must honour all four.

    * ``fully_parallel_save``: every rank writes its own shard (else one consolidated write).
    * ``fully_parallel_load``: every rank reads its own shard (else one rank reads and broadcasts).
    * ``async_save``: return before the files are complete; the backend finishes the write before
      its next save and at shutdown (:meth:`TrainingWorker.finalize_checkpoint`).
    * ``load_rng``: save and restore every RNG state so a resumed run is bit-identical.
    """

    fully_parallel_save: bool = True
    fully_parallel_load: bool = True
    async_save: bool = False
    load_rng: bool = False

    def __post_init__(self) -> None:
        for name in ("fully_parallel_save", "fully_parallel_load", "async_save", "load_rng"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CheckpointOptions.{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> "CheckpointOptions":
        """Read the four options from a backend's (validated) config section, defaults when absent."""
        names = ("fully_parallel_save", "fully_parallel_load", "async_save", "load_rng")
        return cls(**{n: section[n] for n in names if section.get(n) is not None})


# --------------------------------------------------------------------------- descriptors


@dataclass(frozen=True, kw_only=True)
class TrainingBackendSpec:
    """A training backend, returned by ``nrl_training_backends``.

    ``config_key`` is its section under ``policy`` (``megatron_cfg``); the backend is a candidate
    when that section says ``enabled: true``; among candidates the highest ``priority`` wins.
    ``worker`` is the import path of the class the core instantiates once per rank (see
    :class:`TrainingWorker`). ``config_aliases`` are other spellings of ``config_key``;
    ``parallel_size_keys`` name the section's model-parallel sizes (tensor, pipeline, context).
    """

    name: str
    config_key: str
    priority: int
    worker: str
    config_schema: Section
    distribution: str
    config_aliases: Mapping[str, str] = field(default_factory=dict)
    parallel_size_keys: tuple[str, ...] = ()
    description: str = ""

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
    :class:`GenerationWorker` class.
    """

    name: str
    config_key: str
    worker: str
    config_schema: Section
    distribution: str
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class EnvironmentSpec:
    """A reward environment, returned by ``nrl_environments``; configured under ``env.<name>``."""

    name: str
    environment: str
    config_schema: Section
    distribution: str
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class RefitTransportSpec:
    """A way to move weight buckets from training to generation, returned by ``nrl_refit_transports``.

    ``placements`` lists where it works: ``"same_process"``, ``"same_node"``, ``"cross_node"``.
    Unless the config names one (``policy.refit.transport``), the core picks the transport of
    highest ``priority`` that works for the placement (the core's own: 30, 20, 10).

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


@dataclass(frozen=True, kw_only=True)
class MetricSinkSpec:
    """An extra logger, returned by ``nrl_metric_sinks``; enabled by ``logger.<name>_enabled``."""

    name: str
    sink: str
    distribution: str
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """A training algorithm runnable as ``nrl train <name>``; ``entry`` is ``"module:function"``
    taking the validated config (a ``dict``) and returning a process exit code."""

    name: str
    entry: str
    distribution: str
    description: str = ""


# --------------------------------------------------------------------------- data that crosses processes


@dataclass(kw_only=True)
class TokenBatch:
    """Right-padded token sequences and aligned per-token or per-sequence tensors.

    ``input_ids`` is ``[B, T]``; ``input_lengths`` is ``[B]``; each tensor in ``fields`` has
    leading dimension ``B`` and, when per-token, second dimension ``T`` aligned with ``input_ids``:
    position ``t`` describes token ``t`` (so a logprob at ``t`` is log p(token_t | tokens_<t), and
    position 0 is always 0). ``token_mask`` in ``fields`` marks the tokens a loss counts.
    """

    input_ids: "torch.Tensor"
    input_lengths: "torch.Tensor"
    fields: dict[str, "torch.Tensor"] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: "torch.Tensor | Sequence[int]") -> "TokenBatch":
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
        present) is 1; a sequence counts when it has a counted token. Every backend uses this one
        definition (summed over data-parallel ranks), so losses mean the same on all of them.
        """
        import torch

        mask = self.fields.get("token_mask")
        if mask is None:
            mask = (torch.arange(self.input_ids.shape[1])[None, :] < self.input_lengths[:, None]).float()
        if "sample_mask" in self.fields:
            mask = mask * self.fields["sample_mask"].to(mask.dtype).unsqueeze(1)
        return float(mask.sum()), float((mask.sum(dim=1) > 0).sum())

    def shard(self, rank: int, world_size: int) -> "TokenBatch":
        """Rows ``rank::world_size``: the contiguous-free split that keeps groups spread evenly."""
        if self.size % world_size:
            raise ValueError(f"batch of {self.size} sequences does not divide over {world_size} data-parallel ranks")
        return self.select(list(range(rank, self.size, world_size)))


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
    """What a generation worker returns for a batch of prompts, one entry per prompt."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    weight_version: int


@dataclass(kw_only=True)
class EnvSample:
    """One scored interaction: the prompt text, the model's response text, and dataset metadata
    (for math: ``{"ground_truth": "42"}``)."""

    prompt: str
    response: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class EnvResult:
    rewards: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- protocols


class LossFunction(Protocol):
    """A loss the core owns and a backend calls once per micro-batch.

    ``logprobs`` is ``[b, t]`` float32, aligned as in :class:`TokenBatch` and computed with
    gradients by the backend. ``global_valid_tokens`` and ``global_valid_seqs`` are totals over the
    whole global batch on every data-parallel rank, so the sum of micro-batch losses equals the
    global-batch loss whatever the split. Returns the scalar loss and float metrics.
    """

    def __call__(
        self, logprobs: "torch.Tensor", batch: TokenBatch, *, global_valid_tokens: float, global_valid_seqs: float
    ) -> tuple["torch.Tensor", dict[str, float]]: ...


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
    where ``config`` is the whole validated config."""

    def train(self, batch: TokenBatch, loss_fn: LossFunction) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; metrics reduced over ranks.
        The loss sees logprobs as :meth:`get_logprobs` computes them."""

    def get_logprobs(self, batch: TokenBatch) -> "torch.Tensor":
        """Per-token float32 logprobs ``[B, T]`` of ``batch`` under the current weights, from the
        logits divided by :func:`logprob_temperature` (the distribution rollouts are sampled from)."""

    def get_reference_logprobs(self, batch: TokenBatch) -> "torch.Tensor":
        """The same under the initial (reference) weights, for the KL penalty."""

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        """Every weight ``export_weights`` will yield, HF names, full (unsharded) shapes."""

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
        """Full HF-named tensors cast to ``dtype``, in buckets of at most ``bucket_bytes`` (a single
        larger tensor forms its own bucket). Collective: every rank must iterate."""

    def export_hf(self, path: str) -> None:
        """Write a ``save_pretrained``-compatible checkpoint (safetensors and tokenizer)."""

    def finalize_checkpoint(self) -> None:
        """Wait for any asynchronous checkpoint save to complete."""


@runtime_checkable
class GenerationWorker(Protocol):
    """One generation engine. Built as ``WorkerCls(config)`` from the same HF checkpoint as the policy."""

    weight_version: int

    def generate(self, prompts: list[list[int]], *, greedy: bool = False) -> GenerationOutput: ...

    def import_weights(self, buckets: Iterable[list[tuple[str, "torch.Tensor"]]], manifest: list[WeightSpec]) -> int:
        """Load the buckets atomically against ``manifest``; return the new weight version."""


@runtime_checkable
class Environment(Protocol):
    def score(self, samples: list[EnvSample]) -> EnvResult: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None: ...

    def close(self) -> None: ...
