"""A multi-turn environment for tests/e2e/test_multi_turn_grpo.py, loaded with ``NRL_PLUGINS``
through the public hooks as a third party's would be: it answers every turn with a short
follow-up question (tokens the tiny tokenizer knows), never ends an episode itself (so every
episode runs ``grpo.max_rollout_turns`` turns) and pays 1 for each turn whose answer contains the
arithmetic problem's result."""

from __future__ import annotations

from nrl_core import hookimpl
from nrl_core.contracts import EnvironmentSpec, EnvStep, Episode
from nrl_core.schema import Section

NRL_CONTRACT = 6
FOLLOW_UP = "\nQ: And again?\nA:"


class TalkingEnvironment:
    def __init__(self, section: dict) -> None:
        pass

    def step(self, episodes: list[Episode]) -> list[EnvStep]:
        return [EnvStep(observation=FOLLOW_UP, reward=float(e.metadata["ground_truth"] in e.last_response),
                        metrics={"follow_ups": 1.0}) for e in episodes]

    def shutdown(self) -> None:
        pass


@hookimpl
def nrl_environments() -> list[EnvironmentSpec]:
    return [EnvironmentSpec(name="talking", environment="tests.e2e.talking_env:TalkingEnvironment",
                            config_schema=Section(fields={}), distribution="tests", multi_turn=True)]
