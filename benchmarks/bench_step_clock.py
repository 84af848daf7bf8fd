"""An nrl lifecycle plugin for benchmarks: the wall clock of each step's end, in metrics.jsonl.

``metrics.jsonl``'s ``timing/*`` are the phases inside a step; a benchmark comparing frameworks also
needs when each step ended (the interval between step ends is the step as a user sees it, logging
and data loading included) and when the run started its first step. Load it without packaging:
``NRL_PLUGINS=bench_step_clock`` with ``benchmarks/`` on ``PYTHONPATH``. Adds ``bench/step_end_unix``
(``time.time()`` when the step's hooks run, before it is logged) to every step and
``bench/run_start_unix`` (``nrl_run_start``: workers up, before the first step) to the first.
"""

from __future__ import annotations

import time

from nrl_core import hookimpl

_run_start: list[float] = []


@hookimpl
def nrl_run_start(run) -> None:
    _run_start.append(time.time())


@hookimpl
def nrl_step_end(run, step, metrics) -> None:
    metrics["bench/step_end_unix"] = time.time()
    if step == run.first_step and _run_start:
        metrics["bench/run_start_unix"] = _run_start[0]
    return None
