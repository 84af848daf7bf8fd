"""Tool calls as chat templates write them: parsed into name and arguments; every malformed shape
is a ToolCallError whose message can go back to the model."""

from __future__ import annotations

import pytest

from nrl_core.tools import ToolCall, ToolCallError, parse_tool_calls, tool_message


def test_calls_are_parsed_in_order_with_their_arguments():
    text = ('thinking <tool_call>{"name": "lookup", "arguments": {"key": "k3"}}</tool_call> and '
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("lookup", {"key": "k3"}), ToolCall("add", {"a": 1})]
    assert parse_tool_calls("The answer is 42") == []
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize("text, message", [
    ('<tool_call>{"name": "lookup", "arguments": {"key": "k3"}', "is not closed with </tool_call>"),
    ("<tool_call>lookup(k3)</tool_call>", "not valid JSON (Expecting value at character 0)"),
    ('<tool_call>["lookup"]</tool_call>', "must be a JSON object with name and arguments, not list"),
    ('<tool_call>{"arguments": {}}</tool_call>', "has no name"),
    ('<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>', "arguments of lookup must be a JSON object"),
    ('<tool_call>{"name": "lookup", "arguments": "k3"}</tool_call>', "arguments of lookup are not a JSON object"),
])
def test_malformed_calls_say_what_is_wrong_in_one_line(text, message):
    with pytest.raises(ToolCallError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as info:
        parse_tool_calls(text)
    assert "\n" not in str(info.value)


def test_tool_results_are_tool_messages():
    assert tool_message("k3 = 42", name="lookup") == {"role": "tool", "content": "k3 = 42", "name": "lookup"}
    assert tool_message({"a": 1}) == {"role": "tool", "content": '{"a": 1}'}
