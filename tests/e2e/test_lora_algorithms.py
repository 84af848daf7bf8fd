"""LoRA through the SFT and DPO algorithms as a user runs them (``nrl train``), one backend each
(DTensor's PEFT layers for DPO, Megatron's own adapters for SFT; GRPO with LoRA runs in
tests/examples/test_configs.py and tests/e2e/test_refit_backends.py): two steps, then the HF
export is a PEFT adapter, and loaded with PEFT onto the base its adapters have trained (PEFT and
nrl start B at zero, so a B that is not zero moved)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_core.testing.tiny_models import cached_tiny_model
from tests.e2e.test_grpo import assert_ok, metrics, run_nrl

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
MEGATRON = ["policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
            "policy.megatron_cfg.optimizer.lr=0.01", "policy.megatron_cfg.optimizer.min_lr=0.01"]
CASES = {
    "dpo-dtensor": ("dpo", "dpo_tiny_cpu.yaml", [
        "++policy.dtensor_config.lora_cfg.enabled=true", "dpo.max_num_steps=2", "dpo.val_period=0",
        "dpo.val_at_start=false", "data.generate.num_train=32", "data.generate.num_val=8",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16"]),
    "sft-megatron": ("sft", "sft_tiny_cpu.yaml", [
        *MEGATRON, "++policy.megatron_cfg.peft.enabled=true", "sft.max_num_steps=2", "sft.val_period=0",
        "sft.val_at_start=false", "data.generate.num_train=32", "data.generate.num_val=8",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4"]),
}


@pytest.mark.quick  # DPO's and SFT's runs in the quick tier, and Megatron's
@pytest.mark.parametrize("case", list(CASES))
def test_lora_trains_through_the_algorithm_and_exports_a_peft_adapter(case, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    algorithm, config, overrides = CASES[case]
    model = cached_tiny_model("llama", size="small")
    assert_ok(run_nrl(tmp_path, CONFIGS / config, algorithm, [f"policy.model_name={model}", *overrides,
                                                              "checkpointing.export_hf=true"]))
    assert [row["step"] for row in metrics(tmp_path) if "train/loss" in row] == [1, 2]
    export = tmp_path / "ckpt" / "hf_export"
    assert (export / "adapter_config.json").is_file() and not (export / "model.safetensors").exists()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model)), str(export))
    trained = [p for name, p in peft.named_parameters() if "lora_B" in name]
    assert trained and all(float(p.abs().max()) > 0 for p in trained)
