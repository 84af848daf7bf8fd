"""vLLM's CPU rotary kernel against its own PyTorch implementation, for the layouts models call it
with: 2-D rows (the kernel's), and 3-D heads, contiguous or views of a wider tensor as multi-head
latent attention passes them (nrl's repair, ``nrl_gen_vllm/cpu_rope.py``)."""

from __future__ import annotations

import pytest
import torch

from nrl_gen_vllm.cpu_rope import rotate_three_dimensional_inputs_natively


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    assert rotate_three_dimensional_inputs_natively()
    with set_current_vllm_config(VllmConfig()):
        yield lambda neox: get_rope(64, max_position=64, is_neox_style=neox, dtype=torch.float32,
                                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


@pytest.mark.parametrize("neox", [False, True])
def test_three_dimensional_and_strided_heads_rotate_as_vllms_reference(rope, neox: bool) -> None:
    torch.manual_seed(0)
    embedding = rope(neox)
    positions = torch.arange(8)
    wide = torch.randn(8, 2, 96)
    latent = torch.randn(8, 576)
    nope, compressed = wide[..., :32].clone(), latent[:, :512].clone()
    cases = {
        "3-D heads": (torch.randn(8, 2, 64), torch.randn(8, 1, 64)),
        "MLA views": (wide[..., 32:], latent[:, 512:].unsqueeze(1)),  # the rotary part of q, k_pe
        "2-D rows": (torch.randn(8, 128), torch.randn(8, 64)),
    }
    for name, (query, key) in cases.items():
        want_query, want_key = embedding.forward_native(positions, query.clone(), key.clone())
        got_query, got_key = embedding.forward_cpu(positions, query, key)
        assert got_query is query and got_key is key, name  # in place, as the kernel
        torch.testing.assert_close(query, want_query, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(key, want_key, rtol=1e-6, atol=1e-6, msg=name)
    assert torch.equal(wide[..., :32], nope) and torch.equal(latent[:, :512], compressed)  # the rest untouched


def test_the_repair_installs_once() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    assert rotate_three_dimensional_inputs_natively()
    installed = RotaryEmbedding.forward_cpu
    assert rotate_three_dimensional_inputs_natively() and RotaryEmbedding.forward_cpu is installed
