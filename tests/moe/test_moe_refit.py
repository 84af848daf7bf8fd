"""GRPO and refit of mixture-of-experts weights into vLLM, on the tiny Qwen3-MoE.

* In process: vLLM's CPU MoE kernel keeps expert weights prepacked and vLLM's weight update skips
  the prepack (nrl runs it during the reload, ``nrl_gen_vllm/cpu_moe.py``); a refit with changed
  experts and router generates what HF generates (also for experts the kernel pads); a refit
  missing one expert is refused by name and changes nothing.
* Each MoE recipe under examples/configs/recipes/llm runs GRPO in this process (DTensor FSDP2 with
  a colocated engine; Megatron with expert parallel 2 and an engine of its own, here two vLLM
  ranks with expert parallelism too, refit over shared memory). Then the policy trains on its own
  and is refit: vLLM's greedy output equals HF ``generate`` with the policy's exported weights,
  token for token; the manifest names every expert of every layer (the engine checks it against
  its checkpoint's one tensor per expert), and the experts travel many to a bucket.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nrl_core.algorithms.loss import NLLLoss
from nrl_core.refit.buckets import iter_buckets
from nrl_core.refit.plan import RefitPlan
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.e2e.facades import chat_prompts, training_batch
from tests.launch import driving_the_shared_ray
from tests.vllm.helpers import hf_greedy, hf_model

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "configs" / "recipes" / "llm"


@pytest.fixture(scope="module")
def model() -> Path:
    return cached_tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def ray_session():
    """The module's worker groups on the suite's shared Ray (their actors from the zygote)."""
    with driving_the_shared_ray():
        yield


class _DroppingSource:
    """An HF weight source that loses one expert tensor: from its export only (``in_manifest``), or
    from both its export and its manifest (a backend that forgot it consistently)."""

    def __init__(self, source, missing: str, in_manifest: bool) -> None:
        self.source, self.missing, self.in_manifest = source, missing, in_manifest

    def weight_manifest(self, dtype):
        return [s for s in self.source.weight_manifest(dtype) if self.in_manifest or s.name != self.missing]

    def export_weights(self, bucket_bytes, dtype):
        for bucket in self.source.export_weights(bucket_bytes, dtype):
            yield [(n, t) for n, t in bucket if n != self.missing]


def test_refit_of_trained_experts_in_process_and_a_missing_expert_is_refused(model):
    """vLLM's CPU MoE kernel prepacks expert weights, and its weight update skips the prepack
    (nrl runs it during the reload): refit weights with changed experts and router, greedy equals HF;
    then an expert missing from a refit is named and the engine keeps its weights."""
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.refit.hf_source import HFWeightSource
    from nrl_core.refit.manifest import RefitError
    from nrl_gen_vllm.worker import VllmGenerationWorker
    from tests.vllm.helpers import generation_config

    prompts = [[1, 5, 7, 9, 11], [1, 40, 41, 42], [1, 100, 200, 300]]
    worker = VllmGenerationWorker(generation_config(model))
    try:
        trained = hf_model(model, perturb_seed=1)
        refit(HFWeightSource(trained), worker)
        expected = hf_greedy(trained, prompts)
        assert worker.generate(prompts, greedy=True).token_ids == expected
        lost = "model.layers.1.mlp.experts.7.down_proj.weight"
        for in_manifest, message in ((True, f"missing 1: {lost}"), (False, f"lacks 1 of the model's weights: {lost}")):
            with pytest.raises(RefitError, match=message) as err:
                refit(_DroppingSource(HFWeightSource(hf_model(model, perturb_seed=2)), lost, in_manifest), worker)
            assert "\n" not in str(err.value)
            assert worker.generate(prompts, greedy=True).token_ids == expected
    finally:
        worker.shutdown()


def test_refit_of_experts_the_kernel_pads() -> None:
    """Experts 16 wide, which vLLM's CPU kernel pads to its alignment of 32 (the tiny model at
    tensor parallel 2 has the same width per rank): two refits load, greedy equals HF after each.
    The prepack after the reload that nrl ran before 0.5.0 failed here on the padded shapes."""
    from nrl_core.algorithms.refit_orchestrator import refit
    from nrl_core.refit.hf_source import HFWeightSource
    from nrl_gen_vllm.worker import VllmGenerationWorker
    from tests.vllm.helpers import generation_config

    narrow = cached_tiny_model("qwen3_moe", moe_intermediate_size=16)
    prompts = [[1, 5, 7, 9, 11], [1, 40, 41, 42]]
    worker = VllmGenerationWorker(generation_config(narrow))
    try:
        for seed in (3, 4):
            trained = hf_model(narrow, perturb_seed=seed)
            refit(HFWeightSource(trained), worker)
            assert worker.generate(prompts, greedy=True).token_ids == hf_greedy(trained, prompts)
    finally:
        worker.shutdown()


def _short_run(recipe: Path, model: Path, tmp: Path, lr: list[str]) -> dict:
    """The recipe for one GRPO step of 4 prompts x 4 answers, logs under ``tmp``, no checkpoints;
    a learning rate high enough that three NLL steps change the greedy answers afterwards."""
    from nrl_core.algorithms.installed import load_and_validate

    return load_and_validate(str(recipe), [
        f"policy.model_name={model}", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=16", "grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false",
        "data.generate.num_train=16", "data.generate.num_val=4", "checkpointing.enabled=false",
        f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false", "logger.plot=false", *lr])


def _generate(run, prompts):
    """Greedy answers, with the hand-off around them that a GRPO step does."""
    run.generation.prepare()
    try:
        return run.generation.generate(prompts, greedy=True)
    finally:
        run.generation.finish()


@pytest.mark.parametrize("recipe, lr, transport, aux_loss", [
    ("grpo-qwen3moe-1n1cpu-dtensor.yaml", ["policy.optimizer.kwargs.lr=1e-2"], "in_process", False),
    ("grpo-qwen3moe-1n3cpu-megatron-ep2-noncolocated.yaml",
     ["policy.megatron_cfg.optimizer.lr=1e-2", "policy.megatron_cfg.optimizer.min_lr=1e-2",
      # the engine too splits the experts: vLLM tensor parallel 2 with expert parallelism
      "cluster.gpus_per_node=4", "policy.generation.colocated.resources.gpus_per_node=2",
      "policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.expert_parallel_size=2"],
     "shared_memory", True),
], ids=["dtensor-colocated", "megatron-ep2-noncolocated-vllm-ep2"])
def test_grpo_then_refit_of_trained_experts(recipe, lr, transport, aux_loss, model, tmp_path, ray_session):
    from transformers import AutoConfig

    from nrl_core.algorithms.grpo import GRPO

    run = GRPO(config := _short_run(RECIPES / recipe, model, tmp_path, lr))
    try:
        prompts = chat_prompts(model)
        before = _generate(run, prompts)
        assert before.token_ids == hf_greedy(hf_model(model), prompts, max_new_tokens=8)

        run.run()
        (row,) = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
        # vLLM and the policy agree on the sampled tokens' logprobs through the routers (1.0 = identical)
        assert abs(row["train/token_mult_prob_error"] - 1.0) < 1e-3
        assert 1.0 <= row["train/moe/load_balance"] <= 4.0  # 1 = uniform routing, E/k = 4 = collapsed
        assert row["train/moe/expert_load_min"] <= 1.0 <= row["train/moe/expert_load_max"]
        assert ("train/moe/load_balancing_loss" in row) is aux_loss

        # every expert of every layer, once, in the engine's checkpoint layout, all in one bucket
        manifest = run.policy.group.call("weight_manifest", "float32", on=0)
        cfg = AutoConfig.from_pretrained(str(model))
        experts = {s.name for s in manifest if ".mlp.experts." in s.name}
        assert experts == {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in range(cfg.num_hidden_layers)
                           for e in range(cfg.num_experts) for p in ("gate", "up", "down")}
        buckets = list(iter_buckets(((s.name, torch.empty(s.shape, device="meta")) for s in manifest),
                                    RefitPlan.for_run(config).bucket_bytes))
        assert max(sum(".mlp.experts." in n for n, _ in b) for b in buckets) == len(experts)

        for step in range(3):
            run.policy.train(training_batch(step), NLLLoss())
        run.generation.mark_stale()
        report = run.generation.prepare()  # the refit
        after = run.generation.generate(prompts, greedy=True)
        run.generation.finish()
        run.policy.export_hf(str(tmp_path / "trained"))
        assert after.token_ids == hf_greedy(hf_model(tmp_path / "trained"), prompts, max_new_tokens=8)
        assert after.token_ids != before.token_ids, "training should have changed the greedy answers"
        assert report.transport == transport
    finally:
        run.close()
