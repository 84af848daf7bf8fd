"""The DTensor backend on the newer tiny families (gpt-oss, Gemma 4, Nemotron-H): attention sinks
in packed rows, buffers the checkpoint holds in what refit sends, and packing refused where Mamba
layers would carry state from one sequence into the next."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nrl_core.errors import ConfigError
from nrl_core.testing.tiny_models import cached_tiny_model


def test_packed_rows_of_a_model_with_attention_sinks_equal_each_sequence_alone() -> None:
    """gpt-oss's sink logit takes a share of every softmax; transformers' own eager attention on
    each sequence alone is the reference, past the sliding window too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nrl_backend_dtensor.packed_attention import SINK_NAME, register

    path = cached_tiny_model("gpt_oss", "small")
    config = AutoConfig.from_pretrained(path)
    assert register(config) == SINK_NAME
    packed = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register(config))
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(4, 500, (n,), generator=generator) for n in (23, 9))  # 23 crosses the window
    row = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(23), torch.arange(9)])[None]
    with torch.no_grad():
        got = packed(input_ids=row, position_ids=positions).logits[0]
        want = torch.cat([eager(input_ids=first[None]).logits[0], eager(input_ids=second[None]).logits[0]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma4", "gpt_oss", "nemotron_h", "nemotron_h_moe", "deepseek_v3",
                                    "glm4_moe_lite"])
def test_refit_sends_exactly_the_tensors_the_checkpoint_holds(family: str) -> None:
    """Gemma 4's ``layer_scalar`` is a buffer, not a parameter; an engine that never got it would
    keep its placeholder."""
    from transformers import AutoModelForCausalLM

    from nrl_backend_dtensor.weights import export_buckets, manifest

    path = cached_tiny_model(family, "small")
    model = AutoModelForCausalLM.from_pretrained(path)
    checkpoint = load_file(str(path / "model.safetensors"))
    assert {spec.name for spec in manifest(model, "float32")} == set(checkpoint)
    sent = {name: tensor for bucket in export_buckets(model, 1 << 20, "float32") for name, tensor in bucket}
    assert set(sent) == set(checkpoint)
    assert all(torch.equal(sent[name], checkpoint[name]) for name in checkpoint)


def test_packing_a_model_with_mamba_layers_is_refused_in_one_line() -> None:
    from transformers import AutoConfig

    from nrl_backend_dtensor.checks import check_packing

    hybrid = AutoConfig.from_pretrained(cached_tiny_model("nemotron_h", "small"))
    with pytest.raises(ConfigError, match=r"^policy\.sequence_packing\.enabled: a nemotron_h model has Mamba or "
                                          r"linear-attention layers, .*; set it to false$"):
        check_packing({"sequence_packing": {"enabled": True}}, hybrid)
    check_packing({"sequence_packing": {"enabled": False}}, hybrid)
    check_packing({"sequence_packing": {"enabled": True}}, AutoConfig.from_pretrained(cached_tiny_model("gpt_oss")))


def test_a_checkpoint_records_parameters_and_refit_also_sends_buffers() -> None:
    """A checkpoint's architecture record lists parameters only, as earlier releases wrote it, so
    their checkpoints of a model with buffers (Nemotron 3's routing bias) still resume."""
    from common import make_config

    from nrl_backend_dtensor.worker import DTensorPolicyWorker

    worker = DTensorPolicyWorker(make_config("nemotron_h_moe"), 0, 1)
    sent = {spec.name for spec in worker.weight_manifest("float32")}
    recorded = set(worker.checkpoint_io.state.param_shapes)
    assert sent - recorded == {name for name in sent if name.endswith("gate.e_score_correction_bias")} != set()
    assert recorded < sent


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "qwen2_moe"])
def test_the_older_families_send_no_buffers(family: str) -> None:
    """Their buffers (rotary tables, Gemma 3's embedding scale) are derived, not checkpointed: a
    refit of them sends what it sent before buffers travelled."""
    from transformers import AutoModelForCausalLM

    from nrl_backend_dtensor.weights import buffer_names

    assert buffer_names(AutoModelForCausalLM.from_pretrained(cached_tiny_model(family))) == set()
