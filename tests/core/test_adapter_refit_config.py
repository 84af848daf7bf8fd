"""``policy.refit.adapters`` (contract 9) at ``nrl config check``: accepted where both backends
declare their side and the run trains LoRA adapters, refused in one line naming the key anywhere
else; a backend spec that declares a capability without its methods is refused too."""

from __future__ import annotations

import pytest

from nrl_core.algorithms.installed import load_and_validate
from nrl_core.contract_versions import worker_gaps
from nrl_core.errors import ConfigError
from nrl_core.testing.tiny_models import cached_tiny_model

pytest.importorskip("nrl_gen_vllm")
pytest.importorskip("nrl_backend_dtensor")

LORA = "examples/configs/grpo_tiny_cpu_lora.yaml"
FULL = "examples/configs/grpo_tiny_cpu.yaml"


def checked(path: str, *overrides: str) -> dict:
    model = str(cached_tiny_model("llama", "small"))
    return load_and_validate(path, [f"policy.model_name={model}", *overrides], algorithm="grpo")


def refusal(path: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        checked(path, *overrides)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_lora_with_vllm_accepts_adapter_only_refit() -> None:
    assert checked(LORA, "policy.refit.adapters=true")["policy"]["refit"]["adapters"] is True
    assert checked(LORA)["policy"]["refit"]["adapters"] is False  # merged weights by default


def test_full_weights_cannot_send_adapters() -> None:
    assert refusal(FULL, "policy.refit.adapters=true").startswith(
        "policy.refit.adapters: adapter-only refit sends LoRA adapters, and this run trains full weights")


def test_a_generation_backend_without_adapter_refit_is_refused() -> None:
    pytest.importorskip("nrl_gen_hf")
    says = refusal(LORA, "policy.refit.adapters=true", "policy.generation.backend=hf")
    assert says.startswith("policy.refit.adapters: the hf generation backend (nrl-gen-hf) does not declare "
                           "adapter_refit")


def test_a_sleep_level_that_drops_the_base_weights_is_refused() -> None:
    says = refusal(LORA, "policy.refit.adapters=true", "policy.generation.vllm_cfg.sleep_level=2")
    assert says.startswith("policy.generation.vllm_cfg.sleep_level: 2 drops the engine's base weights")


def test_a_lora_rank_vllm_does_not_offer_is_refused() -> None:
    says = refusal(LORA, "policy.refit.adapters=true", "policy.generation.vllm_cfg.max_lora_rank=12")
    assert says.startswith("policy.generation.vllm_cfg.max_lora_rank: vLLM accepts one of 1, 8, 16")


def test_a_declared_capability_needs_its_methods() -> None:
    class Declares:  # a contract-9 training worker that names adapter_export but forgot two methods
        def adapter_config(self) -> dict:
            return {}

    gaps = worker_gaps(Declares, "training", 1, "mine", capabilities={"adapter_export"})
    missing = [g for g in gaps if "declares 'adapter_export'" in g]
    assert [g.split(" but ")[1].split(" is missing")[0] for g in missing] == [
        "adapter_manifest(dtype)", "export_adapter(bucket_bytes, dtype)"]
    assert not [g for g in worker_gaps(Declares, "training", 1, "mine") if "declares" in g]
