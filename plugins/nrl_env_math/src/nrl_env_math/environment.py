"""The ``math`` environment: rewards for responses whose answer equals the ground truth.

Model output is never executed. Responses are handled as text: the answer is cut out with regular
expressions and compared by math-verify's LaTeX parser (see :mod:`nrl_env_math.verify`); nothing
from a response reaches ``eval``, ``exec`` or an import.

Scoring runs in ``num_workers`` Ray actors (:class:`~nrl_env_math.worker.VerifierWorker`), a
batch split evenly across them, so slow symbolic checks neither block the driver nor each other.
Two failure levels:

* a *sample* whose verification exceeds ``timeout_seconds`` scores ``reward_incorrect`` and is
  counted in the ``timeouts`` metric; training goes on;
* a *worker* that dies, or stays silent for ``timeout_seconds`` x its samples +
  ``hang_grace_seconds`` (stuck where the alarm cannot reach), is a
  :class:`~nrl_core.errors.WorkerError` naming it (``math-verifier[1] pid 1234``). The worker is
  killed and a fresh one started, so the environment stays usable after the error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nrl_core.api import ConfigError, EnvResult, EnvSample, WorkerError, first_line
from nrl_env_math.plugin import DAPO_ENV_SCHEMA, MATH_ENV_SCHEMA, VERIFIERS
from nrl_env_math.verify import extract_answer

COUNTS = ("timeouts", "errors", "no_answer", "num_samples")
"""The metrics that are totals over the samples (the others are means)."""

__all__ = ["DapoMathEnvironment", "MathEnvironment"]

logger = logging.getLogger(__name__)


@dataclass
class _Slot:
    """One worker: its actor, its name, and (until it answered once) the pending start-up call."""

    label: str
    actor: Any
    ready: Any = None
    pid: int | None = None

    @property
    def name(self) -> str:
        return f"{self.label} pid {self.pid}" if self.pid is not None else self.label


class MathEnvironment:
    """Scores math responses; ``config`` is the ``env.math`` section (defaults filled in here too,
    so a partial mapping works outside a validated run)."""

    section, schema = "env.math", MATH_ENV_SCHEMA

    def __init__(self, config: Mapping[str, Any]) -> None:
        import ray

        from nrl_core.api import init_ray

        cfg = self.schema.validate(dict(config), self.section)
        assert cfg is not None
        for key in ("num_workers", "timeout_seconds", "startup_timeout_seconds"):
            if cfg[key] <= 0:
                raise ConfigError(f"{self.section}.{key}", f"must be > 0, got {cfg[key]}")
        cfg["verifier"] = cfg["verifier"] or VERIFIERS[cfg["math_verify_impl"]]
        self.config = cfg
        init_ray()
        from nrl_env_math.worker import VerifierWorker

        self._actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(VerifierWorker)
        # Started, not awaited: the verifiers come up while the algorithm builds its policy and
        # engines (about 2 s of start-up on the 2-core machine); the first score waits for them and
        # raises a worker that did not start, as it does for a replaced one.
        self._slots = [self._spawn(i) for i in range(cfg["num_workers"])]

    # ------------------------------------------------------------------ workers

    def _spawn(self, index: int) -> _Slot:
        label = f"math-verifier[{index}]"
        actor = self._actor_cls.options(num_cpus=float(self.config["cpus_per_worker"])).remote(
            label, self.config["verifier"], float(self.config["timeout_seconds"]))
        return _Slot(label=label, actor=actor, ready=actor.info.remote())

    def _await_ready(self) -> None:
        import ray

        limit = float(self.config["startup_timeout_seconds"])
        for i, slot in enumerate(self._slots):
            if slot.ready is None:
                continue
            try:
                info = ray.get(slot.ready, timeout=limit)
            except ray.exceptions.GetTimeoutError:
                self._replace(i)
                raise WorkerError(f"{self.section}: verifier worker {slot.name} did not start within {limit:g} s; "
                                  "raise env.math.startup_timeout_seconds or check the Ray cluster's free CPUs") from None
            except Exception as exc:
                self._replace(i)
                raise WorkerError(f"{self.section}: verifier worker {slot.name} failed to start: {first_line(exc)}") from None
            slot.pid, slot.ready = info["pid"], None
            if not info["per_sample_timeout"]:
                logger.warning("%s cannot use alarms; only the hang limit bounds slow samples", slot.name)

    def _replace(self, index: int) -> None:
        """Kill the worker at ``index`` and start a fresh one in its place (ready on next use)."""
        import ray

        try:
            ray.kill(self._slots[index].actor, no_restart=True)
        except Exception:  # already gone
            pass
        self._slots[index] = self._spawn(index)

    # ------------------------------------------------------------------ scoring

    def score(self, samples: list[EnvSample]) -> EnvResult:
        """Rewards in the order of ``samples``; metrics ``accuracy``, ``reward_mean``, ``timeouts``,
        ``errors`` (verifier exceptions), ``no_answer`` (responses with no answer to extract); each
        sample's extracted answer (or None) as its ``sample_metadata`` ``answer``."""
        if not samples:
            return EnvResult(rewards=[], metrics={"accuracy": 0.0, "reward_mean": 0.0, "timeouts": 0.0,
                                                  "errors": 0.0, "no_answer": 0.0, "num_samples": 0.0}, counts=COUNTS)
        if not self._slots:
            raise WorkerError(f"{self.section}: the environment was shut down; build a new {type(self).__name__}")
        self._await_ready()
        pairs = [(s.response, str(s.metadata.get("ground_truth", ""))) for s in samples]
        statuses = self._run(pairs)
        correct, incorrect = float(self.config["reward_correct"]), float(self.config["reward_incorrect"])
        rewards = [correct if st == "correct" else incorrect for st in statuses]
        n = float(len(samples))
        answers = [extract_answer(response) for response, _ in pairs]
        metrics = {
            "accuracy": statuses.count("correct") / n,
            "reward_mean": sum(rewards) / n,
            "timeouts": float(statuses.count("timeout")),
            "errors": float(statuses.count("error")),
            "no_answer": float(sum(answer is None for answer in answers)),
            "num_samples": n,
        }
        # the answer each response states: logged beside it, and what a majority vote counts
        return EnvResult(rewards=rewards, metrics=metrics, counts=COUNTS,
                         sample_metadata=[{"answer": answer} for answer in answers])

    def _run(self, pairs: list[tuple[str, str]]) -> list[str]:
        """Split ``pairs`` over the workers (round-robin) and wait for all of them.

        After a failure the other workers are still waited for (up to their own deadlines), so no
        stale work is left queued in front of the next batch; then the failed workers are replaced
        and the first failure is raised.
        """
        import ray

        n_workers = len(self._slots)
        chunks = {i: pairs[i::n_workers] for i in range(n_workers) if pairs[i::n_workers]}
        start = time.monotonic()
        grace = float(self.config["hang_grace_seconds"])
        per_sample = float(self.config["timeout_seconds"])
        pending = {self._slots[i].actor.score.remote(chunk): i for i, chunk in chunks.items()}
        deadline = {i: start + per_sample * len(chunk) + grace for i, chunk in chunks.items()}
        results: dict[int, list[str]] = {}
        failures: dict[int, str] = {}
        while pending:
            wait_for = max(0.0, min(deadline[i] for i in pending.values()) - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_for)
            for ref in done:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    failures[i] = f"died while scoring {len(chunks[i])} samples ({first_line(exc)})"
                except Exception as exc:
                    failures[i] = f"raised while scoring {len(chunks[i])} samples: {first_line(exc)}"
            now = time.monotonic()
            for ref, i in list(pending.items()):
                if now >= deadline[i]:
                    del pending[ref]
                    failures[i] = (f"hung: no answer for {len(chunks[i])} samples within {deadline[i] - start:.1f} s "
                                   f"(timeout_seconds x samples + hang_grace_seconds)")
        if failures:
            first = min(failures)
            names = {i: self._slots[i].name for i in failures}
            for i in failures:
                self._replace(i)
            more = f" ({len(failures) - 1} more workers failed too)" if len(failures) > 1 else ""
            raise WorkerError(f"{self.section}: verifier worker {names[first]} {failures[first]}; "
                              f"it was replaced by a fresh worker{more}")
        statuses: list[str] = [""] * len(pairs)
        for i, chunk_statuses in results.items():
            statuses[i::n_workers] = chunk_statuses
        return statuses

    def shutdown(self) -> None:
        """Kill every worker. Idempotent."""
        import ray

        for slot in self._slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
        self._slots = []


class DapoMathEnvironment(MathEnvironment):
    """``env.dapo``: the math environment with DAPO's verifier (:mod:`nrl_env_math.dapo`)."""

    section, schema = "env.dapo", DAPO_ENV_SCHEMA

