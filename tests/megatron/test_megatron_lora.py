"""LoRA on the Megatron worker: only the adapters train and hold optimizer state; the reference
policy is the base model; the adapters start the same at any layout, so TP=2, PP=2 and DP=2 train
as one rank does; the exported weights are the base with ``alpha/r * B @ A`` merged in, which a plain HF
model of them reproduces; checkpoints hold the adapters only and resume exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
pytest.importorskip("nrl_backend_megatron")

from _helpers import make_batch, make_config, run_world

from nrl_core.testing.distributed import gather_shards
from nrl_core.testing.tiny_models import cached_tiny_model

PEFT = {"enabled": True, "dim": 4, "alpha": 8}


def config(path: str, **megatron: Any) -> dict:
    return make_config(path, megatron={"peft": PEFT, **megatron})


def trained(rank: int, world: int, path: str, ckpt: str, layouts: list[str]) -> dict[str, Any]:
    from nrl_backend_megatron.worker import MegatronPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import CheckpointOptions

    batch, out = make_batch(), {}
    shapes = {"tp1": {}, "dp2": {}, "tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2},
              "tp2sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True}}
    for layout in layouts:
        w = MegatronPolicyWorker(config(path, **shapes[layout]), rank, world)
        base = {n: p.detach().clone() for n, p in w.model.named_parameters() if not n.startswith("lora.")}
        start = gather_shards(w.get_logprobs(batch), batch)
        out[f"{layout}/trainable"] = sorted(n for n, p in w.model.named_parameters() if p.requires_grad)
        out[f"{layout}/losses"] = [w.train(batch, NLLLoss())["loss"] for _ in range(3)]
        out[f"{layout}/base_unchanged"] = all(torch.equal(p, base[n]) for n, p in w.model.named_parameters()
                                              if not n.startswith("lora."))
        out[f"{layout}/reference_is_base"] = torch.equal(gather_shards(w.get_reference_logprobs(batch), batch), start)
        out[f"{layout}/logprobs"] = gather_shards(w.get_logprobs(batch), batch)
        out[f"{layout}/export"] = {n: t.clone() for bucket in w.export_weights(1 << 20, "float32") for n, t in bucket}
        w.export_hf(str(Path(ckpt).parent / f"adapter-{layout}"))
        out[f"{layout}/optimizer_tensors"] = sum(1 for leaf in [w.opt.optimizer] for g in leaf.param_groups
                                                 for _ in g["params"])
        if layout != "pp2":
            saved = str(Path(ckpt) / layout)
            options = CheckpointOptions(fully_parallel_save=True, fully_parallel_load=True, async_save=False,
                                        load_rng=True)
            w.save_checkpoint(saved, options)
            expected = [w.train(batch, NLLLoss())["loss"] for _ in range(2)]
            again = MegatronPolicyWorker(config(path, **shapes[layout]), rank, world)
            again.load_checkpoint(saved, options)
            out[f"{layout}/resumed"] = ([again.train(batch, NLLLoss())["loss"] for _ in range(2)], expected)
        del w
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
    path = str(cached_tiny_model("llama"))
    root = tmp_path_factory.mktemp("megatron-lora")
    (one,) = run_world(trained, 1, path, str(root / "one"), ["tp1"])
    two = run_world(trained, 2, path, str(root / "two"), ["pp2", "tp2", "tp2sp", "dp2"])
    return one, two, root


@pytest.mark.slow
def test_only_the_adapters_train_and_the_reference_is_the_base(runs) -> None:
    one, two, _ = runs
    for result, layouts in ((one, ["tp1"]), *((rank, ["tp2", "tp2sp", "pp2", "dp2"]) for rank in two)):
        for layout in layouts:
            trainable = result[f"{layout}/trainable"]
            assert trainable and all(n.startswith("lora.") for n in trainable)
            assert result[f"{layout}/base_unchanged"] and result[f"{layout}/reference_is_base"]
            assert result[f"{layout}/losses"][2] < result[f"{layout}/losses"][0]
    assert len(one["tp1/trainable"]) == 2 * 4 * 2  # A and B of qkv, proj, fc1, fc2 in each of 2 layers
    assert one["tp1/optimizer_tensors"] == len(one["tp1/trainable"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2", "dp2"])
def test_lora_trains_the_same_at_tp2_pp2_and_dp2_as_at_tp1(runs, layout: str) -> None:
    one, two, _ = runs
    for rank in two:
        assert max(abs(a - b) for a, b in zip(rank[f"{layout}/losses"], one["tp1/losses"])) < 1e-5
        assert (rank[f"{layout}/logprobs"] - one["tp1/logprobs"]).abs().max() < 1e-5
        assert rank[f"{layout}/export"].keys() == one["tp1/export"].keys()
        assert max((rank[f"{layout}/export"][k] - v).abs().max().item() for k, v in one["tp1/export"].items()) < 1e-5


@pytest.mark.slow
def test_the_export_is_the_merged_model(runs) -> None:
    """A plain HF model of the exported weights computes the worker's logprobs, and those weights
    are not the base's: the adapters are in them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nrl_core.api import hf_logprobs

    one, _, _ = runs
    path = cached_tiny_model("llama")
    base = load_file(str(path / "model.safetensors"))
    exported = one["tp1/export"]
    changed = sorted(k for k in base if not torch.equal(base[k], exported[k]))
    assert any("q_proj" in k for k in changed) and any("down_proj" in k for k in changed)
    assert not any("norm" in k or "embed" in k for k in changed)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.load_state_dict(exported)
    batch = make_batch()
    assert (hf_logprobs(model.eval(), batch, 1.0) - one["tp1/logprobs"]).abs().max() < 1e-5


@pytest.mark.slow
def test_checkpoints_hold_the_adapters_only_and_resume_exactly(runs) -> None:
    one, two, root = runs
    for result, layouts in ((one, ["tp1"]), *((rank, ["tp2", "dp2"]) for rank in two)):
        for layout in layouts:
            resumed, expected = result[f"{layout}/resumed"]
            assert resumed == expected, layout
    from torch.distributed.checkpoint import FileSystemReader

    for saved in ("one/tp1", "two/tp2", "two/dp2"):
        keys = list(FileSystemReader(str(root / saved)).read_metadata().state_dict_metadata)
        model_keys = [k for k in keys if not k.startswith(("optimizer", "rng"))]
        assert model_keys and all(k.startswith("lora.") for k in model_keys), model_keys[:5]
        assert any(".linear_qkv.A" in k for k in model_keys) and any(".linear_fc2.B" in k for k in model_keys)
        assert not any("embedding" in k or "layernorm" in k for k in keys)  # not even their optimizer state


def test_bad_peft_sections_are_one_line() -> None:
    from nrl_backend_megatron.lora import check_section
    from nrl_core.errors import ConfigError

    with pytest.raises(ConfigError, match="'q_proj' is not a Megatron linear layer name"):
        check_section({"target_modules": ["q_proj"]}, transformer_engine=False)
    with pytest.raises(ConfigError, match="Transformer Engine"):
        check_section({}, transformer_engine=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "dp2"])
def test_the_exported_peft_adapter_gives_the_trained_models_logprobs(runs, layout: str) -> None:
    """The fused qkv and gate/up adapters, written as PEFT adapters on q/k/v and gate/up, load with
    PEFT onto the base and reproduce the trained worker."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nrl_core.api import hf_logprobs

    one, two, root = runs
    adapter = root / f"adapter-{layout}"
    config = (adapter / "adapter_config.json").read_text()
    assert all(name in config for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    base = AutoModelForCausalLM.from_pretrained(str(cached_tiny_model("llama")), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ours = one["tp1/logprobs"] if layout == "tp1" else two[0][f"{layout}/logprobs"]
    assert (hf_logprobs(model, make_batch(), 1.0) - ours).abs().max() < 1e-5
