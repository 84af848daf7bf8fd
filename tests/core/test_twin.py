"""``nrl twin``: a recipe's CPU twin differs from it only in documented scale-down keys.

Every recipe nrl ships and every NeMo RL config the tests keep is twinned (written and validated,
not trained: tests/examples/test_recipe_twins.py and test_nemo_rl_recipe_runs.py train twins). A
twin is refused in one line, or it sets only keys of ``SCALE_DOWN``, each parallelism kind at 2 at
most, and at most four training ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nrl_core.config.loader import load_with_defaults
from nrl_core.errors import NrlError
from nrl_core.plugins import get_plugin_manager
from nrl_core.twin import SCALE_DOWN, WORLD_LIMIT, documented, tiny_family, write_twin

REPO = Path(__file__).resolve().parents[2]
NEMO_RL = REPO / "tests" / "examples" / "nemo_rl_configs"
RECIPES = sorted([*(REPO / "examples" / "configs" / "recipes" / "llm").glob("*.yaml"),
                  *(NEMO_RL / "configs").glob("*.yaml"), *(NEMO_RL / "configs" / "recipes" / "llm").glob("*.yaml")])


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values, list items as ``[i]``."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}.{key}" if prefix else key).items()}
    if isinstance(node, list) and node and all(isinstance(item, dict) for item in node):
        return {k: v for i, item in enumerate(node) for k, v in flat(item, f"{prefix}[{i}]").items()}
    return {prefix: node}


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_twin_sets_only_documented_scale_down_keys(recipe, tmp_path, pm, monkeypatch):
    monkeypatch.chdir(NEMO_RL if NEMO_RL in recipe.parents else REPO)  # a checkout's root: prompt files resolve
    try:
        twin = write_twin(recipe, tmp_path, pm)
    except NrlError as error:
        assert "\n" not in str(error), str(error)
        return
    spec = pm.algorithms().get(twin.algorithm, "algorithm")
    before, after = flat(load_with_defaults(recipe)), flat(load_with_defaults(twin.config))
    changed = {key for key in before.keys() | after.keys() if before.get(key, object()) != after.get(key, object())}
    assert changed == set(twin.overrides), changed ^ set(twin.overrides)
    undocumented = [key for key in changed if documented(key, algorithm=spec.section,
                                                         model_sections=twin.sections[1:]) is None]
    assert not undocumented, undocumented
    sizes = {key: value for key, value in after.items() if key.endswith("_parallel_size") and isinstance(value, int)}
    assert all(value <= 2 for value in sizes.values()), sizes
    text = twin.config.read_text()
    assert all(f"#   {key}: " in text for key in twin.overrides)  # each key's reason, in the file
    engine = int(after.get("policy.generation.colocated.resources.gpus_per_node") or 0) \
        if not after.get("policy.generation.colocated.enabled", True) else 0
    assert after["cluster.gpus_per_node"] - engine <= WORLD_LIMIT and after["cluster.num_nodes"] == 1


def test_a_key_outside_the_table_is_not_a_scale_down_key():
    assert documented("policy.optimizer.kwargs.lr", algorithm="grpo") is None
    assert documented("loss_fn.reference_policy_kl_penalty", algorithm="grpo") is None
    assert documented("policy.megatron_cfg.tensor_model_parallel_size", algorithm="grpo")
    assert documented("teacher.model_name", algorithm="distillation", model_sections=("teacher",))
    assert documented("data.train[1].data_path", algorithm="grpo")


@pytest.mark.parametrize(("name", "family"), [
    ("meta-llama/Llama-3.2-1B-Instruct", "llama"), ("Qwen/Qwen2.5-1.5B", "qwen2"), ("Qwen/Qwen3-8B-Base", "qwen3"),
    ("Qwen/Qwen3-30B-A3B", "qwen3_moe"), ("Qwen/Qwen3-235B-A22B", "qwen3_moe"), ("Qwen/Qwen1.5-MoE-A2.7B", "qwen2_moe"), ("google/gemma-3-1b-it", "gemma3"),
    ("google/gemma-3-27b-it", "gemma3"), ("google/gemma-3n-E4B-it", None), ("google/gemma-4-E2B-it", "gemma4"),
    ("google/gemma-4-26B-A4B-it", "gemma4"), ("openai/gpt-oss-20b", "gpt_oss"),
    ("nvidia/NVIDIA-Nemotron-Nano-12B-v2", "nemotron_h"), ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "nemotron_h_moe"),
    ("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16", "nemotron_h_moe"),
    ("nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16", "nemotron_h_moe"),
    ("mistralai/Mistral-Nemo-Instruct-2407", "mistral"), ("mistralai/Mistral-Medium-3.5-128B", None),
    # Qwen3.5 and Qwen3-Next are other architectures (linear-attention layers), not Qwen3's
    ("Qwen/Qwen3.5-9B-Base", None), ("Qwen/Qwen3.5-35B-A3B-Base", None), ("Qwen/Qwen3-Next-80B-A3B-Instruct", None),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "qwen2"), ("moonshotai/Moonlight-16B-A3B", "deepseek_v3"),
    ("deepseek-ai/DeepSeek-V3-0324", "deepseek_v3"), ("deepseek-ai/DeepSeek-V3.1", "deepseek_v3"),
    ("deepseek-ai/DeepSeek-V3.2", None),
    ("Follow instructions in https://github.com/NVIDIA-NeMo/RL/blob/main/docs/guides/deepseek.md", "deepseek_v3"),
    ("zai-org/GLM-4.7-Flash", "glm4_moe_lite")])
def test_a_hub_name_names_its_tiny_family(name, family):
    assert tiny_family(name) == family


@pytest.mark.parametrize(("name", "latent"), [("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16", True),
                                               ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", False)])
def test_a_super_recipe_gets_latent_experts(name, latent):
    """Nemotron 3 Super computes its experts in a latent space; its twin's tiny model does too."""
    from nrl_core.twin import _latent_experts

    assert _latent_experts({"model_name": name}) == ({"moe_latent_size": 64} if latent else {})


@pytest.mark.parametrize("family", ["nemotron_h", "nemotron_h_moe", "gemma4", "llama", "deepseek_v3", "glm4_moe_lite"])
def test_a_local_model_names_its_tiny_family(family):
    """Nemotron 3 has Nemotron-H's model type; its experts make it the other family."""
    from nrl_core.testing.tiny_models import cached_tiny_model

    assert tiny_family(str(cached_tiny_model(family))) == family


def test_a_family_without_a_tiny_model_is_one_line_naming_the_way_out(tmp_path, pm):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"defaults: {REPO / 'examples' / 'configs' / 'grpo_tiny_cpu.yaml'}\n"
                      "policy: {model_name: mistralai/Mistral-Medium-3.5-128B}\n")
    with pytest.raises(NrlError, match=r"^policy.model_name: no tiny model of mistralai/Mistral-Medium-3.5-128B's "
                                       r"family .* "
                                       r"pass --model DIR"):
        write_twin(recipe, tmp_path / "twin", pm)


def test_a_recipe_with_no_or_two_algorithm_sections_is_one_line_asking_for_one(tmp_path, pm):
    base = REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"defaults: {base}\ndpo: {{reference_policy_kl_penalty: 0.1}}\n")
    with pytest.raises(NrlError, match=r"^twin: recipe.yaml sets the section of dpo, sft of the installed "
                                       r"algorithms .*; pass --algorithm NAME$"):
        write_twin(recipe, tmp_path / "twin", pm)
    recipe.write_text("policy: {model_name: meta-llama/Llama-3.2-1B}\n")
    with pytest.raises(NrlError, match=r"^twin: recipe.yaml sets the section of none of the installed algorithms"):
        write_twin(recipe, tmp_path / "twin", pm)


def test_a_dataset_without_stand_in_rows_is_one_line_naming_the_way_out(tmp_path, pm, monkeypatch):
    """A third party's dataset that gives no ``DatasetSpec.stand_in``: its twin cannot make up rows."""
    from nrl_core.api import DatasetSpec, hookimpl

    class Datasets:
        @hookimpl
        def nrl_datasets(self):
            return [DatasetSpec(name="PlainSet", format="nrl_data_nemo_rl.formats:gsm8k", distribution="nrl-plain-set",
                                hub="example/plain-set")]

    monkeypatch.chdir(NEMO_RL)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"defaults: {NEMO_RL / 'configs' / 'grpo_math_1B.yaml'}\n"
                      "data: {train: {dataset_name: PlainSet}}\n")
    with pm.registered(Datasets(), name="plain-set"), \
            pytest.raises(NrlError, match=r"^data.train\[0\].dataset_name: dataset 'PlainSet' \(nrl-plain-set\) gives no "
                                          r"stand-in rows \(DatasetSpec.stand_in\); point data_path at a small local"):
        write_twin(recipe, tmp_path / "twin", pm)


def test_gpu_kernel_choices_are_left_to_the_engines_in_the_twin(tmp_path, pm, monkeypatch):
    """NeMo RL's Qwen3-30B-A3B recipe picks Megatron's alltoall dispatcher and vLLM's Triton MoE
    kernels, neither of which runs on a CPU: its twin leaves both to the backends' own choice
    (TrainingBackendSpec.twin, GenerationBackendSpec.twin); a recipe that picks nothing gets no key."""
    monkeypatch.chdir(NEMO_RL)
    moe = write_twin(NEMO_RL / "configs" / "recipes" / "llm" / "performance" / "grpo-qwen3-30ba3b-4n8g.yaml",
                     tmp_path / "moe", pm)
    assert moe.overrides["policy.generation.vllm_kwargs.moe_backend"] == "auto"
    assert moe.overrides["policy.megatron_cfg.moe_token_dispatcher_type"] is None
    dense = write_twin(NEMO_RL / "configs" / "grpo_math_1B_megatron.yaml", tmp_path / "dense", pm)
    assert not [key for key in dense.overrides if "_kwargs." in key]


def test_the_docs_give_every_scale_down_key_its_reason():
    text = (REPO / "docs" / "twin.md").read_text()
    for pattern, why in SCALE_DOWN.items():
        assert f"`{pattern}`" in text and why in text, pattern


def test_a_twin_whose_engine_samples_from_other_weights_than_training_is_named_in_one_line(tmp_path):
    """The GLM-4.7-Flash twin trained with train/token_mult_prob_error 1.33 and said nothing; its
    engine computed another model than the trainer's."""
    from nrl_core.twin import mismatch_note

    metrics = tmp_path / "metrics.jsonl"
    assert mismatch_note(tmp_path) is None  # no run, nothing to say
    rows = [{"step": 1, "train/token_mult_prob_error": 1.0002}, {"step": 2, "train/token_mult_prob_error": 1.001}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mismatch_note(tmp_path) is None
    rows += [{"step": 3, "train/token_mult_prob_error": 1.336}, {"step": 3, "val/accuracy": 0.5}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    note = mismatch_note(tmp_path)
    assert note.startswith("twin: the engine's logprobs are not the trainer's: train/token_mult_prob_error 1.34 at "
                           "step 3") and "\n" not in note
    metrics.write_text(json.dumps({"step": 1, "train/token_mult_prob_error": float("nan")}) + "\n")
    assert "token_mult_prob_error nan at step 1" in mismatch_note(tmp_path)
