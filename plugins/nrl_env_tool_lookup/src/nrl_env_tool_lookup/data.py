"""Episodes as data: the ``kv_lookup`` generator (``data.dataset_name``), the ``kv_lookup``
processor (prompts for GRPO; the store goes to the episode's metadata) and ``kv_lookup_sft``
(tool-use traces for SFT, laid out token for token as a GRPO episode is: the call, the tool's
result through the chat template, the answer; the loss on the model's tokens only)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from nrl_core.api import TOOL_CALL_CLOSE as CLOSE
from nrl_core.api import TOOL_CALL_OPEN as OPEN
from nrl_core.api import DatumSpec, ObservationTokens, PromptConfig, build_prompt, tool_message
from nrl_env_tool_lookup.environment import TOOL_NAME, lookup

QUESTION = "Use the lookup tool to find the value of {key}. What is it?"


def kv_splits(num_train: int = 1024, num_val: int = 64, num_keys: int = 4, max_value: int = 99,
              seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``data.generate`` keywords: how many episodes, keys per store, the largest value, the seed."""
    if num_keys < 1 or max_value < 1:
        raise TypeError("num_keys and max_value must be at least 1")
    rng = random.Random(seed)
    records = []
    for _ in range(num_train + num_val):
        keys = rng.sample([f"k{i}" for i in range(10 * num_keys)], num_keys)
        store = {k: rng.randint(0, max_value) for k in keys}
        key = rng.choice(keys)
        records.append({"problem": QUESTION.format(key=key), "expected_answer": str(store[key]),
                        "store": json.dumps(store), "key": key})
    return records[:num_train], records[num_train:]


def call_text(key: str) -> str:
    return f' {OPEN}{json.dumps({"name": TOOL_NAME, "arguments": {"key": key}})}{CLOSE}'


def answer_text(value: Any) -> str:
    return f" The answer is {value}"


def kv_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    text, ids = build_prompt(str(record["problem"]), tokenizer, cfg)
    return DatumSpec(idx=idx, prompt_text=text, prompt_ids=ids,
                     metadata={"store": json.loads(record["store"]), "key": record["key"], "tool_calls": 0})


def kv_sft_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """The prompt, then a tool call, the tool's result (masked) and the answer with its end of sequence."""
    datum = kv_processor(record, idx, tokenizer, cfg)
    store, key = datum.metadata["store"], datum.metadata["key"]
    call = list(tokenizer(call_text(key), add_special_tokens=False)["input_ids"])
    result = ObservationTokens(tokenizer)([tool_message(lookup(store, _Call(key)), name=TOOL_NAME)])
    answer = list(tokenizer(answer_text(store[key]), add_special_tokens=False)["input_ids"])
    answer += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    datum.response_ids = call + result + answer
    datum.response_mask = [1] * len(call) + [0] * len(result) + [1] * len(answer)
    datum.response_text = tokenizer.decode(datum.response_ids)
    return datum


class _Call:
    """A well-formed call of the lookup tool (what :func:`lookup` reads)."""

    def __init__(self, key: str) -> None:
        self.name = TOOL_NAME
        self.arguments = {"key": key}
