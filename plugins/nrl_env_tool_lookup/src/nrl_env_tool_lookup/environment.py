"""``env.kv_lookup``: the model must call ``lookup`` to learn a value it is asked for.

Each episode draws a store of keys and random values; the prompt names one key. A turn with tool
calls gets each call's result as a ``tool`` message; a turn without one is the answer, and ends the
episode: reward ``reward_correct`` when its last number is the key's value. A malformed call, an
unknown tool or a missing key is a ``tool`` message saying so, never an error. The values are drawn
per episode, so nothing but the tool can tell them: a model that answers at once is right by chance.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from nrl_core.api import EnvStep, Episode, ToolCall, ToolCallError, parse_tool_calls, tool_message

TOOL_NAME = "lookup"
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME, "description": "The value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
"""The tool in Hugging Face's ``tools`` form, for ``apply_chat_template(..., tools=TOOLS)``."""

_NUMBER = re.compile(r"-?\d+")


def lookup(store: Mapping[str, Any], call: ToolCall) -> str:
    """What the tool answers to ``call``."""
    if call.name != TOOL_NAME:
        return f"error: unknown tool '{call.name}'; the tool is {TOOL_NAME}"
    key = call.arguments.get("key")
    if not isinstance(key, str):
        return 'error: lookup needs {"key": "<key>"}'
    if key not in store:
        return f"error: no key '{key}'"
    return f"{key} = {store[key]}"


def answer_of(text: str) -> int | None:
    """The last integer of a response (the answer), if any."""
    found = _NUMBER.findall(text)
    return int(found[-1]) if found else None


class KVLookupEnvironment:
    def __init__(self, section: Mapping[str, Any]) -> None:
        self.max_tool_calls = int(section["max_tool_calls"])
        self.reward_correct = float(section["reward_correct"])

    def step(self, episodes: list[Episode]) -> list[EnvStep]:
        return [self._turn(e) for e in episodes]

    def _turn(self, episode: Episode) -> EnvStep:
        store, made = episode.metadata["store"], int(episode.metadata.get("tool_calls", 0))
        text = episode.last_response
        try:
            calls = parse_tool_calls(text)
        except ToolCallError as exc:
            return EnvStep(observation=[tool_message(f"error: {exc}")],
                           metadata={**episode.metadata, "tool_calls": made + 1}, metrics={"malformed_call": 1.0})
        if calls:
            if made + len(calls) > self.max_tool_calls:
                return EnvStep(done=True, metrics=self._end(made, correct=False))
            results = [tool_message(lookup(store, call), name=call.name) for call in calls]
            return EnvStep(observation=results, metadata={**episode.metadata, "tool_calls": made + len(calls)},
                           metrics={"malformed_call": 0.0})
        correct = answer_of(text) == int(store[episode.metadata["key"]])
        return EnvStep(reward=self.reward_correct if correct else 0.0, done=True,
                       metrics=self._end(made, correct))

    @staticmethod
    def _end(calls: int, correct: bool) -> dict[str, float]:
        return {"tool_call_rate": float(calls > 0), "tool_calls_per_episode": float(calls), "correct": float(correct)}

    def shutdown(self) -> None:
        pass
