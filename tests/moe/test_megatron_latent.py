"""Megatron-Core on the tiny multi-head latent attention models (DeepSeek-V3 and GLM-4.7-Flash):
the conversion both ways, HF parity (the routing correction bias included), export, training, and
tensor, expert and pipeline parallelism against one rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

import moe_scenarios
from _helpers import make_batch, run_world
from test_megatron_moe import hf_logits, max_gap

from nrl_core.testing.tiny_models import cached_tiny_model

FAMILIES = ("deepseek_v3", "glm4_moe_lite")


@pytest.fixture(scope="module")
def w1() -> dict[str, Any]:
    (result,) = run_world(moe_scenarios.latent_world1, 1, moe_scenarios.latent_paths())
    return result


@pytest.fixture(scope="module")
def w2(w1) -> list[dict[str, Any]]:  # after w1: its conversions are the session's
    return run_world(moe_scenarios.latent_world2, 2, moe_scenarios.latent_paths())


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_hf_round_trip_is_bit_identical(family: str) -> None:
    """Latent projections are copies under Megatron's names; the routing bias becomes the router's
    ``expert_bias`` buffer and comes back."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nrl_backend_megatron.convert import canonical_shapes, hf_to_megatron, megatron_to_hf

    path = cached_tiny_model(family)
    cfg = AutoConfig.from_pretrained(path)
    hf = load_file(str(path / "model.safetensors"))
    mg = hf_to_megatron(hf, cfg)
    assert {k: tuple(v.shape) for k, v in mg.items()} == canonical_shapes(cfg)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mg and "decoder.layers.1.mlp.router.expert_bias" in mg
    assert ("decoder.layers.0.self_attention.linear_q_down_proj.weight" in mg) == (family == "glm4_moe_lite")
    back = megatron_to_hf(mg, cfg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_latent_models_equal_hf_and_export_their_checkpoint(w1, family: str) -> None:
    from safetensors.torch import load_file

    path = moe_scenarios.latent_paths()[family]
    assert max_gap(w1[f"{family}/logits"], hf_logits(path)) < 1e-4
    hf = load_file(f"{path}/model.safetensors")
    assert hf[next(k for k in hf if k.endswith("e_score_correction_bias"))].abs().sum() > 0  # it takes part
    exported = w1[f"{family}/export"]
    assert exported.keys() == hf.keys() and all(torch.equal(exported[k], hf[k]) for k in hf)


@pytest.mark.slow
def test_the_routing_bias_chooses_experts(w1) -> None:
    """With the bias zeroed, HF routes differently: the parity above depends on Megatron loading it."""
    path = moe_scenarios.latent_paths()["deepseek_v3"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.zero_()
    with torch.no_grad():
        unbiased = model(make_batch().input_ids).logits
    assert max_gap(w1["deepseek_v3/logits"], unbiased) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("layout, family", [("tp2", "deepseek_v3"), ("ep2", "deepseek_v3"), ("pp2", "deepseek_v3"),
                                            ("glm_tp2", "glm4_moe_lite")])
def test_parallel_layouts_equal_one_rank(w1, w2, layout: str, family: str) -> None:
    """Logprobs, three training steps and the trained weights, against the single rank. Before
    nrl built the down-projections whole (``nrl_backend_megatron/latent.py``), TP 2 trained the
    key-value down-projection on partial gradients: grad norms 0.2% off, that weight 0.06 off.
    The weights' tolerance is Adam's at a learning rate of 1e-2, which turns reduction-order
    differences of near-zero gradients into parts of a step (data parallel 2 alone shows 1e-4)."""
    rank0 = w2[0]
    assert (rank0[f"{layout}/logprobs"] - w1[f"{family}/logprobs"]).abs().max() < 1e-5
    for ours, theirs in zip(rank0[f"{layout}/metrics"], w1[f"{family}/metrics"]):
        assert abs(ours["loss"] - theirs["loss"]) < 1e-4  # the bug: 1.3e-3 at step 2
        assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-4
    assert w1[f"{family}/metrics"][-1]["loss"] < w1[f"{family}/metrics"][0]["loss"]
    for name, tensor in w1[f"{family}/trained"].items():
        assert torch.allclose(rank0[f"{layout}/trained"][name], tensor, atol=5e-3), name


def test_a_latent_model_at_tensor_parallel_without_sequence_parallelism_is_refused() -> None:
    """Each rank would see the whole sequence and keep only its own heads' rotary gradient."""
    from types import SimpleNamespace

    from nrl_backend_megatron.latent import DuplicatedLinear

    config = SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=False, use_cpu_initialization=True,
                             params_dtype=torch.float32, perform_initialization=False)
    with pytest.raises(ValueError, match="needs sequence_parallel: true"):
        DuplicatedLinear(8, 4, config=config, init_method=None)
    config.sequence_parallel = True
    assert DuplicatedLinear(8, 4, config=config, init_method=None).weight.sequence_parallel


def test_transformer_engines_fused_latent_norms_have_their_local_names() -> None:
    """With Transformer Engine, Megatron's latent layer spec fuses the query and latent norms into
    the up-projections; their weights must still convert as ``q_layernorm`` and ``kv_layernorm``."""
    from nrl_backend_megatron.convert.mapping import local_name

    prefix = "decoder.layers.1.self_attention."
    assert local_name(prefix + "linear_q_up_proj.layer_norm_weight") == prefix + "q_layernorm.weight"
    assert local_name(prefix + "linear_kv_up_proj.layer_norm_weight") == prefix + "kv_layernorm.weight"
    assert local_name(prefix + "linear_kv_up_proj.weight") == prefix + "linear_kv_up_proj.weight"
