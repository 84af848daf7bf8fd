"""A lifecycle-hook plugin for tests/e2e/test_lifecycle_hooks.py, loaded with ``NRL_PLUGINS``: it
records every call as a JSON line in ``$NRL_TEST_EVENTS``, logs one metric of its own and stops
the run after step ``$NRL_TEST_STOP_AFTER`` when that is set."""

from __future__ import annotations

import json
import os
from pathlib import Path

from nrl_core import hookimpl
from nrl_core.contracts import RunInfo


def _record(event: str, **fields: object) -> None:
    with open(os.environ["NRL_TEST_EVENTS"], "a") as handle:
        handle.write(json.dumps({"event": event, **fields}, default=str) + "\n")


@hookimpl
def nrl_run_start(run: RunInfo) -> None:
    _record("run_start", algorithm=run.algorithm, first_step=run.first_step, max_steps=run.max_steps,
            checkpoint_dir=run.checkpoint_dir)


@hookimpl
def nrl_step_end(run: RunInfo, step: int, metrics: dict[str, float]) -> str | None:
    metrics["recorder/step_squared"] = float(step * step)
    _record("step_end", step=step, keys=sorted(metrics))
    stop_after = os.environ.get("NRL_TEST_STOP_AFTER")
    return f"the recorder stops after step {stop_after}" if stop_after and step >= int(stop_after) else None


@hookimpl
def nrl_checkpoint_saved(run: RunInfo, step: int, path: str, metrics: dict[str, float]) -> None:
    _record("checkpoint_saved", step=step, exists=Path(path).is_dir(), name=Path(path).name,
            has_metrics="recorder_step_squared" in metrics)


@hookimpl
def nrl_run_end(run: RunInfo, status: str, last_step: int, metrics: dict[str, float], outputs: dict[str, str]) -> None:
    _record("run_end", status=status, last_step=last_step, outputs=sorted(outputs))
