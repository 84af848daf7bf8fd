"""Plugins that fail the way a plugin can, for tests/e2e/test_plugin_faults.py, loaded with
``NRL_PLUGINS`` through the public API as a third party's would be: an environment that raises
from ``score``, one that scores one sample too few, a multi-turn one that answers a turn with
something that is not an ``EnvStep``, one that never answers, an advantage estimator and a loss
that raise, and a training backend whose ``train`` raises (the DTensor backend's worker, but for
that)."""

from __future__ import annotations

import dataclasses
import time

from nrl_backend_dtensor import plugin as dtensor_plugin
from nrl_backend_dtensor.worker import DTensorPolicyWorker
from nrl_core.api import (
    AdvantageEstimatorSpec,
    EnvironmentSpec,
    EnvResult,
    Field,
    LossFunctionSpec,
    Section,
    TrainingBackendSpec,
    hookimpl,
)


class RaisingEnvironment:
    def __init__(self, section: dict) -> None:
        pass

    def score(self, samples: list) -> EnvResult:
        raise ZeroDivisionError("the grader divided by the empty answer")

    def shutdown(self) -> None:
        pass


class ShortEnvironment(RaisingEnvironment):
    def score(self, samples: list) -> EnvResult:
        return EnvResult(rewards=[0.0] * (len(samples) - 1))


class WrongTypeEnvironment(RaisingEnvironment):
    def step(self, episodes: list) -> list:
        return [{"observation": "", "reward": 1.0} for _ in episodes]


class SilentEnvironment(RaisingEnvironment):
    def score(self, samples: list) -> EnvResult:
        time.sleep(600)
        return EnvResult(rewards=[0.0] * len(samples))


class _Grader:
    def grade(self, count: int) -> list[float]:
        time.sleep(600)
        return [0.0] * count


class ActorEnvironment(RaisingEnvironment):
    """Grades in a Ray actor of its own, which never answers: the watchdog names that process."""

    def __init__(self, section: dict) -> None:
        import ray

        self.grader = ray.remote(_Grader).options(name="nrl-faulty-grader", num_cpus=0).remote()

    def score(self, samples: list) -> EnvResult:
        import ray

        return EnvResult(rewards=ray.get(self.grader.grade.remote(len(samples))))


class RaisingLoss:
    @classmethod
    def from_config(cls, section: dict) -> RaisingLoss:
        return cls()

    def __call__(self, logprobs: object, batch: object, *, global_valid_tokens: float,
                 global_valid_seqs: float) -> tuple:
        raise KeyError("advantages_v2")


class RaisingTrainWorker(DTensorPolicyWorker):
    def train(self, batch: object, loss_fn: object) -> dict:
        raise RuntimeError("the optimizer lost its state")


class RaisingEstimator:
    def __init__(self, section: dict, config: dict) -> None:
        pass

    def __call__(self, inputs: object) -> object:
        raise IndexError("group 3 of 2")


@hookimpl
def nrl_advantage_estimators() -> list[AdvantageEstimatorSpec]:
    return [AdvantageEstimatorSpec(name="raising", estimator="tests.e2e.faulty_plugins:RaisingEstimator",
                                   distribution="nrl-faulty-plugins")]


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    def spec(name: str, cls: str, **extra: bool) -> EnvironmentSpec:
        return EnvironmentSpec(name=name, environment=f"tests.e2e.faulty_plugins:{cls}", config_schema=Section(fields={}),
                               distribution="nrl-faulty-plugins", **extra)

    return [spec("raising", "RaisingEnvironment"), spec("short", "ShortEnvironment"),
            spec("wrong_type", "WrongTypeEnvironment", multi_turn=True), spec("silent", "SilentEnvironment"),
            spec("silent_actor", "ActorEnvironment")]


@hookimpl
def nrl_loss_functions() -> list[LossFunctionSpec]:
    return [LossFunctionSpec(name="raising", loss="tests.e2e.faulty_plugins:RaisingLoss",
                             distribution="nrl-faulty-plugins")]


@hookimpl
def nrl_training_backends() -> list[TrainingBackendSpec]:
    """Selected by ``policy.raising_train_cfg.enabled``, above DTensor, whose section it reads."""
    (dtensor,) = dtensor_plugin.nrl_training_backends()
    return [dataclasses.replace(dtensor, name="raising_train", config_key="raising_train_cfg", config_aliases={},
                                priority=100, worker="tests.e2e.faulty_plugins:RaisingTrainWorker",
                                config_schema=Section(fields={"enabled": Field(type=bool, default=False)}),
                                config_check=None, distribution="nrl-faulty-plugins")]
