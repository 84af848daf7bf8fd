"""The tool-use environment (nrl-env-tool-lookup): only the tool can tell the value; malformed
calls, unknown tools and missing keys are observations; SFT traces are laid out as episodes are,
the tool's result out of the loss."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("nrl_env_tool_lookup")

from nrl_core.algorithms.multi_turn import ObservationTokens  # noqa: E402
from nrl_core.contracts import Episode  # noqa: E402
from nrl_core.data.processors import PromptConfig  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model  # noqa: E402
from nrl_env_tool_lookup.data import call_text, kv_processor, kv_sft_processor, kv_splits  # noqa: E402
from nrl_env_tool_lookup.environment import KVLookupEnvironment  # noqa: E402

STORE = {"k3": 42, "k7": 5}


def episode(response: str, calls: int = 0) -> Episode:
    return Episode(prompt="p", messages=[{"role": "assistant", "content": response}],
                   metadata={"store": STORE, "key": "k3", "tool_calls": calls}, turn=1)


def test_a_lookup_then_an_answer_is_rewarded_and_everything_else_is_an_observation():
    env = KVLookupEnvironment({"max_tool_calls": 2, "reward_correct": 1.0})
    call, right, wrong, unknown, missing, garbled, too_many = env.step([
        episode(call_text("k3")), episode("The answer is 42", calls=1), episode("The answer is 41", calls=1),
        episode('<tool_call>{"name": "search", "arguments": {"q": "k3"}}</tool_call>'),
        episode(call_text("k9")), episode("<tool_call>lookup k3</tool_call>"), episode(call_text("k3"), calls=2)])
    assert call.observation == [{"role": "tool", "content": "k3 = 42", "name": "lookup"}] and not call.done
    assert call.metadata["tool_calls"] == 1
    assert (right.reward, right.done, right.metrics["tool_call_rate"]) == (1.0, True, 1.0)
    assert (wrong.reward, wrong.done) == (0.0, True)
    assert unknown.observation[0]["content"] == "error: unknown tool 'search'; the tool is lookup"
    assert missing.observation[0]["content"] == "error: no key 'k9'"
    assert garbled.observation[0]["content"].startswith("error: the tool call is not valid JSON")
    assert garbled.metrics["malformed_call"] == 1.0 and not garbled.done
    assert (too_many.done, too_many.reward, too_many.metrics["correct"]) == (True, 0.0, 0.0)
    direct = env.step([episode("The answer is 42")])[0]
    assert direct.reward == 1.0 and direct.metrics["tool_call_rate"] == 0.0  # a lucky guess, no tool


def test_values_are_drawn_per_episode_so_only_the_tool_can_tell_them():
    train, val = kv_splits(num_train=200, num_val=10, seed=1)
    assert len(train) == 200 and len(val) == 10 and kv_splits(num_train=200, num_val=10, seed=1)[0] == train
    answers = [r["expected_answer"] for r in train]
    assert len(set(answers)) > 50  # spread over 0..99: guessing is right about 1 time in 100
    for record in train:
        assert json.loads(record["store"])[record["key"]] == int(record["expected_answer"])
        assert re.findall(r"\d+", record["problem"].replace(record["key"], "")) == []  # no value in the prompt


def test_sft_traces_are_laid_out_as_an_episode_with_the_tool_result_out_of_the_loss():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached_tiny_model("llama", "small")))
    record = kv_splits(num_train=1, num_val=0, seed=2)[0][0]
    cfg = PromptConfig(use_chat_template=True)
    prompt, datum = kv_processor(record, 0, tokenizer, cfg), kv_sft_processor(record, 0, tokenizer, cfg)
    assert datum.prompt_ids == prompt.prompt_ids
    key, value = record["key"], record["expected_answer"]
    call = tokenizer(call_text(key), add_special_tokens=False).input_ids
    result = ObservationTokens(tokenizer)([{"role": "tool", "content": f"{key} = {value}", "name": "lookup"}])
    assert datum.response_ids[:len(call)] == call
    assert datum.response_ids[len(call):len(call) + len(result)] == result
    assert datum.response_mask == [1] * len(call) + [0] * len(result) + [1] * (len(datum.response_ids) - len(call)
                                                                               - len(result))
    assert datum.token_mask == [0] * len(prompt.prompt_ids) + datum.response_mask
    assert tokenizer.decode(datum.response_ids).endswith(f"The answer is {value}</s>")
