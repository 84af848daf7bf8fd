"""``Generation``: the driver's handle on the generation engines, and keeping their weights fresh.

Where the engines live (:mod:`nrl_core.config.topology`):

* **colocated**: one engine per ``engine_size`` training ranks, built inside their actors (every
  training rank hosts a rank of an engine); refit runs in process on every rank at once. Between
  generations the engines sleep and the training state comes back to the device; before the next
  generation it leaves again (NeMo RL's hand-off: optimizer state and gradients off, refit, the
  weights off, the KV cache back).
* **not colocated**: the generation ranks of the cluster in their own actors and placement; rank 0
  of the policy exports once and every generation rank imports (shared memory on one node, a
  broadcast group across nodes).

Prompts are split into contiguous chunks, one per engine, so concatenating the engines' outputs
keeps the input order; every rank of an engine gets its engine's chunk and one rank per engine
returns the result. The driver marks the engines stale after every training step and refits lazily,
just before the next generation, so validation and rollouts always see the current policy.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nrl_core.algorithms.handoff import DeviceHandOff
from nrl_core.algorithms.policy import Policy
from nrl_core.algorithms.policy_launch import launch_generation
from nrl_core.algorithms.refit_orchestrator import refit
from nrl_core.cluster._host import WorkerHost
from nrl_core.cluster.worker_group import method_name
from nrl_core.config.topology import cluster_topology
from nrl_core.contracts import GenerationBackendSpec, GenerationOutput, GenerationWorker, InFlightUpdater
from nrl_core.dispatch import Fanout, dispatch_of
from nrl_core.errors import NrlError
from nrl_core.refit.plan import RefitMode, RefitPlan
from nrl_core.refit.report import RefitReport
from nrl_core.timeline import mark

if TYPE_CHECKING:
    from nrl_core.cluster import WorkerGroup

logger = logging.getLogger(__name__)


def split_evenly(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """Contiguous, nearly equal chunks (so output order is input order after concatenation)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


def generate_on_engines(hosts: WorkerGroup, prompts: Sequence[Sequence[int]], num_engines: int, engine_size: int, *,
                        greedy: bool = False) -> GenerationOutput:
    """Complete ``prompts`` on the ``num_engines`` engines of ``engine_size`` ranks each that the
    worker group ``hosts`` holds, a contiguous chunk each; outputs in input order."""
    chunks = split_evenly(list(prompts), num_engines)
    mark("generate_start")
    outputs = hosts.call(WorkerHost.nrl_generate_sharded, chunks, engine_size, greedy=greedy)
    mark("generate_end")
    return GenerationOutput.concatenate(outputs)


class Generation:
    def __init__(self, config: Mapping[str, Any], spec: GenerationBackendSpec, policy: Policy) -> None:
        generation = config["policy"]["generation"]
        topology = cluster_topology(config, policy.plugins)
        self.spec = spec
        self.policy = policy
        self.colocated = topology.colocated
        self.engine_size = topology.engine_size
        self.num_engines = topology.num_engines
        self.hand_off = DeviceHandOff(policy, offload_weights=bool(generation["colocated"]["offload_weights"]))
        dropped = False
        if self.colocated:
            self.hosts = policy.colocated_hosts()
            self.placement = None
            self._index_ranks()
            dropped = self._build_colocated(spec, config)
        else:
            early = None if policy.runtime is None else policy.runtime.take_generation(spec, config)
            launched = early or launch_generation(config, spec, policy.spec)
            self.placement, self.hosts = launched.placement, launched.group
            try:
                launched.finish_start({"config": dict(config)})
            except BaseException:
                self.placement.remove()
                raise
            self._index_ranks()
        self.adapters = bool(config["policy"]["refit"]["adapters"])
        self.refit_plan = RefitPlan.for_run(config, spec.capabilities, timeout_s=policy.timeout_s)
        if self.adapters:  # LoRA: the engines hold the base model; every refit sends the adapters alone
            adapter_config = self.policy.group.call(WorkerHost.nrl_adapter_config)
            self.policy.group.call(WorkerHost.nrl_refit_adapters, adapter_config)
            if not self.colocated:
                self.hosts.call(WorkerHost.nrl_refit_adapters, adapter_config)
        # engines built with placeholder weights (version -1) get the policy's before they generate;
        # that first load makes them version 0, the checkpoint's weights, as if they had read it
        self.stale = dropped or min(self.weight_versions()) < 0
        mark("generation_built")

    def _index_ranks(self) -> None:
        self.ranks = list(range(self.hosts.world_size))
        self.leads = self.ranks[:: self.engine_size]  # the rank of each engine that reports for it

    def _build_colocated(self, spec: GenerationBackendSpec, config: Mapping[str, Any]) -> bool:
        """Build an engine inside every training actor while the training state is off the device,
        as it will be whenever the engine runs: vLLM sizes itself from the device's memory at
        start-up and refuses to start when less is free than ``gpu_memory_utilization`` asks. The
        engines then sleep and the training state comes back. True when they dropped their weights."""
        self.hand_off.before_generation()
        # vLLM builds its process groups collectively: every training rank builds its engine at once
        self.hosts.call(WorkerHost.nrl_colocate_generation, spec.worker, dict(config))
        dropped = any(self._engines(GenerationWorker.finish_generation))
        self.hand_off.before_training()
        return dropped

    # ------------------------------------------------------------------ generating

    def generate(self, prompts: Sequence[Sequence[int]], *, greedy: bool = False) -> GenerationOutput:
        """Complete ``prompts`` on every engine (a contiguous chunk each); outputs in input order."""
        return generate_on_engines(self.hosts, prompts, self.num_engines, self.engine_size, greedy=greedy)

    def generate_groups(self, prompts: Sequence[Sequence[int]], group_size: int) -> Iterator[tuple[int, GenerationOutput]]:
        """``group_size`` samples of every prompt, yielded as ``(prompt index, output)`` the moment
        a group is complete, from whichever engine finished it (each engine streams its contiguous
        chunk of prompts; async GRPO scores groups as they arrive). An engine that dies or raises
        ends the iteration with its one-line error. Every rank of an engine streams its chunk; only
        the engine's first rank yields."""
        chunks = split_evenly(list(range(len(prompts))), self.num_engines)
        arrived: queue.Queue[Any] = queue.Queue()

        def consume(rank: int, indices: list[int]) -> None:
            try:
                for local, output in self.hosts.stream(WorkerHost.nrl_generate_groups,
                                                       [list(prompts[i]) for i in indices], group_size,
                                                       engine_size=self.engine_size, on=rank):
                    arrived.put((indices[local], output))
                arrived.put(None)
            except BaseException as exc:  # re-raised in the consuming thread
                arrived.put(exc)

        for rank in self.ranks:
            indices = chunks[rank // self.engine_size]
            threading.Thread(target=consume, args=(rank, indices), name=f"nrl-stream-{rank}", daemon=True).start()
        finished = 0
        while finished < len(self.ranks):
            item = arrived.get()
            if item is None:
                finished += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    def prepare(self, *, in_flight: bool = False) -> RefitReport | None:
        """Before generating: refit if the policy changed since the engines last loaded weights.
        Colocated, the training state makes room first (optimizer state and gradients before the
        refit, the weights after it) and the engines wake (weights for the refit, then the KV cache).
        ``in_flight``: the engines may be generating; the new weights land in their requests."""
        if self.colocated:
            self.hand_off.before_refit()
        report = None
        if self.stale:
            if self.colocated:
                self._engines(GenerationWorker.prepare_for_generation, ["weights"])
            report = self.update_weights(in_flight=in_flight)
            self.stale = False
        if self.colocated:
            self.hand_off.before_generation()
            self._engines(GenerationWorker.prepare_for_generation, None)
        return report

    def finish(self) -> None:
        """After generating, colocated: the engines release the device (an engine that dropped its
        weights is refit before it generates again) and the training state comes back."""
        if not self.colocated:
            return
        if any(self._engines(GenerationWorker.finish_generation)):
            self.stale = True
        self.hand_off.before_training()

    def load_policy_weights(self) -> RefitReport | None:
        """Refit every engine with the policy's weights now (a resumed run's), through the same
        hand-off as before a generation: colocated engines wake for it and sleep again after."""
        self.stale = True
        report = self.prepare()
        self.finish()
        return report

    def configure_in_flight(self, recompute_kv_cache: bool) -> None:
        """Let refits land while the engines generate (their backend declares ``in_flight_updates``;
        their hosts were launched with a thread for it: the config asked for in-flight updates)."""
        if self.colocated or not self.hosts.in_flight:
            raise NrlError("in-flight weight updates need engines on workers of their own, launched for them "
                           "(an async section's in_flight_weight_updates: true in the config)")
        self._engines(InFlightUpdater.configure_in_flight, recompute_kv_cache)

    def weight_versions(self) -> list[int]:
        """Each engine's weight version (negative: placeholder weights, never loaded)."""
        return self.hosts.call(WorkerHost.nrl_weight_version, on=self.leads)

    def mark_stale(self) -> None:
        self.stale = True

    def _engines(self, method: Callable[..., Any], *args: Any,
                 per_rank_args: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """``method`` (a :class:`GenerationWorker` method) on every rank of every engine, or on
        each engine's lead rank for a method declared one per data-parallel group."""
        on = self.leads if dispatch_of(method).fanout is Fanout.DP else self.ranks
        if per_rank_args is not None:
            per_rank_args = [(method_name(method), *a) for a in per_rank_args]
        return self.hosts.call(WorkerHost.nrl_generation_call, method_name(method), *args, on=on,
                               per_rank_args=per_rank_args)

    # ------------------------------------------------------------------ weights

    def update_weights(self, *, in_flight: bool = False) -> RefitReport:
        """Move the policy's current weights into every engine.

        Colocated, every training rank loads its own engine in process. Otherwise rank 0 exports
        for the engines while the other training ranks run the same export and drop the result;
        ``in_flight``, the engines import beside the generation they may be streaming."""
        plan = self.refit_plan.with_mode(RefitMode.IN_FLIGHT) if in_flight else self.refit_plan
        if self.colocated:
            ranks = [self.hosts.endpoint(r) for r in self.ranks]
            report = refit(ranks, ranks, plan)
        else:
            drains = None
            if self.policy.world_size > 1:
                drains = self.policy.drain_export(plan.bucket_bytes, plan.dtype)
            report = refit(self.policy.rank0, [self.hosts.endpoint(r) for r in self.ranks], plan)
            if drains is not None:
                drains()
        logger.info("refit: %.1f MB in %.2fs over %s (weights v%d)", report.bytes / 1e6, report.seconds,
                    report.transport, report.version)
        return report

    # ------------------------------------------------------------------ resume

    def sampling_states(self) -> list[dict[str, Any]]:
        """Each engine's sampling position (seed and call count): restored on resume so sampled
        rollouts continue exactly as in an uninterrupted run."""
        return self._engines(GenerationWorker.sampling_state)

    def load_sampling_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        if not states:
            return
        if len(states) != self.num_engines:
            raise ValueError(f"the checkpoint holds the sampling state of {len(states)} engines, this run has "
                             f"{self.num_engines}; resume with the same generation layout")
        self._engines(GenerationWorker.load_sampling_state,
                      per_rank_args=[(states[rank // self.engine_size],) for rank in self.ranks])

    def shutdown(self) -> None:
        if self.colocated:
            return  # the engines live in the policy's actors, which the policy stops
        self.policy.release_refit_buffers()
        self.hosts.shutdown()
        if self.placement is not None:
            self.placement.remove()
