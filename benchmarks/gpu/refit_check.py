"""GPU check, refit part: what issue 59 asks of one GPU, with only PyTorch installed (no Ray, no vLLM).

* **Lent device buffers against shared memory.** Two processes on one GPU, as vLLM's async engine
  and the process that refits it are: the first packs a part of weights and hands it over, the
  second opens it and copies it into weights of its own on the GPU, then answers. Through a CUDA IPC
  handle (``_packed_on_device``, what the async engine does when its one worker shares the GPU)
  the bytes stay on the device; through ``/dev/shm`` (``_packed_file``, its path off the GPU) they
  go to host memory and back. GB/s of each, the median of a few parts per size.
* **A refit group made and destroyed fifty times.** The broadcast transport's group (NCCL on a GPU)
  of one rank, through the transport's own ``prepare`` and ``_Group``, each time used for one
  broadcast (NCCL makes its communicator at the first): seconds per round, and the threads, open
  descriptors and free device memory after the last round against after the first. Nothing may
  grow with the rounds.

``--dry-run`` runs it on the CPU (gloo groups; the shared-memory half only, at small sizes), as the
suite does (tests/core/test_gpu_check.py).

    python benchmarks/gpu/refit_check.py [--dry-run] [--out refit.json]   # or scripts/gpu_check.sh --parts refit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "nrl_gen_vllm" / "src"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

ROUNDS = 50
#: What may differ after the last round from after the first: a thread or two of the runtime's
#: own, a few descriptors, and device memory within the allocator's granularity.
SLACK = {"threads": 2, "descriptors": 4, "device_free_bytes": 64 * 2**20}
PART_SIZES = {"gpu": (256 * 2**20, 1024 * 2**20), "dry": (4 * 2**20, 16 * 2**20)}
REPEATS = 5
ANSWER_S = 120.0  # the reader's longest answer to one part before it counts as gone


def _part(nbytes: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """A part of a decoder layer's shape: four tensors that add up to ``nbytes`` of bfloat16."""
    sizes = [nbytes // 8, nbytes // 8, 3 * nbytes // 8, 3 * nbytes // 8]
    return [(f"model.layers.{nbytes}.w{i}.weight", torch.randn(size // 2, device=device).to(torch.bfloat16))
            for i, size in enumerate(sizes)]


def _reader(conn: Any, cuda: bool) -> None:
    """The second process: open each part, copy every tensor into a weight of its own, answer."""
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    from nrl_core.api import open_lent_buffer
    from nrl_gen_vllm.part_layout import size_of, views

    weights: dict[str, torch.Tensor] = {}
    while True:
        message = conn.recv()
        if message is None:
            return
        method, where, layout = message
        data = open_lent_buffer(where) if method == "nrl_load_part_from_device" else \
            torch.from_file(where, shared=True, size=size_of(layout), dtype=torch.uint8)
        for name, view in views(data, layout):
            target = weights.get(name)
            if target is None:
                target = weights[name] = torch.empty(view.shape, dtype=view.dtype, device=device)
            target.copy_(view)
        del data, view
        if cuda:
            torch.cuda.synchronize()
        conn.send(sum(weights[name].numel() * weights[name].element_size() for name, *_ in layout))


def transfer_rates(cuda: bool) -> dict[str, Any]:
    """GB/s of a part handed to another process on the same device: lent, and through a file."""
    from nrl_gen_vllm.engines import _packed

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    reader = context.Process(target=_reader, args=(theirs, cuda), daemon=True)
    reader.start()
    results: dict[str, Any] = {}
    try:
        for nbytes in PART_SIZES["gpu" if cuda else "dry"]:
            part = _part(nbytes, device)
            for lend in ([True, False] if cuda else [False]):
                seconds = []
                for _ in range(REPEATS + 1):  # the first is a warm-up (the reader's weights, the handle cache)
                    start = time.perf_counter()
                    with _packed(part, lend_device=lend) as (method, where, layout):
                        ours.send((method, where, layout))
                        if not ours.poll(ANSWER_S):
                            raise RuntimeError(f"the reading process gave no answer in {ANSWER_S:.0f} s "
                                               f"(exit code {reader.exitcode}); its error is above")
                        landed = ours.recv()
                    seconds.append(time.perf_counter() - start)
                    assert landed == nbytes, (landed, nbytes)
                way = "lent on the device" if lend else "through /dev/shm"
                median = statistics.median(seconds[1:])
                results[f"{nbytes // 2**20} MiB {way}"] = {"seconds": seconds[1:], "gb_per_s": nbytes / median / 1e9}
            del part
    finally:
        if reader.is_alive():
            ours.send(None)
        reader.join(timeout=60)
    return results


def _counts(cuda: bool) -> dict[str, int]:
    counts = {"threads": len(os.listdir("/proc/self/task")), "descriptors": len(os.listdir("/proc/self/fd"))}
    if cuda:
        counts["device_free_bytes"] = torch.cuda.mem_get_info()[0]
    return counts


def group_rounds(cuda: bool, rounds: int = ROUNDS) -> dict[str, Any]:
    """Make a one-rank refit group, broadcast once, destroy it: ``rounds`` times."""
    from nrl_core.refit.transports import BroadcastTransport, RefitSession, _Group, broadcast_backend

    backend = broadcast_backend(cuda)
    if cuda:
        torch.cuda.set_device(0)
    seconds, after_first = [], None
    for round_ in range(rounds):
        start = time.perf_counter()
        # the transport's own start: its store binds a port the system picks, which the group takes
        session = BroadcastTransport().prepare(RefitSession(options={
            "backend": backend, "host": "127.0.0.1", "world_size": 1, "timeout_s": 60}))
        group = _Group(session, 0)
        probe = torch.ones(1024, device=group.device)
        group.broadcast(probe)
        group.destroy()
        del group, probe
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if round_ == 0:
            after_first = _counts(cuda)
    after_last = _counts(cuda)
    assert after_first is not None
    grew = {key: after_last[key] - after_first[key] if key != "device_free_bytes" else
            after_first[key] - after_last[key] for key in after_last}
    return {"backend": backend, "rounds": rounds, "seconds_first": seconds[0],
            "seconds_median_after_first": statistics.median(seconds[1:]), "after_first": after_first,
            "after_last": after_last, "grew": grew, "ok": all(grew[key] <= SLACK[key] for key in grew)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the CPU: gloo groups, the shared-memory half only")
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    args = parser.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("refit_check: no CUDA device visible; run with --dry-run to check the code path on the CPU")
        return 2
    summary: dict[str, Any] = {"dry_run": args.dry_run,
                               "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    summary["groups"] = group_rounds(cuda)
    summary["transfers"] = transfer_rates(cuda)
    summary["ok"] = summary["groups"]["ok"]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
    groups = summary["groups"]
    print(f"refit groups ({groups['backend']}): {groups['rounds']} made and destroyed, first "
          f"{groups['seconds_first']:.3f} s, then {groups['seconds_median_after_first']:.3f} s each; grew "
          + ", ".join(f"{k} {v}" for k, v in groups["grew"].items()) + (" ok" if groups["ok"] else " FAIL"))
    for name, result in summary["transfers"].items():
        print(f"part of {name}: {result['gb_per_s']:.2f} GB/s")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
