"""The run's side of an environment plugin: what it raises, or answers in the wrong shape, stops the
run in one line naming the plugin and the method (:mod:`nrl_core.plugin_faults`), before a wrong
answer can surface as a traceback deep in the scorer or the multi-turn loop. Each call is a phase
of its own (``environment``) under the environment's ``call_timeout_s``, so a grader that hangs
is named by the watchdog within that limit, not the generation phase's far longer one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nrl_core.config.core_schema import DEFAULT_ENV_CALL_TIMEOUT_S
from nrl_core.contracts import EnvResult, EnvStep
from nrl_core.plugin_faults import PluginBoundary, PluginOwner
from nrl_core.watchdog import PluginCall, phase


class GuardedEnvironment(PluginBoundary):
    """An environment as the algorithms call it: ``score``, ``step`` and ``shutdown`` checked at the
    boundary; any other attribute is the plugin's object's. Type checks of the plugin's class go
    to :attr:`plugin_object` (this wrapper has both methods whatever the plugin has)."""

    def __init__(self, environment: Any, owner: PluginOwner, log_dir: str | Path | None, *,
                 call_timeout_s: float = DEFAULT_ENV_CALL_TIMEOUT_S) -> None:
        super().__init__(environment, owner, log_dir)
        self._call_timeout_s = call_timeout_s

    def score(self, samples: list[Any]) -> EnvResult:
        """The plugin's rewards for ``samples``: an ``EnvResult`` with one reward per sample."""
        result = self._call("score", self.plugin_object.score, samples)
        if not isinstance(result, EnvResult):
            raise self._wrong("score", f"returned {type(result).__name__}; it must return an EnvResult")
        if len(result.rewards) != len(samples):
            raise self._wrong("score", f"returned {len(result.rewards)} rewards for {len(samples)} samples; it "
                                       f"must score each sample once, in order")
        return result

    def step(self, episodes: list[Any]) -> list[EnvStep]:
        """The plugin's answer to each live episode's turn: one ``EnvStep`` per episode, in order."""
        steps = self._call("step", self.plugin_object.step, episodes)
        if not isinstance(steps, list | tuple):
            raise self._wrong("step", f"returned {type(steps).__name__}; it must return a list of EnvStep")
        if len(steps) != len(episodes):
            raise self._wrong("step", f"returned {len(steps)} results for {len(episodes)} episodes; it must "
                                      f"answer each episode once, in order")
        wrong = next((i for i, step in enumerate(steps) if not isinstance(step, EnvStep)), None)
        if wrong is not None:
            raise self._wrong("step", f"returned {type(steps[wrong]).__name__} for episode {wrong}; it must "
                                      f"return an EnvStep for each episode")
        return list(steps)

    def shutdown(self) -> None:
        """The plugin's own shutdown, when it has one."""
        shutdown = getattr(self.plugin_object, "shutdown", None)
        if shutdown is not None:
            self._call("shutdown", shutdown)

    def _call(self, method: str, function: Callable[..., Any], *args: Any) -> Any:
        """Each call a watchdog phase of its own, under the environment's ``call_timeout_s``."""
        who = f"{self._owner}: {self._qualified(method)}"
        limit = PluginCall(who, f"env.{self._owner.name}.call_timeout_s", self._call_timeout_s)
        with phase("environment", limit, env=self._owner.name, method=method):
            return super()._call(method, function, *args)
