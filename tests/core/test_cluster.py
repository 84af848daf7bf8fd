"""Ray worker groups on a real local Ray: collectives, failures by name, placement, shutdown, joining.

One Ray session serves the module; workers are the small classes in ``cluster_workers.py``, which
the actors import through the PYTHONPATH that ``init_ray`` forwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from nrl_core import hookimpl
from nrl_core.cli import main
from nrl_core.cluster import (
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerRaisedError,
    init_ray,
    make_placement,
    shutdown_ray,
    worker_env_vars,
)
from nrl_core.cluster._host import WorkerHost
from nrl_core.contracts import AlgorithmSpec
from nrl_core.errors import NrlError
from nrl_core.net import free_port
from nrl_core.plugins import get_plugin_manager
from nrl_core.process_groups import DEFAULT_TIMEOUT_S, distributed_timeout_s
from nrl_core.testing.errors import example_error, nrl_error_classes

from .conftest import VALID

HERE = Path(__file__).resolve().parent
WORKER = "cluster_workers:CollectiveWorker"
CLUSTER = {"num_cpus": 2, "cpus_per_worker": 0.1, "log_to_driver": False}


def _pids_gone(pids: list[int], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    shutdown_ray()  # this module owns its session: PYTHONPATH must reach the workers
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE)] + ([saved] if saved else []))
    os.environ["NRL_CLUSTER_TEST_FORWARD"] = "yes"  # an NRL_* variable of the driver reaches workers
    try:
        init_ray(CLUSTER)
        yield
    finally:
        shutdown_ray()
        os.environ.pop("NRL_CLUSTER_TEST_FORWARD", None)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def pair(ray_session: None) -> Iterator[WorkerGroup]:
    """Two gloo ranks on a placement group of their own (the non-colocated case)."""
    placement = make_placement(CLUSTER, 2, name="pair")
    group = WorkerGroup(
        WORKER, 2, name="pair", init_kwargs={"tag": "p"}, env_vars={"NRL_TEST_MARK": "marked"}, placement=placement
    )
    yield group
    group.shutdown()
    placement.remove()


def test_worker_env_vars_forward_what_workers_need(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("NRL_SOMETHING", "x")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # Ray's to set per actor
    monkeypatch.setenv("UNRELATED_SECRET", "no")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = worker_env_vars({"EXTRA": "1"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["NRL_SOMETHING"] == "x" and env["OMP_NUM_THREADS"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in env and "UNRELATED_SECRET" not in env
    assert env["PYTHONPATH"].split(os.pathsep) == ["/somewhere", os.getcwd()]
    assert env["EXTRA"] == "1"


def test_placement_that_cannot_fit_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    # As Ray reports a one-GPU node: two GPU workers cannot fit, refused before asking Ray.
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 1.0})
    with pytest.raises(NrlError, match="gpus_per_node=1"):
        make_placement({"gpus_per_node": 1, "num_nodes": 1}, 2)
    # The config would fit, the cluster does not: the message names what the cluster has.
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": "abcdef0123",
                                                "Resources": {"CPU": 2.0, "GPU": 1.0}}])
    with pytest.raises(NrlError, match=r"2 GPU workers for 'x' but the Ray cluster has 1 GPUs \(1 node: abcdef "
                                       r"\(CPU 2, GPU 1\)\)"):
        make_placement({"gpus_per_node": 2, "num_nodes": 1}, 2, name="x")
    monkeypatch.undo()
    with pytest.raises(NrlError, match="cluster.cpus_per_worker"):
        make_placement({"cpus_per_worker": 0}, 2)


def test_all_reduce_over_gloo(pair: WorkerGroup) -> None:
    assert pair.call("all_reduce", 1.5) == [3.0, 3.0]
    assert pair.call("all_reduce", per_rank_args=[(1.0,), (10.0,)]) == [11.0, 11.0]
    info = pair.call("whoami")
    assert [i["rank"] for i in info] == [0, 1]
    assert {i["backend"] for i in info} == {"gloo"}
    assert [i["env"]["RANK"] for i in info] == ["0", "1"]
    assert {i["env"]["WORLD_SIZE"] for i in info} == {"2"}
    assert [i["env"]["LOCAL_RANK"] for i in info] == ["0", "1"]  # one node
    assert {i["env"]["MASTER_ADDR"] for i in info} == {"127.0.0.1"}  # the local Ray is loopback-only
    assert {i["env"]["MASTER_PORT"] for i in info} == {str(pair.master_port)}
    assert {i["tag"] for i in info} == {"p"} and {i["nrl_test_mark"] for i in info} == {"marked"}
    assert {i["forwarded"] for i in info} == {"yes"}
    assert [i["pid"] for i in info] == [w.pid for w in pair.infos]


def _listening(pid: int) -> list[str]:
    """Addresses ``pid``'s sockets listen on (TCP over IPv4 and IPv6), read from /proc: the
    namespace's socket tables, filtered to the inodes of the process's own descriptors."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(_address(fields[1]))
    return found


def _address(hex_address: str) -> str:
    """``0100007F:1F90`` -> ``127.0.0.1:8080`` (/proc writes addresses as host-order 32-bit words)."""
    host, port = hex_address.split(":")
    words = [bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8)]
    packed = b"".join(words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return f"{socket.inet_ntop(family, packed)}:{int(port, 16)}"


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1",) or host.startswith("::ffff:127.")


def test_listener_probe_sees_a_wildcard_socket() -> None:
    """The probe below is only as good as its parsing: a socket on every interface must show up."""
    with socket.socket(socket.AF_INET6) as wide, socket.socket() as local:
        wide.bind(("::", 0)), local.bind(("127.0.0.1", 0))
        wide.listen(), local.listen()
        ports = wide.getsockname()[1], local.getsockname()[1]
        found = _listening(os.getpid())
    assert f":::{ports[0]}" in found and f"127.0.0.1:{ports[1]}" in found
    assert f":::{ports[0]}" in [a for a in found if not _loopback(a)]


def test_a_group_on_the_private_local_ray_listens_on_loopback_only(ray_session: None) -> None:
    """Rank 0's rendezvous store used to listen on every interface; on the private local Ray the
    ranks meet through a file store in a private directory instead, and gloo stays on loopback."""
    group = WorkerGroup(WORKER, 2, name="private")
    try:
        assert group.rendezvous_dir is not None and os.path.isdir(group.rendezvous_dir)
        assert oct(os.stat(group.rendezvous_dir).st_mode & 0o777) == "0o700"
        assert group.call("all_reduce", 2.0) == [4.0, 4.0]
        listening = {w.rank: _listening(w.pid) for w in group.infos}
        assert all(listening.values()), listening  # gloo's own connections do listen, on loopback
        assert not [a for addrs in listening.values() for a in addrs if not _loopback(a)], listening
        rendezvous = group.rendezvous_dir
    finally:
        group.shutdown()
    assert not os.path.exists(rendezvous)


def test_calls_on_one_rank_async_and_execute(pair: WorkerGroup) -> None:
    assert pair.call("echo", 7, key="v", on=1) == (1, (7,), {"key": "v"})
    futures = pair.call_async("echo", "x")
    assert pair.get(futures) == [(0, ("x",), {}), (1, ("x",), {})]
    assert pair.call(WorkerHost.execute, lambda w: w.rank * 10) == [0, 10]
    with pytest.raises(ValueError, match="2 ranks"):
        pair.call("echo", per_rank_args=[()])


def test_a_declared_dispatch_picks_the_ranks_and_how_answers_are_gathered(pair: WorkerGroup) -> None:
    """What a Protocol method declares with ``@dispatch`` is what ``call`` does; ``on`` overrides the ranks."""
    from nrl_core.dispatch import Fanout, Gather, dispatch

    @dispatch(Fanout.RANK0)
    def echo(self, *args): ...

    @dispatch(Fanout.ALL, Gather.FIRST)
    def whoami(self): ...

    @dispatch(Fanout.ALL, Gather.SHARDS)
    def odd_rank(self): ...

    @dispatch(Fanout.ALL, Gather.NONE)
    def all_reduce(self, value): ...

    @dispatch(Fanout.STREAM)
    def streamed(self): ...

    assert pair.call(echo, 5) == (0, (5,), {})
    assert pair.call(echo, 5, on=[0, 1]) == [(0, (5,), {}), (1, (5,), {})]
    assert pair.call(whoami)["rank"] == 0
    assert pair.call(odd_rank) == [1]
    assert pair.call(all_reduce, 1.0) is None  # both ranks took part: neither is left in the collective
    assert pair.call("all_reduce", 1.0) == [2.0, 2.0]

    @dispatch(Fanout.DP)
    def echo(self, *args): ...  # noqa: F811

    pair.dp_leads = (1,)
    try:
        assert pair.call(echo, "x") == [(1, ("x",), {})]
    finally:
        pair.dp_leads = (0, 1)
    with pytest.raises(ValueError, match="is streamed: call it with WorkerGroup.stream"):
        pair.call(streamed)
    with pytest.raises(ValueError, match="only the host's generator endpoints are streamed"):
        list(pair.stream("echo"))
    with pytest.raises(ValueError, match="has ranks 0..1, not \\[2\\]"):
        pair.call("echo", on=[2])


def test_worker_exception_names_rank_type_and_message(pair: WorkerGroup) -> None:
    with pytest.raises(WorkerRaisedError) as info:
        pair.call("explode", "bad value 42", on=1)
    message = str(info.value)
    assert f"pair[rank 1] pid {pair.infos[1].pid}" in message
    assert "explode()" in message and "ValueError: bad value 42" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert "explode" in info.value.remote_traceback
    # Every rank had finished: nothing is stuck, so the group stays usable.
    assert pair.call("all_reduce", 1.0) == [2.0, 2.0]


@pytest.mark.parametrize("cls", nrl_error_classes(), ids=lambda cls: cls.__name__)
def test_nrl_error_raised_in_a_worker_arrives_as_itself(pair: WorkerGroup, cls: type[NrlError]) -> None:
    expected = example_error(cls)
    with pytest.raises(cls) as info:
        pair.call("raise_example", cls)
    assert type(info.value) is cls and str(info.value) == str(expected)
    assert info.value.extra_attribute == expected.extra_attribute  # type: ignore[attr-defined]
    assert any(note.startswith("raised in pair[rank ") and "raise_example()" in note
               for note in info.value.__notes__), info.value.__notes__
    assert pair.call("all_reduce", 1.0) == [2.0, 2.0]  # both ranks raised; none is stuck


class _Algorithms:
    @hookimpl
    def nrl_algorithms(self) -> list[AlgorithmSpec]:
        return [AlgorithmSpec(name="user-error", entry="tests.core.cluster_workers:algorithm_with_user_error", distribution="t"),
                AlgorithmSpec(name="bug", entry="tests.core.cluster_workers:algorithm_with_bug", distribution="t")]


def test_cli_prints_a_worker_user_error_as_one_line_and_a_worker_bug_as_a_traceback(
        ray_session: None, example_backends: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(VALID)
    with get_plugin_manager().registered(_Algorithms(), name="test-algorithms"):
        user_code = main(["train", "user-error", "--config", str(config)])
        user_err = capsys.readouterr().err
        bug_code = main(["train", "bug", "--config", str(config)])
        bug_err = capsys.readouterr().err
    assert user_code == 2
    assert user_err.strip().splitlines() == ["error: policy.optimizer.kwargs.lr: must be non-negative, got -0.1"]
    assert bug_code == 1
    assert "cluster_workers.py\", line" in bug_err and "return a / b" in bug_err  # the remote traceback
    assert bug_err.strip().splitlines()[-1].startswith("error: algo[rank 0] pid ")
    assert "divide() raised ZeroDivisionError: float division by zero" in bug_err


def test_killed_worker_is_named_with_its_last_output_while_peer_blocks(ray_session: None) -> None:
    group = WorkerGroup(WORKER, 2, name="dying")
    pids = [w.pid for w in group.infos]
    marker = "last words of rank one 7f3a"
    started = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        group.call("die_during_all_reduce", 1, marker)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert f"dying[rank 1] pid {pids[1]} died" in message
    assert marker in message
    assert elapsed < 30, f"took {elapsed:.1f} s to report a dead worker"
    with pytest.raises(WorkerError, match="stopped after a failure"):
        group.call("whoami")
    assert _pids_gone(pids), "rank 0 (blocked in the all-reduce) should have been stopped"
    group.shutdown()


def test_rank_raising_while_peer_blocks_in_collective_does_not_hang(ray_session: None) -> None:
    group = WorkerGroup(WORKER, 2, name="halfway", error_grace_s=1.0)

    def rank1_raises(worker: object) -> float:
        if worker.rank == 1:  # type: ignore[attr-defined]
            raise KeyError("missing shard")
        return worker.all_reduce(1.0)  # type: ignore[attr-defined]

    started = time.monotonic()
    with pytest.raises(WorkerRaisedError) as info:
        group.call(WorkerHost.execute, rank1_raises)
    assert time.monotonic() - started < 30
    assert "halfway[rank 1]" in str(info.value) and "KeyError" in str(info.value)
    assert "ranks [0] were still running" in str(info.value)
    assert _pids_gone([w.pid for w in group.infos])
    group.shutdown()


def test_a_group_launched_unstarted_preloads_its_modules_then_starts_on_request(ray_session: None) -> None:
    """``start=False`` returns with the actors importing ``preload`` (the worker class, and with it
    the modules it names in ``lazy_imports``); the workers are built (and the process group joined)
    only by ``start``; a module that fails to import there stops nothing."""
    group = WorkerGroup(WORKER, 2, name="launched", init_kwargs={"tag": "early"},
                        preload=["no_such_module_anywhere", "no_such_module:Anywhere", WORKER], start=False)
    try:
        with pytest.raises(WorkerError, match="worker group 'launched' is not started: call start"):
            group.call("whoami")
        group.start()
        assert group.call("preloaded_before_build", "cluster_preloaded") == [True, True]
        assert [w["tag"] for w in group.call("whoami")] == ["early", "early"]
        assert group.call("all_reduce", 1.5) == [3.0, 3.0]
        with pytest.raises(WorkerError, match="already started"):
            group.start()
    finally:
        group.shutdown()


def test_a_group_shut_down_before_it_started_stops_its_actors_at_once(ray_session: None) -> None:
    group = WorkerGroup(WORKER, 2, name="never-started", preload=["cluster_preloaded"], start=False)
    pids = [ray.get(actor.describe.remote())["pid"] for actor in group.actors]
    began = time.monotonic()
    group.shutdown()
    assert time.monotonic() - began < 5.0  # no teardown call queued behind the imports
    assert _pids_gone(pids)
    with pytest.raises(WorkerError, match="is shut down"):
        group.start()


def test_constructor_failure_names_the_worker(ray_session: None) -> None:
    with pytest.raises(WorkerRaisedError) as info:
        WorkerGroup("cluster_workers:FailingInit", 2, name="failing")
    message = str(info.value)
    assert "failing[rank 1] pid" in message
    assert "cluster_workers:FailingInit" in message
    assert "RuntimeError: rank 1 found an impossible setting" in message


def test_gpus_per_node_counts_workers_on_a_cpu_only_cluster(ray_session: None) -> None:
    placement = make_placement({"gpus_per_node": 2, "num_nodes": 1, "cpus_per_worker": 0.1}, 2, name="cpu-pair")
    try:
        assert placement.num_workers == 2 and placement.num_gpus_per_worker == 0.0
    finally:
        placement.remove()


def test_colocated_groups_share_bundles_and_shutdown_stops_them(ray_session: None) -> None:
    shared = make_placement(CLUSTER, 2, name="shared", max_colocated_groups=2)
    assert shared.fraction == 0.5
    train = WorkerGroup(WORKER, 2, name="train", placement=shared)
    gen_placement = make_placement(CLUSTER, 2, colocate_with=shared)
    assert gen_placement.placement_group.id == shared.placement_group.id
    assert gen_placement.bundle_indices == shared.bundle_indices
    with WorkerGroup(WORKER, 2, name="gen", placement=gen_placement) as gen:
        # Two process groups side by side, each summing only its own ranks.
        futures = [train.call_async("all_reduce", 1.0), gen.call_async("all_reduce", 2.0)]
        assert [train.get(futures[0]), gen.get(futures[1])] == [[2.0, 2.0], [4.0, 4.0]]
        assert [w.node_id for w in train.infos] == [w.node_id for w in gen.infos]
        gen_pids = [w.pid for w in gen.infos]
    train_pids = [w.pid for w in train.infos]
    train.shutdown()
    train.shutdown()  # idempotent
    assert _pids_gone(gen_pids + train_pids)
    with pytest.raises(WorkerError, match="shut down"):
        train.call("whoami")
    for actor in train.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.describe.remote(), timeout=30)
    shared.remove()


def _wait_for_line(proc: subprocess.Popen[str], text: str, timeout_s: float) -> str:
    """Read ``proc``'s output until a line contains ``text``; what was read, for failure messages."""
    seen: list[str] = []
    found = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if text in line:
                found.set()
        found.set()  # the process ended; let the caller look

    threading.Thread(target=reader, daemon=True).start()
    found.wait(timeout_s)
    return "".join(seen)


_JOIN_SCRIPT = textwrap.dedent(
    """
    import ray
    from nrl_core.cluster import WorkerGroup, init_ray
    init_ray()
    assert ray.cluster_resources().get("nrl_join_probe") == 1, ray.cluster_resources()
    with WorkerGroup("cluster_workers:CollectiveWorker", 1, name="joined") as group:
        print("JOINED", ray.get_runtime_context().gcs_address, group.call("all_reduce", 5.0))
    """
)


def test_init_ray_joins_an_existing_cluster_from_ray_address() -> None:
    """A head started with ``ray start`` (its own temp dir, stopped by its pid afterwards)."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="nrlray", dir="/tmp")  # short: Ray's socket paths have a limit
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
         "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir,
         "--resources", '{"nrl_join_probe": 1}', "--block"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
        head_output = _wait_for_line(head, "Ray runtime started", timeout_s=60)
        run = subprocess.run([sys.executable, "-c", _JOIN_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, head_output + run.stdout[-2000:] + run.stderr[-3000:]
        assert "JOINED" in run.stdout and ":" + str(port) in run.stdout and "[5.0]" in run.stdout, run.stdout
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_distributed_timeout_minutes_is_the_main_groups_timeout(ray_session: None) -> None:
    """The key reaches the group the hosts create (it used to be a fixed 1800 s there)."""
    config = {"policy": {"megatron_cfg": {"distributed_timeout_minutes": 7}, "dtensor_cfg": {}}}
    assert distributed_timeout_s(config, "megatron_cfg") == 420.0
    assert distributed_timeout_s(config, "dtensor_cfg") == DEFAULT_TIMEOUT_S
    with WorkerGroup(WORKER, 2, name="timeout7", collective_timeout_s=distributed_timeout_s(config, "megatron_cfg")) as group:
        assert group.call("main_group_timeout_s") == [420.0, 420.0]


def test_a_rank_that_never_joins_fails_its_peer_after_the_group_timeout(ray_session: None) -> None:
    with WorkerGroup(WORKER, 2, name="short", collective_timeout_s=3.0, error_grace_s=1.0) as group:
        started = time.monotonic()
        with pytest.raises(WorkerRaisedError) as info:
            group.call("all_reduce_unless_rank", 1)
        elapsed = time.monotonic() - started
    assert 3.0 <= elapsed < 30, elapsed
    assert "short[rank 0]" in str(info.value) and "3000ms" in str(info.value), str(info.value)
