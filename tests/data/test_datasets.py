"""Loading prompt–answer records from local disk, and the one-line errors for bad data."""

from __future__ import annotations

import json

import pytest

from nrl_core.data.datasets import load_records, read_jsonl, write_jsonl
from nrl_core.data.splits import load_data_splits
from nrl_core.errors import ConfigError, NrlError
from nrl_core.plugins import get_plugin_manager

ROWS = [{"problem": "What is 1 + 2?", "expected_answer": "3"},
        {"problem": "What is 5 - 7?", "expected_answer": "-2"}]


def _hf_dataset(rows=ROWS):
    import datasets

    return datasets.Dataset.from_list(rows)


def test_jsonl_roundtrip_skips_blank_lines(tmp_path):
    path = write_jsonl(ROWS, tmp_path / "sub" / "train.jsonl")
    path.write_text(path.read_text() + "\n   \n")
    assert load_records(path) == ROWS
    assert read_jsonl(path) == ROWS


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"problem": "What is 2 + 2?", "expected_answer": 4\n')
    with pytest.raises(NrlError, match=rf"^{path}:3: malformed JSON line \(.*\); each line must be one JSON object$"):
        load_records(path)


def test_non_object_line_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(NrlError, match=rf"^{path}:2: expected a JSON object per line, got list$"):
        load_records(path)


def test_missing_key_names_file_line_and_key(tmp_path):
    path = write_jsonl([ROWS[0], {"question": "What is 1 + 1?", "expected_answer": "2"}], tmp_path / "t.jsonl")
    with pytest.raises(NrlError, match=rf"^{path}:2: record has no 'problem' \(keys: expected_answer, question\); "
                                       r"fix the data or set data.input_key$"):
        load_records(path)


def test_custom_keys(tmp_path):
    path = write_jsonl([{"q": "What is 1 + 1?", "a": "2"}], tmp_path / "t.jsonl")
    assert load_records(path, input_key="q", output_key="a") == [{"q": "What is 1 + 1?", "a": "2"}]
    with pytest.raises(NrlError, match=r":1: record has no 'expected_answer' .*set data.output_key$"):
        load_records(path, input_key="q")


def test_missing_and_empty_and_unknown_files(tmp_path):
    with pytest.raises(NrlError, match=r"nope.jsonl: no such file or directory"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(NrlError, match=r"empty.jsonl: dataset is empty"):
        load_records(tmp_path / "empty.jsonl")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(NrlError, match=r"data.txt: unknown data file type '.txt'; use one of .jsonl, .json"):
        load_records(tmp_path / "data.txt")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(NrlError, match=r"plain_dir: directory is not a dataset saved with save_to_disk"):
        load_records(tmp_path / "plain_dir")


def test_json_array_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(ROWS))
    assert load_records(path) == ROWS


def test_parquet_file_and_missing_key_names_row(tmp_path):
    path = tmp_path / "train.parquet"
    _hf_dataset().to_parquet(str(path))
    assert load_records(path) == ROWS
    with pytest.raises(NrlError, match=rf"^{path} row 0: record has no 'answer'"):
        load_records(path, output_key="answer")


def test_arrow_file_and_saved_dataset_dirs(tmp_path):
    import datasets

    saved = tmp_path / "saved"
    _hf_dataset().save_to_disk(str(saved))
    assert load_records(saved) == ROWS
    arrow = next(saved.glob("*.arrow"))
    assert load_records(arrow) == ROWS

    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": _hf_dataset(), "validation": _hf_dataset(ROWS[:1])}).save_to_disk(str(splits))
    assert load_records(splits, split="validation") == ROWS[:1]
    with pytest.raises(NrlError, match=r"splits: dataset has no split 'test' \(splits: train, validation\)"):
        load_records(splits, split="test")


def test_corrupt_dataset_file_is_one_line(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(NrlError, match=r"bad.parquet: cannot be read as a dataset") as info:
        load_records(path)
    assert "\n" not in str(info.value)


def test_data_splits_from_paths_and_generator(tmp_path):
    train = write_jsonl(ROWS, tmp_path / "train.jsonl")
    val = write_jsonl(ROWS[:1], tmp_path / "val.jsonl")
    splits = load_data_splits({"train_data_path": str(train), "val_data_path": str(val)}, get_plugin_manager())
    assert splits.train == ROWS and splits.val == ROWS[:1]

    gen = load_data_splits({"dataset_name": "arithmetic", "generate": {"num_train": 10, "num_val": 3, "seed": 1}}, get_plugin_manager())
    assert len(gen.train) == 10 and len(gen.val) == 3 and gen.source == "generator:arithmetic"

    local = load_data_splits({"dataset_name": str(train)}, get_plugin_manager())
    assert local.train == ROWS and local.val is None


def test_data_splits_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.dataset_name: 'openmath' is neither a local file nor an installed "
                                          r"generator \(generators: arithmetic, arithmetic_preference[^)]*\)"):
        load_data_splits({"dataset_name": "openmath"}, get_plugin_manager())
    with pytest.raises(ConfigError, match=r"^data: no training data"):
        load_data_splits({}, get_plugin_manager())
    with pytest.raises(ConfigError, match=r"^data.generate: bad arguments for the 'arithmetic' generator"):
        load_data_splits({"dataset_name": "arithmetic", "generate": {"num_trian": 3}}, get_plugin_manager())
