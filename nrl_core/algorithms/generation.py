"""``Generation``: the driver's handle on the generation engines, and keeping their weights fresh.

Two placements (``policy.generation.colocated.enabled``):

* **colocated**: the engine is built inside the policy's rank-0 actor, sharing its resources;
  refit hands tensors over in process.
* **not colocated**: ``colocated.resources.num_workers`` engines in their own actors and
  placement; refit moves buckets through shared memory (same node) or a broadcast group.

Either way the driver marks the engines stale after every training step and refits lazily, just
before the next generation, so validation and rollouts always see the current policy.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from nrl_core.algorithms.policy import Policy
from nrl_core.cluster import WorkerGroup, make_placement
from nrl_core.contracts import GenerationBackendSpec, GenerationOutput
from nrl_core.refit.orchestrator import refit, refit_options
from nrl_core.refit.report import RefitReport

logger = logging.getLogger(__name__)


def _split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """Contiguous, nearly equal chunks (so output order is input order after concatenation)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


class Generation:
    def __init__(self, config: Mapping[str, Any], spec: GenerationBackendSpec, policy: Policy) -> None:
        generation = config["policy"]["generation"]
        self.spec = spec
        self.policy = policy
        self.colocated = bool(generation["colocated"]["enabled"])
        self.refit_options = refit_options(config)
        self.stale = False  # engines start from the same HF checkpoint as the policy
        self.group: WorkerGroup | None = None
        if self.colocated:
            policy.group.host_call(0, "nrl_colocate_generation", spec.worker, dict(config))
            self.actors = [policy.rank0]
        else:
            num_workers = int(generation["colocated"]["resources"]["num_workers"] or 1)
            self.placement = make_placement(config["cluster"], num_workers, name="generation")
            self.group = WorkerGroup(spec.worker, num_workers, name=f"generation-{spec.name}",
                                     init_kwargs={"config": dict(config)}, placement=self.placement,
                                     distributed_backend="none")
            self.actors = self.group.actors

    def generate(self, prompts: Sequence[Sequence[int]], *, greedy: bool = False) -> GenerationOutput:
        chunks = _split(list(prompts), len(self.actors))
        if self.colocated:
            outputs = [self.policy.group.host_call(0, "nrl_generation_call", "generate", chunks[0], greedy=greedy)]
        else:
            assert self.group is not None
            outputs = self.group.run_all_sharded("generate", [(c,) for c in chunks], [{"greedy": greedy}] * len(chunks))
        return GenerationOutput(
            token_ids=[t for o in outputs for t in o.token_ids],
            logprobs=[lp for o in outputs for lp in o.logprobs],
            finish_reasons=[r for o in outputs for r in o.finish_reasons],
            weight_version=min(o.weight_version for o in outputs),
        )

    def sampling_states(self) -> list[dict[str, Any]]:
        """Each engine's sampling position (seed and call count): restored on resume so sampled
        rollouts continue exactly as in an uninterrupted run."""
        if self.colocated:
            return [self.policy.group.host_call(0, "nrl_generation_call", "sampling_state")]
        assert self.group is not None
        return self.group.run_all("sampling_state")

    def load_sampling_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        if not states:
            return
        if self.colocated:
            self.policy.group.host_call(0, "nrl_generation_call", "load_sampling_state", states[0])
        else:
            assert self.group is not None
            self.group.run_all_sharded("load_sampling_state", [(s,) for s in states])

    def mark_stale(self) -> None:
        self.stale = True

    def refresh(self) -> RefitReport | None:
        """Refit if the policy changed since the engines last loaded weights."""
        if not self.stale:
            return None
        report = self.update_weights()
        self.stale = False
        return report

    def update_weights(self) -> RefitReport:
        """Move the policy's current weights into every engine.

        Exporting full tensors is collective for sharded backends, so while rank 0 exports its
        buckets for the engines the other ranks run the same export and drop the result."""
        opts = self.refit_options
        drains = None
        if self.policy.world_size > 1:
            drains = self.policy.group.host_call_async(list(range(1, self.policy.world_size)), "nrl_refit_drain",
                                                       opts["bucket_bytes"], opts["dtype"])
        report = refit(self.policy.rank0, self.actors, transport=opts["transport"],
                       bucket_bytes=opts["bucket_bytes"], dtype=opts["dtype"])
        if drains is not None:
            self.policy.group.get(drains)
        logger.info("refit: %.1f MB in %.2fs over %s (weights v%d)", report.bytes / 1e6, report.seconds,
                    report.transport, report.version)
        return report

    def shutdown(self) -> None:
        if self.group is not None:
            self.policy.group.host_call(0, "nrl_refit_release")  # the training side's shared buffers
            self.group.shutdown()
            self.placement.remove()
