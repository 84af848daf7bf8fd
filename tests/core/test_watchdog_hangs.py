"""Hangs in the phases a rank can stall besides a collective, each on a real Ray worker group
under the watchdog: a generate that never returns (generation), an offload that never returns
(hand-off), and a start-up where one worker never finishes building (start-up). Each ends within
its limit with the one-line error naming the phase and the stuck rank, a stack file for every
rank and no worker process left."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nrl_core.cluster import WorkerGroup, init_ray
from nrl_core.cluster.worker_group import live_groups
from nrl_core.stacks import process_state
from nrl_core.watchdog import HangError, Watchdog, WatchdogSettings, phase

WORKER = "hang_workers:HangWorker"
LIMIT_S = 2
STARTUP_S = 30  # the actors' own start (a second or two; more than 10 s on a loaded 2-core host) is inside it


@pytest.fixture(autouse=True)
def ray_up(worker_path: None) -> Iterator[None]:
    """A local Ray for each test: a watchdog that fired stops the one its run used."""
    init_ray({"num_cpus": 2, "cpus_per_worker": 0.1, "log_to_driver": False})
    yield
    gc.collect()  # the killed groups of a test's hang (held by its traceback) leave live_groups()
    assert live_groups() == []


def group(name: str, **init_kwargs: Any) -> WorkerGroup:
    return WorkerGroup(WORKER, 2, name=name, init_kwargs=init_kwargs, distributed_backend="none")


def hang(tmp: Path, name: str, body: Callable[[], object], **settings: Any) -> tuple[str, Path, float]:
    """Run ``body`` as phase ``name`` under a fast watchdog; the error, its dump and the seconds."""
    dog = Watchdog(WatchdogSettings(**settings), tmp)
    dog.tick_s = 0.05
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        with dog, phase(name):
            body()
    message = str(info.value)
    assert "\n" not in message and f"phase '{name}'" in message and f"raise watchdog.phases.{name}" in message
    return message, next((tmp / "stacks").glob(f"*-hang-{name}")), time.monotonic() - start


def assert_stacks_and_nothing_left(dump: Path, name: str, pids: list[int]) -> None:
    # py-spy, where installed, adds a .native.txt per process beside each Python stack
    files = sorted(p.name for p in dump.glob(f"{name}-rank*-pid*.txt") if not p.name.endswith(".native.txt"))
    assert files == [f"{name}-rank{r}-pid{pid}.txt" for r, pid in enumerate(pids)], (dump / "status.txt").read_text()
    deadline = time.monotonic() + 15
    while any(process_state(pid) not in (None, "Z") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(process_state(pid) in (None, "Z") for pid in pids)


def test_a_generate_that_never_returns(tmp_path: Path) -> None:
    engines = group("engine", stuck_rank=0, stuck_in="generate")
    pids = engines.call("pid")
    message, dump, seconds = hang(tmp_path, "generation", lambda: engines.call("generate", ["a", "b"]),
                                  floor_s=LIMIT_S)
    assert f"engine[rank 0] pid {pids[0]} in generate()" in message and "engine[rank 1]" not in message
    assert f"limit of {LIMIT_S} s" in message and seconds < LIMIT_S + 15
    assert "in generate" in (dump / f"engine-rank0-pid{pids[0]}.txt").read_text()
    assert_stacks_and_nothing_left(dump, "engine", pids)


def test_a_stuck_offload_in_the_hand_off(tmp_path: Path) -> None:
    policy = group("policy", stuck_rank=1, stuck_in="offload")
    pids = policy.call("pid")
    message, dump, seconds = hang(tmp_path, "hand_off", lambda: policy.call("offload"),
                                  phases={"hand_off": LIMIT_S})
    assert f"policy[rank 1] pid {pids[1]} in offload()" in message and "policy[rank 0]" not in message
    assert seconds < LIMIT_S + 15
    assert "in offload" in (dump / f"policy-rank1-pid{pids[1]}.txt").read_text()
    assert_stacks_and_nothing_left(dump, "policy", pids)


def test_a_start_up_where_one_worker_never_reports(tmp_path: Path) -> None:
    message, dump, seconds = hang(tmp_path, "start_up", lambda: group("starting", stuck_rank=1, stuck_in="init"),
                                  startup_s=STARTUP_S)
    files = {p.name.split("-pid")[0]: int(p.name.split("-pid")[1][:-4]) for p in dump.glob("starting-rank*-pid*.txt")
             if not p.name.endswith(".native.txt")}
    pids = [files["starting-rank0"], files["starting-rank1"]]
    assert re.search(r"still running: starting\[rank 1\] pid \d+ in constructing hang_workers:HangWorker", message)
    assert "[rank 0]" not in message and f"limit of {STARTUP_S} s" in message and seconds < STARTUP_S + 15
    assert "__init__" in (dump / f"starting-rank1-pid{pids[1]}.txt").read_text()
    assert_stacks_and_nothing_left(dump, "starting", pids)
