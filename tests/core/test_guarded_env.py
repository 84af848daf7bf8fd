"""An environment plugin's faults at the run's boundary (``GuardedEnvironment``): one line naming
the plugin, its distribution, entry point and method, with the exception's own message, and the
traceback in ``<log_dir>/faults/``; a wrong type or count is one line saying what was expected."""

from __future__ import annotations

import copy
import pickle
import re

import pytest

from nrl_core.algorithms.guarded_env import GuardedEnvironment
from nrl_core.contracts import EnvResult, EnvSample, EnvStep, Episode
from nrl_core.errors import ConfigError, PluginError
from nrl_core.plugin_faults import PluginOwner

OWNER = PluginOwner("environment", "dice", "nrl-dice", "dice-plugin")
NAMED = "environment 'dice' of nrl-dice (entry point 'dice-plugin'): "
SAMPLES = [EnvSample(prompt="p", response=str(i)) for i in range(3)]
EPISODES = [Episode(prompt="p", messages=[], metadata={}, turn=0) for _ in range(2)]


class Dice:
    """Answers as the contract asks, unless told to misbehave in one of the ways a plugin can."""

    def __init__(self, fault: str = "") -> None:
        self.fault, self.shut = fault, False
        self.sides = 6

    def score(self, samples):
        if self.fault == "raise":
            raise ValueError("a die has\nno side 7")
        if self.fault == "count":
            return EnvResult(rewards=[1.0] * (len(samples) - 1))
        if self.fault == "type":
            return [1.0] * len(samples)
        return EnvResult(rewards=[float(s.response) for s in samples])

    def step(self, episodes):
        if self.fault == "raise":
            raise KeyError("turn")
        if self.fault == "count":
            return [EnvStep()] * (len(episodes) + 1)
        if self.fault == "type":
            return [EnvStep(), {"reward": 1.0}]
        return [EnvStep(reward=1.0) for _ in episodes]

    def shutdown(self):
        if self.fault == "raise":
            raise RuntimeError("the pool was already closed")
        self.shut = True


def test_a_well_behaved_environment_passes_through_unchanged():
    dice = Dice()
    env = GuardedEnvironment(dice, OWNER, None)
    assert env.score(SAMPLES).rewards == [0.0, 1.0, 2.0]
    assert [s.reward for s in env.step(EPISODES)] == [1.0, 1.0]
    assert env.sides == 6 and env.plugin_object is dice  # anything else reaches the plugin's object
    env.shutdown()
    assert dice.shut


@pytest.mark.parametrize("method, call, raised", [
    ("score", lambda env: env.score(SAMPLES), "ValueError: a die has no side 7"),
    ("step", lambda env: env.step(EPISODES), "KeyError: 'turn'"),
])
def test_a_raising_environment_is_one_line_with_its_traceback_on_disk(tmp_path, method, call, raised):
    env = GuardedEnvironment(Dice("raise"), OWNER, tmp_path)
    with pytest.raises(PluginError) as info:
        call(env)
    message = str(info.value)
    assert "\n" not in message
    match = re.fullmatch(re.escape(f"{NAMED}Dice.{method} raised {raised}; traceback in ") + r"(\S+)", message)
    assert match, message
    trace = open(match.group(1)).read()
    assert match.group(1).startswith(str(tmp_path / "faults")) and f"in {method}" in trace and raised.split(":")[0] in trace


@pytest.mark.parametrize("fault, call, problem", [
    ("count", lambda env: env.score(SAMPLES),
     "Dice.score returned 2 rewards for 3 samples; it must score each sample once, in order"),
    ("type", lambda env: env.score(SAMPLES), "Dice.score returned list; it must return an EnvResult"),
    ("count", lambda env: env.step(EPISODES),
     "Dice.step returned 3 results for 2 episodes; it must answer each episode once, in order"),
    ("type", lambda env: env.step(EPISODES),
     "Dice.step returned dict for episode 1; it must return an EnvStep for each episode"),
], ids=["score-count", "score-type", "step-count", "step-type"])
def test_a_wrong_answer_is_one_line_saying_what_was_expected(fault, call, problem):
    with pytest.raises(PluginError, match=f"^{re.escape(NAMED + problem)}$"):
        call(GuardedEnvironment(Dice(fault), OWNER, None))


def test_without_a_log_directory_the_line_stands_alone():
    with pytest.raises(PluginError, match=f"^{re.escape(NAMED)}Dice.score raised ValueError: a die has no side 7$"):
        GuardedEnvironment(Dice("raise"), OWNER, None).score(SAMPLES)


def test_shutdown_raising_is_one_line_too():
    with pytest.raises(PluginError, match=f"^{re.escape(NAMED)}Dice.shutdown raised RuntimeError: the pool was "
                                          f"already closed$"):
        GuardedEnvironment(Dice("raise"), OWNER, None).shutdown()


def test_a_message_meant_for_the_user_and_the_cores_own_faults_pass_unchanged():
    """An ``NrlError`` is the plugin's own one-line message; a built-in of nrl-core that raises is
    the core's bug, reported with its traceback rather than blamed on a plugin."""
    class Refusing(Dice):
        def score(self, samples):
            raise ConfigError("env.dice.sides", "must be at least 2")

    with pytest.raises(ConfigError, match="^env.dice.sides: must be at least 2$"):
        GuardedEnvironment(Refusing(), OWNER, None).score(SAMPLES)
    core = PluginOwner("environment", "dice", "nrl-core", "nrl_core.builtin")
    with pytest.raises(ValueError, match="a die has\nno side 7"):
        GuardedEnvironment(Dice("raise"), core, None).score(SAMPLES)


def test_the_wrapper_copies_and_pickles_and_type_checks_go_to_the_plugins_object():
    env = GuardedEnvironment(Dice(), OWNER, None)
    for clone in (copy.copy(env), copy.deepcopy(env), pickle.loads(pickle.dumps(env))):
        assert clone.score(SAMPLES).rewards == [0.0, 1.0, 2.0] and clone.sides == 6
    assert isinstance(env.plugin_object, Dice) and not hasattr(env, "no_such_attribute")


def test_an_error_from_the_plugins_ray_actor_is_named_by_its_own_type_and_message():
    """Ray wraps an actor's exception in its own, whose text is the remote traceback; the line names
    the plugin's exception itself."""
    from ray.exceptions import RayTaskError

    class Remote(Dice):
        def score(self, samples):
            wrapped = RayTaskError("VerifierWorker.score", "Traceback (most recent call last):\n  ...\n",
                                   ValueError("cannot parse '\\\\frac{1}{'"))
            raise wrapped.as_instanceof_cause()

    with pytest.raises(PluginError, match=f"^{re.escape(NAMED)}Remote.score raised ValueError: cannot parse "
                                          r"'\\\\frac\{1\}\{'$"):
        GuardedEnvironment(Remote(), OWNER, None).score(SAMPLES)
