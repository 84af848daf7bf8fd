"""Training step time: the DTensor backend vs the Megatron backend, same tiny model and batch.

Each backend runs in its own spawned process (world of 1, gloo, so Megatron's CPU shim never
touches the DTensor run), is built from the spec its plugin's hook returns, as ``nrl train`` would
(section validated by the plugin's own schema), does ``--warmup`` steps and then ``--steps`` timed
``train`` calls with the core's NLL loss. Prints per-backend median seconds per step, the ratio
megatron/dtensor, and one JSON line.

    python benchmarks/bench_backends_step_time.py [--size small] [--batch 8] [--seq 64] [--steps 5]

With ``--commits`` it instead times one commit against another: each revision is checked out in a
detached git worktree, and every round runs each backend once per commit (alternating which commit
goes first) as a fresh process whose ``PYTHONPATH`` puts that worktree's sources first. Prints each
backend's per-commit medians over the rounds, the ratio after/before, the per-round values, how far
the two commits' losses differ, and one JSON line.

    python benchmarks/bench_backends_step_time.py --commits <before> <after> [--rounds 5] [--backends dtensor,megatron]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

BACKENDS = ("dtensor", "megatron")
SINGLE_TIMEOUT_S = 900


def _policy(model: str, args: argparse.Namespace, backend: str, spec: Any) -> dict[str, Any]:
    section = spec.config_schema.validate({"enabled": True}, f"policy.{spec.config_key}")
    if backend == "megatron":
        section = spec.config_schema.validate({"enabled": True, "optimizer": {"lr": 1e-4, "weight_decay": 0.0,
                                                                             "clip_grad": 1.0}},
                                              f"policy.{spec.config_key}")
    return {"model_name": model, "precision": "float32", "train_global_batch_size": args.batch,
            "train_micro_batch_size": args.micro, "logprob_batch_size": args.micro,
            "max_total_sequence_length": args.seq, "max_grad_norm": 1.0, "seed": 0,
            "optimizer": None if backend == "megatron" else {
                "name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4, "weight_decay": 0.0}},
            "hf_config_overrides": {}, "sequence_packing": {"enabled": False}, spec.config_key: section}


def _free_port() -> int:
    """A port nothing listens on, so each world of 1 gets its own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(backend: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build ``backend``'s worker as ``nrl train`` would and time ``args.steps`` train calls after warmup;
    returns the median seconds per step, every step's loss, and the file the worker class came from."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), OMP_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from nrl_core.algorithms.loss import NLLLoss
    from nrl_core.contracts import TokenBatch, import_object

    dist.init_process_group("gloo", rank=0, world_size=1)
    # the spec straight from the plugin's hook module (its entry point): the registry would hold the
    # installed metadata's nrl-core requirement against an older commit's core
    hooks = importlib.import_module(f"nrl_backend_{backend}.plugin")
    spec = next(s for s in hooks.nrl_training_backends() if s.name == backend)
    worker = import_object(spec.worker)({"policy": _policy(model, args, backend, spec)}, rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (args.batch, args.seq), generator=g)
    mask = torch.ones(args.batch, args.seq)
    mask[:, 0] = 0
    batch = TokenBatch(input_ids=ids, input_lengths=torch.full((args.batch,), args.seq), fields={"token_mask": mask})
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(float(worker.train(batch, NLLLoss())["loss"]))
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"backend": backend, "seconds_per_step": statistics.median(times), "losses": losses,
            "backend_file": inspect.getfile(type(worker))}


def _run(rank: int, backend: str, model: str, args: argparse.Namespace, out: Any) -> None:
    """Spawned-process entry of the backend-vs-backend mode: one backend, its result back through ``out``."""
    result = _measure(backend, model, args)
    out.put((backend, result["seconds_per_step"], result["losses"]))


def _compare_backends(args: argparse.Namespace) -> None:
    """The default mode: DTensor vs Megatron on this checkout, each in its own spawned process."""
    from nrl_backend_megatron.parallel import KEY  # noqa: F401  (fails early if the plugin is missing)
    from nrl_core.testing.tiny_models import cached_tiny_model

    model = args.model or str(cached_tiny_model(args.family, size=args.size))
    os.environ.setdefault("NRL_MEGATRON_CHECKPOINT_DIR", tempfile.mkdtemp(prefix="nrl-bench-mcore-"))
    ctx = mp.get_context("spawn")
    results = {}
    for backend in BACKENDS:
        args.port = _free_port()
        queue = ctx.Queue()
        proc = ctx.Process(target=_run, args=(0, backend, model, args, queue))
        proc.start()
        name, seconds, losses = queue.get(timeout=SINGLE_TIMEOUT_S)
        proc.join()
        results[name] = {"seconds_per_step": seconds, "losses": losses}
        print(f"{name:9s} {seconds * 1000:9.1f} ms/step  losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    ratio = results["megatron"]["seconds_per_step"] / results["dtensor"]["seconds_per_step"]
    print(f"ratio megatron/dtensor: {ratio:.2f}")
    print(json.dumps({"bench": "backends_step_time", "size": args.size, "batch": args.batch, "seq": args.seq,
                      "ratio_megatron_over_dtensor": ratio, **{k: v["seconds_per_step"] for k, v in results.items()}}))


def _single(args: argparse.Namespace) -> None:
    """``--single``: one backend measured in this very process, reported as one JSON line for a parent to parse,
    with the files ``nrl_core`` and the worker resolved to so the parent can check which checkout ran."""
    import nrl_core

    if args.model is None:
        from nrl_core.testing.tiny_models import cached_tiny_model

        args.model = str(cached_tiny_model(args.family, size=args.size))
    args.port = _free_port()
    result = _measure(args.single, args.model, args)
    print(json.dumps({"backend": result["backend"], "seconds_per_step": result["seconds_per_step"],
                      "losses": result["losses"], "nrl_core": nrl_core.__file__,
                      "backend_file": result["backend_file"]}))


@dataclass(frozen=True)
class Checkout:
    """One side of a commit comparison: the revision as given, its commit, its worktree and its own
    Megatron conversion dir (so two commits never share a converted checkpoint whose format may differ)."""

    label: str
    rev: str
    sha: str
    path: Path
    checkpoint_dir: Path


def _git(repo: Path, *argv: str) -> str:
    """Run git in ``repo`` and return its stripped stdout; a failure carries git's own message."""
    proc = subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout.strip()


@contextlib.contextmanager
def _worktrees(repo: Path, revs: dict[str, str]) -> Iterator[dict[str, Checkout]]:
    """Detached worktrees of ``revs`` (label -> revision) under one temp dir, removed again however the run ends."""
    root = Path(tempfile.mkdtemp(prefix="nrl-bench-commits-"))
    checkouts: dict[str, Checkout] = {}
    try:
        for label, rev in revs.items():
            sha = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
            path = root / label
            _git(repo, "worktree", "add", "--detach", str(path), sha)
            checkouts[label] = Checkout(label, rev, sha, path, root / f"mcore-{label}")
        yield checkouts
    finally:
        for checkout in checkouts.values():
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(checkout.path)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _python_path(worktree: Path) -> str:
    """``PYTHONPATH`` putting the worktree's core, backends and plugins ahead of the venv's editable installs
    (their finders sit after ``PathFinder`` on ``sys.meta_path``, and ``.pth`` dirs after ``PYTHONPATH``)."""
    dirs = [worktree, worktree / "nrl_backend_dtensor" / "src", worktree / "nrl_backend_megatron" / "src",
            *sorted(worktree.glob("plugins/*/src"))]
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*map(str, dirs), *([inherited] if inherited else [])])


def _single_argv(backend: str, model: str, args: argparse.Namespace) -> list[str]:
    """This script (from the checkout being run: an old commit's copy may lack ``--single``) in ``--single`` mode."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--single", backend, "--model", model]
    for name in ("family", "size", "batch", "micro", "seq", "steps", "warmup", "threads"):
        argv += [f"--{name}", str(getattr(args, name))]
    return argv


def _inside(file: str, root: Path) -> bool:
    """Whether ``file`` lies under ``root`` (both resolved, so symlinked temp dirs compare equal)."""
    return Path(file).resolve().is_relative_to(root.resolve())


def _run_single(checkout: Checkout, backend: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process timing ``backend`` on ``checkout``; checks that its code really came from the worktree."""
    env = {**os.environ, "PYTHONPATH": _python_path(checkout.path),
           "NRL_MEGATRON_CHECKPOINT_DIR": str(checkout.checkpoint_dir)}
    proc = subprocess.run(_single_argv(backend, model, args), env=env, cwd=checkout.path, capture_output=True,
                          text=True, timeout=SINGLE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} on {checkout.label} ({checkout.rev}) exited {proc.returncode}:\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"{backend} on {checkout.label} printed no JSON line:\n{proc.stdout[-4000:]}")
    result = json.loads(line)
    for key in ("nrl_core", "backend_file"):
        if not _inside(result[key], checkout.path):
            raise RuntimeError(f"{backend} on {checkout.label}: {key} resolved to {result[key]}, "
                               f"outside the worktree {checkout.path}")
    return result


def _round_order(round_number: int) -> tuple[str, str]:
    """Odd rounds run before then after, even rounds the reverse, so neither commit always goes first."""
    return ("before", "after") if round_number % 2 else ("after", "before")


def _summarize(backend: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print one backend's medians, ratio, per-round values and round 1's loss agreement; return its JSON part."""
    seconds = {label: [r["seconds_per_step"] for r in runs[label]] for label in ("before", "after")}
    medians = {label: statistics.median(values) for label, values in seconds.items()}
    ratio = medians["after"] / medians["before"]
    loss_diff = max(abs(a - b) for a, b in zip(runs["before"][0]["losses"], runs["after"][0]["losses"], strict=True))
    print(f"{backend}: before {medians['before'] * 1000:.1f} ms/step, after {medians['after'] * 1000:.1f} ms/step"
          f" (medians), ratio after/before {ratio:.3f}")
    for label in ("before", "after"):
        print(f"  {label:6s} per round (ms): " + ", ".join(f"{s * 1000:.1f}" for s in seconds[label]))
    print(f"  round 1 losses: max |before - after| = {loss_diff:.3g}")
    return {"before_median": medians["before"], "after_median": medians["after"], "ratio": ratio,
            "before": seconds["before"], "after": seconds["after"], "loss_max_abs_diff": loss_diff}


def _compare_commits(args: argparse.Namespace) -> None:
    """``--commits``: each backend timed on two revisions over ``--rounds`` alternating rounds of fresh processes."""
    from nrl_core.testing.tiny_models import cached_tiny_model

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise SystemExit(f"--backends: expected a comma-separated subset of {','.join(BACKENDS)}, "
                         f"got {args.backends!r}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: expected at least 1, got {args.rounds}")
    model = args.model or str(cached_tiny_model(args.family, size=args.size))
    repo = Path(_git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
    before, after = args.commits
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {b: {"before": [], "after": []} for b in backends}
    with _worktrees(repo, {"before": before, "after": after}) as checkouts:
        for label, checkout in checkouts.items():
            print(f"{label:6s} {checkout.rev} = {checkout.sha[:12]}  worktree {checkout.path}")
        for round_number in range(1, args.rounds + 1):
            for backend in backends:
                for label in _round_order(round_number):
                    result = _run_single(checkouts[label], backend, model, args)
                    runs[backend][label].append(result)
                    print(f"round {round_number} {backend:9s} {label:6s} {result['seconds_per_step'] * 1000:9.1f} "
                          f"ms/step  losses {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}", flush=True)
    summary: dict[str, Any] = {"bench": "backends_step_time_commits", "before": before, "after": after,
                               "rounds": args.rounds}
    for backend in backends:
        summary[backend] = _summarize(backend, runs[backend])
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="model dir to train (default: the cached tiny model of "
                                                      "--family/--size)")
    parser.add_argument("--commits", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="time each backend on two git revisions instead of one backend against the other")
    parser.add_argument("--rounds", type=int, default=5, help="--commits: alternating rounds per backend")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="--commits: comma-separated backends")
    parser.add_argument("--single", choices=BACKENDS, help="time one backend in this process, print one JSON line "
                                                          "(what --commits runs per commit)")
    args = parser.parse_args()
    if args.single:
        _single(args)
    elif args.commits:
        _compare_commits(args)
    else:
        _compare_backends(args)


if __name__ == "__main__":
    main()
