"""The step trace of a GRPO run (issue 39): two colocated steps of the tiny CPU config write a
``trace.json`` that parses as trace JSON, holds every phase of a step (validation included), and
has each rank's own calls, refit (and its buckets) and generation included, on that rank's own row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_grpo import assert_ok, nrl_train

PHASES = {"start_up", "step", "refit", "generation", "reward", "logprobs", "training", "checkpoint_save",
          "validation"}


@pytest.mark.slow
def test_a_grpo_run_writes_a_trace_with_every_phase_and_every_rank(tmp_path: Path, model: Path) -> None:  # noqa: F811
    assert_ok(nrl_train(tmp_path, model, "grpo.max_num_steps=2", "cluster.gpus_per_node=2"))
    trace = json.loads((tmp_path / "logs" / "trace.json").read_text())
    assert isinstance(trace, list) and all({"name", "ph", "pid"} <= set(event) for event in trace)
    driver = [event for event in trace if event.get("tid") == "driver"]
    assert PHASES <= {event["name"] for event in driver}, sorted({event["name"] for event in driver})
    assert [event["name"] for event in driver].count("step") == 2
    assert all(event["ph"] == "X" and event["dur"] >= 0 and event["ts"] > 0 for event in trace if event["ph"] != "M")
    rows = {event["pid"]: event["args"]["name"] for event in trace if event["name"] == "process_name"}
    assert sorted(name.rsplit(" rank ", 1)[1] for name in rows.values()) == ["0", "1"], rows
    for pid in rows:
        served = {event["name"] for event in trace if event["pid"] == pid and event["ph"] == "X"}
        assert {"train", "nrl_refit_local", "refit_bucket"} <= served and any("generat" in n for n in served), served
