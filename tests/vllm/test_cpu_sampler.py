"""vLLM's sampled-token ranks counted eagerly on CPU (nrl_gen_vllm/cpu_sampler.py)."""

from __future__ import annotations

import torch

from nrl_gen_vllm.cpu_sampler import count_at_least


def test_count_matches_the_definition_in_and_across_chunks() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 50, generator=g)
    values = x.gather(-1, torch.randint(0, 50, (37, 1), generator=g))
    expected = (x >= values).sum(-1)
    whole, chunked = count_at_least(x, values), count_at_least(x, values, chunk_elements=3 * 50)
    assert torch.equal(whole, expected) and torch.equal(chunked, expected) and chunked.dtype == torch.int64
    assert int(expected.min()) >= 1  # each row's own value counts


def test_a_cpu_engine_samples_through_it(engine, prompts) -> None:
    from vllm.v1.sample import sampler

    assert sampler.batched_count_greater_than is count_at_least  # the worker set it at start
    out = engine.generate(prompts)
    assert all(len(lp) == len(ids) > 0 for lp, ids in zip(out.logprobs, out.token_ids))
