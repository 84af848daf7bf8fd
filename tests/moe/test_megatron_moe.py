"""Megatron-Core on the tiny mixture-of-experts models: conversion, HF parity, expert parallelism,
the ``moe_*`` keys, checkpoints across expert-parallel sizes, router metrics, and one-line errors.

Two spawned worlds (1 and 2 ranks) run every multi-process scenario once per module; the
assertions below read their results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

import moe_scenarios
from _helpers import make_batch, run_world
from moe_scenarios import moe_paths

from nrl_core.errors import ConfigError
from nrl_core.testing.tiny_models import cached_tiny_model, model_config


def hf_logits(path: str, **overrides: Any) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(make_batch().input_ids).logits


def max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    n = int(make_batch().input_lengths.min())  # positions every row holds a real token at
    return float((a[:, :n] - b[:, :n]).abs().max())


@pytest.fixture(scope="module")
def w1(megatron_w1: dict[str, Any]) -> dict[str, Any]:
    return megatron_w1


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = tmp_path_factory.mktemp("moe-ckpt") / "ep2"
    return run_world(moe_scenarios.megatron_world2, 2, moe_paths(), str(ckpt))  # the session's conversions


# ------------------------------------------------------------------ conversion and checks (no engine)
def test_mixed_dense_and_moe_layers_round_trip() -> None:
    """decoder_sparse_step=2: layer 0 keeps a dense MLP, layer 1 routes; both convert both ways."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from nrl_backend_megatron.convert import canonical_shapes, hf_to_megatron, megatron_to_hf

    path = cached_tiny_model("qwen3_moe", decoder_sparse_step=2)
    cfg = AutoConfig.from_pretrained(path)
    hf = load_file(str(path / "model.safetensors"))
    mg = hf_to_megatron(hf, cfg)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mg and "decoder.layers.0.mlp.router.weight" not in mg
    assert {f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(8)} <= mg.keys()
    assert {k: tuple(v.shape) for k, v in mg.items()} == canonical_shapes(cfg)
    back = megatron_to_hf(mg, cfg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def _section(**keys: Any) -> dict[str, Any]:
    from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA

    return MEGATRON_CFG_SCHEMA.validate({"enabled": True, **keys}, "policy.megatron_cfg")


def _arch(family: str) -> Any:
    cfg = model_config(family)
    cfg.architectures = [{"qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}[family]]
    return cfg


@pytest.mark.parametrize("keys, family, match", [
    ({"moe_token_dispatcher_type": "alltoall"}, "qwen3_moe", "moe_token_dispatcher_type: 'alltoall' needs CUDA"),
    ({"moe_token_dispatcher_type": "flex"}, "qwen3_moe", "moe_token_dispatcher_type: 'flex' needs CUDA"),
    ({"moe_enable_deepep": True}, "qwen3_moe", "moe_enable_deepep: DeepEP needs CUDA"),
    ({"moe_shared_expert_overlap": True}, "qwen3_moe", "moe_shared_expert_overlap: needs the alltoall token"),
    ({"expert_model_parallel_size": 3}, "qwen3_moe", "expert_model_parallel_size: 3 does not divide the model's 8"),
    ({"expert_tensor_parallel_size": 2}, "qwen3_moe", "expert_tensor_parallel_size: 2 is not supported"),
    ({"moe_router_topk": 9}, "qwen3_moe", "moe_router_topk: must be between 1 and the model's 8"),
    ({"moe_router_topk": 1}, "qwen3_moe", "moe_router_topk: top-1 routing of a model that renormalises"),
    ({"expert_model_parallel_size": 2}, "llama", "needs a mixture-of-experts model"),
    ({"tensor_model_parallel_size": 2}, "qwen3_moe", "sequence_parallel: a mixture-of-experts model at tensor_model"),
])
def test_impossible_moe_settings_are_one_line_errors(keys: dict, family: str, match: str) -> None:
    from nrl_backend_megatron.moe import check_moe_section

    with pytest.raises(ConfigError, match=match) as err:
        check_moe_section(_section(**keys), _arch(family), on_gpu=False)
    assert "\n" not in str(err.value) and str(err.value).startswith("policy.megatron_cfg.")


def test_expert_parallel_must_divide_a_pipeline_stage() -> None:
    from nrl_backend_megatron.model import ParallelLayout
    from nrl_backend_megatron.parallel import check_layout

    with pytest.raises(ConfigError, match="expert_model_parallel_size: 4 does not divide the 2 ranks"):
        check_layout(ParallelLayout(ep=4), 2, _arch("qwen3_moe"))


def test_nemo_rl_moe_keys_are_ignored_for_a_dense_model() -> None:
    """NeMo RL's base configs set the MoE keys for every model, dense ones included."""
    from nrl_backend_megatron.moe import check_moe_section, moe_config_kwargs

    section = _section(freeze_moe_router=True, moe_router_dtype="fp64", moe_token_dispatcher_type="alltoall",
                       moe_permute_fusion=True)
    check_moe_section(section, _arch("llama"), on_gpu=False)
    assert moe_config_kwargs(_arch("llama"), section, on_gpu=False) == {}


@pytest.mark.parametrize("on_gpu", [True, False])
def test_tensor_parallel_moe_needs_sequence_parallel(on_gpu: bool) -> None:
    from nrl_backend_megatron.moe import check_moe_section

    with pytest.raises(ConfigError, match="sequence_parallel: a mixture-of-experts model at tensor_model_parallel_size 2"):
        check_moe_section(_section(tensor_model_parallel_size=2), _arch("qwen3_moe"), on_gpu=on_gpu)
    check_moe_section(_section(tensor_model_parallel_size=2, sequence_parallel=True), _arch("qwen3_moe"), on_gpu=on_gpu)


def test_dispatcher_default_follows_the_machine() -> None:
    from nrl_backend_megatron.moe import token_dispatcher

    assert token_dispatcher(_section(), on_gpu=False) == "allgather"
    assert token_dispatcher(_section(), on_gpu=True) == "alltoall"
    assert token_dispatcher(_section(moe_token_dispatcher_type="alltoall"), on_gpu=True) == "alltoall"


# ------------------------------------------------------------------ one rank: HF parity and the keys
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "qwen3_moe_sparse2"])
def test_megatron_logits_equal_hf(w1: dict[str, Any], name: str) -> None:
    ours = w1["logits"] if name == "qwen3_moe" else w1[f"{name}/logits"]
    assert max_gap(ours, hf_logits(moe_paths()[name])) < 1e-4


@pytest.mark.slow
def test_model_shape_comes_from_the_hf_config(w1: dict[str, Any]) -> None:
    assert w1["tconfig"] == {"num_moe_experts": 8, "moe_router_topk": 2, "moe_router_pre_softmax": False,
                             "moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "none",
                             "moe_aux_loss_coeff": 0.0, "moe_router_dtype": None, "moe_grouped_gemm": False}


@pytest.mark.slow
def test_router_topk_key_takes_effect(w1: dict[str, Any]) -> None:
    """moe_router_topk: 4 computes what HF computes with num_experts_per_tok=4, not the top-2 model."""
    path = moe_paths()["qwen3_moe"]
    assert max_gap(w1["top4/logits"], hf_logits(path, num_experts_per_tok=4)) < 1e-4
    assert max_gap(w1["top4/logits"], w1["logits"]) > 1e-2


@pytest.mark.slow
def test_router_keys_take_effect(w1: dict[str, Any]) -> None:
    keys, base = w1["keys/metrics"], w1["metrics"][0]
    assert w1["keys/tconfig"] == {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.1,
                                  "moe_router_dtype": "fp64"}
    assert float((w1["keys/logprobs"] - w1["logprobs"]).abs().max()) < 1e-5  # fp64 routing: same model
    assert keys["loss"] == pytest.approx(base["loss"], abs=1e-5)  # the aux loss is not the policy loss...
    assert abs(keys["grad_norm"] - base["grad_norm"]) > 1e-4  # ...but it adds to the gradient
    # Megatron's own load-balancing loss, per MoE layer and averaged
    assert keys["moe/load_balancing_loss"] == pytest.approx(
        (keys["moe/load_balancing_loss_layer_0"] + keys["moe/load_balancing_loss_layer_1"]) / 2)
    assert 1.0 <= keys["moe/load_balancing_loss"] <= 4.0  # 1 balanced, E/k = 4 collapsed
    assert "moe/load_balancing_loss" not in base
    # freeze_moe_router: the routers did not move, everything else did
    for name, before in w1["initial"].items():
        changed = not torch.equal(before, w1["keys/after"][name])
        assert changed is (not name.endswith("mlp.gate.weight")), name


@pytest.mark.slow
def test_router_balance_metrics_are_logged(w1: dict[str, Any]) -> None:
    m = w1["metrics"][0]
    assert 1.0 <= m["moe/load_balance"] <= 4.0
    assert m["moe/expert_load_min"] <= 1.0 <= m["moe/expert_load_max"] <= 4.0


# ------------------------------------------------------------------ two ranks: expert parallel 2
@pytest.mark.slow
def test_expert_parallel_2_equals_1(w1: dict[str, Any], w2: list[dict[str, Any]]) -> None:
    assert [r["local_experts"] for r in w2] == [["0", "1", "2", "3"]] * 2  # 4 of 8 experts each, locally named
    for r in w2:
        assert float((r["logprobs"] - w1["logprobs"]).abs().max()) < 1e-5
        for ours, ref in zip(r["metrics"], w1["metrics"]):
            for key in ("loss", "grad_norm", "moe/load_balance", "moe/expert_load_max", "moe/expert_load_min"):
                assert ours[key] == pytest.approx(ref[key], abs=1e-5), key


def _same_as_files(exported: dict[str, torch.Tensor], name: str) -> bool:
    from safetensors.torch import load_file

    hf = load_file(str(Path(moe_paths()[name]) / "model.safetensors"))
    return exported.keys() == hf.keys() and all(torch.equal(exported[k], hf[k]) for k in hf)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe_sparse2"])
def test_export_is_the_hf_checkpoint(w1: dict[str, Any], name: str) -> None:
    """Shared expert and its gate, mixed dense and MoE layers: back to the HF files, bit for bit."""
    assert _same_as_files(w1[f"{name}/export"], name)


@pytest.mark.slow
def test_expert_parallel_export_is_the_hf_checkpoint(w2: list[dict[str, Any]]) -> None:
    """Experts gathered over the expert-parallel ranks come back as the HF files' tensors, bit for bit."""
    assert all(_same_as_files(r["export"], "qwen3_moe") for r in w2)
    assert [n for n, _ in w2[0]["manifest"]] == list(w2[0]["export"])


@pytest.mark.slow
def test_buckets_carry_many_experts(w2: list[dict[str, Any]]) -> None:
    """64 KiB buckets of 8 KiB expert tensors: every expert once, several per bucket, few buckets."""
    buckets = w2[0]["buckets"]
    names = [n for b in buckets for n in b]
    experts = [n for n in names if ".mlp.experts." in n]
    assert len(experts) == len(set(experts)) == 2 * 8 * 3
    per_bucket = [sum(".mlp.experts." in n for n in b) for b in buckets]
    assert max(per_bucket) >= 6 and len(buckets) < len(experts) / 4


@pytest.mark.slow
def test_expert_parallel_export_gathers_a_layer_per_projection(w2: list[dict[str, Any]]) -> None:
    """48 expert tensors live on two ranks; gathering them takes one all-gather per MoE layer and
    projection (fc1, fc2), each carrying every local expert, not one transfer per expert."""
    assert [r["export_gathers"] for r in w2] == [2 * 2, 2 * 2]


@pytest.mark.slow
def test_tensor_and_sequence_parallel_experts_equal_data_parallel(w2: list[dict[str, Any]]) -> None:
    """Tensor parallel 2 with sequence parallelism, as Megatron-Core runs a mixture of experts
    under tensor parallelism, without Transformer Engine, and expert parallel 2: the same
    logprobs, steps and router statistics as data parallel on the same model (two key/value heads
    to split)."""
    for r in w2:
        assert float((r["tp2sp_ep2/logprobs"] - r["kv2/logprobs"]).abs().max()) < 1e-5
        for ours, ref in zip(r["tp2sp_ep2/metrics"], r["kv2/metrics"]):
            for key in ("loss", "grad_norm", "moe/load_balance", "moe/expert_load_max", "moe/expert_load_min"):
                assert ours[key] == pytest.approx(ref[key], abs=1e-4), key


@pytest.mark.slow
def test_checkpoint_saved_at_ep2_resumes_at_ep1(w2: list[dict[str, Any]]) -> None:
    for r in w2:
        assert float((r["ep1/logprobs"] - r["saved/logprobs"]).abs().max()) < 1e-5
        assert r["ep1/next_loss"] == pytest.approx(r["saved/next_loss"], abs=1e-5)  # optimizer state came too


def test_grouped_gemm_is_accepted_and_experts_still_run_one_by_one() -> None:
    """NeMo RL's MoE recipes set moe_grouped_gemm (its default is true): the key validates as an
    inert one (named in the inert-keys warning) and the experts stay SequentialMLP."""
    from nrl_backend_megatron.moe import moe_config_kwargs
    from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA

    section = _section(moe_grouped_gemm=True)
    assert MEGATRON_CFG_SCHEMA.fields["moe_grouped_gemm"].inert
    assert moe_config_kwargs(_arch("qwen3_moe"), section, on_gpu=True)["moe_grouped_gemm"] is False
