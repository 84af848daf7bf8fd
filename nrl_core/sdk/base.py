"""``TrainingWorkerBase``: the parts of a training worker every backend shares.

What a subclass sets in ``__init__``: ``self.device`` (where the model trains), ``self.rank``,
``self.model`` and ``self.optimizer`` (used by the default hand-off hooks), ``self.hf_config``, and
``self.export_dtype`` when its exported weights are not float32. What it writes: ``train``,
``get_logprobs``, ``get_reference_logprobs`` (usually ``with self.reference.swapped_in():`` around
its logprobs, see :class:`~nrl_core.sdk.ReferenceWeights`), ``weight_manifest``,
``export_weights``, and its checkpoint methods. What it may override: the four hand-off hooks
(``offload_training_state``, ``reload_training_state``, ``offload_weights``, ``reload_weights``)
and ``tokenizer_source``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from nrl_core.device import free_device_cache, move_optimizer_state, resolve_precision
from nrl_core.errors import ConfigError, NrlError
from nrl_core.sdk.hf_export import write_hf_export

PRECISIONS = ("float32", "bfloat16", "float16")
#: The HF export writes each bucket as it arrives, so its peak is the bucket in flight (or the
#: largest tensor): small buckets, as an export runs once per run and few collectives do not matter.
EXPORT_BUCKET_BYTES = 64 << 20


def training_precision(policy: Mapping[str, Any], device: torch.device) -> str:
    """``policy.precision`` resolved for ``device`` (null: bf16 on a GPU that has it, else
    float32), refused in one line unless it is one a backend can train in."""
    precision = resolve_precision(policy.get("precision"), device)
    if precision not in PRECISIONS:
        raise ConfigError("policy.precision", f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


class TrainingWorkerBase:
    """See the module docstring; the contract it helps meet is :class:`nrl_core.contracts.TrainingWorker`."""

    backend_name = "training"  # in messages: "<backend_name> worker rank N: ..."
    export_dtype = "float32"  # the dtype of the HF export's tensors
    lazy_imports: tuple[str, ...] = ()  # modules the worker imports only once built: the core imports them early
    router_metrics: Any = None  # MoE models: the routers' choice counts (nrl_core.moe.RouterStats as .stats)
    value_head: str | None = None  # reward_model_type when the model has a value head (nrl_core.sdk.value_head)
    device: torch.device
    rank: int
    model: Any
    optimizer: Any
    hf_config: Any
    policy: Mapping[str, Any]

    # ------------------------------------------------------------------ colocated memory hand-off

    @property
    def offloaded(self) -> set[str]:
        """What is off the device now: "optimizer" (training state) and/or "weights"."""
        if not hasattr(self, "_offloaded"):
            self._offloaded: set[str] = set()
        return self._offloaded

    @property
    def moves_to_host(self) -> bool:
        """Whether offloading moves anything (on a CPU device there is nowhere to move to)."""
        return self.device.type != "cpu"

    def offload_before_refit(self) -> None:
        """Neither the refit nor generation needs the training state: free it from the device."""
        self.offload_training_state()
        free_device_cache()
        self.offloaded.add("optimizer")

    def offload_after_refit(self) -> None:
        """The engine generates from its own copy of the weights: move them off the device."""
        self.offload_weights()
        free_device_cache()
        self.offloaded.add("weights")

    def prepare_for_training(self) -> None:
        """Bring back what the offload calls moved (idempotent)."""
        if "weights" in self.offloaded:
            self.reload_weights()
        if "optimizer" in self.offloaded:
            self.reload_training_state()
        self.offloaded.clear()

    def recording_routes(self, token_mask: Callable[[], torch.Tensor] | None) -> AbstractContextManager[Any]:
        """Count the routers' choices during a forward (MoE models, whose ``router_metrics`` the
        backend set); ``None`` for a pass that must not count (padding, forward-only)."""
        if self.router_metrics is None or token_mask is None:
            return nullcontext()
        return self.router_metrics.stats.recording(token_mask())

    def require_on_device(self, what: str) -> None:
        """Refuse ``what`` (train, logprobs) in one line while anything is offloaded."""
        if self.offloaded:
            raise NrlError(f"{self.backend_name} worker rank {self.rank}: {what} while its "
                           f"{', '.join(sorted(self.offloaded))} are offloaded; call prepare_for_training first")

    def require_lm_head(self, what: str) -> None:
        """Refuse ``what`` (logprobs) in one line on a model with a value head."""
        if self.value_head:
            raise NrlError(f"{self.backend_name} worker rank {self.rank}: {what} needs a language model, but this "
                           f"one has a value head (policy.reward_model_cfg.enabled); call get_values instead")

    def require_value_head(self, what: str) -> None:
        """Refuse ``what`` (values) in one line on a language model."""
        if not self.value_head:
            raise NrlError(f"{self.backend_name} worker rank {self.rank}: {what} needs a value head; enable "
                           "policy.reward_model_cfg for this model")

    def require_loss_fits(self, loss_fn: Any) -> None:
        """A loss reads what this model has: values from a value head (``reads_values``), else logprobs."""
        what = f"train with {type(getattr(loss_fn, 'plugin_object', loss_fn)).__name__}"
        if getattr(loss_fn, "reads_values", False):
            self.require_value_head(what)
        else:
            self.require_lm_head(what)

    def offload_training_state(self) -> None:
        """Default: free the gradients, move the optimizer state to (pinned) host memory."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.moves_to_host:
            move_optimizer_state(self.optimizer, torch.device("cpu"))

    def reload_training_state(self) -> None:
        if self.moves_to_host:
            move_optimizer_state(self.optimizer, self.device)

    def offload_weights(self) -> None:
        if self.moves_to_host:
            self.model.to("cpu")

    def reload_weights(self) -> None:
        if self.moves_to_host:
            self.model.to(self.device)

    # ------------------------------------------------------------------ HF export

    def tokenizer_source(self) -> str:
        """Where the tokenizer the export carries comes from (default: the model's directory)."""
        tokenizer = self.policy.get("tokenizer") or {}
        return str(tokenizer.get("name") or self.policy["model_name"])

    def export_hf(self, path: str) -> None:
        """A ``save_pretrained``-compatible directory built from :meth:`export_weights` (rank 0
        writes). Collective."""
        import torch.distributed as dist

        writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        write_hf_export(self.export_weights(EXPORT_BUCKET_BYTES, self.export_dtype), self.hf_config,
                        self.tokenizer_source(), path, dtype=self.export_dtype, writer=writer)
