"""Megatron-Core on Nemotron-H and Nemotron 3 (Mamba-2, attention, MLP or expert layers): the torch
scan against an exact recurrence, the conversion both ways, HF parity, export, sequence packing,
and tensor, expert and pipeline parallelism against one rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

import moe_scenarios
from _helpers import run_world
from test_megatron_moe import hf_logits, max_gap

from nrl_core.api import ConfigError

FAMILIES = ("nemotron_h", "nemotron_h_moe", "nemotron_h_moe_latent")
# HF's Mamba layer without mamba_ssm runs transformers' own PyTorch scan, which is off by up to
# 7e-5 per layer from an exact float64 recurrence (nrl's scan: 1e-7, below); three Mamba layers
# and the experts' routing on top are within this
HF_TOLERANCE = 5e-4


def _exact_mixer(zxbcdt, weight, bias, dt_bias, A, D, heads, head_dim, groups):
    """The Mamba-2 mixer's definition, step by step in float64."""
    d = torch.float64
    inner = heads * head_dim
    state = (zxbcdt.shape[-1] - 2 * inner - heads) // (2 * groups)
    z, xbc, dt = torch.split(zxbcdt.to(d), [inner, inner + 2 * groups * state, heads], -1)
    width, length = weight.shape[-1], xbc.shape[1]
    padded = F.pad(xbc, (0, 0, width - 1, 0))
    conv = torch.stack([(padded[:, t:t + width] * weight.to(d).T).sum(1) + bias.to(d) for t in range(length)], 1)
    x, B, C = torch.split(F.silu(conv), [inner, groups * state, groups * state], -1)
    x = x.reshape(*x.shape[:2], heads, head_dim)
    group = torch.arange(heads) // (heads // groups)
    B, C = B.reshape(*B.shape[:2], groups, state)[:, :, group], C.reshape(*C.shape[:2], groups, state)[:, :, group]
    dt = F.softplus(dt + dt_bias.to(d))
    h = torch.zeros(x.shape[0], heads, head_dim, state, dtype=d)
    ys = []
    for t in range(length):
        h = torch.exp(dt[:, t] * A.to(d))[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    y = torch.stack(ys, 1) + x * D.to(d)[:, None]
    return y.reshape(*y.shape[:2], inner) * F.silu(z)


def _mixer_inputs(seed: int = 0, length: int = 37):
    g = torch.Generator().manual_seed(seed)
    heads, head_dim, groups, state, width = 4, 8, 2, 16, 4
    channels = heads * head_dim + 2 * groups * state
    return dict(zxbcdt=torch.randn(2, length, 2 * heads * head_dim + 2 * groups * state + heads, generator=g),
                weight=torch.randn(channels, width, generator=g) * 0.3, bias=torch.randn(channels, generator=g) * 0.1,
                dt_bias=torch.randn(heads, generator=g) * 0.5, A=-torch.rand(heads, generator=g) * 3 - 0.5,
                D=torch.randn(heads, generator=g), heads=heads, head_dim=head_dim, groups=groups)


def test_torch_scan_equals_the_exact_recurrence() -> None:
    """Chunks of 8 over 37 steps: within-chunk products, states carried across chunks, a padded tail."""
    from nrl_backend_megatron.cpu_mamba import split_conv1d_scan

    i = _mixer_inputs()
    got = split_conv1d_scan(i["zxbcdt"], i["weight"], i["bias"], i["dt_bias"], i["A"], i["D"], chunk_size=8,
                            headdim=i["head_dim"], ngroups=i["groups"])
    assert (got.double() - _exact_mixer(**i)).abs().max() < 1e-6


def test_packed_sequences_start_from_a_fresh_state() -> None:
    """Each packed sequence scans and convolves as if alone: no state or window crosses a boundary."""
    from nrl_backend_megatron.cpu_mamba import split_conv1d_scan

    i = _mixer_inputs(length=30)
    seq_idx = torch.tensor([[0] * 10 + [1] * 13 + [2] * 7, [0] * 30])
    kw = dict(chunk_size=8, headdim=i["head_dim"], ngroups=i["groups"])
    packed = split_conv1d_scan(i["zxbcdt"], i["weight"], i["bias"], i["dt_bias"], i["A"], i["D"], seq_idx=seq_idx, **kw)
    alone = split_conv1d_scan(i["zxbcdt"][:1, 10:23], i["weight"], i["bias"], i["dt_bias"], i["A"], i["D"], **kw)
    assert torch.equal(packed[:1, 10:23], alone)
    whole = split_conv1d_scan(i["zxbcdt"], i["weight"], i["bias"], i["dt_bias"], i["A"], i["D"], **kw)
    assert torch.allclose(packed[1], whole[1], atol=1e-6) and not torch.allclose(packed[0, 10:23], whole[0, 10:23])


def test_gated_norm_normalises_each_group_after_the_gate() -> None:
    from nrl_backend_megatron.cpu_mamba import GatedGroupRMSNorm

    norm = GatedGroupRMSNorm(8, eps=1e-6, group_size=4)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x, z = torch.randn(3, 8), torch.randn(3, 8)
    gated = (x * F.silu(z)).reshape(3, 2, 4)
    expected = (gated / gated.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).reshape(3, 8) * norm.weight
    assert torch.allclose(norm(x, z), expected, atol=1e-6)


def test_tensor_parallel_parts_round_trip() -> None:
    """Each rank's slice holds its share of every part, in order; joining every rank's slices restores it."""
    from nrl_backend_megatron.hybrid import join_parts, slice_parts

    full = torch.arange(20.0)
    parts = (8, 8, 2, 2)
    slices = [slice_parts(full, parts, 0, r, 2) for r in range(2)]
    assert slices[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 18]
    assert torch.equal(join_parts(slices, parts, 0), full)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_hf_round_trip_is_bit_identical(family: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nrl_backend_megatron.convert import canonical_shapes, hf_to_megatron, megatron_to_hf

    path = moe_scenarios.hybrid_paths()[family]
    cfg = AutoConfig.from_pretrained(path)
    hf = load_file(f"{path}/model.safetensors")
    mg = hf_to_megatron(hf, cfg)
    assert {k: tuple(v.shape) for k, v in mg.items()} == canonical_shapes(cfg)
    assert {"decoder.layers.0.mixer.in_proj.weight", "decoder.layers.1.self_attention.linear_qkv.weight",
            "decoder.final_norm.weight"} <= mg.keys()
    assert ("decoder.layers.3.mlp.router.expert_bias" in mg) == family.startswith("nemotron_h_moe")
    assert ("decoder.layers.3.mlp.fc1_latent_proj.weight" in mg) == family.endswith("latent")
    back = megatron_to_hf(mg, cfg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_mamba_pre_norm_takes_transformer_engine_name() -> None:
    from nrl_backend_megatron.convert.mapping import local_name, te_name

    assert te_name("decoder.layers.2.norm.weight") == "decoder.layers.2.mixer.in_proj.layer_norm_weight"
    assert te_name("decoder.layers.2.mixer.norm.weight") == "decoder.layers.2.mixer.norm.weight"
    assert local_name("decoder.layers.2.mixer.in_proj.layer_norm_weight") == "decoder.layers.2.norm.weight"


@pytest.mark.parametrize(("change", "tp", "needle"), [
    ({"mlp_hidden_act": "silu"}, 1, "MLP activation 'silu'"),
    ({}, 4, "does not divide the model's n_groups (2)"),
    ({"conv_kernel": 3}, 1, "conv_kernel=3"),
    ({"use_conv_bias": False}, 1, "use_conv_bias=False"),
])
def test_what_megatron_cannot_build_is_one_line(change: dict[str, Any], tp: int, needle: str) -> None:
    from transformers import AutoConfig

    from nrl_backend_megatron.hybrid import check_hybrid

    cfg = AutoConfig.from_pretrained(moe_scenarios.hybrid_paths()["nemotron_h_moe"])
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ConfigError) as info:
        check_hybrid(cfg, tp)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_latent_experts_refuse_the_shared_expert_overlap() -> None:
    """Megatron asserts it mid-forward; nrl refuses it at config check, in one line."""
    from transformers import AutoConfig

    from nrl_backend_megatron.moe import check_moe_section

    cfg = AutoConfig.from_pretrained(moe_scenarios.hybrid_paths()["nemotron_h_moe_latent"])
    with pytest.raises(ConfigError, match="moe_shared_expert_overlap"):
        check_moe_section({"moe_shared_expert_overlap": True}, cfg, on_gpu=True)


@pytest.fixture(scope="module")
def w1() -> dict[str, Any]:
    (result,) = run_world(moe_scenarios.hybrid_world1, 1, moe_scenarios.hybrid_paths())
    return result


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_models_equal_hf_and_export_their_checkpoint(w1, family: str) -> None:
    from safetensors.torch import load_file

    path = moe_scenarios.hybrid_paths()[family]
    assert max_gap(w1[f"{family}/logits"], hf_logits(path)) < HF_TOLERANCE
    hf = load_file(f"{path}/model.safetensors")
    exported = w1[f"{family}/export"]
    assert exported.keys() == hf.keys() and all(torch.equal(exported[k], hf[k]) for k in hf)
    losses = [m["loss"] for m in w1[f"{family}/metrics"]]
    assert losses[2] < losses[0]


@pytest.mark.slow
def test_packing_gives_each_sequence_its_own_state(w1) -> None:
    assert (w1["nemotron_h/packed_logprobs"] - w1["nemotron_h/logprobs"]).abs().max() < 1e-5


@pytest.mark.slow
def test_full_recompute_runs_each_layer_again_and_trains_the_same(w1) -> None:
    """Megatron's Mamba stack has no recompute of its own; nrl's runs each layer again in backward.
    Three steps of two micro-batches: a mixer forward and its recomputation for each."""
    assert w1["nemotron_h/mixer_forwards"] == 3 * 2 * 2
    for got, want in zip(w1["nemotron_h/recomputed_metrics"], w1["nemotron_h/metrics"]):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]


def test_megatron_checkpoints_of_a_hybrid_are_refused_in_one_line() -> None:
    from transformers import AutoConfig

    from nrl_backend_megatron.convert.megatron_checkpoint import MegatronCheckpointError, architecture_of_hf

    with pytest.raises(MegatronCheckpointError, match="start from the Hugging Face model") as info:
        architecture_of_hf(AutoConfig.from_pretrained(moe_scenarios.hybrid_paths()["nemotron_h"]))
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_parallel_layouts_match_one_rank(w1) -> None:
    results = run_world(moe_scenarios.hybrid_world2, 2, moe_scenarios.hybrid_paths())
    for tag, family in (("tp2", "nemotron_h_moe_latent"), ("ep2", "nemotron_h_moe"), ("pp2", "nemotron_h")):
        for rank in results:
            exported = rank[f"{tag}/export"]
            assert exported.keys() == w1[f"{family}/export"].keys(), tag
            assert all(torch.equal(exported[k], w1[f"{family}/export"][k]) for k in exported), tag
            assert (rank[f"{tag}/logprobs"] - w1[f"{family}/logprobs"]).abs().max() < 1e-5, tag
            for got, want in zip(rank[f"{tag}/metrics"], w1[f"{family}/metrics"]):
                assert abs(got["loss"] - want["loss"]) < 1e-4 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-4, tag
