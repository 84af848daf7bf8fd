"""Tool calls as chat templates write them, for environments that offer tools.

Models trained with Hugging Face's ``tools`` argument of ``apply_chat_template`` (Qwen2.5, Hermes,
and the templates derived from them) call a tool by writing ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, and read its result from a ``{"role": "tool", "content": ...}``
message. :func:`parse_tool_calls` turns a response into :class:`ToolCall` s; a malformed call is a
:class:`ToolCallError` whose message an environment can hand back as the observation, so the
model learns from it instead of the run crashing. Standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

__all__ = ["CLOSE", "OPEN", "ToolCall", "ToolCallError", "parse_tool_calls", "tool_message"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


class ToolCallError(ValueError):
    """A response that tries to call a tool and gets the format wrong; ``str()`` says how."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` of ``text`` in order (none: the response calls no tool). Raises
    :class:`ToolCallError` for an unclosed tag, a body that is not a JSON object, a missing or
    non-string ``name``, or ``arguments`` that are not an object (a JSON string holding one is
    accepted, as some templates write it)."""
    calls = []
    for body in _CALL.findall(text):
        calls.append(_call_of(body.strip()))
    if text.count(OPEN) != len(calls):
        raise ToolCallError(f"a {OPEN} is not closed with {CLOSE}")
    return calls


def _call_of(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}); write "
                            f'{OPEN}{{"name": "...", "arguments": {{...}}}}{CLOSE}') from None
    if not isinstance(value, dict):
        raise ToolCallError(f"the tool call must be a JSON object with name and arguments, not {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError("the tool call has no name")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolCallError(f"the arguments of {name} are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"the arguments of {name} must be a JSON object")
    return ToolCall(name=name, arguments=arguments)


def tool_message(content: Any, name: str | None = None) -> dict[str, Any]:
    """A tool's result as the message chat templates expect."""
    message: dict[str, Any] = {"role": "tool", "content": content if isinstance(content, str) else json.dumps(content)}
    if name is not None:
        message["name"] = name
    return message
