"""Async GRPO: generation runs ahead of training, with bounded staleness (``grpo.async_grpo``).

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

Checkpoints: what is in flight (groups in the buffer, prompts being generated) is not saved but
regenerated. A checkpoint after step ``s`` stores the dataloader position of step ``s + 1``'s
prompts, so a resumed run draws them again and samples them with the restored weights; the
staleness bound holds from the first resumed step (the resumed rollouts are fresh). Sampling is
therefore not bit-identical to an uninterrupted async run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from nrl_core.algorithms.grpo import GRPO, RolloutGroup
from nrl_core.algorithms.setup import PhaseTimer
from nrl_core.contracts import EnvResult, EnvSample
from nrl_core.errors import NrlError

logger = logging.getLogger(__name__)

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

    def take(self, step: int, count: int, failure: "Any") -> list[Trajectory]:
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

    def __init__(self, run: "AsyncGRPO", first_step: int, version: int) -> None:
        self.run = run
        self.max_age = int(run.cfg["async_grpo"]["max_trajectory_age_steps"])
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
            while not self._stop.is_set() and self.next_step <= self.run.max_steps:
                step = self.next_step
                if not self._wait_for_weights(step):
                    return
                self.loader_states[step] = self.run.train_loader.state_dict()
                prompts = self.run.train_loader.next_batch()
                with self._engines:
                    self._generate(step, prompts)
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

    def _generate(self, step: int, prompts: Sequence[Any]) -> None:
        run = self.run
        for index, output in run.generation.generate_groups([d.prompt_ids for d in prompts], run.group_size):
            prompt = prompts[index]
            texts = run.tokenizer.batch_decode(output.token_ids, skip_special_tokens=True)
            result = run.env.score([EnvSample(prompt=prompt.prompt_text, response=text, metadata=prompt.metadata)
                                    for text in texts])
            group = run.scored_group(prompt, output, result)
            self.buffer.put(Trajectory(group=group, step=step, position=index, env_result=result))

    # ------------------------------------------------------------------ called by the trainer

    @contextlib.contextmanager
    def engines(self) -> Iterator[None]:
        """Hold the engines between two of the collector's steps (refit, validation)."""
        with self._engines:
            yield

    def refit(self) -> None:
        """Load the trainer's new weights once the step streaming now is done."""
        with self._engines:
            report = self.run.generation.prepare()
        if report is not None:
            with self._versions:
                self.version = report.version
                self._versions.notify_all()


class AsyncGRPO(GRPO):
    """GRPO whose rollouts come from :class:`TrajectoryCollector` (``grpo.async_grpo.enabled``)."""

    def start(self) -> None:
        """Start collecting once the run's state is restored (the engines' weight version and the
        dataloader position are the resumed ones)."""
        version = min(self.generation.weight_versions())
        if version < 0:  # engines built with placeholder weights load the policy's first
            version = self.generation.prepare().version
        self.collector = TrajectoryCollector(self, first_step=self.state.step + 1, version=version)
        self.collector.start()

    def step_data(self, step: int) -> tuple[int, list[Trajectory], float]:
        start = time.monotonic()
        taken = self.collector.buffer.take(step, int(self.cfg["num_prompts_per_step"]), self.collector.failure)
        return step, taken, time.monotonic() - start

    def step(self, data: tuple[int, list[Trajectory], float]) -> dict[str, float]:
        step, trajectories, waited = data
        trainer_version = step - 1
        ages = [trainer_version - t.weight_version for t in trajectories]
        if max(ages) > self.collector.max_age:
            raise NrlError(f"step {step}: a rollout of weight version {min(t.weight_version for t in trajectories)} "
                           f"is {max(ages)} steps old, over grpo.async_grpo.max_trajectory_age_steps="
                           f"{self.collector.max_age} (a bug in the collector)")
        # the order the prompts were drawn in, whatever order the groups finished in
        trajectories.sort(key=lambda t: t.position)
        timer = PhaseTimer()
        timer.seconds["waiting"] = waited
        env = EnvResult.combine([t.env_result for t in trajectories])
        metrics = self.train_on([t.group for t in trajectories], {f"env/{k}": v for k, v in env.metrics.items()}, timer)
        with timer("refit"):
            self.collector.refit()
        idle, self.collector.idle_seconds = self.collector.idle_seconds, 0.0
        metrics.update({"async/trajectory_age_mean": sum(ages) / len(ages), "async/trajectory_age_max": float(max(ages)),
                        "async/buffer_size": float(len(self.collector.buffer)),
                        "async/generation_idle_seconds": idle, "async/trainer_idle_seconds": waited,
                        **timer.metrics()})
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        with self.collector.engines():
            return super().validate(step)

    def dataloader_state(self) -> dict[str, Any]:
        """The position of the next step's prompts: what the collector drew beyond it is regenerated."""
        return self.collector.loader_states.get(self.state.step + 1, self.train_loader.state_dict())

    def shutdown(self) -> None:
        collector = getattr(self, "collector", None)
        if collector is not None:
            collector.stop()
        super().shutdown()
