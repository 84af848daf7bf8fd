"""Preference data: NeMo RL's two record formats, one-line errors for bad records, tokenization,
the pair batch layout every backend splits without separating a pair, and the generator."""

from __future__ import annotations

import json

import pytest

from nrl_core.contracts import TokenBatch
from nrl_core.data.preference import (
    arithmetic_preference_splits,
    parse_preference,
    preference_batch,
    prepare_preference_data,
)
from nrl_core.errors import ConfigError, NrlError
from nrl_core.plugins import get_plugin_manager

RANKED = {"context": [{"role": "user", "content": "What is 2 + 2?"}],
          "completions": [{"rank": 1, "completion": [{"role": "assistant", "content": "5"}]},
                          {"rank": 0, "completion": [{"role": "assistant", "content": "4"}]}]}
BINARY = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}


def write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_both_formats_parse_to_the_same_messages():
    ranked, binary = parse_preference(RANKED, "x"), parse_preference(BINARY, "x")
    assert ranked == binary == ([{"role": "user", "content": "What is 2 + 2?"}],
                                [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}])


@pytest.mark.parametrize("record, message", [
    ({"context": "hi", "completions": [{"rank": 0, "completion": "a"}]}, "'completions' must be a list of exactly two"),
    ({"context": "hi", "completions": [{"rank": 0, "completion": "a"}, {"rank": 0, "completion": "b"}]},
     "'completions' ranks tie \\(0\\)"),
    ({"context": "hi", "completions": [{"rank": "first", "completion": "a"}, {"rank": 1, "completion": "b"}]},
     "'completions\\[0\\].rank' must be a number"),
    ({"context": [{"role": "user"}], "completions": [{"rank": 0, "completion": "a"}, {"rank": 1, "completion": "b"}]},
     "'context\\[0\\]' must be a message with string 'role' and 'content'"),
    ({"completions": []}, "record has 'completions' but no 'context'"),
    ({"prompt": "hi", "chosen": "a"}, "binary preference record has no 'rejected'"),
    ({"problem": "hi", "expected_answer": "1"}, "not a preference record \\(keys: expected_answer, problem\\)"),
])
def test_bad_records_name_file_line_and_key(tmp_path, tokenizer, record, message):
    path = write(tmp_path / "train.jsonl", [RANKED, record])
    with pytest.raises(NrlError, match=f"^{tmp_path / 'train.jsonl'}:2: {message}") as info:
        prepare_preference_data({"train_data_path": path}, tokenizer, get_plugin_manager(), max_length=64)
    assert "\n" not in str(info.value)


def test_malformed_json_and_empty_file(tmp_path, tokenizer):
    path = write(tmp_path / "bad.jsonl", [RANKED, "{not json"])
    with pytest.raises(NrlError, match=r"bad.jsonl:2: malformed JSON line"):
        prepare_preference_data({"train_data_path": path}, tokenizer, get_plugin_manager(), max_length=64)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(NrlError, match=r"empty.jsonl: dataset is empty; it needs at least one record with a preference"):
        prepare_preference_data({"train_data_path": str(tmp_path / "empty.jsonl")}, tokenizer, get_plugin_manager(), max_length=64)


def test_tokenized_pair_shares_the_prompt(tmp_path, tokenizer):
    data = prepare_preference_data({"train_data_path": write(tmp_path / "t.jsonl", [RANKED]),
                                    "val_data_path": write(tmp_path / "v.jsonl", [BINARY])}, tokenizer, get_plugin_manager(), max_length=64)
    [pair], [val] = data.train, data.val
    assert pair.chosen.prompt_text == "Q: What is 2 + 2?\nA:" and pair.chosen.prompt_ids == pair.rejected.prompt_ids
    assert tokenizer.decode(pair.chosen.response_ids, skip_special_tokens=True).strip() == "4"
    assert tokenizer.decode(pair.rejected.response_ids, skip_special_tokens=True).strip() == "5"
    assert pair.chosen.response_ids[-1] == tokenizer.eos_token_id
    assert (val.chosen.input_ids, val.rejected.input_ids) == (pair.chosen.input_ids, pair.rejected.input_ids)


def test_overlong_pairs_are_dropped_and_all_dropped_is_an_error(tmp_path, tokenizer, caplog):
    long = {**BINARY, "rejected": " ".join(["7"] * 80)}
    data = prepare_preference_data({"train_data_path": write(tmp_path / "t.jsonl", [BINARY, long])}, tokenizer, get_plugin_manager(),
                                   max_length=32)
    assert len(data.train) == 1 and "dropped 1 of 2 preference pairs" in caplog.text and "t.jsonl:2" in caplog.text
    with pytest.raises(NrlError, match="all 1 preference pairs of .* are longer than policy.max_total_sequence_length=32"):
        prepare_preference_data({"train_data_path": write(tmp_path / "l.jsonl", [long])}, tokenizer, get_plugin_manager(), max_length=32)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_rank_gets_whole_pairs_in_order(tokenizer, dp):
    train, _ = arithmetic_preference_splits(num_train=8, num_val=0)
    data = prepare_preference_data({"dataset_name": "arithmetic_preference", "generate": {"num_train": 8, "num_val": 0}},
                                   tokenizer, get_plugin_manager(), max_length=64)
    batch = preference_batch(data.train, tokenizer.pad_token_id, dp)
    assert batch.size == 16 and len(train) == 8
    seen = []
    for rank in range(dp):
        local = batch.shard(rank, dp)
        assert local.fields["chosen"].tolist() == [1.0, 0.0] * (8 // dp)
        pairs = local.fields["pair"].tolist()
        assert pairs[0::2] == pairs[1::2]
        seen += pairs[0::2]
        for i, p in enumerate(pairs[0::2]):  # the rows are the pair's own sequences
            for row, side in ((2 * i, data.train[p].chosen), (2 * i + 1, data.train[p].rejected)):
                assert local.input_ids[row, :side.length].tolist() == side.input_ids
                assert local.fields["token_mask"][row, :side.length].tolist() == side.token_mask
    assert sorted(seen) == list(range(8))
    assert batch.fields["sample_mask"].tolist() == [1.0] * 16


def test_a_batch_that_does_not_divide_is_padded_with_masked_pairs(tokenizer):
    data = prepare_preference_data({"dataset_name": "arithmetic_preference", "generate": {"num_train": 3, "num_val": 0}},
                                   tokenizer, get_plugin_manager(), max_length=64)
    batch = preference_batch(data.train, tokenizer.pad_token_id, 2)
    assert isinstance(batch, TokenBatch) and batch.size == 8
    assert batch.fields["sample_mask"].sum() == 6 and batch.loss_counts()[1] == 6.0


def test_generator_is_seeded_and_prefers_the_right_answer():
    train, val = arithmetic_preference_splits(num_train=20, num_val=5, seed=3)
    assert (train, val) == arithmetic_preference_splits(num_train=20, num_val=5, seed=3)
    for record in train + val:
        a, op, b = record["context"][0]["content"].removeprefix("What is ").rstrip("?").split()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        chosen, rejected = (c["completion"][0]["content"] for c in sorted(record["completions"], key=lambda c: c["rank"]))
        assert int(chosen) == right and 1 <= abs(int(rejected) - right) <= 5
    operand, _ = arithmetic_preference_splits(num_train=20, num_val=0, distractor="operand")
    for record in operand:
        a, _, b = record["context"][0]["content"].removeprefix("What is ").rstrip("?").split()
        rejected = int(record["completions"][1]["completion"][0]["content"])
        assert rejected in (int(a), int(b)) or abs(rejected - int(record["completions"][0]["completion"][0]["content"])) <= 5
    with pytest.raises(ConfigError, match="^data.generate.distractor: must be one of offset, operand"):
        arithmetic_preference_splits(distractor="typo")
