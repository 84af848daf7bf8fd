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


def test_every_vllm_worker_process_counts_eagerly() -> None:
    """vLLM imports the worker extension in each process its workers run in (the async engine's
    core process is spawned, so nothing the nrl worker set in its own process reaches it)."""
    import subprocess
    import sys

    child = ("import nrl_gen_vllm.extension\n"
             "from vllm.v1.sample import sampler\n"
             "from nrl_gen_vllm.cpu_sampler import count_at_least\n"
             "print('eager', sampler.batched_count_greater_than is count_at_least)\n")
    proc = subprocess.run([sys.executable, "-c", child], check=True, capture_output=True, text=True)
    assert proc.stdout.split() == ["eager", "True"], proc.stdout
    assert "leaked" not in proc.stderr  # vLLM loads triton, a nanobind module: the heap is not frozen at exit
