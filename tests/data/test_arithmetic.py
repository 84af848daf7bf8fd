"""The seeded arithmetic generator: deterministic, disjoint splits, correct answers, SFT forms."""

from __future__ import annotations

import re

import pytest

from nrl_core.data.arithmetic import (
    ArithmeticConfig,
    generate_arithmetic,
    sft_response,
    to_sft,
    write_arithmetic_splits,
)
from nrl_core.data.datasets import load_records
from nrl_core.errors import ConfigError


def test_same_config_same_records_other_seed_other_records():
    cfg = ArithmeticConfig(num_train=50, num_val=10, seed=7)
    assert generate_arithmetic(cfg) == generate_arithmetic(ArithmeticConfig(num_train=50, num_val=10, seed=7))
    assert generate_arithmetic(cfg) != generate_arithmetic(ArithmeticConfig(num_train=50, num_val=10, seed=8))


def test_answers_are_right_and_splits_disjoint():
    train, val = generate_arithmetic(ArithmeticConfig(num_train=200, num_val=50, min_operand=3, max_operand=30,
                                                      ops=("+", "-", "*")))
    assert len(train) == 200 and len(val) == 50
    assert not {r["problem"] for r in train} & {r["problem"] for r in val}
    for record in train + val:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", record["problem"]).groups()
        assert 3 <= int(a) <= 30 and 3 <= int(b) <= 30
        assert int(record["expected_answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                                  "*": int(a) * int(b)}[op]


def test_non_negative_and_exhausted_space():
    train, _ = generate_arithmetic(ArithmeticConfig(num_train=40, num_val=0, ops=("-",), non_negative=True))
    assert all(int(r["expected_answer"]) >= 0 for r in train)
    with pytest.raises(ConfigError, match=r"^data.generate: only 8 distinct problems exist"):
        generate_arithmetic(ArithmeticConfig(num_train=9, num_val=0, min_operand=0, max_operand=1, ops=("+", "-")))
    with pytest.raises(ConfigError, match=r"^data.generate.ops: unknown operators \['/'\]"):
        ArithmeticConfig(ops=("/",))


def test_sft_forms_and_written_splits(tmp_path):
    assert sft_response("19") == "19" and sft_response("19", "boxed") == "\\boxed{19}"
    with pytest.raises(ConfigError, match="answer_format"):
        sft_response("19", "latex")
    train_path, val_path = write_arithmetic_splits(tmp_path, ArithmeticConfig(num_train=5, num_val=2), sft=True,
                                                   answer_format="boxed")
    train = load_records(train_path, output_key="response")
    assert len(train) == 5 and len(load_records(val_path)) == 2
    assert train == to_sft(generate_arithmetic(ArithmeticConfig(num_train=5, num_val=2))[0], "boxed")
    assert train[0]["response"] == f"\\boxed{{{train[0]['expected_answer']}}}"
