"""A data processor plugin's faults while a run reads its data: one line naming the plugin, its
distribution, entry point and function, and the record it failed on."""

from __future__ import annotations

import re

import pytest

from nrl_core.api import DataProcessorSpec, NrlError, PluginError, PromptConfig, hookimpl, registered_plugin
from nrl_core.data.processors import process_records
from nrl_core.plugins import get_plugin_manager

RECORDS = [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": "4"}]


def raising(record, idx, tokenizer, cfg):
    return int(record["problem"])


def wrong_type(record, idx, tokenizer, cfg):
    return {"prompt": record["problem"]}


def refusing(record, idx, tokenizer, cfg):
    raise NrlError(f"record {idx} has no 'question'; set data.input_key")


class Processors:
    @hookimpl
    def nrl_data_processors(self):
        return [DataProcessorSpec(name=name, processor=f"{__name__}:{name}", distribution="nrl-faulty-data")
                for name in ("raising", "wrong_type", "refusing")]


@pytest.fixture(scope="module", autouse=True)
def faulty_processors():
    with registered_plugin(Processors(), "faulty-data"):
        yield


NAMED = "data processor '{}' of nrl-faulty-data (entry point 'faulty-data'): "


def test_a_raising_processor_is_one_line_naming_it_and_the_record():
    with pytest.raises(PluginError, match="^" + re.escape(
            NAMED.format("raising") + "raising on train.jsonl:1 raised ValueError: invalid literal for int() with "
                                      "base 10: '1+1'") + "$"):
        process_records(RECORDS, None, PromptConfig(), "raising", where=["train.jsonl:1", "train.jsonl:2"], plugins=get_plugin_manager())


def test_a_processor_returning_something_else_is_one_line_saying_what_was_expected():
    with pytest.raises(PluginError, match="^" + re.escape(
            NAMED.format("wrong_type") + "wrong_type returned dict for the data index 0; it must return a DatumSpec")
            + "$"):
        process_records(RECORDS, None, PromptConfig(), "wrong_type", plugins=get_plugin_manager())


def test_a_processors_own_message_about_the_data_stays_its_own():
    with pytest.raises(NrlError, match="^record 0 has no 'question'; set data.input_key$") as info:
        process_records(RECORDS, None, PromptConfig(), "refusing", plugins=get_plugin_manager())
    assert not isinstance(info.value, PluginError)
