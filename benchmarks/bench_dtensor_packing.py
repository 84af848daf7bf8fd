"""Packed vs padded training throughput of the dtensor backend, and its FLOP/s relative to torch.mm.

Run:  OMP_NUM_THREADS=2 python benchmarks/bench_dtensor_packing.py [--size small] [--steps 3]

One process (world size 1, gloo), a tiny random model, a batch of sequences with lengths spread
evenly over 16..512. "padded" uses fixed micro-batches of --micro-batch rows padded to their
longest; "packed" packs into rows of --mb-tokens tokens. Tokens/s counts real (unpadded) tokens.
Training FLOPs are estimated as 6 x parameters x real tokens plus the attention score/value
products (6 x layers x hidden x sum(len^2)) and compared with a plain ``torch.mm`` measured here.

Packed rows are attended segment by segment (nrl_backend_dtensor.packed_attention), so a
row's attention costs the sum of its sequences' squared lengths, not the row length squared; a
larger budget then means fewer, fuller micro-batches. Measured figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch


def _mm_flops(n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "bench"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--mb-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from nrl_backend_dtensor.worker import DTensorPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import TokenBatch
    from nrl_core.testing.tiny_models import cached_tiny_model

    model_dir = str(cached_tiny_model("llama", size=args.size))
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(16, 512, args.batch).round().long()[torch.randperm(args.batch, generator=g)]
    width = int(lengths.max())
    ids = torch.randint(4, 512, (args.batch, width), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    batch = TokenBatch(input_ids=ids, input_lengths=lengths, fields={"token_mask": mask})

    def config(packing: bool) -> dict:
        return {"policy": {
            "model_name": model_dir, "precision": "float32", "train_global_batch_size": args.batch,
            "train_micro_batch_size": args.micro_batch, "logprob_batch_size": args.micro_batch, "max_grad_norm": 1.0,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4}}, "scheduler": None,
            "sequence_packing": {"enabled": packing, "train_mb_tokens": args.mb_tokens,
                                 "logprob_mb_tokens": args.mb_tokens, "algorithm": "modified_first_fit_decreasing",
                                 "sequence_length_round": 8},
            "dtensor_config": {"enabled": True}}}

    rows = []
    real_tokens = int(lengths.sum())
    for name, packing in (("padded", False), ("packed", True)):
        worker = DTensorPolicyWorker(config(packing), 0, 1)
        worker.train(batch, NLLLoss())  # warm-up
        start = time.perf_counter()
        for _ in range(args.steps):
            worker.train(batch, NLLLoss())
        seconds = (time.perf_counter() - start) / args.steps
        cfg = worker.hf_config
        n_params = sum(p.numel() for p in worker.model.parameters())
        flops = 6 * n_params * real_tokens + 6 * cfg.num_hidden_layers * cfg.hidden_size * int((lengths**2).sum())
        rows.append((name, seconds, real_tokens / seconds, flops / seconds))
    mm = _mm_flops()
    print(f"model llama-{args.size}, batch {args.batch}, lengths 16..512 ({real_tokens} real tokens), "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'mode':8} {'s/step':>8} {'tokens/s':>10} {'GFLOP/s':>9} {'of mm':>6}")
    for name, seconds, tps, fps in rows:
        print(f"{name:8} {seconds:8.3f} {tps:10.0f} {fps / 1e9:9.2f} {fps / mm:6.1%}")
    print(f"torch.mm 1024^3: {mm / 1e9:.2f} GFLOP/s; packed/padded tokens/s: {rows[1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    main()
