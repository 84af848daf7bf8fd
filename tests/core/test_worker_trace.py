"""Every worker's own spans in the run's trace: a host records each call it serves (worker
methods, refit endpoints and each refit bucket, a colocated engine's generation, streamed or not) into its own file, and
the driver merges those into trace.json as one Perfetto row per rank; nothing is recorded without
a trace."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nrl_core import timeline
from nrl_core.algorithms.refit_orchestrator import choose_transport
from nrl_core.cluster._host import WorkerHost
from nrl_core.testing.refit_host import RandomWeightSource, RecordingSink

SHAPES = {"a": (8, 4), "b": (16,)}


class Engine(RecordingSink):
    def generate_groups(self, prompts: list[list[int]], group_size: int, greedy: bool = False) -> Iterator[Any]:
        for prompt in prompts:
            yield [prompt] * group_size


def host(rank: int) -> WorkerHost:
    made = WorkerHost("lm_policy", rank, 2)
    made.worker, made.generation_worker = RandomWeightSource(SHAPES, seed=rank), Engine()
    if made._spans is not None:  # as if each rank were its own process
        made._spans.path = made._spans.path.with_name(f"lm_policy-rank{rank}-pid{4240 + rank}.jsonl")
    return made


def test_each_rank_records_its_calls_and_the_driver_merges_them_one_row_per_rank(tmp_path: Path) -> None:
    timeline.start_trace(tmp_path / "trace.json")
    try:
        ranks = [host(0), host(1)]
        for made in ranks:
            made.call("checksums", (), {})
            made.nrl_refit_local(choose_transport("same_process", "in_process"), 64, "float32")
            assert list(made.nrl_generate_groups([[1], [2]], 2)) == [[[1], [1]], [[2], [2]]]
            made.nrl_generation_call("checksums")
        timeline.merge_workers()  # what the watchdog's monitor does every few seconds
        ranks[0].call_packed("checksums", ((), {}))  # merged when the trace closes
    finally:
        timeline.stop_trace()
    assert timeline.TRACE_DIR_ENV not in os.environ
    events = json.loads((tmp_path / "trace.json").read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert rows == {4240: "lm_policy rank 0", 4241: "lm_policy rank 1"}
    served = [(e["tid"], e["name"]) for e in events if e["ph"] == "X"]
    calls = ["checksums", "nrl_refit_local", "nrl_generate_groups", "generation.checksums"]
    for rank in (0, 1):
        assert [name for tid, name in served if tid == f"lm_policy-rank{rank}" and name != "refit_bucket"][:4] == calls
    assert served[-1] == ("lm_policy-rank0", "checksums")
    buckets = [e for e in events if e["name"] == "refit_bucket" and e["tid"] == "lm_policy-rank0"]
    refit = next(e for e in events if e["name"] == "nrl_refit_local" and e["tid"] == "lm_policy-rank0")
    assert len(buckets) == 2 and all(refit["ts"] <= b["ts"] <= b["ts"] + b["dur"] <= refit["ts"] + refit["dur"] + 1
                                     for b in buckets)  # one span per bucket, inside the transfer
    assert all(e["dur"] >= 0 and e["ts"] > 0 and e["pid"] == 4240 + int(e["tid"][-1]) for e in events if e["ph"] == "X")


def test_no_trace_no_recording(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv(timeline.TRACE_DIR_ENV, raising=False)
    made = host(0)
    assert made._spans is None
    made.call("checksums", (), {})
    assert list(made.nrl_generate_groups([[1]], 1)) == [[[1]]]
