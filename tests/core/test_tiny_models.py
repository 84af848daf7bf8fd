"""Tiny models: each family loads as a causal LM with the local tokenizer, deterministic for a seed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nrl_core.testing.tiny_models import build_tiny_model, cached_tiny_model


@pytest.mark.parametrize("family, model_type", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                               ("qwen3_moe", "qwen3_moe"), ("qwen2_moe", "qwen2_moe"),
                                               ("mistral", "mistral"), ("gemma3", "gemma3_text"),
                                               ("gemma4", "gemma4_text"), ("gpt_oss", "gpt_oss"),
                                               ("nemotron_h", "nemotron_h"), ("nemotron_h_moe", "nemotron_h"),
                                               ("deepseek_v3", "deepseek_v3"), ("glm4_moe_lite", "glm4_moe_lite")])
def test_family_loads_and_generates(family, model_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cached_tiny_model(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == model_type and model.config.vocab_size == len(tokenizer) == 512
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, pad_token_id=3)
    assert out.shape[1] > len(ids)


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = load_file(str(build_tiny_model(tmp_path / "a", "qwen2", seed=3) / "model.safetensors"))
    b = load_file(str(build_tiny_model(tmp_path / "b", "qwen2", seed=3) / "model.safetensors"))
    c = load_file(str(build_tiny_model(tmp_path / "c", "qwen2", seed=4) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_cache_returns_the_same_directory():
    assert cached_tiny_model("llama", seed=7) == cached_tiny_model("llama", seed=7)


@pytest.mark.parametrize("family, shared", [("qwen3_moe", False), ("qwen2_moe", True)])
def test_moe_checkpoint_stores_every_expert_by_name(family, shared):
    """The files hold one tensor per expert and projection (the layout vLLM and real checkpoints
    use), although transformers fuses the experts in memory."""
    from transformers import AutoConfig

    path = cached_tiny_model(family)
    cfg = AutoConfig.from_pretrained(path)
    keys = load_file(str(path / "model.safetensors")).keys()
    for layer in range(cfg.num_hidden_layers):
        experts = {k for k in keys if k.startswith(f"model.layers.{layer}.mlp.experts.")}
        assert experts == {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for e in range(cfg.num_experts)
                           for p in ("gate", "up", "down")}
        assert f"model.layers.{layer}.mlp.gate.weight" in keys
        assert (f"model.layers.{layer}.mlp.shared_expert_gate.weight" in keys) is shared
    head_dim = cfg.head_dim if family == "qwen3_moe" else cfg.hidden_size // cfg.num_attention_heads
    assert head_dim == 32  # vLLM's CPU attention refuses 16


def test_cli_writes_a_moe_model(tmp_path, capsys):
    import json

    from nrl_core.cli import main

    assert main(["tiny-model", str(tmp_path / "m"), "--family", "qwen2_moe", "--size", "tiny"]) == 0
    assert "qwen2_moe" in capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["num_experts"] == 8 and config["num_experts_per_tok"] == 2


def test_the_cli_writes_a_shallower_model_with_the_same_tokenizer(tmp_path):
    """``--layers``: a distillation student of the demo model's width and tokenizer, fewer layers."""
    import json

    from nrl_core.cli import main

    assert main(["tiny-model", str(tmp_path / "full"), "--size", "small"]) == 0
    assert main(["tiny-model", str(tmp_path / "half"), "--size", "small", "--seed", "1", "--layers", "2"]) == 0
    full = json.loads((tmp_path / "full" / "config.json").read_text())
    half = json.loads((tmp_path / "half" / "config.json").read_text())
    assert half["num_hidden_layers"] == 2 < full["num_hidden_layers"]
    assert half["hidden_size"] == full["hidden_size"] and half["vocab_size"] == full["vocab_size"]
    assert (tmp_path / "half" / "tokenizer.json").read_text() == (tmp_path / "full" / "tokenizer.json").read_text()


@pytest.mark.parametrize("family, blocks", [("nemotron_h", ["mamba", "attention", "mamba", "mlp"]),
                                            ("nemotron_h_moe", ["mamba", "attention", "mamba", "moe"])])
def test_a_nemotron_h_twin_model_has_every_block_kind_of_its_hub_models(family, blocks):
    """Nano 2's hybrid has Mamba-2, attention and MLP blocks; Nemotron 3 has experts for MLPs."""
    from transformers import AutoConfig

    from nrl_core.config.model_config import has_recurrent_layers

    cfg = AutoConfig.from_pretrained(cached_tiny_model(family, "small"))
    kinds = {"linear_attention": "mamba", "full_attention": "attention"}
    assert [kinds.get(kind, kind) for kind in cfg.layers_block_type] == blocks
    assert has_recurrent_layers(cfg) and cfg.head_dim == 32


def test_the_newer_families_refuse_the_larger_sizes():
    from nrl_core.testing.tiny_models import model_config

    with pytest.raises(ValueError, match="family 'gpt_oss' comes in sizes tiny, small, not 'bench'"):
        model_config("gpt_oss", "bench")


def test_a_newer_family_refuses_another_depth():
    from nrl_core.testing.tiny_models import model_config

    with pytest.raises(ValueError, match="family 'nemotron_h' has a fixed layout of layer kinds"):
        model_config("nemotron_h", "small", num_hidden_layers=2)
