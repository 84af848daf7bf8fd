"""LoRA against full fine-tuning on the DTensor backend, the same model in the same process.

The bench Llama (25.7M parameters) at world size 1, float32, AdamW: one worker trains full
weights, one trains rank-``--rank`` adapters on every linear layer. For each it reports the
trainable parameters, the optimizer's state (bytes of every tensor it holds), the median time of a
training step on the same batch (the two take turns, so both see the same machine), and the bytes
a refit sends (the exported weights; LoRA sends the base with the adapters merged in, so the same
bytes) next to the bytes an adapter-only refit sends (``policy.refit.adapters``: ``export_adapter``).

    python benchmarks/bench_lora.py [--rank 8] [--steps 6] [--batch 16] [--seq 128]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def config(model: str, lora: dict[str, Any] | None) -> dict[str, Any]:
    from nrl_backend_dtensor.schema import DTENSOR_CONFIG_SCHEMA

    section = DTENSOR_CONFIG_SCHEMA.validate({"enabled": True, "lora_cfg": lora or {}}, "policy.dtensor_config")
    return {"policy": {
        "model_name": model, "seed": 0, "precision": "float32", "train_global_batch_size": 16,
        "train_micro_batch_size": 16, "logprob_batch_size": 16, "max_total_sequence_length": 256,
        "max_grad_norm": 1.0, "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4, "foreach": False}},
        "scheduler": None, "logprob_chunk_size": None, "sequence_packing": {"enabled": False},
        "dynamic_batching": {"enabled": False}, "hf_config_overrides": None, "dtensor_config": section}}


def batch(rows: int, seq: int) -> Any:
    from nrl_core.contracts import TokenBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (rows, seq), generator=g)
    mask = torch.ones(rows, seq)
    mask[:, 0] = 0
    return TokenBatch(input_ids=ids, input_lengths=torch.full((rows,), seq), fields={"token_mask": mask})


def optimizer_bytes(worker: Any) -> int:
    return sum(t.numel() * t.element_size() for state in worker.optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from nrl_backend_dtensor.worker import DTensorPolicyWorker
    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = str(cached_tiny_model("llama", size="bench"))
    workers = {"full": DTensorPolicyWorker(config(model, None), 0, 1),
               "lora": DTensorPolicyWorker(config(model, {"enabled": True, "dim": args.rank, "alpha": 2 * args.rank}),
                                           0, 1)}
    data = batch(args.batch, args.seq)
    times: dict[str, list[float]] = {name: [] for name in workers}
    for step in range(args.steps + 1):
        for name, worker in workers.items():  # in turns: both see the same machine
            start = time.perf_counter()
            worker.train(data, NLLLoss())
            if step:  # the first step warms up
                times[name].append(time.perf_counter() - start)
    rows = {}
    for name, worker in workers.items():
        params = sum(p.numel() for p in worker.model.parameters() if p.requires_grad)
        refit = sum(t.numel() * t.element_size() for bucket in worker.export_weights(1 << 26, "float32")
                    for _, t in bucket)
        adapters = 0 if worker.lora is None else sum(  # what policy.refit.adapters sends
            t.numel() * t.element_size() for bucket in worker.export_adapter(1 << 26, "float32") for _, t in bucket)
        rows[name] = {"trainable_params": params, "optimizer_state_bytes": optimizer_bytes(worker),
                      "step_seconds_median": statistics.median(times[name]), "refit_bytes": refit,
                      "adapter_bytes": adapters}
    full, lora = rows["full"], rows["lora"]
    print(f"{'':<26}{'full':>14}{'lora r=' + str(args.rank):>14}{'lora/full':>12}")
    for key in ("trainable_params", "optimizer_state_bytes", "step_seconds_median", "refit_bytes", "adapter_bytes"):
        ratio = lora[key] / full[key] if full[key] else float("nan")
        fmt = "{:>14.3f}" if isinstance(full[key], float) else "{:>14,}"
        print(f"{key:<26}{fmt.format(full[key])}{fmt.format(lora[key])}{ratio:>12.3f}")
    print(json.dumps({"rank": args.rank, "batch": args.batch, "seq": args.seq, **{f"{n}_{k}": v for n, r in rows.items()
                                                                                for k, v in r.items()}}))


if __name__ == "__main__":
    main()
