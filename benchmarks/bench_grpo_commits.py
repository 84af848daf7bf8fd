"""The GRPO-vs-TRL bench work in nrl at two or more commits, alternating runs: phase by phase.

Run:  python benchmarks/bench_grpo_commits.py 769b0a3 HEAD [--rounds 2] [--steps 7] [--nrl-override K=V ...]

Why: a phase that is slower than in an older measurement is slower either because the code changed
or because the machine did (this shared 2-core host drifts by 2x over a day). Running both commits
in the same hour, alternating, tells the two apart. Each commit is checked out with ``git worktree``
and its packages are put first on ``PYTHONPATH`` (the driver's and, forwarded, every Ray actor's),
so every run uses this venv's third-party packages and plugin entry points with the commit's own
nrl code; a commit whose entry points differ from the installed ones needs its own venv. The runs
are ``bench_grpo_vs_trl.run_nrl``'s: the same model, config, steps and timing.

Prints, per commit, the medians over steps ``--first-steady``..S of every round of the steady step
and each ``timing/*`` phase, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.bench_grpo_vs_trl import run_nrl, steady  # noqa: E402
from nrl_core.testing.tiny_models import cached_tiny_model  # noqa: E402


def source_path(tree: Path) -> str:
    """The ``PYTHONPATH`` that imports every first-party package from ``tree``: the core at its
    root, each plugin distribution from its ``src`` directory."""
    dirs = [tree, *sorted(p for p in tree.glob("*/src") if p.is_dir()),
            *sorted(p for p in tree.glob("plugins/*/src") if p.is_dir())]
    return os.pathsep.join(str(d) for d in dirs)


def checkout(commit: str, into: Path) -> Path:
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "--verify", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise SystemExit(f"{commit!r} is not a commit of {REPO}; give a hash, tag or branch (e.g. HEAD~1)")
    sha = found.stdout.strip()
    tree = into / sha
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha], check=True,
                   capture_output=True)
    return tree


def phase_medians(runs: list[dict[str, Any]], first: int) -> dict[str, float]:
    st = steady(runs, first)
    out = {"step_s": statistics.median(s["step_s"] for s in st)}
    out.update({phase: statistics.median(s["timing"][phase] for s in st) for phase in st[0]["timing"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="+", help="two or more commits (anything git rev-parse takes)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--first-steady", type=int, default=3)
    parser.add_argument("--nrl-omp-threads", type=int, default=2)
    parser.add_argument("--nrl-override", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if len(args.commits) < 2:
        raise SystemExit("give two or more commits to compare")
    if args.steps < args.first_steady:
        raise SystemExit(f"--steps {args.steps}: needs at least --first-steady ({args.first_steady}) steps")

    work = Path(tempfile.mkdtemp(prefix="nrl-bench-commits-"))
    trees: dict[str, Path] = {}
    try:
        for commit in args.commits:
            trees[commit] = checkout(commit, work)
        model = cached_tiny_model("llama", size="bench")  # nrl tiny-model --size bench --seed 0, built once
        results: dict[str, list[dict[str, Any]]] = {c: [] for c in args.commits}
        for r in range(args.rounds):
            for commit, tree in trees.items():
                run_dir = work / f"{tree.name}-{r}"
                run_dir.mkdir()
                os.environ["PYTHONPATH"] = source_path(tree)
                results[commit].append(run_nrl(model, args.steps, run_dir, args.nrl_omp_threads, args.nrl_override))
                row = phase_medians(results[commit][-1:], args.first_steady)
                print(f"round {r} {commit} ({tree.name}): " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
        table = {c: phase_medians(runs, args.first_steady) for c, runs in results.items()}
        print(f"\nmedian s over steps {args.first_steady}..{args.steps} of {args.rounds} rounds")
        print(f"{'':14s}" + "".join(f"{c:>14s}" for c in args.commits))
        for key in table[args.commits[0]]:
            print(f"{key:14s}" + "".join(f"{table[c].get(key, float('nan')):14.3f}" for c in args.commits))
        print(json.dumps({"bench": "grpo_commits", "rounds": args.rounds, "steps": args.steps,
                          "first_steady": args.first_steady, "nrl_overrides": args.nrl_override,
                          "commits": {c: trees[c].name for c in args.commits}, "medians": table}))
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
