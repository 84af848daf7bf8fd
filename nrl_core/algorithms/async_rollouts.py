"""Async GRPO's rollouts: generation runs ahead of training, with bounded staleness (``grpo.async_grpo``).

NeMo RL's semantics. A trajectory collector, in a thread of the driver, keeps the engines busy: it
draws the prompts of step ``t`` from the dataloader, streams them to the engines, scores each
group of responses as it completes and puts it in a replay buffer, labelled with the version of
the weights that sampled it (``g``: optimizer steps behind those weights) and the step it is for.
The trainer takes exactly the groups meant for its step. A group is fit for step ``t``, trained
with weights of version ``t - 1``, only if ``(t - 1) - g <= max_trajectory_age_steps``, so the
collector starts step ``t``'s prompts only once the engines hold weights of at least version
``t - 1 - max_trajectory_age_steps``; the trainer checks the bound again on every group it takes.

After each step the trainer refits the engines. Refits land between generation requests: the
collector holds the engines while a step's prompts stream, the refit waits for that, then the
engines load the new weights (no restart) and the collector continues with them. With
``max_trajectory_age_steps: 0`` this is the synchronous loop: every step's rollouts come from the
current weights, and the same seeds sample the same tokens. The loss corrects off-policy samples
with importance weights ``exp(prev_logprobs - generation_logprobs)``: ``generation_logprobs`` are
what the engine that sampled each token reported, under the weights of version ``g``.

In-flight weight updates (``grpo.async_grpo.in_flight_weight_updates``, off by default as in NeMo
RL): the refit does not wait for the step streaming now. The engines import the new weights beside
the stream (their hosts' in-flight thread) and the requests in flight finish with them, keeping the
KV cache the old weights computed or, with ``recompute_kv_cache_after_weight_updates``, recomputing
it. NeMo RL labels a trajectory with the version it started under; nrl records each token's version
(the engine reports them), labels the trajectory with its oldest token's, and bounds the age by
that one, so the bound is NeMo RL's. ``async/in_flight_mixed_fraction`` (responses that carry two
versions or more) and ``async/token_age_mean`` say what the updates did.

Checkpoints: what is in flight (groups in the buffer, prompts being generated) is not saved but
regenerated. A checkpoint after step ``s`` stores the dataloader position of step ``s + 1``'s
prompts, so a resumed run draws them again and samples them with the restored weights; the
staleness bound holds from the first resumed step (the resumed rollouts are fresh). Sampling is
therefore not bit-identical to an uninterrupted async run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nrl_core.algorithms.rollout_sources import RolloutBatch, Sampler, env_metrics
from nrl_core.algorithms.scoring import RolloutGroup
from nrl_core.algorithms.setup import PhaseTimer
from nrl_core.contracts import EnvResult
from nrl_core.errors import NrlError

POLL_S = 0.5


@dataclass
class Trajectory:
    """A scored group of responses, the step it was drawn for and its completion time."""

    group: RolloutGroup
    step: int
    position: int  # of the prompt in its step's batch
    env_result: EnvResult
    finished_at: float = field(default_factory=time.monotonic)

    @property
    def weight_version(self) -> int:
        return self.group.output.weight_version


class ReplayBuffer:
    """Trajectories by the step they were drawn for; thread-safe. The trainer takes a step's
    groups once all of them are in."""

    def __init__(self) -> None:
        self._by_step: dict[int, list[Trajectory]] = {}
        self._changed = threading.Condition()

    def put(self, trajectory: Trajectory) -> None:
        with self._changed:
            self._by_step.setdefault(trajectory.step, []).append(trajectory)
            self._changed.notify_all()

    def take(self, step: int, count: int, failure: Callable[[], BaseException | None]) -> list[Trajectory]:
        """Wait until ``count`` groups for ``step`` are in and take them; ``failure()`` returning an
        exception ends the wait with it (the collector died)."""
        with self._changed:
            while len(self._by_step.get(step, ())) < count:
                error = failure()
                if error is not None:
                    raise error
                self._changed.wait(POLL_S)
            return self._by_step.pop(step)

    def __len__(self) -> int:
        with self._changed:
            return sum(len(groups) for groups in self._by_step.values())


class TrajectoryCollector:
    """The thread that keeps generating (see the module docstring). ``version`` is the weight
    version the engines hold; the trainer moves it with :meth:`refit`."""

    def __init__(self, sampler: Sampler, loader: Any, generation: Any, *, first_step: int, last_step: int,
                 version: int, max_age: int, in_flight: bool = False) -> None:
        self.in_flight = in_flight
        self.sampler = sampler
        self.loader = loader
        self.generation = generation
        self.last_step = last_step
        self.max_age = max_age
        self.buffer = ReplayBuffer()
        self.version = version
        self.next_step = first_step
        self.loader_states: dict[int, dict[str, Any]] = {}
        self.idle_seconds = 0.0  # waiting for fresher weights, since the trainer last read it
        self.error: BaseException | None = None
        self._engines = threading.Lock()  # held while a step's prompts stream; refits and validation wait
        self._versions = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, name="nrl-trajectory-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._versions:
            self._versions.notify_all()
        self._thread.join(timeout=30)

    def failure(self) -> BaseException | None:
        return self.error

    # ------------------------------------------------------------------ the collector's thread

    def _collect(self) -> None:
        try:
            while not self._stop.is_set() and self.next_step <= self.last_step:
                step = self.next_step
                if not self._wait_for_weights(step):
                    return
                self.loader_states[step] = self.loader.state_dict()
                prompts = self.loader.next_batch()
                with self._engines:
                    for index, group, result in self.sampler.stream(prompts):
                        self.buffer.put(Trajectory(group=group, step=step, position=index, env_result=result))
                self.next_step += 1
        except BaseException as exc:  # handed to the trainer, which raises it
            self.error = exc

    def _wait_for_weights(self, step: int) -> bool:
        """Block until weights of version ``step - 1 - max_age`` or newer are loaded."""
        start = time.monotonic()
        with self._versions:
            while (step - 1) - self.version > self.max_age and not self._stop.is_set():
                self._versions.wait(POLL_S)
        self.idle_seconds += time.monotonic() - start
        return not self._stop.is_set()

    # ------------------------------------------------------------------ called by the trainer

    @contextlib.contextmanager
    def engines(self) -> Iterator[None]:
        """Hold the engines between two of the collector's steps (refit, validation)."""
        with self._engines:
            yield

    def refit(self) -> None:
        """Load the trainer's new weights once the step streaming now is done, or at once, into
        the requests in flight (in-flight weight updates)."""
        if self.in_flight:
            report = self.generation.prepare(in_flight=True)
        else:
            with self._engines:
                report = self.generation.prepare()
        if report is not None:
            with self._versions:
                self.version = report.version
                self._versions.notify_all()


class AsyncRollouts:
    """Each step's rollouts from a :class:`TrajectoryCollector` (``grpo.async_grpo.enabled``; any
    algorithm that samples with the core's samplers may use it: PPO's ``ppo.async_ppo``)."""

    def __init__(self, sampler: Sampler, loader: Any, generation: Any, *, prompts_per_step: int, max_age: int,
                 last_step: int, age_key: str = "grpo.async_grpo.max_trajectory_age_steps", in_flight: bool = False,
                 recompute_kv_cache: bool = False) -> None:
        self.in_flight = in_flight
        self.recompute_kv_cache = recompute_kv_cache
        self.sampler = sampler
        self.loader = loader
        self.generation = generation
        self.prompts_per_step = prompts_per_step
        self.max_age = max_age
        self.age_key = age_key  # named in the error a too-old rollout raises
        self.last_step = last_step
        self.collector: TrajectoryCollector | None = None

    def start(self, first_step: int) -> None:
        """Start collecting once the run's state is restored (the engines' weight version and the
        dataloader position are the resumed ones)."""
        version = min(self.generation.weight_versions())
        if version < 0:  # engines built with placeholder weights load the policy's first
            version = self.generation.prepare().version
        if self.in_flight:
            self.generation.configure_in_flight(self.recompute_kv_cache)
        self.collector = TrajectoryCollector(self.sampler, self.loader, self.generation, first_step=first_step,
                                             last_step=self.last_step, version=version, max_age=self.max_age,
                                             in_flight=self.in_flight)
        self.collector.start()

    def batch_for(self, step: int) -> RolloutBatch:
        collector = self._running()
        start = time.monotonic()
        trajectories = collector.buffer.take(step, self.prompts_per_step, collector.failure)
        waited = time.monotonic() - start
        ages = [(step - 1) - t.weight_version for t in trajectories]
        if max(ages) > self.max_age:
            raise NrlError(f"step {step}: a rollout of weight version {min(t.weight_version for t in trajectories)} "
                           f"is {max(ages)} steps old, over {self.age_key}={self.max_age} (a bug in the collector)")
        trajectories.sort(key=lambda t: t.position)  # the order the prompts were drawn in
        timer = PhaseTimer()
        timer.seconds["waiting"] = waited
        metrics = {**env_metrics(EnvResult.combine([t.env_result for t in trajectories])),
                   "async/trajectory_age_mean": sum(ages) / len(ages), "async/trajectory_age_max": float(max(ages)),
                   "async/trainer_idle_seconds": waited}
        if self.in_flight:
            metrics.update(in_flight_metrics([t.group.output for t in trajectories], step))
        return RolloutBatch(step=step, groups=[t.group for t in trajectories], metrics=metrics, timer=timer)

    def after_step(self, batch: RolloutBatch) -> dict[str, float]:
        """Refit the engines with the trained weights (between two of the collector's steps)."""
        collector = self._running()
        with batch.timer("refit"):
            collector.refit()
        idle, collector.idle_seconds = collector.idle_seconds, 0.0
        return {"async/buffer_size": float(len(collector.buffer)), "async/generation_idle_seconds": idle,
                **batch.timer.metrics()}

    def engines(self) -> contextlib.AbstractContextManager[None]:
        return self._running().engines()

    def dataloader_state(self, next_step: int) -> dict[str, Any]:
        """The position of the next step's prompts: what the collector drew beyond it is regenerated."""
        states = self.collector.loader_states if self.collector is not None else {}
        return states.get(next_step, self.loader.state_dict())

    def stop(self) -> None:
        if self.collector is not None:
            self.collector.stop()

    def _running(self) -> TrajectoryCollector:
        if self.collector is None:
            raise RuntimeError("async rollouts: start() was not called")
        return self.collector


def in_flight_metrics(outputs: list[Any], step: int) -> dict[str, float]:
    """What in-flight weight updates did to ``step``'s rollouts (trained with weights ``step - 1``):
    the fraction of responses whose tokens come from two versions or more, and the mean age of
    their tokens."""
    per_response = [output.versions_of(i) for output in outputs for i in range(len(output.token_ids))]
    tokens = [v for versions in per_response for v in versions]
    mixed = sum(len(set(versions)) > 1 for versions in per_response)
    return {"async/in_flight_mixed_fraction": mixed / max(len(per_response), 1),
            "async/token_age_mean": sum((step - 1) - v for v in tokens) / max(len(tokens), 1)}
