"""The DTensor worker at one data-parallel rank: without ``fully_shard`` (the default there) vs wrapped.

Run:  OMP_NUM_THREADS=2 python benchmarks/bench_dtensor_one_rank_fsdp.py [--pairs 6]

Why: at one rank FSDP2 shards nothing, yet before every layer's forward and backward it copies the
layer's parameters into a gathered buffer and afterwards copies the gradients out;
``nrl_backend_dtensor.parallel.fsdp_needed`` leaves it out there (float32, no CPU offload). This
measures what that saves on the GRPO benchmark's training work (bench_grpo_vs_trl.py): the
25.7M-parameter ``bench`` model, 32 sequences of 70-94 tokens packed into 1024-token training rows
and one 4096-token logprob row, the clipped loss with a KL penalty. Both workers live in this
process and alternate, a pair of ``train`` + ``get_logprobs`` calls each, so the machine's drift
hits both; the figure is the ratio of medians and the count of pairs each side won. The test
``tests/dtensor/test_worker.py::test_one_rank_in_float32_skips_fsdp_and_trains_bit_identically``
shows the two compute the same numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def bench_batch(size: int = 32) -> object:
    from nrl_core.contracts import TokenBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(70, 95, (size,), generator=g)
    width, prompt = int(lengths.max()), 20
    position = torch.arange(width)[None]
    mask = ((position >= prompt) & (position < lengths[:, None])).float()
    fields = {"token_mask": mask, "advantages": torch.randn(size, 1, generator=g) * mask,
              "sample_mask": torch.ones(size), "generation_logprobs": torch.zeros(size, width),
              "reference_logprobs": -torch.rand(size, width, generator=g)}
    return TokenBatch(input_ids=torch.randint(4, 500, (size, width), generator=g), input_lengths=lengths,
                      fields=fields)


def worker_config(model_dir: str, batch_size: int) -> dict:
    return {"policy": {
        "model_name": model_dir, "precision": "float32", "seed": 42, "train_global_batch_size": batch_size,
        "train_micro_batch_size": batch_size, "logprob_batch_size": batch_size, "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-4}}, "scheduler": None,
        "sequence_packing": {"enabled": True, "train_mb_tokens": 1024, "logprob_mb_tokens": 4096,
                             "algorithm": "modified_first_fit_decreasing", "sequence_length_round": 1},
        "dtensor_config": {"enabled": True}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args()

    from nrl_backend_dtensor import parallel
    from nrl_backend_dtensor.worker import DTensorPolicyWorker
    from nrl_core.algorithms.loss import ClippedPGLoss
    from nrl_core.testing.tiny_models import cached_tiny_model

    batch = bench_batch()
    config = worker_config(str(cached_tiny_model("llama", size="bench")), batch.size)
    loss = ClippedPGLoss(reference_policy_kl_penalty=0.01, force_on_policy_ratio=True)
    plain = DTensorPolicyWorker(config, 0, 1)
    real_check = parallel.fsdp_needed
    parallel.fsdp_needed = lambda *a, **k: True
    try:
        wrapped = DTensorPolicyWorker(config, 0, 1)
    finally:
        parallel.fsdp_needed = real_check
    assert not plain.fsdp and wrapped.fsdp

    times: dict[str, list[float]] = {"plain/train": [], "fsdp/train": [], "plain/logprobs": [], "fsdp/logprobs": []}
    for worker in (plain, wrapped):  # warm-up: the optimizer state and the allocator's pools
        worker.train(batch, loss)
    for _ in range(args.pairs):
        for name, worker in (("fsdp", wrapped), ("plain", plain)):
            start = time.perf_counter()
            worker.train(batch, loss)
            times[f"{name}/train"].append(time.perf_counter() - start)
            start = time.perf_counter()
            worker.get_logprobs(batch)
            times[f"{name}/logprobs"].append(time.perf_counter() - start)

    print(f"bench model, {int(batch.input_lengths.sum())} tokens, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, {args.pairs} pairs")
    for phase in ("train", "logprobs"):
        fsdp, own = times[f"fsdp/{phase}"], times[f"plain/{phase}"]
        wins = sum(a < b for a, b in zip(own, fsdp))
        print(f"{phase:9s} without FSDP {statistics.median(own):.3f} s, wrapped {statistics.median(fsdp):.3f} s: "
              f"{statistics.median(own) / statistics.median(fsdp):.3f}x, faster in {wins}/{args.pairs} pairs")


if __name__ == "__main__":
    main()
