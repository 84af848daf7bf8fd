"""Compare runs by their logs: validation accuracy before and after, with standard errors, the
tool-call rate of validation episodes (for runs whose model calls tools), the sampled training reward of the first and last steps,
and one plot of the validation curves.

``python -m nrl_core.logging.compare LOG_DIR... --labels A B --out comparison.png`` prints one
line per run and, for two runs, how many standard errors apart their final accuracies are.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nrl_core.tools import OPEN


@dataclass(frozen=True)
class Evaluation:
    """One validation: its step, accuracy (reward > 0) over ``n`` episodes, and in how many the
    model wrote a tool call (``<tool_call>``), answered or not."""

    step: int
    accuracy: float
    n: int
    tool_calls: int

    @property
    def stderr(self) -> float:
        return math.sqrt(self.accuracy * (1.0 - self.accuracy) / self.n) if self.n else 0.0

    @property
    def tool_call_rate(self) -> float:
        return self.tool_calls / self.n if self.n else 0.0


def evaluations(log_dir: Path) -> list[Evaluation]:
    """Every validation a run logged (``val_data_step<N>.jsonl``), by step."""
    found = []
    for path in log_dir.glob("val_data_step*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        step = int(path.stem.removeprefix("val_data_step"))
        correct = sum(float(r["reward"]) > 0 for r in records)
        tools = sum(any(m.get("role") == "assistant" and OPEN in str(m.get("content", "")) for m in r.get("messages", []))
                    for r in records)
        found.append(Evaluation(step=step, accuracy=correct / len(records) if records else 0.0, n=len(records),
                                tool_calls=tools))
    return sorted(found, key=lambda e: e.step)


@dataclass(frozen=True)
class RewardWindow:
    """The mean training reward of every rollout in steps ``first``..``last`` and its standard error
    (rollouts taken as independent draws; the rewards of one prompt's group are correlated, so it
    is a lower bound)."""

    first: int
    last: int
    mean: float
    stderr: float


def reward_windows(log_dir: Path, window: int) -> tuple[RewardWindow, RewardWindow] | None:
    """The first and the last ``window`` training steps' rewards (``train_data_step<N>.jsonl``);
    None when the run logged fewer than two windows' worth of steps."""
    by_step = {int(p.stem.removeprefix("train_data_step")): p for p in log_dir.glob("train_data_step*.jsonl")}
    steps = sorted(by_step)
    if window < 1 or len(steps) < 2 * window:
        return None

    def summary(chosen: list[int]) -> RewardWindow:
        rewards = [float(json.loads(line)["reward"]) for s in chosen
                   for line in by_step[s].read_text().splitlines() if line.strip()]
        mean = sum(rewards) / len(rewards)
        var = sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)
        return RewardWindow(first=chosen[0], last=chosen[-1], mean=mean, stderr=math.sqrt(var / len(rewards)))

    return summary(steps[:window]), summary(steps[-window:])


def separation(a: Evaluation, b: Evaluation) -> float:
    """How many standard errors of the difference ``a``'s accuracy is above ``b``'s."""
    spread = math.sqrt(a.stderr ** 2 + b.stderr ** 2)
    gap = a.accuracy - b.accuracy
    if spread == 0:
        return 0.0 if gap == 0 else math.copysign(math.inf, gap)
    return gap / spread


def plot(runs: dict[str, list[Evaluation]], out: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_tools = any(e.tool_calls for evals in runs.values() for e in evals)
    fig, axes = plt.subplots(1, 2 if with_tools else 1, figsize=(10 if with_tools else 5.5, 4), squeeze=False)
    acc = axes[0][0]
    for label, evals in runs.items():
        steps = [e.step for e in evals]
        acc.errorbar(steps, [e.accuracy for e in evals], yerr=[e.stderr for e in evals], marker="o", capsize=3,
                     label=label)
    acc.set(title="validation accuracy (±1 standard error)", xlabel="GRPO step", ylim=(-0.02, 1.02))
    if with_tools:  # a panel only for runs whose model calls tools
        tools = axes[0][1]
        for label, evals in runs.items():
            tools.plot([e.step for e in evals], [e.tool_call_rate for e in evals], marker="o", label=label)
        tools.set(title="validation episodes with a tool call", xlabel="GRPO step", ylim=(-0.02, 1.02))
    for ax in axes[0]:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dirs", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--out", type=Path, default=None, help="where to write the plot")
    parser.add_argument("--window", type=int, default=5, help="training steps averaged at the start and the end")
    args = parser.parse_args(argv)
    labels = args.labels or [str(d) for d in args.log_dirs]
    if len(labels) != len(args.log_dirs):
        parser.error("give one label per log directory")
    runs = {label: evaluations(d) for label, d in zip(labels, args.log_dirs)}
    for label, evals in runs.items():
        if not evals:
            print(f"{label}: no validation logged")
            continue
        first, last = evals[0], evals[-1]
        tools = (f"; tool-call rate {first.tool_call_rate:.3f} -> {last.tool_call_rate:.3f}"
                 if any(e.tool_calls for e in evals) else "")
        print(f"{label}: validation accuracy {first.accuracy:.3f} ± {first.stderr:.3f} (step {first.step}) -> "
              f"{last.accuracy:.3f} ± {last.stderr:.3f} (step {last.step}, {last.n} episodes){tools}")
    for label, log_dir in zip(labels, args.log_dirs):
        windows = reward_windows(log_dir, args.window)
        if windows is not None:
            start, end = windows
            print(f"{label}: training reward {start.mean:.3f} ± {start.stderr:.3f} (steps {start.first}-{start.last}) -> "
                  f"{end.mean:.3f} ± {end.stderr:.3f} (steps {end.first}-{end.last})")
    if len(runs) == 2 and all(runs.values()):
        (a, ea), (b, eb) = runs.items()
        print(f"{a} vs {b} at the end: {ea[-1].accuracy - eb[-1].accuracy:+.3f}, "
              f"{separation(ea[-1], eb[-1]):.1f} standard errors apart")
    if args.out is not None:
        written = plot(runs, args.out)
        print(f"plot: {written}" if written else "plot: matplotlib is not installed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
