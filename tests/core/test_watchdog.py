"""The watchdog on real threads and a real Ray: limits from each phase's history, no alarm for a
first phase or steadily growing ones, and a rank stuck in a collective ended with one line, every
stack on disk and no actor left; the on-demand dump leaves the run going; the trace is valid JSON."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from nrl_core.cluster import WorkerGroup, init_ray
from nrl_core.config.core_schema import WATCHDOG
from nrl_core.errors import ConfigError
from nrl_core.stacks import SIGNAL, process_state
from nrl_core.watchdog import HangError, PhaseLimits, Watchdog, WatchdogSettings, phase

HERE = Path(__file__).resolve().parent
WORKER = "cluster_workers:CollectiveWorker"
CLUSTER = {"num_cpus": 2, "cpus_per_worker": 0.1, "log_to_driver": False}


def fast(tmp: Path, **settings: object) -> Watchdog:
    dog = Watchdog(WatchdogSettings(**settings), tmp)  # type: ignore[arg-type]
    dog.tick_s = dog.interrupt_after_s = 0.05
    return dog


def test_a_first_phase_gets_the_floor_then_a_multiple_of_its_slowest() -> None:
    limits = PhaseLimits(WatchdogSettings(floor_s=10, multiple=3, startup_s=99, phases={"reward": 7}))
    assert limits.limit("generation") == 10
    limits.record("generation", 2.0)
    assert limits.limit("generation") == 10  # the floor still rules
    limits.record("generation", 8.0)
    limits.record("generation", 5.0)
    assert limits.limit("generation") == 24  # the slowest, not the last
    assert limits.limit("start_up") == 99 and limits.limit("reward") == 7


def test_steadily_growing_phases_and_a_slow_first_one_raise_no_alarm(tmp_path: Path) -> None:
    with fast(tmp_path, floor_s=0.4, multiple=2) as dog:
        with phase("start_up"):
            time.sleep(0.6)  # above the floor: start-up has its own limit
        for seconds in (0.1, 0.15, 0.22, 0.33, 0.5, 0.75):  # each 1.5x the one before
            with phase("generation"):
                time.sleep(seconds)
    assert dog.error is None


def test_a_driver_stuck_in_itself_is_interrupted_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(HangError) as info:
        with fast(tmp_path, floor_s=0.3) as dog:
            with phase("reward"):
                time.sleep(60)
    message = str(info.value)
    assert "\n" not in message and "phase 'reward'" in message and "the driver" in message
    assert dog.error == message
    driver = next((tmp_path / "stacks").glob("*-hang-reward/driver-pid*.txt")).read_text()
    assert "test_a_driver_stuck_in_itself" in driver


@pytest.mark.parametrize("inner", ["training", "generation"])
def test_a_hang_inside_a_step_names_the_innermost_phase_and_its_knob(tmp_path: Path, inner: str) -> None:
    """Issue 62: with the floor setting every limit, the outer ``step`` (entered first) passed its
    limit first and was named, with the wrong knob. A step stuck between its phases, each of
    which finished in time, is still named once past its own limit."""
    for attempt in range(5):
        with pytest.raises(HangError) as info:
            with fast(tmp_path / f"{inner}-{attempt}", floor_s=0.3):
                with phase("step"):
                    time.sleep(0.05)  # the step's own work before the inner phase
                    with phase(inner):
                        time.sleep(60)
        message = str(info.value)
        assert f"phase '{inner}' did not finish" in message and message.endswith(f"raise watchdog.phases.{inner}")
    with pytest.raises(HangError) as info:
        with fast(tmp_path / "steps", floor_s=0.3, phases={"step": 0.5}):
            with phase("step"):
                for _ in range(2):
                    with phase("training"):
                        time.sleep(0.2)  # each in time
                time.sleep(60)  # stuck in the step itself
    assert "phase 'step' did not finish" in str(info.value)


@pytest.mark.parametrize("sigint", [signal.SIG_IGN, lambda signum, frame: None], ids=["ignored", "a-library-handler"])
def test_a_hang_is_interrupted_whatever_sigint_does_in_this_process(tmp_path: Path, sigint: object) -> None:
    """A job started in the background inherits SIGINT ignored, and libraries install handlers
    that swallow it: the watchdog's own signal still ends the blocked phase, and SIGINT is left
    as it was (nrl_core.interrupt)."""
    saved = signal.signal(signal.SIGINT, sigint)  # type: ignore[arg-type]
    try:
        started = time.monotonic()
        with pytest.raises(HangError, match="phase 'training' did not finish"):
            with fast(tmp_path, floor_s=0.3):
                with phase("training"):
                    time.sleep(30)
        assert time.monotonic() - started < 15
        assert signal.getsignal(signal.SIGINT) is sigint  # the interrupt came on the driver's own signal
    finally:
        signal.signal(signal.SIGINT, saved)


def test_bad_values_are_one_line_errors_naming_the_key() -> None:
    for section, key in (({"phases": {"trainin": 5}}, "watchdog.phases.trainin"),
                         ({"phases": {"training": 0}}, "watchdog.phases.training"),
                         ({"multiple": 0.5}, "watchdog.multiple")):
        with pytest.raises(ConfigError) as info:
            WATCHDOG.validate(section, "watchdog")
        assert info.value.key_path == key
    assert WATCHDOG.validate({}, "watchdog")["enabled"] is True


def test_on_demand_dump_then_a_rank_stuck_in_a_collective(worker_path: None, tmp_path: Path) -> None:
    init_ray(CLUSTER)
    group = WorkerGroup(WORKER, 2, name="pair")  # launched before the trace opens, as nrl train's early policy
    pids = [info.pid for info in group.infos]
    with pytest.raises(HangError) as info:
        with fast(tmp_path, floor_s=3):
            with phase("training"):
                group.call("all_reduce", 1.0)
            os.kill(os.getpid(), SIGNAL)  # what ``nrl stacks`` sends
            deadline = time.monotonic() + 20
            while not list((tmp_path / "stacks").glob("*-on_demand/status.txt")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert group.call("echo", 1) == [(0, (1,), {}), (1, (1,), {})]  # the run went on
            with phase("training"):
                group.call("all_reduce_unless_rank", 1)  # rank 0 waits for rank 1 forever
    message = str(info.value)
    assert "\n" not in message and "phase 'training'" in message and "pair[rank 0]" in message
    assert "pair[rank 1]" not in message and "waited 3 s" in message
    for reason in ("on_demand", "hang-training"):
        dump = next((tmp_path / "stacks").glob(f"*-{reason}"))
        # py-spy, where installed, adds a .native.txt per process beside each Python stack
        ranks = sorted(p.name for p in dump.glob("pair-rank*.txt") if not p.name.endswith(".native.txt"))
        assert ranks == [f"pair-rank{r}-pid{pid}.txt" for r, pid in enumerate(pids)], (dump / "status.txt").read_text()
        assert list(dump.glob("driver-pid*.txt"))
    stuck = next((tmp_path / "stacks").glob("*-hang-training")) / f"pair-rank0-pid{pids[0]}.txt"
    assert "all_reduce" in stuck.read_text()
    deadline = time.monotonic() + 15
    while any(process_state(pid) not in (None, "Z") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(process_state(pid) in (None, "Z") for pid in pids)
    trace = json.loads((tmp_path / "trace.json").read_text())
    driver = [e for e in trace if e.get("tid") == "driver"]
    assert [e["name"] for e in driver] == ["training", "training"] and all(e["ph"] == "X" for e in driver)
    rows = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert rows == {pids[0]: "pair rank 0", pids[1]: "pair rank 1"}
    for pid in pids:  # each rank's own spans, on its own row
        served = [e["name"] for e in trace if e["ph"] == "X" and e["pid"] == pid]
        assert served[:2] == ["all_reduce", "echo"], served
    assert "all_reduce_unless_rank" in [e["name"] for e in trace if e["pid"] == pids[1]]  # rank 1 returned
    assert "all_reduce_unless_rank" not in [e["name"] for e in trace if e["pid"] == pids[0]]  # rank 0 never did


def test_a_stack_file_left_by_a_dead_process_never_gets_its_pid_signalled(tmp_path: Path) -> None:
    """The kernel reuses pids: a stack file older than the process with that pid was left by a dead
    one, and SIGUSR1 would kill a process without the handler. Neither the dump nor ``nrl stacks``
    (a driver.pid left by a killed run) signals it."""
    import subprocess
    import sys

    from nrl_core import stacks
    from nrl_core.errors import NrlError
    from nrl_core.watchdog import PID_FILE, request_stacks

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale = stacks.stack_file(victim.pid)
    try:
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("")
        hour_ago = time.time() - 3600
        os.utime(stale, (hour_ago, hour_ago))
        assert not stacks.answers_stack_signal(victim.pid)
        status = stacks.dump_processes([stacks.StackTarget("victim", victim.pid)], tmp_path, wait_s=0.5)
        assert status["victim"] == "no stack handler installed"
        (tmp_path / PID_FILE).write_text(str(victim.pid))
        with pytest.raises(NrlError, match=f"the driver \\(pid {victim.pid}\\) is gone"):
            request_stacks(tmp_path, timeout_s=1)
        time.sleep(0.3)
        assert victim.poll() is None  # never signalled
        stale.touch()  # opened after the process started: what install_stack_dump does
        assert stacks.answers_stack_signal(victim.pid)
    finally:
        victim.kill()
        victim.wait()
        stale.unlink(missing_ok=True)
