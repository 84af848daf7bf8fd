"""What checkpoint checksums cost: hashing bytes/s against writing and reading the same bytes.

In one process, ``--files`` files of ``--mib`` MiB of float32 tensors each are written with
``torch.save`` and fsynced (the write itself), then hashed as the checkpoint manager does at
publication (``tree_digests``), verified as resume does (``verify_tree``) and read back with
``torch.load(weights_only=True)`` (the read itself), for each hash algorithm. Hashing and loading
read the freshly written files from the page cache, so these are upper bounds on read speed and
the ratios are the cost relative to the I/O nrl does anyway. Best of ``--repeats``.

    python benchmarks/bench_checkpoint_checksums.py [--mib 128] [--files 4] [--repeats 3] [--dir /tmp]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from nrl_core.checkpoint.checksums import HASHERS, tree_digests, verify_tree


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="size of each file")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="nrl_ckbench_", dir=args.dir))
    tensors = [torch.randn(args.mib << 18) for _ in range(args.files)]  # 4-byte floats: MiB * 2^18 each
    total = 0

    def write() -> None:
        for i, t in enumerate(tensors):
            path = root / f"shard_{i}.pt"
            torch.save({"weight": t}, path)
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())

    def read() -> None:
        for i in range(args.files):
            torch.load(root / f"shard_{i}.pt", weights_only=True)

    try:
        t_write = best_of(args.repeats, write)
        total = sum(p.stat().st_size for p in root.iterdir())
        t_read = best_of(args.repeats, read)
        rows = {"write (torch.save + fsync)": t_write, "read (torch.load)": t_read}
        result = {"bytes": total, "write_s": t_write, "read_s": t_read}
        for algorithm in HASHERS:
            recorded = tree_digests(root, algorithm)
            t_hash = best_of(args.repeats, lambda a=algorithm: tree_digests(root, a))
            t_verify = best_of(args.repeats, lambda a=algorithm, r=recorded: verify_tree(root, r, a))
            rows[f"{algorithm} at save"] = t_hash
            rows[f"{algorithm} at load"] = t_verify
            result[algorithm] = {"save_s": t_hash, "load_s": t_verify, "save_vs_write": t_hash / t_write,
                                 "load_vs_read": t_verify / t_read}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"{total / 2**20:.0f} MiB in {args.files} files, best of {args.repeats}")
    print(f"{'':32s} {'seconds':>8s} {'MB/s':>8s}")
    for name, seconds in rows.items():
        print(f"{name:32s} {seconds:8.3f} {total / seconds / 1e6:8.0f}")
    for algorithm in HASHERS:
        r = result[algorithm]
        print(f"{algorithm}: save-side hash = {r['save_vs_write']:.2f} x the write, "
              f"load-side verify = {r['load_vs_read']:.2f} x the read")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
