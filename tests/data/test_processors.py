"""Prompt processing: templates, system prompts, the chat template, SFT masks, length limits."""

from __future__ import annotations

import logging

import pytest

from nrl_core.algorithms.installed import prepare_data
from nrl_core.data.collate import prompt_batch, sft_batch
from nrl_core.data.datasets import write_jsonl
from nrl_core.data.processors import DatumSpec, LengthLimits, PromptConfig, get_processor, process_records
from nrl_core.errors import ConfigError, NrlError
from nrl_core.plugins import get_plugin_manager

RECORD = {"problem": "What is 12 + 7?", "expected_answer": "19"}


def test_math_prompt_through_chat_template(tokenizer):
    [datum] = process_records([RECORD], tokenizer, PromptConfig(), plugins=get_plugin_manager())
    assert datum.prompt_text == "Q: What is 12 + 7?\nA:"
    assert datum.prompt_ids == list(tokenizer(datum.prompt_text, add_special_tokens=False)["input_ids"])
    assert datum.metadata == {"ground_truth": "19"}
    assert datum.length == len(datum.prompt_ids) and datum.response_ids == []


def test_template_and_system_prompt_files(tokenizer, tmp_path):
    (tmp_path / "cot.txt").write_text("Think step by step about {} and put the answer in \\boxed{{}}.\n")
    (tmp_path / "system.txt").write_text("You are good at sums.\n")
    cfg = PromptConfig.from_data_config({"prompt_file": str(tmp_path / "cot.txt"),
                                         "system_prompt_file": str(tmp_path / "system.txt"), "use_chat_template": True})
    [datum] = process_records([RECORD], tokenizer, cfg, plugins=get_plugin_manager())
    # Braces other than the first {} are kept as written (LaTeX in templates is common).
    assert datum.prompt_text == ("You are good at sums.\n"
                                 "Q: Think step by step about What is 12 + 7? and put the answer in \\boxed{{}}.\nA:")
    plain = PromptConfig.from_data_config({"prompt_file": str(tmp_path / "cot.txt"),
                                           "system_prompt_file": str(tmp_path / "system.txt"), "use_chat_template": False})
    [datum] = process_records([RECORD], tokenizer, plain, plugins=get_plugin_manager())
    assert datum.prompt_text.startswith("You are good at sums.\nThink step by step about What is 12 + 7?")


def test_prompt_config_errors(tmp_path):
    (tmp_path / "bad.txt").write_text("no placeholder")
    with pytest.raises(ConfigError, match=r"^data.prompt_file: the prompt template has no '\{\}' placeholder"):
        PromptConfig.from_data_config({"prompt_file": str(tmp_path / "bad.txt")})
    with pytest.raises(ConfigError, match=r"^data.system_prompt_file: cannot read '.*missing.txt' \(No such file"):
        PromptConfig.from_data_config({"system_prompt_file": str(tmp_path / "missing.txt")})
    with pytest.raises(ConfigError, match=r"^data.processor: data processor 'chess' is not available "
                                          r"\(installed: [^)]*\bmath\b[^)]*\bsft\b[^)]*\); install the plugin"):
        get_processor("chess", get_plugin_manager())


def test_tokenizer_without_chat_template_is_a_config_error(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ConfigError, match=r"^data.use_chat_template: the tokenizer has no chat template"):
        process_records([RECORD], bare, PromptConfig(), plugins=get_plugin_manager())


def test_prompts_over_the_limit_are_dropped(tokenizer):
    short = {"problem": "1?", "expected_answer": "1"}
    long = {"problem": "What is 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9?", "expected_answer": "45"}
    limit = len(process_records([short], tokenizer, PromptConfig(), plugins=get_plugin_manager())[0].prompt_ids)
    kept = process_records([short, long], tokenizer, PromptConfig(max_input_seq_length=limit), plugins=get_plugin_manager())
    assert [d.idx for d in kept] == [0]
    with pytest.raises(NrlError, match=r"^all 1 examples of the data have prompts too long for "
                                       r"data.max_input_seq_length=3; raise the limit"):
        process_records([long], tokenizer, PromptConfig(max_input_seq_length=3), plugins=get_plugin_manager())


def _jsonl(path, problems):
    write_jsonl([{"problem": p, "expected_answer": "1"} for p in problems], path)
    return path


def test_grpo_drops_prompts_with_no_room_to_generate_naming_file_and_line(tokenizer, tmp_path, caplog):
    """The issue's case: one over-long prompt in a file; it is dropped at load time, not sampled."""
    data = _jsonl(tmp_path / "train.jsonl", ["1 + 1?", "2 + 2?", "3 + 3 " * 400, "4 + 4?", "5 + 5 " * 300])
    short = len(process_records([{"problem": "1 + 1?", "expected_answer": "1"}], tokenizer, PromptConfig(), plugins=get_plugin_manager())[0].prompt_ids)
    limits = LengthLimits(prompt=short + 5, prompt_key="policy.max_total_sequence_length")
    with caplog.at_level(logging.WARNING):
        prepared = prepare_data({"train_data_path": str(data)}, tokenizer, limits=limits)
    assert [d.idx for d in prepared.train] == [0, 1, 3]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"dropped 2 of 5 examples of {data} whose prompt is too long for "
                              f"policy.max_total_sequence_length={short + 6} (no room to generate): {data}:3 (")
    assert f"{data}:5 (" in warning and "data.max_input_seq_length" not in warning


def test_generated_data_names_the_index_and_nothing_left_is_one_line(tokenizer, caplog):
    cfg = {"dataset_name": "arithmetic", "generate": {"num_train": 6, "num_val": 2, "seed": 3}}
    with pytest.raises(NrlError) as info:
        prepare_data(cfg, tokenizer, limits=LengthLimits(prompt=3, prompt_key="policy.generation.vllm_cfg.max_model_len"))
    assert str(info.value) == ("all 6 examples of generator:arithmetic have prompts too long for "
                               "policy.generation.vllm_cfg.max_model_len=4 (no room to generate); raise the limit or "
                               "shorten the prompts (or the prompt template)")
    assert "generator:arithmetic train index 0 (" in caplog.text


def test_sft_drop_warning_names_the_sequence_limit_not_the_prompt_limit(tokenizer, caplog):
    records = [{"problem": "1 + 1?", "expected_answer": "2"}, {"problem": "9 " * 200, "expected_answer": "9"}]
    with caplog.at_level(logging.WARNING):
        kept = process_records(records, tokenizer, PromptConfig(), "sft", limits=LengthLimits(total=40),
                               source="train.jsonl", plugins=get_plugin_manager())
    assert [d.idx for d in kept] == [0]
    assert "for policy.max_total_sequence_length=40: train.jsonl index 1 (" in caplog.text
    assert "data.max_input_seq_length" not in caplog.text


def test_sft_response_mask_with_chat_template(tokenizer):
    record = {**RECORD, "response": "19"}
    cfg = PromptConfig(output_key="response")
    [datum] = process_records([record], tokenizer, cfg, "sft", plugins=get_plugin_manager())
    [prompt_only] = process_records([record], tokenizer, cfg, "math", plugins=get_plugin_manager())
    assert datum.prompt_ids == prompt_only.prompt_ids  # SFT and GRPO see the same prompt
    assert tokenizer.decode(datum.response_ids) == " 19</s>"
    assert datum.response_ids[-1] == tokenizer.eos_token_id
    assert datum.token_mask == [0] * len(datum.prompt_ids) + [1] * len(datum.response_ids)
    assert datum.input_ids == datum.prompt_ids + datum.response_ids


def test_sft_without_chat_template_and_truncation(tokenizer):
    record = {**RECORD, "response": "\\boxed{19}"}
    cfg = PromptConfig(output_key="response", use_chat_template=False)
    [datum] = process_records([record], tokenizer, cfg, "sft", plugins=get_plugin_manager())
    assert tokenizer.decode(datum.response_ids) == "\\boxed{19}</s>"
    [cut] = process_records([record], tokenizer, cfg, "sft", max_length=len(datum.prompt_ids) + 2, plugins=get_plugin_manager())
    assert len(cut.response_ids) == 2 and cut.prompt_ids == datum.prompt_ids


def test_collate_pads_right_and_masks_responses(tokenizer):
    data = [DatumSpec(idx=0, prompt_text="a", prompt_ids=[5, 6, 7], response_ids=[8, 2]),
            DatumSpec(idx=1, prompt_text="b", prompt_ids=[9], response_ids=[2])]
    prompts = prompt_batch(data, pad_token_id=3)
    assert prompts.input_ids.tolist() == [[5, 6, 7], [9, 3, 3]] and prompts.input_lengths.tolist() == [3, 1]
    sft = sft_batch(data, pad_token_id=3)
    assert sft.input_ids.tolist() == [[5, 6, 7, 8, 2], [9, 2, 3, 3, 3]]
    assert sft.fields["token_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 0, 0, 0]]


def test_prepare_data_from_the_config_section(tokenizer):
    data_cfg = {"dataset_name": "arithmetic", "generate": {"num_train": 6, "num_val": 2, "seed": 3},
                "processor": "math", "use_chat_template": True, "input_key": "problem", "output_key": "expected_answer"}
    prepared = prepare_data(data_cfg, tokenizer)
    assert len(prepared.train) == 6 and len(prepared.val) == 2
    assert all(d.prompt_text.startswith("Q: What is ") and d.metadata["ground_truth"] for d in prepared.train)
