"""The warm start of a twin with dynamic sampling (nrl_core/twin_warm_start.py): the answer format
is the recipe's environment's, the SFT data are the twin's own prompts as the recipe renders them,
and the SFT config is a valid one. tests/examples/test_nemo_rl_recipe_runs.py trains such a twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nrl_core.config import load_and_validate
from nrl_core.data.processors import prepare_data
from nrl_core.errors import ConfigError
from nrl_core.plugins import get_plugin_manager
from nrl_core.twin import write_twin
from nrl_core.twin_warm_start import answer_format, exported, needs_warm_start, warm_start

CHECKOUT = Path(__file__).resolve().parents[1] / "examples" / "nemo_rl_configs"
DAPO = CHECKOUT / "configs" / "recipes" / "llm" / "dapo-gemma4-e2b-it-1n8g-fsdp2-automodel.yaml"


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


@pytest.mark.parametrize(("env", "form"), [("dapo", "Answer: {answer}"), ("math", "Answer: {answer}"),
                                           ("math_multi_reward", "<answer>{answer}</answer>")])
def test_the_format_is_the_first_one_the_environment_rewards_right_and_not_wrong(env, form):
    assert answer_format({"data": {"env_name": env}, "env": {}}) == form


def test_an_environment_that_rewards_no_format_is_one_line():
    with pytest.raises(ConfigError, match=r"^env\.code: rewards none of the answer formats .*pass --model DIR"):
        answer_format({"data": {"env_name": "code"}, "env": {}})


def test_the_warm_start_learns_the_twins_own_prompts_in_the_environments_format(tmp_path, pm, monkeypatch):
    monkeypatch.chdir(CHECKOUT)
    twin = write_twin(DAPO, tmp_path / "twin", pm)
    config = load_and_validate(str(twin.config), [], pm, algorithm="grpo")
    assert needs_warm_start(config)
    assert not needs_warm_start(load_and_validate(str(CHECKOUT / "configs" / "grpo_math_1B.yaml"), [], pm,
                                                  algorithm="grpo"))
    sft = warm_start(config, twin.config, tmp_path / "warm", pm)
    from nrl_core.algorithms.setup import load_tokenizer

    datums = prepare_data(config["data"], load_tokenizer(config), pm).train
    rows = [json.loads(line) for line in (tmp_path / "warm" / "train.jsonl").read_text().splitlines()]
    assert rows == [{"input": d.prompt_text, "output": f"Answer: {d.metadata['ground_truth']}"} for d in datums]
    written = yaml.safe_load(sft.read_text())
    assert written["policy"]["model_name"] == config["policy"]["model_name"]
    assert written["checkpointing"]["checkpoint_dir"] == str(exported(tmp_path / "warm").parent)
    assert load_and_validate(str(sft), [], pm, algorithm="sft")["data"]["use_chat_template"] is False
