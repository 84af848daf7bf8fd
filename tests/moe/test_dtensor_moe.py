"""The DTensor backend on the tiny Qwen3-MoE: FSDP2 over two ranks trains transformers' own MoE and
agrees with HF and with the Megatron backend on the same batch; refit weights leave in the
checkpoint's per-expert layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import moe_scenarios
import pytest
import torch
from _helpers import make_batch, run_world
from moe_scenarios import moe_paths

from nrl_core.errors import ConfigError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fsdp2() -> list[dict[str, Any]]:
    return run_world(moe_scenarios.dtensor_world2, 2, moe_paths()["qwen3_moe"])


def test_fsdp2_logprobs_equal_hf(fsdp2: list[dict[str, Any]]) -> None:
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(moe_paths()["qwen3_moe"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1), lp], 1)
    lp = lp * (torch.arange(lp.shape[1])[None] < batch.input_lengths[:, None])
    for r in fsdp2:
        assert float((r["logprobs"] - lp).abs().max()) < 1e-5


def test_loss_and_router_metrics_equal_megatron_on_the_same_batch(fsdp2: list[dict[str, Any]],
                                                                  megatron_w1: dict[str, Any]) -> None:
    """First step (same weights, same batch): the loss, the gradient norm and the routers' balance."""
    ref = megatron_w1["metrics"][0]
    for r in fsdp2:
        ours = r["metrics"][0]
        assert ours["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-4)
        for key in ("moe/load_balance", "moe/expert_load_max", "moe/expert_load_min"):
            assert ours[key] == pytest.approx(ref[key], abs=1e-6), key
        assert r["metrics"][1]["loss"] < ours["loss"]


def test_refit_export_is_the_checkpoint_layout(fsdp2: list[dict[str, Any]]) -> None:
    """transformers fuses a layer's experts into one 3-D tensor in memory; the export and its
    manifest hold the files' one tensor per expert and projection, bit for bit."""
    from safetensors.torch import load_file

    hf = load_file(str(Path(moe_paths()["qwen3_moe"]) / "model.safetensors"))
    for r in fsdp2:
        assert r["export"].keys() == hf.keys() and all(torch.equal(r["export"][k], hf[k]) for k in hf)
        assert [n for n, _ in r["manifest"]] == list(r["export"])
        assert all(tuple(shape) == tuple(r["export"][n].shape) for n, shape in r["manifest"])


def test_tensor_parallel_moe_is_a_one_line_error() -> None:
    from nrl_backend_dtensor.moe import check_tensor_parallel
    from nrl_core.testing.tiny_models import model_config

    with pytest.raises(ConfigError, match="tensor_parallel_size: 2 is not supported for a mixture-of-experts") as err:
        check_tensor_parallel(model_config("qwen3_moe"), 2)
    assert "\n" not in str(err.value)
    check_tensor_parallel(model_config("qwen3"), 2)  # dense models keep tensor parallelism
