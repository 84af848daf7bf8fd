"""NeMo RL's data layout and named datasets (nrl-data-nemo-rl), each read from a local stand-in.

No hub here, so every registered dataset is read from a stand-in the test writes with the hub
dataset's columns and types (parquet, or ``save_to_disk`` for datasets whose recipes read two
splits). Which columns exist and which NeMo RL reads are from NeMo RL at commit 7ea279a
(``nemo_rl/data/datasets/response_datasets/`` and ``preference_datasets/``: the file is named on
each stand-in) and from each dataset's card on the hub (the repository named on the spec). The
prompts are compared with the text NeMo RL's processor builds, written out by hand for the tiny
tokenizer's chat template (``Q: ...`` for a user turn, ``A:`` as the generation prompt, a system
turn as its text and a newline).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from nrl_core.algorithms.installed import load_and_validate, prepare_data
from nrl_core.cli import main
from nrl_core.data.preference import prepare_preference_data
from nrl_core.data.splits import load_data_splits
from nrl_core.errors import ConfigError, NrlError
from nrl_core.plugins import get_plugin_manager

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"
SFT = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"
DPO = REPO / "examples" / "configs" / "dpo_tiny_cpu.yaml"
# NeMo RL's examples/prompts/cot.txt at 7ea279a, byte for byte: two backslashes and a doubled
# brace pair, which str.format turns into one pair.
COT = ("Think step-by-step to solve the following problem. Output your answer inside of \\\\boxed{{}} tags.:\n"
       "{}\n\nLet's think step-by-step")


def cot_rendered(problem: str) -> str:
    """NeMo RL's math_hf_data_processor's prompt for ``problem`` with cot.txt and the tiny template."""
    return ("Q: Think step-by-step to solve the following problem. Output your answer inside of \\\\boxed{} "
            f"tags.:\n{problem}\n\nLet's think step-by-step\nA:")
MESSAGES = [{"content": "Solve 2+3. Answer: $Answer", "role": "user"}]


def _dapo(problem: str, answer: str) -> dict[str, Any]:
    # response_datasets/dapo_math.py; the card of BytedTsinghua-SIA/DAPO-Math-17k (and AIME-2024)
    return {"data_source": "math_dapo", "prompt": [{"content": problem, "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "a1b2"}}


# name -> (rows of the stand-in, (problem, answer) NeMo RL reads from the first row)
PROMPT_DATASETS: dict[str, tuple[list[dict[str, Any]], tuple[str, str]]] = {
    # response_datasets/openmathinstruct2.py; card of nvidia/OpenMathInstruct-2
    "OpenMathInstruct-2": ([{"problem": "What is $1+2$?", "generated_solution": "1+2=3, so \\boxed{3}.",
                             "expected_answer": "3", "problem_source": "augmented_math"},
                            {"problem": "What is 2*4?", "generated_solution": "\\boxed{8}", "expected_answer": "8",
                             "problem_source": "math"}], ("What is $1+2$?", "3")),
    "DAPOMath17K": ([_dapo("Solve 2+3. Remember to put your answer on its own line after \"Answer:\".", "5")],
                    ("Solve 2+3. Remember to put your answer on its own line after \"Answer:\".", "5")),
    "DAPOMathAIME2024": ([_dapo("Find x if x+1=2.", "1")], ("Find x if x+1=2.", "1")),
    # response_datasets/aime.py; cards of HuggingFaceH4/aime_2024, opencompass/AIME2025, MathArena/aime_2026
    "AIME2024": ([{"id": 60, "problem": "Find the remainder of 7 mod 4.", "solution": "7 = 4 + 3.",
                   "answer": "3", "url": "https://artofproblemsolving.com/wiki", "year": "2024"}],
                 ("Find the remainder of 7 mod 4.", "3")),
    "AIME2025": ([{"question": "How many primes are below 10?", "answer": "4"}], ("How many primes are below 10?", "4")),
    "AIME2026": ([{"problem_idx": 1, "problem": "Compute 6*7.", "answer": 42}], ("Compute 6*7.", "42")),
    # response_datasets/gsm8k.py; card of openai/gsm8k (config main)
    "gsm8k": ([{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"}],
              ("Tom has 3 apples and buys 4. How many?", "7")),
    # response_datasets/deepscaler.py; card of agentica-org/DeepScaleR-Preview-Dataset
    "DeepScaler": ([{"problem": "Let $a=2$. Find $a^3$.", "answer": "8", "solution": "$2^3=8$."}],
                   ("Let $a=2$. Find $a^3$.", "8")),
    # response_datasets/openr1_math.py; card of open-r1/OpenR1-Math-220k (config default)
    "OpenR1-Math-220k": ([{"problem": "Find 3!.", "solution": "3! = 6", "answer": "6", "problem_type": "Algebra",
                           "question_type": "math-word-problem", "source": "olympiads", "uuid": "u1",
                           "is_reasoning_complete": [True], "generations": ["6"], "correctness_math_verify": [True],
                           "correctness_llama": None, "finish_reasons": None, "correctness_count": 1,
                           "messages": [{"content": "Find 3!.", "role": "user"}]}], ("Find 3!.", "6")),
    # response_datasets/response_dataset.py: a user's file with NeMo RL's default columns
    "ResponseDataset": ([{"input": "What is 9-4?", "output": "5"}], ("What is 9-4?", "5")),
}


def write_stand_in(path: Path, rows: list[dict[str, Any]] | dict[str, list[dict[str, Any]]]) -> Path:
    """``rows`` as a parquet file, or (a mapping of split to rows) a ``save_to_disk`` directory."""
    import datasets

    if isinstance(rows, dict):
        datasets.DatasetDict({split: datasets.Dataset.from_list(r) for split, r in rows.items()}).save_to_disk(path)
    else:
        datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def config_file(tmp: Path, base: Path, data: dict[str, Any], **sections: Any) -> Path:
    """A config that takes ``base`` (an nrl tiny CPU recipe) with NeMo RL's data layout."""
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump({"defaults": str(base), "data": {"dataset_name": None, **data}, **sections}))
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from nrl_core.testing.tiny_models import cached_tiny_model

    return AutoTokenizer.from_pretrained(cached_tiny_model("llama", size="tiny"))


@pytest.fixture()
def cot(tmp_path: Path) -> Path:
    path = tmp_path / "cot.txt"
    path.write_text(COT)
    return path


@pytest.mark.parametrize("name", sorted(PROMPT_DATASETS))
def test_each_prompt_dataset_reads_its_stand_in_into_nemo_rls_prompt(name, tmp_path, cot, tokenizer):
    rows, (problem, answer) = PROMPT_DATASETS[name]
    stand_in = write_stand_in(tmp_path / f"{name}.parquet", rows)
    train = {"dataset_name": name, "data_path": str(stand_in), "split_validation_size": 0}
    config = load_and_validate(str(config_file(tmp_path, GRPO, {
        "train": train, "default": {"prompt_file": str(cot), "processor": "math_hf_data_processor",
                                    "env_name": "math"}})), algorithm="grpo")
    data = prepare_data(config["data"], tokenizer)
    first = data.train[0]
    assert first.prompt_text == cot_rendered(problem)
    assert first.prompt_ids == tokenizer(first.prompt_text, add_special_tokens=False)["input_ids"]
    assert first.metadata == {"ground_truth": answer}
    assert len(data.train) == len(rows) and data.val is None


def test_the_system_prompt_is_one_rendering_for_math_hf_and_two_for_math_data(tmp_path, cot, tokenizer,
                                                                             monkeypatch):
    stand_in = write_stand_in(tmp_path / "deepscaler.parquet", PROMPT_DATASETS["DeepScaler"][0])
    system = tmp_path / "system.txt"
    system.write_text("You are precise.\n")  # read as written: the trailing newline stays
    # a template that opens every rendering with BOS, as Llama 3's does: two renderings, two BOS
    monkeypatch.setattr(tokenizer, "chat_template", "{{ bos_token }}" + tokenizer.chat_template)
    texts = {}
    for processor in ("math_hf_data_processor", "math_data_processor", "default"):
        config = load_and_validate(str(config_file(tmp_path, GRPO, {
            "train": {"dataset_name": "DeepScaler", "data_path": str(stand_in)},
            "default": {"prompt_file": None, "system_prompt_file": str(system), "processor": processor}})),
            algorithm="grpo")
        datum = prepare_data(config["data"], tokenizer).train[0]
        texts[processor] = datum.prompt_text
        assert datum.prompt_ids == tokenizer(datum.prompt_text, add_special_tokens=False)["input_ids"]
    assert texts["math_hf_data_processor"] == texts["default"] == "<s>You are precise.\n\nQ: Let $a=2$. Find $a^3$.\nA:"
    assert texts["math_data_processor"] == "<s>You are precise.\n\n<s>Q: Let $a=2$. Find $a^3$.\nA:"


def test_gsm8k_gives_the_whole_solution_when_asked_and_no_answer_without_its_marker(tmp_path):
    rows = [*PROMPT_DATASETS["gsm8k"][0], {"question": "Q2", "answer": "no marker here"}]
    stand_in = write_stand_in(tmp_path / "gsm8k.parquet", rows)
    answers = {}
    for extract in (True, False):
        config = load_and_validate(str(config_file(tmp_path, GRPO, {
            "train": {"dataset_name": "gsm8k", "data_path": str(stand_in), "extract_answer": extract}})),
            algorithm="grpo")
        answers[extract] = [r["expected_answer"] for r in load_data_splits(config["data"], get_plugin_manager()).train]
    assert answers == {True: ["7", None], False: ["3+4=<<3+4=7>>7\n#### 7", "no marker here"]}


def test_split_validation_size_holds_out_what_hf_train_test_split_holds_out(tmp_path):
    import datasets

    rows = [{"problem": f"p{i}", "generated_solution": "s", "expected_answer": str(i), "problem_source": "math"}
            for i in range(41)]
    stand_in = write_stand_in(tmp_path / "omi2.parquet", rows)
    expected = datasets.Dataset.from_list(rows).train_test_split(test_size=0.1, seed=7)
    config = load_and_validate(str(config_file(tmp_path, GRPO, {"train": {
        "dataset_name": "OpenMathInstruct-2", "data_path": str(stand_in), "split_validation_size": 0.1, "seed": 7}})),
        algorithm="grpo")
    splits = load_data_splits(config["data"], get_plugin_manager())
    assert [r["problem"] for r in splits.val] == expected["test"]["problem"]  # ceil(4.1) = 5 rows
    assert [r["problem"] for r in splits.train] == expected["train"]["problem"]
    # OpenMathInstruct-2 holds out 5% by default, with seed 42
    config = load_and_validate(str(config_file(tmp_path, GRPO, {"train": {
        "dataset_name": "OpenMathInstruct-2", "data_path": str(stand_in)}})), algorithm="grpo")
    default = datasets.Dataset.from_list(rows).train_test_split(test_size=0.05, seed=42)
    assert [r["problem"] for r in load_data_splits(config["data"], get_plugin_manager()).val] == default["test"]["problem"]


def test_a_held_out_count_a_sample_and_a_split_that_holds_everything(tmp_path):
    import datasets

    rows = [{"problem": f"p{i}", "generated_solution": "s", "expected_answer": str(i), "problem_source": "math"}
            for i in range(10)]
    omi = write_stand_in(tmp_path / "omi2.parquet", rows)

    def splits(**train: Any) -> Any:
        return load_data_splits(load_and_validate(str(config_file(tmp_path, GRPO, {"train": {
            "dataset_name": "OpenMathInstruct-2", "data_path": str(omi), **train}})), algorithm="grpo")["data"], get_plugin_manager())

    expected = datasets.Dataset.from_list(rows).train_test_split(test_size=3, seed=42)["test"]["problem"]
    assert [r["problem"] for r in splits(split_validation_size=3).val] == expected  # 1 or more: a row count
    with pytest.raises(NrlError, match=r"^data.train\[0\].split_validation_size=10 holds out all 10 records"):
        splits(split_validation_size=10)
    tulu = write_stand_in(tmp_path / "tulu.parquet", [
        {"id": f"t{i}", "messages": [{"content": f"q{i}", "role": "user"}, {"content": "a", "role": "assistant"}],
         "source": "s"} for i in range(10)])
    config = load_and_validate(str(config_file(tmp_path, SFT, {"train": {
        "dataset_name": "tulu3_sft_mixture", "data_path": str(tulu), "max_samples": 4, "seed": 3,
        "split_validation_size": 0}})), algorithm="sft")
    drawn = datasets.Dataset.from_list([{"i": i} for i in range(10)]).shuffle(seed=3)["i"][:4]
    assert [r["problem"] for r in load_data_splits(config["data"], get_plugin_manager()).train] == [f"q{i}" for i in drawn]


def test_keys_a_dataset_does_not_read_do_nothing_and_an_explicit_null_beats_the_default(tmp_path, caplog):
    omi = write_stand_in(tmp_path / "omi2.parquet", PROMPT_DATASETS["OpenMathInstruct-2"][0])
    with caplog.at_level(logging.WARNING):
        config = load_and_validate(str(config_file(tmp_path, GRPO, {
            "train": {"dataset_name": "OpenMathInstruct-2", "data_path": str(omi), "split_validation_size": 0,
                      "prompt_file": None},
            "default": {"repeat": 16, "subset": "socratic", "prompt_file": "/no/such/prompt.txt"}})),
            algorithm="grpo")
    assert "data.train[0]: dataset 'OpenMathInstruct-2' does not read repeat, subset" in caplog.text
    assert config["data"]["prompt_file"] is None  # the dataset's own null, not the default's file
    assert len(load_data_splits(config["data"], get_plugin_manager()).train) == 2  # not repeated


def test_datasets_of_a_list_are_concatenated_and_validation_adds_held_out_and_named_sets(tmp_path, tokenizer):
    omi = write_stand_in(tmp_path / "omi2.parquet", PROMPT_DATASETS["OpenMathInstruct-2"][0] * 10)
    deepscaler = write_stand_in(tmp_path / "ds.parquet", PROMPT_DATASETS["DeepScaler"][0] * 3)
    aime = write_stand_in(tmp_path / "aime.parquet", PROMPT_DATASETS["AIME2024"][0] * 2)
    config = load_and_validate(str(config_file(tmp_path, GRPO, {
        "train": [{"dataset_name": "OpenMathInstruct-2", "data_path": str(omi), "split_validation_size": 0.1},
                  {"dataset_name": "DeepScaler", "data_path": str(deepscaler)}],
        "validation": [{"dataset_name": "AIME2024", "data_path": str(aime), "repeat": 3}]})), algorithm="grpo")
    splits = load_data_splits(config["data"], get_plugin_manager())
    assert len(splits.train) == 18 + 3 and splits.source == "OpenMathInstruct-2 + DeepScaler"
    assert len(splits.val) == 2 + 2 * 3  # OpenMathInstruct-2's held-out 10%, then AIME 2024 three times over
    assert [r["expected_answer"] for r in splits.val[2:]] == ["3"] * 6


def test_sft_processor_tokenizes_a_conversation_turn_by_turn_with_the_assistant_in_the_loss(tmp_path, tokenizer):
    # response_datasets/squad.py; card of rajpurkar/squad
    squad = {"id": "5733be284776f41900661182", "title": "University_of_Notre_Dame",
             "context": "The college was founded in 1842.", "question": "When was the college founded?",
             "answers": {"text": ["1842"], "answer_start": [27]}}
    stand_in = write_stand_in(tmp_path / "squad", {"train": [squad], "validation": [squad, squad]})
    config = load_and_validate(str(config_file(tmp_path, SFT, {
        "train": {"dataset_name": "squad", "data_path": str(stand_in), "split": "train"},
        "validation": {"dataset_name": "squad", "data_path": str(stand_in), "split": "validation"},
        "default": {"processor": "sft_processor", "prompt_file": None},
        "add_bos": True, "add_eos": True, "add_generation_prompt": False})), algorithm="sft")
    data = prepare_data(config["data"], tokenizer, processor="sft_processor")
    datum = data.train[0]
    assert datum.prompt_text == "<s>The college was founded in 1842.\nQ: When was the college founded?\n"
    assert datum.response_text == "A: 1842</s>\n"  # the template's EOS is there, so none is added
    assert datum.response_ids == tokenizer("A: 1842</s>\n", add_special_tokens=False)["input_ids"]
    assert datum.token_mask == [0] * len(datum.prompt_ids) + [1] * len(datum.response_ids)
    assert len(data.val) == 2


def test_sft_processor_fills_the_first_user_turn_with_the_prompt_file(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"}]
    stand_in = write_stand_in(tmp_path / "chats.jsonl.parquet", [{"messages": chat}])
    template = tmp_path / "math.txt"
    template.write_text("Solve: {}\n\n")  # NeMo RL's math.txt style, trailing blank line kept
    config = load_and_validate(str(config_file(tmp_path, SFT, {
        "train": {"dataset_name": "ResponseDataset", "data_path": str(stand_in)},
        "default": {"processor": "sft_processor", "prompt_file": str(template)}})), algorithm="sft")
    datum = prepare_data(config["data"], tokenizer, processor="sft_processor").train[0]
    assert datum.prompt_text == "<s>Be brief.\nQ: Solve: 2+2\n\n\n"
    assert datum.response_text == "A: 4</s>\n"


def test_a_multi_turn_conversation_trains_only_its_assistant_turns(tmp_path, tokenizer):
    # response_datasets/tulu3.py; card of allenai/tulu-3-sft-mixture
    chat = [{"content": "Hi", "role": "user"}, {"content": "Hello!", "role": "assistant"},
            {"content": "Add 1 and 1.", "role": "user"}, {"content": "2", "role": "assistant"}]
    stand_in = write_stand_in(tmp_path / "tulu.parquet", [{"id": "t1", "messages": chat, "source": "s"}] * 4)
    config = load_and_validate(str(config_file(tmp_path, SFT, {
        "train": {"dataset_name": "tulu3_sft_mixture", "data_path": str(stand_in), "split_validation_size": 0},
        "default": {"processor": "sft_processor", "prompt_file": None},
        "add_bos": False, "add_eos": True, "add_generation_prompt": True})), algorithm="sft")
    datum = prepare_data(config["data"], tokenizer, processor="sft_processor").train[0]
    assert datum.prompt_text == "Q: Hi\nA:"  # the user's turn carries the generation prompt
    first, user, last = (tokenizer(t, add_special_tokens=False)["input_ids"]
                         for t in (" Hello!</s>\n", "Q: Add 1 and 1.\nA:", " 2</s>\n"))
    # each turn's text starts where its rendering departs from the one before it
    assert datum.response_text == " Hello!</s>\nQ: Add 1 and 1.\nA: 2</s>\n"
    assert datum.response_mask == [1] * len(first) + [0] * len(user) + [1] * len(last)


PREFERENCE_DATASETS: dict[str, tuple[dict[str, Any], dict[str, Any] | None, tuple[str, str, str]]] = {
    # preference_datasets/helpsteer3.py; card of nvidia/HelpSteer3 (config preference)
    "HelpSteer3": ({"domain": "general", "language": "english",
                    "context": [{"role": "user", "content": "Name a prime."}], "response1": "4", "response2": "7",
                    "overall_preference": 2,
                    "individual_preference": [{"score": 2, "reasoning": "7 is prime", "feedback1": "",
                                               "feedback2": ""}]}, None, ("Q: Name a prime.\nA:", "7", "4")),
    # preference_datasets/tulu3.py; card of allenai/llama-3.1-tulu-3-8b-preference-mixture
    "Tulu3Preference": ({"id": "x", "prompt": "Say yes.",
                         "chosen": [{"content": "Say yes.", "role": "user"}, {"content": "yes", "role": "assistant"}],
                         "rejected": [{"content": "Say yes.", "role": "user"}, {"content": "no", "role": "assistant"}],
                         "source": "s"}, None, ("Q: Say yes.\nA:", "yes", "no")),
    # preference_datasets/preference_dataset.py: NeMo RL's own pair format
    "PreferenceDataset": ({"context": [{"role": "user", "content": "2+2?"}],
                           "completions": [{"rank": 1, "completion": [{"role": "assistant", "content": "5"}]},
                                           {"rank": 0, "completion": [{"role": "assistant", "content": "4"}]}]},
                          None, ("Q: 2+2?\nA:", "4", "5")),
    # preference_datasets/binary_preference_dataset.py, with its column names configured
    "BinaryPreferenceDataset": ({"q": "Pick red.", "good": "red", "bad": "blue"},
                                {"prompt_key": "q", "chosen_key": "good", "rejected_key": "bad"},
                                ("Q: Pick red.\nA:", "red", "blue")),
}


def test_helpsteer3_prefers_by_the_sign_and_keeps_a_tie_as_nemo_rl_does(tmp_path, tokenizer, caplog):
    base = PREFERENCE_DATASETS["HelpSteer3"][0]
    stand_in = write_stand_in(tmp_path / "hs3.parquet", [{**base, "overall_preference": -1},
                                                         {**base, "overall_preference": 0}])
    config = load_and_validate(str(config_file(tmp_path, DPO, {
        "train": {"dataset_name": "HelpSteer3", "data_path": str(stand_in)}})), algorithm="dpo")
    with caplog.at_level(logging.WARNING):
        pairs = prepare_preference_data(config["data"], tokenizer, get_plugin_manager(), max_length=64).train
    answers = [(tokenizer.decode(p.chosen.response_ids), tokenizer.decode(p.rejected.response_ids)) for p in pairs]
    assert answers == [(" 4</s>", " 7</s>"), (" 4</s>", " 4</s>")]
    assert "keeps response1 as both chosen and rejected" in caplog.text


@pytest.mark.parametrize("name", sorted(PREFERENCE_DATASETS))
def test_each_preference_dataset_reads_its_stand_in_into_pairs(name, tmp_path, tokenizer):
    row, keys, (prompt, chosen, rejected) = PREFERENCE_DATASETS[name]
    stand_in = write_stand_in(tmp_path / f"{name}.parquet", [row] * 3)
    config = load_and_validate(str(config_file(tmp_path, DPO, {
        "train": {"dataset_name": name, "data_path": str(stand_in), **(keys or {})}})), algorithm="dpo")
    pair = prepare_preference_data(config["data"], tokenizer, get_plugin_manager(), max_length=64).train[0]
    assert pair.chosen.prompt_text == pair.rejected.prompt_text == prompt
    assert tokenizer.decode(pair.chosen.response_ids) == f" {chosen}</s>"
    assert tokenizer.decode(pair.rejected.response_ids) == f" {rejected}</s>"


def test_config_check_says_where_each_dataset_would_load_from(tmp_path, cot, capsys):
    aime = write_stand_in(tmp_path / "aime.parquet", PROMPT_DATASETS["AIME2024"][0])
    path = config_file(tmp_path, GRPO, {
        "train": {"dataset_name": "OpenMathInstruct-2", "split_validation_size": 0.05, "seed": 42},
        "validation": {"dataset_name": "AIME2024", "data_path": str(aime), "repeat": 16},
        "default": {"prompt_file": str(cot), "processor": "math_hf_data_processor", "env_name": "math"}})
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("data:")] == [
        "data: train OpenMathInstruct-2 from hub nvidia/OpenMathInstruct-2 split train_1M, 5% held out for "
        "validation (seed 42); processor math_hf_data_processor",
        f"data: validation AIME2024 from local {aime}, repeated 16 times; processor math_hf_data_processor"]


@pytest.mark.parametrize("data, key, phrase", [
    ({"train": {"dataset_name": "OpenMathInstruct"}}, "data.train[0].dataset_name",
     "dataset 'OpenMathInstruct' is not available"),
    ({"train": {"dataset_name": "clevr-cogent"}}, "data.train[0].dataset_name",
     "NeMo RL's multimodal (vision/audio/video) training data dataset, which nrl lacks"),
    ({"train": {"dataset_name": "DeepScaler", "data_path": "/no/such/deepscaler.parquet"}}, "data.train[0].data_path",
     "/no/such/deepscaler.parquet: no such file or directory"),
    ({"train": {"dataset_name": "ResponseDataset"}}, "data.train[0].data_path", "is required for 'ResponseDataset'"),
    ({"train": {"dataset_name": "OpenMathInstruct-2", "split": "train_3M"}}, "data.train[0].split",
     "has no split 'train_3M'"),
    ({"train": {"dataset_name": "DeepScaler"}, "default": {"prompt_file": "nemo_rl/prompts/cot.txt"}},
     "data.train[0].prompt_file", "nemo_rl/prompts/cot.txt: no such file"),
    ({"train": [{"dataset_name": "DeepScaler", "env_name": "math"}, {"dataset_name": "AIME2024", "env_name": "code"}]},
     "data.train[1].env_name", "nrl prompts and scores a run's datasets one way"),
    ({"train": {"dataset_name": "DeepScaler"}, "train_data_path": "x.jsonl"}, "data.train_data_path",
     "beside data.train"),
    ({"train": {"dataset_name": "DeepScaler"}, "dataset_name": "DAPOMath17K"}, "data.dataset_name",
     "NeMo RL ignores beside data.train (it would read DeepScaler)"),
    ({"train": {"dataset_name": "DeepScaler", "processor": "math_hf"}}, "data.train[0].processor",
     "data processor 'math_hf' is not available"),
    ({"train": {"dataset_name": "HelpSteer3"}}, "data.train[0].dataset_name",
     "'HelpSteer3' holds preference records, and this algorithm reads prompt records"),
    ({"train": {"dataset_name": "DeepScaler"}, "default": {"prompt_file": "{braces}"}}, "data.train[0].prompt_file",
     "not a template Python's str.format can fill with the problem (KeyError"),
    ({"dataset_name": "DeepScaler"}, "data.dataset_name", "'DeepScaler' is a named dataset of NeMo RL's layout; "
                                                          "write it as data.train.dataset_name"),
    ({"validation": {"dataset_name": "AIME2024"}}, "data.validation", "but data.train names none"),
])
def test_a_bad_dataset_is_one_line_at_check_time(data, key, phrase, tmp_path, capsys):
    (tmp_path / "{braces}").write_text("Solve {x}: {}")  # a prompt file whose braces str.format reads
    data = {**data, "default": {k: (str(tmp_path / v) if v == "{braces}" else v)
                                for k, v in data.get("default", {}).items()}}
    assert main(["config", "check", str(config_file(tmp_path, GRPO, data))]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}: ") and phrase in errors[0], errors


def test_a_preference_dataset_for_grpo_and_an_unloadable_hub_dataset_are_one_line(tmp_path, monkeypatch):
    stand_in = write_stand_in(tmp_path / "pairs.parquet", [PREFERENCE_DATASETS["PreferenceDataset"][0]])
    config = load_and_validate(str(config_file(tmp_path, DPO, {
        "train": {"dataset_name": "PreferenceDataset", "data_path": str(stand_in)}})), algorithm="dpo")
    with pytest.raises(ConfigError, match=r"^data.train\[0\].dataset_name: 'PreferenceDataset' holds preference "
                                          r"records, and this algorithm reads prompt records"):
        load_data_splits(config["data"], get_plugin_manager())  # the loader checks the kind too: SFT's prepare_data on DPO's data
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    config = load_and_validate(str(config_file(tmp_path, GRPO, {"train": {"dataset_name": "DeepScaler"}})),
                               algorithm="grpo")
    with pytest.raises(NrlError) as failure:
        load_data_splits(config["data"], get_plugin_manager())
    message = str(failure.value)
    assert "\n" not in message and message.startswith(
        "data.train[0]: cannot load agentica-org/DeepScaleR-Preview-Dataset split train from the hub or HF's cache")
    assert message.endswith("set data.train[0].data_path to a local copy")


def test_keys_a_dataset_does_not_read_are_named_as_nemo_rl_names_them(tmp_path, caplog):
    stand_in = write_stand_in(tmp_path / "ds.parquet", PROMPT_DATASETS["DeepScaler"][0])
    with caplog.at_level(logging.WARNING):
        load_and_validate(str(config_file(tmp_path, GRPO, {"train": {
            "dataset_name": "DeepScaler", "data_path": str(stand_in), "split_validation_size": 0.05, "seed": 42}})),
            algorithm="grpo")
    assert "data.train[0]: dataset 'DeepScaler' does not read seed, split_validation_size" in caplog.text


def test_response_dataset_reads_named_columns_or_keeps_a_chat_whole(tmp_path):
    columns = write_stand_in(tmp_path / "qa.parquet", [{"q": "What is 9-4?", "a": "5"}])
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    chats = write_stand_in(tmp_path / "chats.parquet", [{"messages": chat}])
    read = []
    for path, keys in ((columns, {"input_key": "q", "output_key": "a"}), (chats, {})):
        config = load_and_validate(str(config_file(tmp_path, GRPO, {"train": {
            "dataset_name": "ResponseDataset", "data_path": str(path), **keys}})), algorithm="grpo")
        read += load_data_splits(config["data"], get_plugin_manager()).train
    assert read == [{"problem": "What is 9-4?", "expected_answer": "5"},
                    {"problem": "S", "expected_answer": "U", "messages": chat}]  # NeMo RL's messages[0] and [1]


def test_a_missing_nemo_rl_name_says_which_distribution_provides_it():
    from nrl_core.plugins import FIRST_PARTY_DISTRIBUTIONS
    from nrl_data_nemo_rl import plugin

    names = [spec.name for spec in plugin.nrl_datasets()] + [spec.name for spec in plugin.nrl_data_processors()]
    hinted = sorted(n for n, d in FIRST_PARTY_DISTRIBUTIONS.items() if d == plugin.DISTRIBUTION)
    assert hinted == sorted(set(names) - {"default"})  # too common a name to send every miss to this plugin


@pytest.mark.parametrize("name", [spec.name for spec in get_plugin_manager().datasets()
                                  if spec.distribution == "nrl-data-nemo-rl"])
def test_each_datasets_twin_stand_in_row_reads_back_as_its_problem_and_answer(name):
    """``nrl twin`` writes a recipe's data with the dataset's ``stand_in``: its format reads the
    row back as the problem and answer (the chosen and rejected answers of a pair)."""
    from nrl_core.contracts import import_object

    spec = get_plugin_manager().datasets().get(name, "dataset_name")
    entry = {"dataset_name": name}
    record = import_object(spec.format)(import_object(spec.stand_in)("3+4", "7", "8", entry), entry)
    if spec.kind == "preference":
        assert record["context"][-1]["content"] == "3+4"
        ranked = sorted(record["completions"], key=lambda c: c["rank"])
        assert [c["completion"][-1]["content"] for c in ranked] == ["7", "8"]
    else:
        assert record["expected_answer"] == "7" and "3+4" in record["problem"]
