"""NeMo RL's own configs (unmodified copies, see nemo_rl_configs/README.md) pass ``nrl config check``
or fail with one line naming the first feature nrl lacks; never with "unknown key"."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nrl_core.cli import main

CONFIGS = Path(__file__).parent / "nemo_rl_configs" / "configs"


@pytest.fixture(autouse=True)
def in_the_checkouts_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """NeMo RL's configs name their prompt files relative to its checkout's root (examples/prompts/),
    which ``nrl config check`` finds there as a NeMo RL user running from the checkout does."""
    monkeypatch.chdir(CONFIGS.parent)


def _lacks(section: str, what: str) -> str:
    return (f"error: {section}: belongs to NeMo RL's {what} algorithm, which nrl lacks: no installed plugin provides "
            f"an algorithm with a '{section}' section")


#: None: passes the check. Otherwise the start of the one error line.
EXPECTED: dict[str, str | None] = {
    "grpo_math_1B.yaml": None,
    "grpo_math_1B_megatron.yaml": None,
    "grpo_math_1B_sglang.yaml": "error: policy.generation.backend: 'sglang' is NeMo RL's SGLang generation backend, which nrl lacks",
    "sft.yaml": None,
    "dpo.yaml": None,
    # Reward models (nrl-reward-model): Bradley-Terry training, and GRPO scored by one.
    "rm.yaml": None,
    "grpo_rm_1B.yaml": None,
    # On-policy distillation (nrl-algo-distillation) stops at context parallelism, as GRPO does;
    # past it the student and the teacher (its own section, its own backend checks) pass.
    "distillation_math.yaml":
        "error: policy.dtensor_cfg.context_parallel_size: context parallelism is not supported by the dtensor backend",
    "distillation_math_megatron.yaml":
        "error: policy.megatron_cfg.context_parallel_size: 2 needs Transformer Engine and CUDA",
    "xtoken_off_policy_distillation.yaml": "error: teachers: cross-tokenizer distillation (NeMo RL's xtoken recipes",
    # PPO with a value model (nrl-algo-ppo): the critic is the value section, with a value head.
    "ppo_math_1B.yaml": None,
    "ppo_math_1B_megatron.yaml": None,
    "recipes/llm/ppo-qwen2.5-1.5b-gsm8k-1n8g-automodel-valuetp2sp.yaml": None,
    "recipes/llm/ppo-qwen2.5-1.5b-gsm8k-1n8g-automodel-noncolocated-async.yaml": None,
    # NeMo RL's Megatron critic with sequence parallelism (which the value head takes) stops at the
    # policy's context parallelism
    "recipes/llm/ppo-qwen2.5-1.5b-gsm8k-1n8g-megatron-valuetp2sp-dynbatch.yaml":
        "error: policy.megatron_cfg.context_parallel_size: 2 needs Transformer Engine and CUDA",
    "recipes/llm/ppo-dsr1-7b-math-8n8g-megatron.yaml":
        "error: policy.megatron_cfg.context_parallel_size: 2 needs Transformer Engine and CUDA",
    "recipes/llm/grpo-llama3.2-1b-instruct-1n8g-fsdp2tp1.v3.yaml": None,
    "recipes/llm/grpo-llama3.2-1b-instruct-1n8g-megatron.yaml": None,
    "recipes/llm/grpo-llama3.1-8b-instruct-2n8g-fsdp2tp1-noncolocated.yaml": None,
    "recipes/llm/grpo-gemma3-1b-it-1n8g-fsdp2tp1.yaml": None,
    "recipes/llm/grpo-deepscaler-1.5b-8K.yaml": None,
    "recipes/llm/grpo-gspo-deepscaler-1.5b-8K.yaml": None,
    "recipes/llm/grpo-qwen3-8B-base-1n8g-fsdp2-lora.yaml": None,
    "recipes/llm/grpo-moonlight-16b-automodel-1n8g-ep8.yaml": None,
    # TE's FusedAdam with master weights and bfloat16 moments: TE's own class where it is installed,
    # nrl_backend_dtensor.fused_adam where it is not
    "recipes/llm/dapo-gemma4-e2b-it-1n8g-fsdp2-automodel.yaml": None,
    # Its packing section says 'modified_ffd', which NeMo RL's own enum lacks too; packing is
    # disabled there, so the value is named in a warning, not refused.
    "recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron.yaml": None,
    "recipes/llm/sft-llama3.2-1b-1n8g-fsdp2tp1.v3.yaml": None,
    "recipes/llm/sft-qwen2.5-math7b-2n8g-megatron.yaml":
        "error: policy.megatron_cfg.context_parallel_size: 2 needs Transformer Engine and CUDA",
    "recipes/llm/dpo-llama3.2-1b-instruct-1n8g-fsdp2tp1.v2.yaml": None,
    "recipes/llm/distillation-qwen3-32b-to-1.7b-base-1n8g-fsdp2tp1.v1.yaml": None,
    # GDPO (multi-reward estimator and environment), DAPO (dynamic sampling, reward scaling and
    # shaping, env.dapo, the DAPO verifier) and CISPO pass or stop at a feature nrl lacks elsewhere.
    "gdpo_math_1B.yaml": None,
    # Multi-turn: the sliding puzzle (nrl-env-sliding-puzzle), 50 turns.
    "grpo_sliding_puzzle.yaml": None,
    "grpo_math_qwen30ba3b_megatron.yaml": None,
    "recipes/llm/dapo-qwen2.5-7b.v2.yaml":
        "error: policy.dtensor_cfg.context_parallel_size: context parallelism is not supported by the dtensor backend",
    "recipes/llm/grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml":
        "error: policy.generation.vllm_cfg.precision: fp8 rollouts (NeMo RL's FP8 generation) are a feature nrl lacks",
    # vLLM's async engine at tensor parallel 4, not colocated (its workers in vLLM's own processes)
    "recipes/llm/grpo-cispo-mm1-async-lag1-highoffpolicy-qwen3-30ba3b-3n8g-megatron-cispo.yaml": None,
    # vLLM's async engine at tensor parallel 8 and 32 colocated in the training ranks, and at 2 not colocated
    # with async GRPO (its first rank starts the engine's workers on the engine's devices)
    "recipes/llm/performance/grpo-nemotron3-super-120BA12B-32n8g.yaml": None,
    "recipes/llm/performance/grpo-deepseek-v3-32n8g.yaml": None,
    "recipes/llm/performance/grpo-qwen3-30ba3b-4n8g.yaml": None,
    "recipes/llm/performance/grpo-qwen3-30ba3b-4n8g-async-1off.yaml": None,
}

#: The GPU-sized features some stop at, switched off: what remains passes.
PAST_THE_STOP: dict[str, list[str]] = {
    "distillation_math.yaml": ["policy.dtensor_cfg.context_parallel_size=1",
                               "teacher.dtensor_cfg.context_parallel_size=1"],
    "recipes/llm/dapo-qwen2.5-7b.v2.yaml": ["policy.dtensor_cfg.context_parallel_size=1"],
    "recipes/llm/grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml": ["policy.generation.vllm_cfg.precision=null"],
}


def test_every_copied_config_has_an_expectation():
    copied = {str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml") if p.parent.name != "evals"}
    assert copied == set(EXPECTED)
    assert sum(name.startswith("recipes/llm/") for name in EXPECTED) >= 10


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=str)
def test_nemo_rl_config_checks_or_names_what_nrl_lacks(name, capsys):
    code = main(["config", "check", str(CONFIGS / name)])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "unknown key" not in err
    if EXPECTED[name] is None:
        assert code == 0 and out.startswith("ok: ") and not errors, err
    else:
        assert code == 2 and len(errors) == 1 and errors[0].startswith(EXPECTED[name]), err


@pytest.mark.parametrize("name", sorted(PAST_THE_STOP), ids=str)
def test_gdpo_dapo_and_cispo_recipes_pass_past_their_gpu_sized_stop(name, capsys):
    assert main(["config", "check", str(CONFIGS / name), *PAST_THE_STOP[name]]) == 0, capsys.readouterr().err


def test_a_bad_value_in_a_disabled_section_is_a_warning_and_enabling_it_refuses_it(caplog, capsys):
    recipe = str(CONFIGS / "recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron.yaml")
    with caplog.at_level(logging.WARNING):
        assert main(["config", "check", recipe]) == 0
    assert any("policy.sequence_packing.algorithm: must be one of" in r.getMessage()
               and "(ignored: policy.sequence_packing is disabled)" in r.getMessage() for r in caplog.records)
    assert main(["config", "check", recipe, "policy.sequence_packing.enabled=true"]) == 2
    assert "error: policy.sequence_packing.algorithm: must be one of" in capsys.readouterr().err


def test_inert_keys_are_named_together_in_one_warning(caplog):
    """Which keys are named, and why, is tests/examples/test_nemo_rl_inert_keys.py's; here: one
    warning, and the keys nrl reads or leaves at what nrl does are not in it."""
    with caplog.at_level(logging.WARNING):
        assert main(["config", "check", str(CONFIGS / "grpo_math_1B.yaml")]) == 0
    [warning] = [r.getMessage() for r in caplog.records if "no effect in nrl" in r.getMessage()]
    assert "cluster.master_port_range_low" in warning
    # live: NeMo RL's GRPO validation delay, the Megatron worker's cache emptying
    for key in ("grpo.val_start_at", "policy.megatron_cfg.empty_unused_memory_level"):
        assert key not in warning
    # set to the value that switches nothing on (what nrl does), or in a section the config leaves off
    for key in ("checkpointing.checkpoint_must_save_by", "data_plane.enabled", "data_plane.impl", "reward_penalties",
                "policy.make_sequence_length_divisible_by"):
        assert key not in warning
    assert "policy.generation.val_temperature" not in warning  # live: validation samples at it
    # live: equal to top_p and top_k, as NeMo RL requires outside NeMo Gym; the data layout's keys are read
    for key in ("policy.generation.val_top_p", "policy.generation.val_top_k", "data.train", "data.default"):
        assert key not in warning


def test_keys_inert_only_where_they_do_nothing_are_named(caplog):
    config = str(CONFIGS / "grpo_math_1B.yaml")
    with caplog.at_level(logging.WARNING):
        assert main(["config", "check", config, "policy.generation.colocated.resources.gpus_per_node=2",
                     "policy.make_sequence_length_divisible_by=4"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if "no effect in nrl" in r.getMessage()]
    assert "policy.generation.colocated.resources.gpus_per_node" in warning
    assert "policy.make_sequence_length_divisible_by" in warning


def test_grpo_without_a_generation_backend_fails_the_check(capsys):
    config = str(CONFIGS / "grpo_math_1B.yaml")
    assert main(["config", "check", config, "policy.generation=null"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "error: policy.generation: GRPO generates rollouts; configure a generation backend (policy.generation.backend)")
    assert main(["config", "check", "--algorithm", "nosuch", config]) == 2
    assert "nosuch" in capsys.readouterr().err


@pytest.mark.parametrize("config, key", [("dpo_tiny_cpu.yaml", "dpo"), ("rm_tiny_cpu.yaml", "rm"),
                                         ("distillation_tiny_cpu.yaml", "distillation")])
def test_a_negative_val_period_is_never_as_nemo_rl_writes_it(config, key):
    from nrl_core.algorithms.installed import load_and_validate

    path = Path(__file__).resolve().parents[2] / "examples" / "configs" / config
    assert load_and_validate(str(path), [f"{key}.val_period=-1"], algorithm=key)[key]["val_period"] == -1


def test_a_token_budget_below_the_longest_sequence_fails_only_on_a_sequence_that_does_not_fit():
    """NeMo RL accepts train_mb_tokens below policy.max_total_sequence_length (three of its recipes
    set it so) and fails only when a sequence longer than the budget is packed."""
    from nrl_core.algorithms.installed import load_and_validate
    from nrl_core.data.packing import pack_bins
    from nrl_core.errors import NrlError

    path = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_tiny_cpu.yaml"
    config = load_and_validate(str(path), ["policy.sequence_packing.enabled=true",
                                           "policy.sequence_packing.train_mb_tokens=32"], algorithm="sft")
    assert config["policy"]["sequence_packing"]["train_mb_tokens"] < config["policy"]["max_total_sequence_length"]
    assert sorted(map(sorted, pack_bins([20, 12, 30], 32))) == [[0, 1], [2]]
    with pytest.raises(NrlError, match=r"^a sequence of 40 tokens exceeds the packing budget of 32 tokens; raise "
                                       r"policy.sequence_packing.\*_mb_tokens to at least 40$"):
        pack_bins([20, 40], 32)


#: NeMo RL's examples/configs/evals/ (copied unmodified): `nrl eval --check` passes or names what nrl lacks.
EVAL_EXPECTED: dict[str, str | None] = {
    "eval.yaml": None,  # AIME 2024, a registered dataset, with NeMo RL's math_hf_data_processor
    "math_eval.yaml": "error: data.dataset_name: 'math' is NeMo RL's MATH test set (read from a URL), which nrl lacks",
    "local_eval.yaml": "error: data.dataset_name: 'https://openaipublic.blob.core.windows.net/simple-evals/"
                       "math_500_test.csv' is a URL, and nrl reads local files",
    "gpqa_eval.yaml": "error: data.dataset_name: 'gpqa' is NeMo RL's GPQA, scored by its multiple-choice",
    "mmlu.yaml": "error: data.dataset_name: 'mmlu' is NeMo RL's MMLU, scored by its multiple-choice",
    "mmlu_zh_cn.yaml": "error: data.dataset_name: 'mmlu_ZH-CN' is NeMo RL's MMLU",
    "mmlu_pro.yaml": "error: data.dataset_name: 'mmlu_pro' is NeMo RL's MMLU",
    "mmau.yaml": "error: data.dataset_name: 'TwinkStart/MMAU' is NeMo RL's MMAU (audio), which nrl lacks",
    "daily_omni.yaml": "error: data.dataset_name: 'daily-omni' is NeMo RL's Daily-Omni (video), which nrl lacks",
}


def test_every_copied_eval_config_has_an_expectation():
    assert sorted(p.name for p in (CONFIGS / "evals").glob("*.yaml")) == sorted(EVAL_EXPECTED)


@pytest.mark.parametrize("name", sorted(EVAL_EXPECTED))
def test_nrl_eval_check_passes_a_nemo_rl_eval_config_or_names_what_nrl_lacks(name, capsys):
    code = main(["eval", "--check", "--config", str(CONFIGS / "evals" / name)])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if EVAL_EXPECTED[name] is None:
        assert code == 0 and not errors, err
        assert out.splitlines()[1:] == [
            "model: Qwen/Qwen2.5-Math-1.5B-Instruct", "generation backend: vllm",
            "data: train AIME2024 from hub HuggingFaceH4/aime_2024 split train; processor math_hf_data_processor",
            "eval: pass@k with k=1 of 1 samples per problem"]
    else:
        assert code == 2 and len(errors) == 1 and errors[0].startswith(EVAL_EXPECTED[name]), err
