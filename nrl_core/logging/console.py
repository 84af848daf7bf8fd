"""The live console view: a progress bar over the run and one line per step with the figures
people watch (reward, loss, KL, tokens/s) and where the time went (generation, logprobs, training,
refit)."""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

HEADLINE = (("train/reward", "reward"), ("val/accuracy", "val_acc"), ("train/loss", "loss"),
            ("train/kl_penalty", "kl"), ("train/token_mult_prob_error", "mismatch"),
            ("throughput/tokens_per_second", "tok/s"))


class ConsoleView:
    def __init__(self, total_steps: int, description: str = "training") -> None:
        self.console = Console(stderr=True, highlight=False)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task(description, total=total_steps)

    def log(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        metrics = {f"{prefix}{k}": v for k, v in metrics.items()}
        figures = [f"{label} {metrics[key]:.4g}" for key, label in HEADLINE if isinstance(metrics.get(key), (int, float))]
        timings = [f"{key.split('/', 1)[1]} {value:.1f}s" for key, value in metrics.items()
                   if key.startswith("timing/") and isinstance(value, (int, float))]
        line = f"step {step}: " + "  ".join(figures) + ("  |  " + "  ".join(timings) if timings else "")
        self.progress.console.print(line, soft_wrap=True)
        self.progress.update(self.task, completed=step)

    def close(self) -> None:
        self.progress.stop()
