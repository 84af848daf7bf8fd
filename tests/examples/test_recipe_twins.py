"""Every ``1n8g`` recipe runs, as its CPU twin (``nrl twin``, nrl_core/twin.py).

The twin keeps what makes the recipe's shape (algorithm, training backend, placement, model-parallel
layout, packing, KL penalty, optimizer and scheduler) and sets only its documented scale-down keys:
the tiny local model of the recipe's family, each parallelism kind at 2 with two data-parallel
groups, one generation engine when generation is not colocated, float32 (where the refit check
below is an exact equality; in bfloat16 vLLM's and HF's kernels round differently), and what a CPU
lacks (Megatron's mixed-precision optimizer). On top of the twin this test sets its own: the
arithmetic task and short sequences (fast, and the refit check compares greedy answers the
training changes), and a learning rate that changes them within two steps. GRPO twins train two
steps and check the refit end to end (tests/e2e/test_grpo_matrix.py), SFT twins train one and
validate on three examples (a batch that does not divide over their two data-parallel ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core.algorithms.installed import choose_backends, load_and_validate
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


def cpu_twin(recipe: Path, model: Path, out: Path) -> tuple[Path, list[str]]:
    """``recipe``'s twin written under ``out``, and this test's overrides on top of it (see the module docstring)."""
    from nrl_core.plugins import get_plugin_manager
    from nrl_core.twin import write_twin

    twin = write_twin(recipe, out, get_plugin_manager(), model=model, steps=2 if "grpo" in recipe.name else 1)
    config = load_and_validate(str(twin.config))
    training = choose_backends(config, generation=False).training
    overrides = ["policy.max_total_sequence_length=64", "data.dataset_name=arithmetic",
                 "++data.generate=" + ARITHMETIC, "data.train_data_path=null", "data.val_data_path=null",
                 "data.prompt_file=null", "data.input_key=problem", "data.output_key=expected_answer",
                 "++data.use_chat_template=true"]
    if twin.algorithm == "grpo":
        overrides += [*CHANGES_WEIGHTS[training.name], "policy.generation.max_new_tokens=8",
                      "policy.generation.vllm_cfg.enforce_eager=true"]
    else:  # validation at the step, over 3 examples: a batch that does not divide over 2 data-parallel ranks
        overrides += ["sft.val_period=1", "sft.val_batches=1", "sft.val_global_batch_size=8",
                      "++data.generate={num_train: 64, num_val: 3, min_operand: 0, max_operand: 19, ops: ['+', '-'], "
                      "seed: 0}"]
    return twin.config, overrides + TWIN_EXTRAS.get(recipe.stem, [])


@pytest.mark.parametrize("recipe", ONE_NODE_EIGHT, ids=lambda p: p.stem)
def test_recipe_twin_runs(recipe, tmp_path, model):
    if recipe.stem in SFT_MODEL:
        from tests.e2e.test_distillation import teacher_model

        model = teacher_model()
    twin, overrides = cpu_twin(recipe, model, tmp_path / "twin")
    if recipe.name.startswith("grpo"):
        check_refit_after_training(tmp_path, model, overrides, config=twin)
    else:
        proc = run_nrl(tmp_path, twin, "sft", [*overrides, "checkpointing.enabled=false"])
        assert_ok(proc)
        assert [r["step"] for r in metrics(tmp_path)] == [1] and metrics(tmp_path)[0]["val/loss"] > 0


@pytest.fixture(scope="module")
def model() -> Path:
    from nrl_core.testing.tiny_models import cached_tiny_model

    return cached_tiny_model("llama", size="small")
