"""Hangs in the phases a rank can stall besides a collective, each on a real Ray worker group
under the watchdog: a generate that never returns (generation), an offload that never returns
(hand-off), and a start-up where one worker never finishes building (start-up). Each ends within
its limit with the one-line error naming the phase and the stuck rank, a stack file for every
rank and no worker process left."""

from __future__ import annotations

import gc
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nrl_core.cluster import WorkerGroup, init_ray
from nrl_core.cluster.worker_group import live_groups
from nrl_core.stacks import process_state
from nrl_core.watchdog import HangError, Watchdog, WatchdogSettings, phase
from tests.core.hang_workers import ScoringWorker
from tests.launch import driving_the_shared_ray

WORKER = "hang_workers:HangWorker"
LIMIT_S = 2
STARTUP_S = 30  # the actors' own start (a second or two; more than 10 s on a loaded 2-core host) is inside it


@pytest.fixture(autouse=True)
def ray_up(worker_path: None) -> Iterator[None]:
    """Each test joins the suite's shared Ray as a run's driver does: a watchdog that fired
    disconnects it, and its actors end with it."""
    with driving_the_shared_ray():
        init_ray({"log_to_driver": False})
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
    assert_nothing_left(pids)


def assert_nothing_left(pids: list[int]) -> None:
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


def test_a_stopped_rank_is_named_as_the_cause_and_its_peer_as_waiting(tmp_path: Path) -> None:
    """Two ranks in a collective (``train``), rank 1 stopped (SIGSTOP) before it arrives: both are
    "in train()" to the driver, and the line names rank 1, stopped, as the cause and rank 0 as
    waiting on it; the stopped process is killed with the rest."""
    policy = group("policy")
    pids = policy.call("pid")
    os.kill(pids[1], signal.SIGSTOP)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    message, dump, seconds = hang(tmp_path, "training", lambda: policy.call("train", str(barrier)), floor_s=LIMIT_S)
    assert (f"policy[rank 1] pid {pids[1]} is stopped, state T: the likely cause; waiting on it: "
            f"policy[rank 0] pid {pids[0]} in train()") in message, message
    assert "train" in (dump / f"policy-rank0-pid{pids[0]}.txt").read_text()
    status = (dump / "status.txt").read_text()
    assert f"cannot be making progress: policy[rank 1] pid {pids[1]} (stopped, state T)" in status, status
    assert seconds < LIMIT_S + 15
    assert_nothing_left(pids)


def test_a_stopped_process_a_worker_started_is_named_itself(tmp_path: Path) -> None:
    """An engine waits on a process it started (as vLLM's asynchronous engine waits on its engine
    core), and that process is stopped: the line names it, by its name and pid and the rank that
    started it, not only the rank."""
    engines = group("engine")
    pid = engines.call("pid", on=0)
    child = engines.call("start_child", on=0)
    assert engines.call("ask_child", "ping", on=0) == "ping"
    os.kill(child, signal.SIGSTOP)
    message, dump, _ = hang(tmp_path, "generation", lambda: engines.call("ask_child", "pong", on=0), floor_s=LIMIT_S)
    assert (f"EngineCore_0 pid {child} (started by engine[rank 0] pid {pid}) is stopped, state T: the likely cause; "
            f"waiting on it: engine[rank 0] pid {pid} in ask_child()") in message, message
    assert f"engine-rank0-pid{pid}-child-EngineCore_0-pid{child}" in (dump / "status.txt").read_text()
    assert_nothing_left([pid, child])


def test_a_stopped_actor_outside_the_worker_groups_is_named_with_its_stack(tmp_path: Path) -> None:
    """The driver waits on an actor no worker group holds (as an environment's workers are), and
    that actor is stopped mid-call: the line names it by class and pid, not the driver, and its
    Python stack is read without resuming it (py-spy, installed with Ray's default extra)."""
    import ray

    from nrl_core.stacks import py_spy

    actor = ray.remote(num_cpus=0.1)(ScoringWorker).options(name="math-verifier-0").remote()
    pid = ray.get(actor.pid.remote())
    pending = actor.score.remote(str(tmp_path / "never"))
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    message, dump, _ = hang(tmp_path, "reward", lambda: ray.get(pending), floor_s=LIMIT_S)
    assert f"ScoringWorker actor 'math-verifier-0' pid {pid} is stopped, state T: the likely cause" in message, message
    assert "the driver" not in message
    assert py_spy() is not None
    assert "score" in (dump / f"actor-math-verifier-0-pid{pid}.native.txt").read_text()
    assert_nothing_left([pid])
