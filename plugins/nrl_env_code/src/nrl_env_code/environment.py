"""``env.code`` and ``env.code_multi_turn``: rewards from running the model's program against its task's tests.

Single-turn (``code``, :meth:`CodeEnvironment.score`): the last code block of each response runs
against every test of its task, each test in its own sandbox (:mod:`nrl_env_code.sandbox`); the
reward is the fraction of tests passed (``reward_mode: fraction``) or 1 only when all pass
(``all_or_nothing``). A response without a code block scores 0.

Multi-turn (``code_multi_turn``, :meth:`CodeEnvironment.step`): each turn's code runs the same
way and the interpreter's output (each test's verdict, the output and stderr of the first failing
one; never the expected output, which the model could copy) is the observation. The episode ends
when every test passes, after ``max_turns`` model turns, or after the first turn that ran code
with NeMo RL's ``terminate_on_evaluation``. A turn's reward is its score minus the last scored
turn's, so an episode's reward (the sum of its turns') is the score of its last program, however
the episode ends; a turn without code changes nothing.

Per-test results (status, exit code, stdout and stderr excerpts, seconds) are each sample's
``EnvResult.sample_metadata`` (single-turn) or in the episode's metadata (multi-turn,
``results``); the core logs both beside each rollout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nrl_core.api import ConfigError, EnvResult, EnvSample, EnvStep, Episode
from nrl_env_code.checks import TestCase, TestResult, judge, program_for, tests_of
from nrl_env_code.extract import extract_code
from nrl_env_code.plugin import CODE_SCHEMA, MULTI_TURN_SCHEMA
from nrl_env_code.pool import LocalRunner, SandboxPool

__all__ = ["CodeEnvironment", "CodeMultiTurnEnvironment", "Evaluation"]

COUNTS = ("no_code", "test_runs", "limits_hit", "num_samples")
NO_CODE = "No code block found. Write your whole program in one block:\n```python\n...\n```"


@dataclass(kw_only=True)
class Evaluation:
    """One response's verdict: its program (None: no code block), each test's result, the score."""

    code: str | None
    results: list[TestResult] = field(default_factory=list)
    score: float = 0.0

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def all_passed(self) -> bool:
        return bool(self.results) and self.passed == len(self.results)

    def metadata(self) -> dict[str, Any]:
        """This turn's verdict: what a multi-turn episode keeps (its state from then on) and what a
        single-turn sample reports in its ``sample_metadata``."""
        return {"code_score": self.score, "tests_passed": self.passed, "tests_total": len(self.results),
                "results": [r.to_dict() for r in self.results]}


class CodeEnvironment:
    """Scores programs in sandboxes; ``config`` is the ``env.code`` section (validated again here, so a
    partial mapping works outside a run)."""

    section, schema = "env.code", CODE_SCHEMA

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = self.schema.validate(dict(config), self.section)
        assert cfg is not None
        if cfg["timeout_seconds"] <= 0:
            raise ConfigError(f"{self.section}.timeout_seconds", f"must be > 0, got {cfg['timeout_seconds']}")
        self.config = cfg
        if cfg["num_workers"] == 0:
            self.runner: LocalRunner | SandboxPool = LocalRunner(cfg["sandbox"])
        else:
            self.runner = SandboxPool(cfg["sandbox"], cfg["num_workers"], section=self.section,
                                      cpus_per_worker=cfg["cpus_per_worker"],
                                      startup_timeout=cfg["startup_timeout_seconds"],
                                      hang_grace=cfg["hang_grace_seconds"])

    # ------------------------------------------------------------------ evaluating

    def evaluate(self, responses: Sequence[str], metadatas: Sequence[Mapping[str, Any]]) -> list[Evaluation]:
        """Every response run against its task's tests, all runs of the batch in one go through the pool.

        The same program against the same test runs once per batch: a group's responses are often
        identical (GRPO samples several per prompt), and the verdict is the program's, not the sample's."""
        codes = [extract_code(r) for r in responses]
        tests = [tests_of(m) for m in metadatas]  # a task without tests is a dataset error, code or not
        unique: dict[tuple[str, TestCase], int] = {}
        for code, cases in zip(codes, tests):
            for case in cases if code is not None else []:
                unique.setdefault((code, case), len(unique))
        timeout = float(self.config["timeout_seconds"])
        runs = [program_for(code, case, timeout) for code, case in unique]
        results = self.runner.run([program for program, _ in runs]) if runs else []
        excerpt = int(self.config["excerpt_chars"])
        verdicts = [judge(case, result, parts, excerpt) for (_, case), (_, parts), result in zip(unique, runs, results)]
        evaluations = []
        for code, cases in zip(codes, tests):
            evaluation = Evaluation(code=code)
            if code is not None:
                evaluation.results = [verdicts[unique[(code, case)]] for case in cases]
            evaluation.score = self._score(evaluation)
            evaluations.append(evaluation)
        return evaluations

    def _score(self, evaluation: Evaluation) -> float:
        if not evaluation.results:
            return 0.0
        if self.config["reward_mode"] == "all_or_nothing":
            return float(evaluation.all_passed)
        return evaluation.passed / len(evaluation.results)

    # ------------------------------------------------------------------ single-turn

    def score(self, samples: list[EnvSample]) -> EnvResult:
        """Rewards in the order of ``samples``; metrics ``accuracy`` (all tests passed), ``pass_rate``
        (tests passed per test), ``reward_mean``, and the totals ``no_code``, ``test_runs``,
        ``limits_hit`` (tests a time, CPU, output or memory limit ended), ``num_samples``."""
        evaluations = self.evaluate([s.response for s in samples], [s.metadata for s in samples])
        rewards = [e.score for e in evaluations]
        return EnvResult(rewards=rewards, metrics=self._metrics(evaluations), counts=COUNTS,
                         sample_metadata=[e.metadata() for e in evaluations])

    @staticmethod
    def _metrics(evaluations: Sequence[Evaluation]) -> dict[str, float]:
        n = float(len(evaluations)) or 1.0
        results = [r for e in evaluations for r in e.results]
        return {
            "accuracy": sum(e.all_passed for e in evaluations) / n,
            "pass_rate": sum(e.passed / len(e.results) for e in evaluations if e.results) / n,
            "reward_mean": sum(e.score for e in evaluations) / n,
            "no_code": float(sum(e.code is None for e in evaluations)),
            "test_runs": float(len({id(r) for r in results})),  # sandbox runs (a repeated program ran once)
            "limits_hit": float(sum(r.status in ("wall_time", "cpu_time", "output", "memory") for r in results)),
            "num_samples": float(len(evaluations)),
        }

    # ------------------------------------------------------------------ multi-turn

    def step(self, episodes: list[Episode]) -> list[EnvStep]:
        """One answer per episode: the interpreter's output as the observation, the score's change as the reward."""
        with_code = [e for e in episodes if extract_code(e.last_response) is not None]
        evaluations = dict(zip(map(id, with_code), self.evaluate([e.last_response for e in with_code],
                                                                  [e.metadata for e in with_code])))
        return [self._turn(e, evaluations.get(id(e))) for e in episodes]

    def _turn(self, episode: Episode, evaluation: Evaluation | None) -> EnvStep:
        last = float(episode.metadata.get("code_score", 0.0))
        out_of_turns = episode.turn >= int(self.config["max_turns"])
        if evaluation is None:
            metrics = {"has_code": 0.0, **({"solved": 0.0} if out_of_turns else {})}
            return EnvStep(observation=f"\n{NO_CODE}\n", done=out_of_turns, metrics=metrics)
        done = evaluation.all_passed or out_of_turns or bool(self.config["terminate_on_evaluation"])
        metadata = {**episode.metadata, **evaluation.metadata()}
        metrics = {"has_code": 1.0, "pass_rate": evaluation.passed / max(len(evaluation.results), 1)}
        if done:
            metrics["solved"] = float(evaluation.all_passed)
        return EnvStep(observation="" if done else observation(evaluation), reward=evaluation.score - last,
                       done=done, metadata=metadata, metrics=metrics)

    def shutdown(self) -> None:
        self.runner.shutdown()


class CodeMultiTurnEnvironment(CodeEnvironment):
    """``env.code_multi_turn``: the same environment, configured in its own section."""

    section, schema = "env.code_multi_turn", MULTI_TURN_SCHEMA


def observation(evaluation: Evaluation) -> str:
    """The interpreter's output for the model: a line per test, then the first failing test's
    output and stderr. Expected outputs are never shown."""
    lines = [f"test {i + 1}: {r.status.replace('_', ' ')}" for i, r in enumerate(evaluation.results)]
    failing = next((r for r in evaluation.results if not r.passed), None)
    if failing is not None:
        if failing.stdout.strip():
            lines += ["stdout:", failing.stdout.rstrip()]
        if failing.stderr.strip():
            lines += ["stderr:", failing.stderr.rstrip()]
    summary = f"{evaluation.passed}/{len(evaluation.results)} tests passed"
    return "\n<output>\n" + "\n".join([summary, *lines]) + "\n</output>\n"
