"""Every shipped config validates (``nrl config check`` semantics, no network), the documented
minimal shapes resolve to the documented values, and the minimal tiny CPU recipe runs one step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from nrl_core.algorithms.installed import choose_backends, load_and_validate
from nrl_core.cli import main
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.launch import nrl

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
ALL_YAML = sorted(p.relative_to(REPO) for p in (REPO / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", ALL_YAML, ids=str)
def test_every_example_config_validates(path, capsys):
    assert main(["config", "check", str(REPO / path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {REPO / path}") and "training backend:" in out


def test_recipes_cover_every_combination():
    names = {p.stem for p in (CONFIGS / "recipes" / "llm").glob("*.yaml")}
    for algorithm, backend, placement in [("grpo", "dtensor", ""), ("grpo", "dtensor", "-noncolocated"),
                                          ("grpo", "megatron", ""), ("grpo", "megatron", "-noncolocated"),
                                          ("sft", "dtensor", ""), ("sft", "megatron", "")]:
        assert f"{algorithm}-llama3.2-1b-1n8g-{backend}{placement}" in names
    for path in (CONFIGS / "recipes" / "llm").glob("*.yaml"):
        assert "defaults" in yaml.safe_load(path.read_text()), f"{path.name} must inherit a base"


@pytest.mark.parametrize("path, backend, colocated", [
    ("recipes/llm/grpo-llama3.2-1b-1n8g-dtensor.yaml", "dtensor", True),
    ("recipes/llm/grpo-llama3.2-1b-1n8g-dtensor-noncolocated.yaml", "dtensor", False),
    ("recipes/llm/grpo-llama3.2-1b-1n8g-megatron.yaml", "megatron", True),
    ("recipes/llm/grpo-llama3.2-1b-1n8g-megatron-noncolocated.yaml", "megatron", False),
])
def test_recipe_names_say_what_the_config_does(path, backend, colocated):
    config = load_and_validate(str(CONFIGS / path))
    assert choose_backends(config).training.name == backend
    assert config["policy"]["generation"]["colocated"]["enabled"] is colocated
    assert config["policy"]["model_name"] == "meta-llama/Llama-3.2-1B-Instruct"


def test_minimal_shape_resolves_to_documented_defaults():
    config = load_and_validate(str(CONFIGS / "minimal" / "minimal.yaml"))
    policy = config["policy"]
    assert policy["max_total_sequence_length"] == 1024
    assert (policy["train_micro_batch_size"], policy["train_global_batch_size"]) == (2, 2 * 2 * 1)
    assert choose_backends(config).training.name == "dtensor" and policy["dtensor_config"]["enabled"] is True
    assert policy["generation"]["backend"] == "vllm" and policy["generation"]["vllm_cfg"]["max_model_len"] is None
    assert config["grpo"]["num_generations_per_prompt"] == 16 and config["loss_fn"]["ratio_clip_max"] == 0.2
    # null: bfloat16 on a bf16-capable GPU, float32 elsewhere, resolved by the process holding the weights
    assert policy["precision"] is None and policy["tokenizer"]["name"] == "Qwen/Qwen2.5-1.5B"


def test_advanced_minimal_shape():
    policy = load_and_validate(str(CONFIGS / "minimal" / "minimal_advanced.yaml"))["policy"]
    assert policy["max_total_sequence_length"] == 2048
    assert (policy["train_micro_batch_size"], policy["train_global_batch_size"]) == (1, 1 * 8 * 8)


def test_advanced_minimal_shape_with_tensor_parallel_counts_data_parallel_ranks():
    policy = load_and_validate(str(CONFIGS / "minimal" / "minimal_advanced.yaml"),
                               ["+policy.dtensor_config.enabled=true", "+policy.dtensor_config.tensor_parallel_size=2"])["policy"]
    assert policy["train_global_batch_size"] == 1 * 8 * (8 // 2)


def test_config_show_prints_the_mapping(capsys):
    assert main(["config", "show", str(CONFIGS / "minimal" / "minimal.yaml")]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["policy"]["train_global_batch_size"] == 4 and shown["policy"]["max_total_sequence_length"] == 1024


# --------------------------------------------------------------------------- the tiny CPU recipes run


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    return cached_tiny_model("llama", size="small")


# grpo_tiny_cpu.yaml runs in tests/e2e (test_grpo.py and the matrix), sft_tiny_cpu.yaml in
# tests/e2e/test_lifecycle_hooks.py and tests/reliability, both through `nrl train` as here.
ONE_STEP = {
    "minimal/grpo_tiny_cpu_minimal.yaml": ["+grpo.max_num_steps=1", "+grpo.num_prompts_per_step=8",
                                           "+grpo.num_generations_per_prompt=16", "+grpo.val_period=0",
                                           "+policy.generation.vllm_cfg.enforce_eager=true",
                                           "+policy.generation.max_new_tokens=8", "+env.math.num_workers=1"],
    # LoRA adapters through a whole GRPO step: merged refit, adapter-only optimizer, base reference
    "grpo_tiny_cpu_lora.yaml": ["grpo.max_num_steps=1", "grpo.num_prompts_per_step=4",
                                "grpo.num_generations_per_prompt=8", "grpo.val_at_start=false", "grpo.val_at_end=false",
                                "policy.train_global_batch_size=32", "policy.train_micro_batch_size=16",
                                "policy.logprob_batch_size=32", "loss_fn.reference_policy_kl_penalty=0.01"],
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.quick] if name.startswith("minimal/") else [])
                                  for name in ONE_STEP])  # GRPO's run in the quick tier
def test_tiny_cpu_recipe_runs_one_step(name, sft_model, tmp_path):
    algorithm = "sft" if name.startswith("sft") else "grpo"
    overrides = [f"policy.model_name={sft_model}", f"++checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
                 "++checkpointing.enabled=false", f"++logger.log_dir={tmp_path / 'logs'}", *ONE_STEP[name]]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "NRL_STRICT_PLUGINS": "1"}
    proc = nrl(["train", algorithm, "--config", str(CONFIGS / name), *overrides], env=env, cwd=tmp_path, timeout=600,
               join_shared_ray=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1
