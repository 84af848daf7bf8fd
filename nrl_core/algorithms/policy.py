"""``Policy``: the driver's handle on the training backend's worker group.

Algorithms call these methods and never see ranks: every rank receives the whole global batch
and takes its own data-parallel shard (a backend knows its parallel layout; the driver does not).
Per-sequence results (logprobs) come back once per data-parallel group, as
:class:`~nrl_core.contracts.BatchShard`s the driver puts together; metrics come back reduced by
the backend, from rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from nrl_core.algorithms.policy_launch import launch_beside, launch_policy
from nrl_core.cluster import WorkerGroup
from nrl_core.cluster._host import WorkerHost
from nrl_core.cluster.placement import Placement
from nrl_core.cluster.worker_group import GroupRank
from nrl_core.config.topology import cluster_topology
from nrl_core.contract_versions import check_result
from nrl_core.contracts import (
    BatchShard,
    CheckpointOptions,
    GenerationBackendSpec,
    LossFunction,
    TokenBatch,
    TopkScorer,
    TopkShard,
    TrainingBackendSpec,
    TrainingWorker,
    ValueScorer,
)
from nrl_core.plugins import get_plugin_manager
from nrl_core.process_groups import distributed_timeout_s
from nrl_core.sdk.reference import without_reference_model
from nrl_core.sdk.value_head import value_head_type

if TYPE_CHECKING:
    from nrl_core.algorithms.runtime import Runtime

logger = logging.getLogger(__name__)


class Policy:
    """The training workers of ``spec``: every training rank of the cluster's topology
    (:func:`~nrl_core.config.validate.cluster_topology`)."""

    def __init__(self, config: Mapping[str, Any], spec: TrainingBackendSpec, *, colocated_generation: bool,
                 generation: GenerationBackendSpec | None = None, models_beside: int = 0,
                 beside: Policy | None = None, name: str = "policy", standalone: bool = False,
                 reference_policy: bool = True, runtime: Runtime | None = None) -> None:
        """Takes the group ``nrl train`` launched early when ``runtime`` holds one, else launches it
        (:mod:`nrl_core.algorithms.policy_launch`), then builds the workers with ``config``.
        ``generation`` is the engine's spec, whose modules colocated workers preload.
        ``models_beside`` is how many models will share this policy's devices; such a model
        (:mod:`nrl_core.config.models`) is built with ``beside=`` that policy and its own ``name``.
        A ``standalone`` group (a model an environment scores with) gets devices of its own from
        ``config["cluster"]`` and never takes the group ``nrl train`` launched for the policy.
        Without ``reference_policy`` (a run that never asks for reference logprobs, a model that
        does not train) the workers keep no copy of the initial weights."""
        self.spec = spec
        self.name = name
        self.runtime = runtime
        self.value_head = value_head_type(config["policy"]) is not None  # a scorer, not a language model
        self.plugins = runtime.plugins if runtime is not None else get_plugin_manager()
        self.world_size = cluster_topology(config, self.plugins).train_world
        self.checkpoint_options = CheckpointOptions.from_section(config["policy"][spec.config_key])
        saving = config.get("checkpointing") or {}
        if not saving.get("save_optimizer", True):  # checked against the capability
            self.checkpoint_options = replace(self.checkpoint_options, save_optimizer=False)
        if saving.get("model_save_format") == "safetensors" and "safetensors_checkpoints" in spec.capabilities:
            self.checkpoint_options = replace(self.checkpoint_options, model_save_format="safetensors")
        self.timeout_s = distributed_timeout_s(config, spec.config_key)  # every group of this run
        if beside is not None:
            launched = launch_beside(config, spec, beside.placement, name)
        elif standalone:
            launched = launch_policy(config, spec, colocated=False, name=name)
        else:
            early = None if runtime is None else runtime.take_policy(spec, colocated=colocated_generation,
                                                                       models_beside=models_beside)
            launched = (early
                        or launch_policy(config, spec, colocated=colocated_generation, generation=generation,
                                         models_beside=models_beside))
        self.placement: Placement = launched.placement
        self.group = launched.group
        try:
            self.group.start({"config": dict(config) if reference_policy else without_reference_model(config)})
        except BaseException:
            self.placement.remove()
            raise

    # ------------------------------------------------------------------ compute

    def train(self, batch: TokenBatch, loss_fn: LossFunction) -> dict[str, float]:
        self._check_loss(loss_fn)
        return self.group.call(TrainingWorker.train, batch, loss_fn)

    def train_steps(self, batch: TokenBatch, loss_fn: LossFunction, global_batch_size: int) -> dict[str, float]:
        """One optimizer step per ``global_batch_size`` rows of ``batch`` (NeMo RL's semantics: one
        step's rollouts may feed several optimizer steps); metrics averaged over them."""
        results = [self.train(batch.select(list(range(start, min(start + global_batch_size, batch.size)))), loss_fn)
                   for start in range(0, batch.size, global_batch_size)]
        return {key: sum(r[key] for r in results) / len(results) for key in results[0]}

    def _check_loss(self, loss_fn: LossFunction) -> None:
        """Refuse, in one line, a loss this model cannot feed: ids' logprobs from a backend without
        top-k, values from a language model, logprobs from a model with a value head."""
        from nrl_core.errors import PluginError

        loss = type(getattr(loss_fn, "plugin_object", loss_fn)).__name__
        if getattr(loss_fn, "gather_ids_field", None) and "topk_logprobs" not in self.spec.capabilities:
            raise PluginError(f"the {self.spec.name} training backend ({self.spec.distribution}) does not declare "
                              f"topk_logprobs, which the loss {loss} needs (gather_ids_field)")
        if bool(getattr(loss_fn, "reads_values", False)) != self.value_head:
            raise PluginError(f"the loss {loss} reads {'values' if not self.value_head else 'logprobs'} but "
                              f"the {self.name} model has {'a value head' if self.value_head else 'an LM head'} "
                              "(policy.reward_model_cfg.enabled); pair value losses with value models")

    def get_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """``[B, T]`` logprobs of ``batch``, put together from every data-parallel group's shard
        (anything else a worker returns is a one-line error naming the method and the type due)."""
        shards = [check_result("get_logprobs", s) for s in self.group.call(TrainingWorker.get_logprobs, batch)]
        return BatchShard.assemble(shards, batch.size, int(batch.input_ids.shape[1]))

    def get_reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        shards = [check_result("get_reference_logprobs", s)
                  for s in self.group.call(TrainingWorker.get_reference_logprobs, batch)]
        return BatchShard.assemble(shards, batch.size, int(batch.input_ids.shape[1]))

    def get_topk_logprobs(self, batch: TokenBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T, k]`` logprobs and ids of the ``k`` likeliest next tokens at every position
        (capability ``topk_logprobs``), put together from every data-parallel group's shard."""
        shards = [check_result("get_topk_logprobs", s, "TopkShard", since=10)
                  for s in self.group.call(TopkScorer.get_topk_logprobs, batch, k)]
        return TopkShard.assemble(shards, batch.size, int(batch.input_ids.shape[1]))

    def get_gathered_logprobs(self, batch: TokenBatch, ids_field: str) -> torch.Tensor:
        """``[B, T, k]`` logprobs of the ids in ``batch.fields[ids_field]`` (capability ``topk_logprobs``)."""
        shards = [check_result("get_gathered_logprobs", s)
                  for s in self.group.call(TopkScorer.get_gathered_logprobs, batch, ids_field)]
        return BatchShard.assemble(shards, batch.size, int(batch.input_ids.shape[1]))

    def get_values(self, batch: TokenBatch) -> torch.Tensor:
        """``[B, T]`` outputs of the value head at every position (capability ``value_head``)."""
        shards = [check_result("get_values", s, since=11) for s in self.group.call(ValueScorer.get_values, batch)]
        return BatchShard.assemble(shards, batch.size, int(batch.input_ids.shape[1]))

    # ------------------------------------------------------------------ memory hand-off (colocated generation)

    def offload_before_refit(self) -> None:
        self.group.call(TrainingWorker.offload_before_refit)

    def offload_after_refit(self) -> None:
        self.group.call(TrainingWorker.offload_after_refit)

    def prepare_for_training(self) -> None:
        self.group.call(TrainingWorker.prepare_for_training)

    # ------------------------------------------------------------------ state

    def save_checkpoint(self, path: str) -> None:
        """Every rank's ``save_checkpoint`` (a contract 1-3 worker's adapter reaches its plugin's
        hook: :mod:`nrl_core.contract_adapters`)."""
        self.group.call(TrainingWorker.save_checkpoint, path, self.checkpoint_options)

    def load_checkpoint(self, path: str) -> None:
        self.group.call(TrainingWorker.load_checkpoint, path, self.checkpoint_options)

    def finalize_checkpoint(self) -> None:
        """Block until an asynchronous save has written every file."""
        self.group.call(TrainingWorker.finalize_checkpoint)

    def export_hf(self, path: str) -> None:
        self.group.call(TrainingWorker.export_hf, path)

    # ------------------------------------------------------------------ refit (the training side)

    @property
    def rank0(self) -> GroupRank:
        """Rank 0: the refit source for engines in other actors."""
        return self.group.endpoint(0)

    def colocated_hosts(self) -> WorkerGroup:
        """The training actors, for engines built inside them (colocated generation)."""
        return self.group

    def drain_export(self, bucket_bytes: int, dtype: str | None) -> Callable[[], None] | None:
        """Start the weight export on every rank but 0, which exports for the engines: gathering
        full tensors is collective for a sharded backend. Returns what waits for it (None: one rank)."""
        if self.world_size == 1:
            return None
        futures = self.group.call_async(WorkerHost.nrl_refit_drain, bucket_bytes, dtype,
                                        on=list(range(1, self.world_size)))
        return lambda: self.group.get(futures)

    def release_refit_buffers(self) -> None:
        """Free the shared-memory buffers rank 0 keeps for refits into engines in other actors."""
        self.group.call(WorkerHost.nrl_refit_release)

    def shutdown(self) -> None:
        self.group.shutdown()
        self.placement.remove()
