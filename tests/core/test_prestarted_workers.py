"""Actors on the private local Ray take the workers Ray prestarted, and still get the right environment.

A fresh local Ray of its own (``init_ray``), so the two prestarted workers are still idle when the
first group asks for them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from nrl_core.cluster import WorkerGroup, init_ray, shutdown_ray, worker_env_vars
from nrl_core.cluster.ray_cluster import actor_runtime_env
from tests.launch import shared_ray_pids

HERE = Path(__file__).resolve().parent
WORKER = "cluster_workers:CollectiveWorker"


@pytest.fixture()
def fresh_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    shutdown_ray()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("NRL_CLUSTER_TEST_FORWARD", "at-start")
    try:
        init_ray({"num_cpus": 2, "log_to_driver": False, "env_vars": {"NRL_TEST_MARK": "from-cluster-section"}})
        yield
    finally:
        shutdown_ray()


def _is_idle_worker(cmdline: list[str]) -> bool:
    """A Ray worker process booting (``default_worker.py``) or booted and idle (it renames itself)."""
    return bool(cmdline) and (cmdline[0] == "ray::IDLE" or any(arg.endswith("default_worker.py") for arg in cmdline))


def _idle_ray_workers(timeout_s: float = 30.0) -> set[int]:
    """The pids of the worker processes Ray's node started before any actor asked for one."""
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = {p.pid for p in psutil.Process(raylet).children() if _is_idle_worker(p.cmdline())}
        if len(workers) == 2:
            return workers
        time.sleep(0.1)
    raise AssertionError(f"Ray prestarted {len(workers)} workers on a 2-CPU node, expected 2")


def _whoami_in_a_new_group(name: str) -> dict[str, Any]:
    """One worker's report, from a group given the cluster section's variables (as a run's groups are)."""
    group = WorkerGroup(WORKER, 1, name=name, env_vars={"NRL_TEST_MARK": "from-cluster-section"},
                        num_cpus_per_worker=0.1)
    try:
        return group.call("whoami", on=0)
    finally:
        group.shutdown()


def test_a_group_takes_a_prestarted_worker_with_the_starting_environment(fresh_ray: None) -> None:
    assert os.environ.get("NRL_TEST_MARK") is None  # the cluster section's variable stays out of the driver
    assert actor_runtime_env(worker_env_vars({"NRL_TEST_MARK": "from-cluster-section"})) is None
    prestarted = _idle_ray_workers()
    me = _whoami_in_a_new_group("prestarted")
    assert me["pid"] in prestarted
    assert (me["forwarded"], me["nrl_test_mark"]) == ("at-start", "from-cluster-section")


def test_a_variable_set_after_the_start_still_reaches_a_new_group(fresh_ray: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    prestarted = _idle_ray_workers()
    monkeypatch.setenv("NRL_CLUSTER_TEST_FORWARD", "changed-later")
    runtime_env = actor_runtime_env(worker_env_vars({"NRL_TEST_MARK": "from-cluster-section"}))
    assert runtime_env is not None and runtime_env["env_vars"]["NRL_CLUSTER_TEST_FORWARD"] == "changed-later"
    me = _whoami_in_a_new_group("late-env")
    assert me["pid"] not in prestarted  # a worker of its own environment
    assert (me["forwarded"], me["nrl_test_mark"]) == ("changed-later", "from-cluster-section")


def test_the_private_ray_starts_no_autoscaler_and_no_dashboard(fresh_ray: None) -> None:
    shared = shared_ray_pids()  # the suite's shared Ray, if an earlier test in this process started it
    scripts = {Path(arg).name for p in psutil.Process().children(recursive=True) if p.pid not in shared
               for arg in p.cmdline()[:3]}
    assert "log_monitor.py" in scripts  # worker output still reaches the driver
    assert not scripts & {"monitor.py", "dashboard.py"}


def test_the_private_ray_retries_its_socket_connections_every_20_ms_for_10_s(fresh_ray: None) -> None:
    """The raylet's object-store connection retries on this schedule (``LOCAL_SYSTEM_CONFIG``), not
    Ray's one attempt per second, and still gives up after Ray's 10 s: read back from the running
    Ray. (A key Ray does not know stops its GCS at start, so a renamed setting fails every test.)"""
    held = ray._private.state.state.get_system_config()
    assert held["raylet_client_connect_timeout_milliseconds"] == 20
    assert held["raylet_client_num_connect_attempts"] * 20 == 10_000


def test_the_start_polls_the_node_table_for_the_node_it_waits_on(fresh_ray: None) -> None:
    """``init_ray`` waits for its raylet by polling the GCS's node table (``_node_alive``) instead of
    Ray's call that sleeps a second between tries; the poll must recognise this node, and no other,
    in the table as the running GCS returns it (else every start would wait its full 30 s)."""
    from nrl_core.cluster.ray_cluster import _gcs_state, _node_alive

    with _gcs_state(ray.get_runtime_context().gcs_address) as state:
        assert _node_alive(state, ray.get_runtime_context().get_node_id())
        assert not _node_alive(state, "ab" * 28)
