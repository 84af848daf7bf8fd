"""The code sandbox (nrl-env-code) against hostile programs, for real: nothing here is mocked or skipped.

Every containment test uses the real sandbox, probed first (the ``sandbox`` fixture), so a machine that cannot provide a layer
fails these tests (``SandboxUnavailable`` names the layer); it never passes them by skipping. Each
containment test runs one hostile program and checks three things: the program did not get what it
went for (its own report, and the host's state), the run ended with an error or a limit (so the
reward is 0), and nothing it started is still running (no process of the sandbox's uid, no child of
this process). ``test_the_checks_catch_an_unisolated_run`` runs some of the same programs without
isolation to show the checks do fail when a layer is missing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nrl_env_code.launch import LAUNCHER
from nrl_env_code.sandbox import Program, RunResult, Sandbox, SandboxConfig

# This module's own sandbox uid, one per pytest-xdist worker: any process of it after a run was left
# behind, and a test of this module on the other worker runs its programs under another.
UID = 1999997 - int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
REPO = Path(__file__).resolve().parents[2]
CONFIG = SandboxConfig(uid=UID, cpu_seconds=5, memory_mb=256, max_processes=16, workdir_mb=64, file_size_mb=16)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(CONFIG)
    box.probe()  # a missing layer raises here: every test of the module errors, none is skipped
    return box


def left_running(*hosts: int) -> list[str]:
    """What sandbox runs left behind: processes of the sandbox's uid anywhere on the machine, and the
    launchers (with the init each forks) that this process or one of ``hosts`` started, alive or
    not yet reaped. A launcher names its host in its command line, so nothing else running here
    counts: a Ray another test left, or the sandboxes of a test on another worker."""
    ours = {str(os.getpid()), *map(str, hosts)}
    left = []
    for process in psutil.process_iter(["uids", "name", "cmdline"]):
        uids, command = process.info["uids"], process.info["cmdline"] or []
        if (uids is not None and UID in (uids.real, uids.effective)) or (LAUNCHER in command and command[-1] in ours):
            left.append(f"{process.pid} {process.info['name']}")
    return left


def run(box: Sandbox, code: str, timeout: float = 5.0, stdin: str = "", *args: str) -> RunResult:
    result = box.run(Program(files={"main.py": code}, argv=["main.py", *args], stdin=stdin, timeout=timeout))
    assert left_running() == [], "a sandboxed process outlived its run"
    return result


def report(result: RunResult) -> dict:
    """The JSON line the hostile program printed last about what it managed."""
    return json.loads(result.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- time, processes, memory


def test_an_infinite_loop_is_killed_at_the_wall_time_limit(sandbox):
    start = time.monotonic()
    result = run(sandbox, "while True:\n    pass\n", timeout=1.0)
    assert result.limit == "wall_time" and result.exit_code is None and not result.ok
    assert time.monotonic() - start < 5.0


def test_a_cpu_bound_loop_is_killed_at_the_cpu_time_limit(sandbox):
    box = Sandbox(SandboxConfig(uid=UID, cpu_seconds=1))
    result = run(box, "while True:\n    pass\n", timeout=30.0)
    assert result.limit == "cpu_time" and result.signal in (signal.SIGXCPU, signal.SIGKILL)


def test_a_fork_bomb_is_capped_by_rlimit_nproc_and_killed_whole(sandbox):
    counted = run(sandbox, """
import json, os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError as exc:
    print(json.dumps({"children": children, "error": exc.errno}))
""")
    assert report(counted)["children"] < CONFIG.max_processes  # RLIMIT_NPROC binds: the uid is not root
    bomb = run(sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
               timeout=1.5)
    assert bomb.limit == "wall_time"


def test_a_memory_bomb_gets_a_memory_error(sandbox):
    result = run(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n")
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_output_beyond_the_cap_kills_the_run(sandbox):
    result = run(sandbox, "while True:\n    print('x' * 1000)\n")
    assert result.limit == "output" and len(result.stdout) <= CONFIG.output_limit_bytes


# --------------------------------------------------------------------------- the filesystem


WRITE_1GB = """
import json, sys
written = 0
try:
    with open(sys.argv[1], "wb") as f:
        for _ in range(1024):
            f.write(b"0" * (1 << 20))
            f.flush()
            written += 1 << 20
except OSError as exc:
    print(json.dumps({"written": written, "error": exc.strerror}))
    sys.exit(1)
print(json.dumps({"written": written, "error": None}))
"""


def test_a_1gb_write_stops_at_the_file_size_limit(sandbox):
    result = run(sandbox, WRITE_1GB, 5.0, "", "big.bin")
    seen = report(result)
    assert result.exit_code == 1 and seen["error"] == "File too large" and seen["written"] <= CONFIG.file_size_mb << 20


def test_a_1gb_write_stops_at_the_workdir_size_when_files_may_be_larger(sandbox):
    box = Sandbox(SandboxConfig(uid=UID, file_size_mb=4096, workdir_mb=32))
    result = run(box, WRITE_1GB, 10.0, "", "big.bin")
    seen = report(result)
    assert result.exit_code == 1 and seen["error"] == "No space left on device" and seen["written"] <= 32 << 20


def test_writes_outside_the_working_directory_fail_and_leave_nothing(sandbox, tmp_path):
    targets = [str(REPO / "tests" / "plugins" / "sandbox_escape.txt"), "/etc/sandbox_escape.txt",
               "/root/sandbox_escape.txt", "/var/tmp/sandbox_escape.txt", "/dev/shm/sandbox_escape.txt",
               "/run/sandbox_escape.txt", str(tmp_path / "sandbox_escape.txt"), "/sandbox_escape.txt"]
    result = run(sandbox, """
import json, os, sys
written = []
for path in json.loads(sys.argv[1]):
    try:
        with open(path, "w") as f:
            f.write("escaped")
        written.append(path)
    except OSError:
        pass
try:
    os.mkdir("/sandbox_escape_dir")
    written.append("/sandbox_escape_dir")
except OSError:
    pass
with open("inside.txt", "w") as f:  # the working directory is writable
    f.write("fine")
print(json.dumps({"written": written}))
""", 5.0, "", json.dumps(targets))
    assert result.exit_code == 0 and report(result)["written"] == []
    assert [t for t in [*targets, "/sandbox_escape_dir"] if os.path.exists(t)] == []


# --------------------------------------------------------------------------- network


def test_a_connection_to_a_port_listening_on_localhost_fails(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        result = run(sandbox, """
import json, socket, sys
port = int(sys.argv[1])
outcomes = {}
for host in ("127.0.0.1", "localhost", "::1"):
    try:
        socket.create_connection((host, port), timeout=2).close()
        outcomes[host] = "connected"
    except OSError as exc:
        outcomes[host] = exc.strerror or type(exc).__name__
print(json.dumps(outcomes))
""", 10.0, "", str(port))
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.exit_code == 0 and "connected" not in report(result).values()


# --------------------------------------------------------------------------- secrets and descriptors


PARENT = """
import json, os, sys
from nrl_env_code.sandbox import Program, Sandbox, SandboxConfig
box = Sandbox(SandboxConfig(uid=int(sys.argv[1]), unsafe_no_isolation_trusted_code_only=sys.argv[2] == "unsafe"))
result = box.run(Program(files={"main.py": sys.stdin.read()}, argv=["main.py", str(os.getpid())], timeout=10.0))
print(json.dumps(result.to_dict()))
"""

READ_SECRETS = """
import json, os, sys
def environ(pid):
    try:
        return open("/proc/%s/environ" % pid, "rb").read().decode(errors="replace")
    except OSError as exc:
        return exc.strerror
visible = sorted(p for p in os.listdir("/proc") if p.isdigit())
print(json.dumps({"environ": os.environ.get("NRL_CODE_TEST_SECRET"), "keys": sorted(os.environ),
                  "real_parent": environ(sys.argv[1]), "ppid": environ(os.getppid()), "visible": visible,
                  "all": {pid: environ(pid) for pid in visible}}))
"""


def run_under_a_parent_with_a_secret(code: str, secret: str, unsafe: bool = False) -> RunResult:
    """``code`` run by a process started with ``NRL_CODE_TEST_SECRET`` in its environment (so its
    /proc/<pid>/environ holds it, as a Ray worker's holds its secrets); the program gets that pid.
    Nothing the run started is left running."""
    env = {**os.environ, "NRL_CODE_TEST_SECRET": secret}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(UID), "unsafe" if unsafe else "isolated"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    stdout, stderr = parent.communicate(code, timeout=120)
    assert parent.returncode == 0, stderr
    assert left_running(parent.pid) == []
    return RunResult(**json.loads(stdout.splitlines()[-1]))


def test_the_parent_s_environment_is_not_readable(sandbox):
    secret = f"nrl-secret-{os.getpid()}-{time.monotonic_ns()}"
    result = run_under_a_parent_with_a_secret(READ_SECRETS, secret)
    seen = report(result)
    assert secret not in result.stdout + result.stderr
    assert seen["environ"] is None and set(seen["keys"]) <= {"LC_CTYPE"}  # set by Python itself (PEP 538)
    assert seen["real_parent"] == "No such file or directory"  # a fresh /proc of its own PID namespace
    assert seen["visible"] == ["2"]  # the program only: /proc hides the sandbox's init (PID 1)
    assert seen["ppid"] == "No such file or directory"  # init, hidden (root's, and started with an empty environment)


def test_no_descriptor_of_the_parent_is_inherited(sandbox, tmp_path):
    with open(tmp_path / "held.txt", "w"), socket.socket() as held_socket:
        held_socket.bind(("127.0.0.1", 0))
        result = run(sandbox, "import json, os\nprint(json.dumps(sorted(int(fd) for fd in os.listdir('/proc/self/fd'))))\n")
    assert json.loads(result.stdout)[:3] == [0, 1, 2] and len(json.loads(result.stdout)) == 4  # + listdir's own


# --------------------------------------------------------------------------- killing and escaping


def test_killing_the_parent_fails_and_this_process_survives(sandbox):
    result = run(sandbox, """
import json, os, signal, sys
outcomes = {}
for name, pid in (("ppid", os.getppid()), ("test_process", int(sys.argv[1])), ("everyone", -1)):
    try:
        os.kill(pid, signal.SIGKILL)
        outcomes[name] = "sent"
    except OSError as exc:
        outcomes[name] = exc.strerror
print(json.dumps(outcomes))
""", 5.0, "", str(os.getpid()))
    seen = report(result)
    assert seen["ppid"] == "Operation not permitted"  # PID 1 of its namespace belongs to root
    assert seen["test_process"] == "No such process"  # not in its PID namespace
    assert psutil.pid_exists(os.getpid())


def test_a_setsid_daemon_dies_with_the_run(sandbox):
    start = time.monotonic()
    result = run(sandbox, """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            time.sleep(0.1)
    os._exit(0)
time.sleep(0.2)
print("parent done")
""")
    assert result.ok and result.stdout == "parent done\n" and time.monotonic() - start < 5.0


def test_a_background_process_left_behind_dies_with_the_run(sandbox):
    result = run(sandbox, """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
subprocess.Popen([sys.executable, "-c", "import os, time; os.setpgid(0, 0); time.sleep(600)"])
print("left them running")
""")
    assert result.ok and result.stdout == "left them running\n"


HOST = """
import sys
from nrl_env_code.sandbox import Program, Sandbox, SandboxConfig
box = Sandbox(SandboxConfig(uid=int(sys.argv[1])))
print("running", flush=True)
box.run(Program(files={"main.py": "import time\\nwhile True:\\n    time.sleep(1)\\n"}, argv=["main.py"], timeout=600))
"""


def test_a_host_killed_mid_run_takes_its_sandbox_with_it(sandbox):
    """A sandbox worker killed while a program runs (Ray kills workers) leaves nothing running:
    the launcher dies with its host, init with the launcher, the namespace with init."""
    host = subprocess.Popen([sys.executable, "-c", HOST, str(UID)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline() == "running\n"
        deadline = time.monotonic() + 30
        while not any(UID in (p.uids().real, p.uids().effective) for p in psutil.process_iter()
                      if p.is_running() and p.status() != psutil.STATUS_ZOMBIE):  # the program is up
            assert time.monotonic() < deadline, "the sandboxed program never started"
            time.sleep(0.1)
        host.kill()
        host.wait()
        deadline = time.monotonic() + 10
        while left_running(host.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left_running(host.pid) == [], "a sandbox outlived the process that started it"
    finally:
        host.kill()
        host.wait()


def test_the_sandbox_goes_on_running_programs_after_hostile_ones(sandbox):
    assert run(sandbox, "print(int(input()) * 2)\n", stdin="21\n").stdout == "42\n"


# --------------------------------------------------------------------------- the checks can fail


def test_the_checks_catch_an_unisolated_run(tmp_path):
    """Without isolation the same programs read the secret, connect and write outside: the checks
    above fail on a sandbox missing those layers."""
    secret = f"nrl-secret-{time.monotonic_ns()}"
    leaked = run_under_a_parent_with_a_secret(READ_SECRETS, secret, unsafe=True)
    assert secret in leaked.stdout
    unsafe = Sandbox(SandboxConfig(unsafe_no_isolation_trusted_code_only=True))
    target = tmp_path / "escaped.txt"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        code = f"""
import socket
socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=2).close()
open({str(target)!r}, "w").write("escaped")
"""
        result = unsafe.run(Program(files={"main.py": code}, argv=["main.py"], timeout=10.0))
    assert result.ok and target.exists()
