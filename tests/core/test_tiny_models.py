"""Tiny models: each family loads as a causal LM with the local tokenizer, deterministic for a seed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nrl_core.testing.tiny_models import build_tiny_model, cached_tiny_model


@pytest.mark.parametrize("family, model_type", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
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
