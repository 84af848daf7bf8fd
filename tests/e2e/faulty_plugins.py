"""Plugins that fail the way a plugin can, for tests/e2e/test_plugin_faults.py, loaded with
``NRL_PLUGINS`` through the public API as a third party's would be: an environment that raises
from ``score``, one that scores one sample too few, a multi-turn one that answers a turn with
something that is not an ``EnvStep``, and an advantage estimator that raises."""

from __future__ import annotations

from nrl_core.api import AdvantageEstimatorSpec, EnvironmentSpec, EnvResult, Section, hookimpl


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
            spec("wrong_type", "WrongTypeEnvironment", multi_turn=True)]
