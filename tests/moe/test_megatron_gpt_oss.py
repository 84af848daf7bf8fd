"""Megatron-Core on the tiny gpt-oss: the conversion both ways (experts stacked and interleaved in
HF), HF parity with its sinks, sliding windows, YaRN, biased router and experts and the clamp,
packed rows, export, training, and tensor and expert parallelism against one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

import moe_scenarios
from _helpers import run_world

from nrl_core.testing.tiny_models import cached_tiny_model

REPO = Path(__file__).resolve().parents[2]


def _path() -> str:
    """The small size: grouped queries (4 heads, 2 key/value heads) that tensor parallelism can split."""
    return str(cached_tiny_model("gpt_oss", size="small"))


@pytest.fixture(scope="module")
def w1() -> dict[str, Any]:
    (result,) = run_world(moe_scenarios.gpt_oss_world1, 1, _path())
    return result


@pytest.fixture(scope="module")
def w2(w1) -> list[dict[str, Any]]:  # after w1: its conversion is the session's
    return run_world(moe_scenarios.gpt_oss_world2, 2, _path())


def _hf_logits(**overrides: Any) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(_path())
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(_path(), config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(moe_scenarios.gpt_oss_batch().input_ids).logits


def _gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    n = int(moe_scenarios.gpt_oss_batch().input_lengths.min())  # positions every row holds a real token at
    return float((ours[:, :n] - theirs[:, :n]).abs().max())


def test_hf_megatron_hf_round_trip_is_bit_identical() -> None:
    """Each Megatron expert is its slice of HF's stacked tensors, gate and up de-interleaved."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nrl_backend_megatron.convert import canonical_shapes, hf_to_megatron, megatron_to_hf

    cfg = AutoConfig.from_pretrained(_path())
    hf = load_file(f"{_path()}/model.safetensors")
    mg = hf_to_megatron(hf, cfg)
    assert {k: tuple(v.shape) for k, v in mg.items()} == canonical_shapes(cfg)
    stacked, width = hf["model.layers.1.mlp.experts.gate_up_proj"][5], cfg.intermediate_size
    fc1 = mg["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(fc1[:width], stacked[:, 0::2].t()) and torch.equal(fc1[width:], stacked[:, 1::2].t())
    assert torch.equal(mg["decoder.layers.0.self_attention.core_attention.softmax_offset"],
                       hf["model.layers.0.self_attn.sinks"])
    back = megatron_to_hf(mg, cfg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    del mg["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.bias"]
    with pytest.raises(ValueError, match=r"experts \[2\] of model.layers.1.mlp.experts.down_proj_bias"):
        megatron_to_hf(mg, cfg)


@pytest.mark.slow
def test_gpt_oss_equals_hf_padded_and_packed_and_exports_its_checkpoint(w1) -> None:
    from safetensors.torch import load_file

    assert _gap(w1["logits"], _hf_logits()) < 1e-4
    # a clamp the tiny model's activations reach: without it HF's logits move by more than that
    assert _gap(w1["clamped/logits"], _hf_logits(swiglu_limit=0.05)) < 1e-4
    assert _gap(w1["clamped/logits"], w1["logits"]) > 1e-3
    assert (w1["packed/logprobs"] - w1["logprobs"]).abs().max() < 1e-5
    hf = load_file(f"{_path()}/model.safetensors")
    exported = w1["export"]
    assert exported.keys() == hf.keys() and all(torch.equal(exported[k], hf[k]) for k in hf)
    assert w1["metrics"][-1]["loss"] < w1["metrics"][0]["loss"]


@pytest.mark.slow
def test_the_sinks_and_the_window_take_part() -> None:
    """HF without its sinks, or with a full window, computes other logits: the parity above depends
    on Megatron keeping both."""
    full = _hf_logits()
    assert _gap(_hf_logits(sliding_window=64), full) > 1e-4
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_path(), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        sinkless = model(moe_scenarios.gpt_oss_batch().input_ids).logits
    assert _gap(sinkless, full) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_layouts_equal_one_rank(w1, w2, layout: str) -> None:
    for rank in w2:
        assert (rank[f"{layout}/logprobs"] - w1["logprobs"]).abs().max() < 1e-5
        for ours, theirs in zip(rank[f"{layout}/metrics"], w1["metrics"]):
            assert abs(ours["loss"] - theirs["loss"]) < 1e-4
            assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-4
        for name, tensor in w1["trained"].items():
            assert torch.allclose(rank[f"{layout}/trained"][name], tensor, atol=5e-3), name


@pytest.mark.parametrize("override, phrase", [
    ("swiglu_alpha=1.5", "gpt-oss with swiglu_alpha 1.5 is not supported by the Megatron backend (Megatron-Core's "
                         "quick_gelu fixes it at 1.702)"),
    ("layer_types=[chunked_attention,full_attention,sliding_attention,full_attention]",
     "gpt-oss layer types ['chunked_attention', 'full_attention', 'sliding_attention'] are not supported"),
])
def test_nrl_config_check_refuses_what_megatron_would_compute_otherwise(override: str, phrase: str, tmp_path,
                                                                        capsys) -> None:
    from nrl_core.cli import main

    args = [str(REPO / "examples" / "configs" / "sft_tiny_cpu.yaml"), f"policy.model_name={_path()}",
            "policy.dtensor_config.enabled=false", "policy.megatron_cfg.enabled=true", "policy.optimizer=null",
            f"++policy.hf_config_overrides.{override}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"logger.log_dir={tmp_path / 'logs'}"]
    code = main(["config", "check", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: policy.model_name: ") and phrase in lines[0], lines
