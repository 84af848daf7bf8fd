"""Every ``1n8g`` recipe runs, as its data-parallel-2 CPU twin.

A twin keeps what makes the recipe's shape (algorithm, training backend, placement, model-parallel
layout, packing, KL penalty, optimizer and scheduler) and scales the sizes down: the tiny local
model, two data-parallel groups (so a TP=2 recipe trains on 2 x 2 workers), one generation engine
when generation is not colocated, a few prompts of the arithmetic task, short sequences. It runs
in float32, where the refit check below is an exact equality (in bfloat16 vLLM's and HF's kernels
round differently), and without what needs a GPU (Megatron's mixed-precision and distributed
optimizers, Transformer Engine's). It runs through ``nrl train`` exactly as a user would run the recipe with overrides;
GRPO twins train two steps and check the refit end to end (tests/e2e/test_grpo_matrix.py), SFT
twins train one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core.algorithms.installed import choose_backends, cluster_topology, load_and_validate
from tests.e2e.test_grpo import assert_ok, metrics, run_nrl
from tests.e2e.test_grpo_matrix import check_refit_after_training

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "configs" / "recipes" / "llm"
ONE_NODE_EIGHT = sorted(RECIPES.glob("*-1n8g-*.yaml"))
ARITHMETIC = "{num_train: 64, num_val: 8, min_operand: 0, max_operand: 19, ops: ['+', '-'], seed: 0}"
# A learning rate and weight decay that change the greedy answers within two steps, so that the
# GRPO twins' refit check compares trained weights (the recipes' rates would barely move them).
CHANGES_WEIGHTS = {
    "dtensor": ["policy.optimizer.kwargs.lr=0.05", "policy.optimizer.kwargs.weight_decay=2.0"],
    "megatron": ["policy.megatron_cfg.optimizer.lr=0.05", "policy.megatron_cfg.optimizer.min_lr=0.05",
                 "policy.megatron_cfg.optimizer.weight_decay=2.0", "policy.megatron_cfg.scheduler.lr_warmup_iters=0"],
}
# What only a GPU machine has: Megatron's mixed-precision optimizer keeps CUDA tensors, and the
# precision-aware optimizer is Transformer Engine's FusedAdam. (The distributed optimizer, with the
# recipes' overlaps, runs here as they set it.)
CPU_ONLY = {"dtensor": [], "megatron": [
    "policy.megatron_cfg.optimizer.bf16=false",
    "policy.megatron_cfg.optimizer.use_precision_aware_optimizer=false"]}


# The twin's arithmetic data states answers as numbers, never DAPO's "Answer:" line, so its DAPO
# twin scores with math-verify; every other DAPO key (dynamic sampling, scaling, shaping) stays.
# Dynamic sampling needs groups whose answers differ in correctness: the DAPO twin starts from the
# tiny model after the demo's SFT (cached once per machine, as the distillation tests build it),
# which answers sums of 0 to 4 right about as often as wrong. (From the untrained tiny model,
# such groups came by luck: a change of sampling seeds once left one in 240 prompts at step 2.)
TWIN_EXTRAS = {"grpo-dapo-qwen2.5-1.5b-1n8g-dtensor": [
    "env.math.math_verify_impl=hf_math_verify", "grpo.dynamic_sampling_max_gen_batches=40",
    "++data.generate={num_train: 20, num_val: 4, min_operand: 0, max_operand: 4, ops: ['+'], seed: 0}"]}
SFT_MODEL = frozenset({"grpo-dapo-qwen2.5-1.5b-1n8g-dtensor"})


def cpu_twin(recipe: Path, model: Path) -> list[str]:
    """Overrides that turn ``recipe`` into its data-parallel-2 CPU twin (see the module docstring)."""
    config = load_and_validate(str(recipe))
    training = choose_backends(config, generation=False).training
    model_parallel = training.model_parallel_size(config["policy"][training.config_key])
    overrides = [f"policy.model_name={model}", "cluster.num_nodes=1", "policy.train_global_batch_size=8",
                 "policy.train_micro_batch_size=2", "policy.logprob_batch_size=2",
                 "policy.max_total_sequence_length=64", "data.dataset_name=arithmetic",
                 "++data.generate=" + ARITHMETIC, "data.train_data_path=null", "data.val_data_path=null",
                 "data.prompt_file=null", "data.input_key=problem", "data.output_key=expected_answer",
                 "++data.use_chat_template=true", "logger.wandb_enabled=false", "policy.precision=float32"]
    overrides += CPU_ONLY[training.name]
    train_world = 2 * model_parallel
    if "grpo" in recipe.name:
        engine_size = cluster_topology(config).engine_size
        generation = config["policy"]["generation"]
        overrides += [*CHANGES_WEIGHTS[training.name], "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.max_val_samples=8",
                      "grpo.val_batch_size=8", "policy.generation.max_new_tokens=8",
                      "policy.generation.vllm_cfg.enforce_eager=true", "++env.math.num_workers=1"]
        if not generation["colocated"]["enabled"]:
            overrides += [f"policy.generation.colocated.resources.gpus_per_node={engine_size}",
                          "policy.generation.colocated.resources.num_nodes=1"]
            train_world += engine_size
    else:
        overrides += ["sft.max_num_steps=1", "sft.val_period=0", "sft.val_at_start=false"]
    return overrides + TWIN_EXTRAS.get(recipe.stem, []) + [f"cluster.gpus_per_node={train_world}"]


@pytest.mark.parametrize("recipe", ONE_NODE_EIGHT, ids=lambda p: p.stem)
def test_recipe_twin_runs(recipe, tmp_path, model):
    if recipe.stem in SFT_MODEL:
        from tests.e2e.test_distillation import teacher_model

        model = teacher_model()
    overrides = cpu_twin(recipe, model)
    if recipe.name.startswith("grpo"):
        check_refit_after_training(tmp_path, model, overrides, config=recipe)
    else:
        proc = run_nrl(tmp_path, recipe, "sft", [*overrides, "checkpointing.enabled=false"])
        assert_ok(proc)
        assert [r["step"] for r in metrics(tmp_path)] == [1]


@pytest.fixture(scope="module")
def model() -> Path:
    from nrl_core.testing.tiny_models import cached_tiny_model

    return cached_tiny_model("llama", size="small")
