"""A run that finished (validating at its end) and is started again with a larger step count
continues as the unbroken run: the same metrics at the new step and the same weights after it.

Before validation sampled apart from training, a GRPO run extended this way drew other rollout
seeds (its end-of-run validation had advanced the engines' sampling position). GRPO on DTensor,
and DPO on Megatron, are checked by tests/e2e/test_grpo.py and tests/e2e/test_dpo.py on runs they
already make; this module covers the other four pairs of algorithm and backend, and compares the
weights too (each run exports its newest checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.reliability_trials import Mode
from nrl_core.testing.tiny_models import cached_tiny_model
from tests.e2e.test_grpo import TIMING, assert_ok, finite, metrics, nrl_train, run_nrl

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
SAVED = ["checkpointing.enabled=true", "checkpointing.export_hf=true", "checkpointing.metric_name=null"]
MEGATRON_GRPO = ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
                 "policy.megatron_cfg.optimizer.lr=0.05", "policy.megatron_cfg.optimizer.min_lr=0.05",
                 "policy.megatron_cfg.load_rng=true"]


def _train(tmp: Path, algorithm: str, backend: str, steps: int) -> None:
    """``steps`` steps of the tiny recipe, validating only after the last one."""
    model = cached_tiny_model("llama", size="small")
    tmp.mkdir(parents=True, exist_ok=True)
    if algorithm == "grpo":
        rng = MEGATRON_GRPO if backend == "megatron" else ["policy.dtensor_config.load_rng=true"]
        proc = nrl_train(tmp, model, *rng, *SAVED, f"grpo.max_num_steps={steps}", "grpo.val_period=0",
                         "grpo.val_at_end=true")
    elif algorithm == "sft":
        proc = run_nrl(tmp, CONFIGS / "sft_tiny_cpu.yaml", "sft", [
            f"policy.model_name={model}", *Mode(backend, async_save=False).overrides(), *SAVED,
            f"sft.max_num_steps={steps}", "sft.val_period=0", "sft.val_at_end=true", "sft.val_batches=1",
            "sft.val_global_batch_size=8", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8"])
    else:
        proc = run_nrl(tmp, CONFIGS / "recipes" / "llm" / f"dpo-tinyllama-1n1cpu-{backend}.yaml", "dpo", [
            f"policy.model_name={model}", *SAVED, f"dpo.max_num_steps={steps}", "dpo.val_at_start=false",
            "dpo.val_period=0", "dpo.val_at_end=true", "policy.dtensor_config.load_rng=true"])
    assert_ok(proc)


def _weights(tmp: Path) -> dict[str, torch.Tensor]:
    files = sorted((tmp / "ckpt" / "hf_export").glob("*.safetensors"))
    assert files, f"no export under {tmp / 'ckpt'}"
    return {name: tensor for f in files for name, tensor in load_file(f).items()}


@pytest.mark.parametrize(("algorithm", "backend"),
                         [("grpo", "megatron"), ("sft", "dtensor"), ("sft", "megatron"), ("dpo", "dtensor")])
def test_a_finished_run_extended_by_a_step_equals_the_unbroken_run(tmp_path: Path, algorithm: str,
                                                                     backend: str) -> None:
    _train(tmp_path / "unbroken", algorithm, backend, steps=2)
    _train(tmp_path / "extended", algorithm, backend, steps=1)
    finished = metrics(tmp_path / "extended")
    assert [r["step"] for r in finished] == [1] and any(k.startswith("val") for k in finished[0]), finished
    _train(tmp_path / "extended", algorithm, backend, steps=2)
    unbroken, extended = metrics(tmp_path / "unbroken"), metrics(tmp_path / "extended")
    assert finite(unbroken) and finite(extended)
    assert [r["step"] for r in extended] == [r["step"] for r in unbroken] == [1, 2]
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith(TIMING)}  # noqa: E731
    assert strip(extended[1]) == strip(unbroken[1])
    a, b = _weights(tmp_path / "unbroken"), _weights(tmp_path / "extended")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b.get(k, torch.empty(0)))]
