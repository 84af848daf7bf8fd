"""Loading: defaults chains, interpolation, overrides, and the NeMo RL short forms."""

from __future__ import annotations

import pytest

from nrl_core.algorithms.installed import load_and_validate
from nrl_core.config import load_config
from nrl_core.errors import ConfigError


def test_three_deep_defaults_chain_with_interpolation_and_overrides(write):
    write("base.yaml", """\
        policy:
          model_name: /models/base
          max_total_sequence_length: 128
          tokenizer: {name: "${policy.model_name}"}
          generation:
            max_new_tokens: ${mul:${policy.max_total_sequence_length}, 2}
            stop_strings: ["</s>"]
        grpo: {seed: 1, num_prompts_per_step: 2}
        """)
    write("middle.yaml", """\
        defaults: base.yaml
        policy:
          max_total_sequence_length: 256
        grpo: {seed: 2}
        """)
    write("sub/dummy.txt", "") if False else None
    top = write("top.yaml", """\
        defaults: middle.yaml
        grpo: {seed: 3}
        logger: {log_dir: "logs/${grpo.seed}"}
        """)
    config = load_config(top, ["policy.model_name=/models/override", "+data.shuffle=false", "~policy.generation.stop_strings"])
    assert config["grpo"] == {"seed": 3, "num_prompts_per_step": 2}
    assert config["policy"]["max_total_sequence_length"] == 256
    assert config["policy"]["generation"]["max_new_tokens"] == 512  # computed after the child's value
    assert config["policy"]["tokenizer"]["name"] == "/models/override"  # references see overrides
    assert config["logger"]["log_dir"] == "logs/3"  # embedded reference becomes text
    assert config["data"] == {"shuffle": False}
    assert "stop_strings" not in config["policy"]["generation"]


def test_defaults_path_is_relative_to_the_file(tmp_path, write):
    write("base.yaml", "policy: {model_name: /m}\n")
    (tmp_path / "recipes").mkdir()
    child = write("recipes/child.yaml", "defaults: ../base.yaml\ngrpo: {seed: 5}\n")
    assert load_config(child)["policy"]["model_name"] == "/m"


def test_defaults_list_merges_in_order(write):
    write("a.yaml", "grpo: {seed: 1, val_period: 3}\n")
    write("b.yaml", "grpo: {seed: 2}\n")
    top = write("top.yaml", "defaults: [a.yaml, b.yaml]\npolicy: {model_name: /m}\n")
    assert load_config(top)["grpo"] == {"seed": 2, "val_period": 3}


def test_override_values_are_parsed_as_yaml(write):
    path = write("c.yaml", "policy: {model_name: /m}\n")
    config = load_config(path, ["grpo.seed=7", "loss_fn.ratio_clip_min=1e-1", "policy.generation.stop_strings=[a, b]",
                                "policy.tokenizer.chat_template=null", "++grpo.seed=8"])
    assert config["grpo"]["seed"] == 8
    assert config["loss_fn"]["ratio_clip_min"] == pytest.approx(0.1)
    assert config["policy"]["generation"]["stop_strings"] == ["a", "b"]
    assert config["policy"]["tokenizer"]["chat_template"] is None


def test_resolvers_and_environment(write, monkeypatch):
    monkeypatch.setenv("NRL_TEST_DIR", "/data")
    path = write("c.yaml", """\
        a: 6
        b: 4
        product: ${mul:${a},${b}}
        quotient: ${div:${a},${b}}
        biggest: ${max:${a},${b},10}
        where: ${env:NRL_TEST_DIR}/x
        fallback: ${env:NRL_NOT_SET_ANYWHERE,none}
        omegaconf_spelling: ${oc.env:NRL_TEST_DIR}
        """)
    config = load_config(path)
    assert config["product"] == 24 and config["quotient"] == 1 and config["biggest"] == 10
    assert config["where"] == "/data/x" and config["fallback"] == "none" and config["omegaconf_spelling"] == "/data"


def test_validation_fills_defaults_and_keeps_user_values(write, example_backends):
    path = write("c.yaml", """\
        policy:
          model_name: /m
          alpha_cfg: {enabled: true}
          generation: {backend: gamma}
        grpo: {seed: 11}
        """)
    config = load_and_validate(path)
    assert config["grpo"]["seed"] == 11
    assert config["grpo"]["num_generations_per_prompt"] == 16
    assert config["policy"]["alpha_cfg"] == {"enabled": True, "tensor_parallel_size": 1}
    assert config["policy"]["generation"]["gamma_cfg"] == {"engine_threads": 1}
    assert config["policy"]["tokenizer"]["name"] == "/m"
    assert config["checkpointing"]["enabled"] is False
    assert config["loss_fn"]["reference_policy_kl_type"] == "k3"


def test_nemo_rl_alias_is_rewritten_to_our_spelling(write, example_backends):
    path = write("c.yaml", "policy: {model_name: /m, alpha_config: {enabled: true}, generation: {backend: gamma}}\n")
    config = load_and_validate(path)
    assert config["policy"]["alpha_cfg"]["enabled"] is True
    assert "alpha_config" not in config["policy"]


def test_short_form_sets_global_batch_from_data_parallel_size(write, example_backends):
    path = write("c.yaml", """\
        cluster: {gpus_per_node: 4, num_nodes: 2}
        policy: {model_name: /m, max_seq_length: 2048, alpha_cfg: {enabled: true, tensor_parallel_size: 2},
                 generation: {backend: gamma}}
        algorithm: {batch_size: 1, gradient_accumulation_steps: 8}
        """)
    policy = load_and_validate(path)["policy"]
    assert policy["max_total_sequence_length"] == 2048
    assert policy["train_micro_batch_size"] == 1
    assert policy["train_global_batch_size"] == 1 * 8 * (8 // 2)


def test_duplicate_alias_and_name_is_an_error(write, example_backends):
    path = write("c.yaml", "policy: {model_name: /m, alpha_config: {enabled: true}, alpha_cfg: {enabled: true}}\n")
    with pytest.raises(ConfigError, match="alias of policy.alpha_cfg"):
        load_and_validate(path)


def test_relative_interpolation_resolves_against_the_holding_mapping(write):
    path = write("rel.yaml", """\
policy:
  model_name: /m
  precision: bfloat16
  generation:
    temperature: 0.7
    val_temperature: ${.temperature}
    copy_of_precision: ${..precision}
    top: ${...top_level}
    scaled: ${mul:${.temperature},2}
    text: t=${.temperature}
top_level: 3
alias: ${policy.generation.val_temperature}
""")
    config = load_config(path, ["policy.generation.temperature=0.9"])
    generation = config["policy"]["generation"]
    assert generation["val_temperature"] == 0.9 and generation["copy_of_precision"] == "bfloat16"
    assert generation["top"] == 3 and generation["scaled"] == 1.8 and generation["text"] == "t=0.9"
    assert config["alias"] == 0.9  # reached through an absolute reference, still relative to its own mapping


@pytest.mark.parametrize("value, message", [
    ("${....x}", "goes 3 levels up from a key 2 levels deep"),
    ("${.missing}", "refers to '${a.b.missing}', which does not exist"),
    ("${.}", "is not a relative key path"),
])
def test_bad_relative_interpolation_is_one_line(write, value, message):
    path = write("bad.yaml", f"a:\n  b:\n    c: '{value}'\n")
    with pytest.raises(ConfigError, match="a.b.c") as info:
        load_config(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_relative_interpolation_inside_a_list_is_refused(write):
    path = write("list.yaml", "a:\n  x: 1\n  items: ['${.x}']\n")
    with pytest.raises(ConfigError, match=r"a.items\[0\].*not inside lists"):
        load_config(path)


def test_yaml_merge_keys_as_pyyaml_reads_them(write):
    path = write("merge.yaml", """\
policy: &POLICY
  model_name: /student
  precision: bfloat16
  dtensor_cfg: &DTENSOR
    enabled: true
    tensor_parallel_size: 1
teacher:
  <<: *POLICY
  model_name: /teacher
  dtensor_cfg:
    <<: *DTENSOR
    tensor_parallel_size: 2
""")
    teacher = load_config(path)["teacher"]
    assert teacher == {"model_name": "/teacher", "precision": "bfloat16",
                       "dtensor_cfg": {"enabled": True, "tensor_parallel_size": 2}}


def test_duplicate_explicit_key_next_to_a_merge_key_is_still_an_error(write):
    path = write("dup.yaml", "base: &B {x: 1}\nother:\n  <<: *B\n  y: 1\n  y: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'y'"):
        load_config(path)
