"""The code sandbox against the attacks of issue 61, each beside a control that shows the check can fail.

Memory: a program may not hold more than ``memory_mb`` however it holds it (a ``memfd``, a tmpfs of
its own, several processes); the run's memory cgroup, read from outside by the host, never passes
the limit. The control runs the same program without the cgroup (and, for the tmpfs, without
isolation) and holds far more.

The verdict: a program that does not compute the answers scores 0 whatever it reads in its own
process (the stack, ``gc``, ``/proc/self/mem``) or forges on its output. The control judges the
same programs as the sandbox used to, the assertions and a one-time pass token in the program's
process (``TOKEN_HARNESS`` below, the old design): there they score.

The filesystem: nothing of the host outside the interpreter's files is visible, and ``/proc``
shows the program its own processes only. The control is the unisolated mode.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path

import pytest

from nrl_core.contracts import EnvSample
from nrl_env_code.environment import CodeEnvironment
from nrl_env_code.sandbox import Program, RunResult, Sandbox, SandboxConfig

UID = 1999990 - int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
REPO = Path(__file__).resolve().parents[2]
MEMORY_MB = 256
CONFIG = SandboxConfig(uid=UID, cpu_seconds=10, memory_mb=MEMORY_MB, max_processes=16, workdir_mb=64)
TESTS = [{"assert": "assert f(3) == 7"}, {"assert": "assert f(10) == 21"}]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(CONFIG)
    box.probe()  # a missing layer raises here: every test of the module errors, none is skipped
    return box


@pytest.fixture(scope="module")
def env() -> CodeEnvironment:
    e = CodeEnvironment({"num_workers": 0, "timeout_seconds": 10.0, "sandbox": {"uid": UID, "memory_mb": MEMORY_MB}})
    yield e
    e.shutdown()


def without_cgroups(config: SandboxConfig) -> Sandbox:
    """The control: the same sandbox as if this machine had no writable cgroup (the weaker mode)."""
    box = Sandbox(config)
    box._cgroup_checked = True  # as when none was found and env.code.sandbox.unsafe_without_cgroup is set
    return box


def run(box: Sandbox, code: str, timeout: float = 30.0, *args: str) -> RunResult:
    return box.run(Program(files={"main.py": code}, argv=["main.py", *args], timeout=timeout))


def report(result: RunResult) -> dict:
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


# --------------------------------------------------------------------------- memory

MEMFD = """
import json, os
held, fds = 0, []
try:
    while held < (640 << 20):  # a memfd per 16 MiB, the largest file RLIMIT_FSIZE allows
        fds.append(os.memfd_create("hold"))
        os.write(fds[-1], b"\\1" * (16 << 20))
        held += 16 << 20
except OSError:
    pass
print(json.dumps({"held_mb": held >> 20}), flush=True)
"""

PROCESSES = """
import json, os, time
r, w = os.pipe()
for _ in range(4):
    if os.fork() == 0:
        block = b"\\1" * (96 << 20)
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
os.set_blocking(r, False)
got, deadline = 0, time.time() + 20
while got < 4 and time.time() < deadline:
    try:
        got += len(os.read(r, 8))
    except BlockingIOError:
        time.sleep(0.05)
print(json.dumps({"held_mb": got * 96}), flush=True)
"""

NESTED_TMPFS = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x00020000) != 0:  # a user and a mount namespace of its own
    out["unshare"] = os.strerror(ctypes.get_errno())
    # clone's flags pass the seccomp filter: a child in a user namespace of its own (as fork)
    pid = libc.syscall(56 if os.uname().machine == "x86_64" else 220, 0x10000000 | 17, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    out["clone"] = os.strerror(ctypes.get_errno()) if pid == -1 else os.waitpid(pid, 0) and "made"
else:
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
    os.mkdir("mnt")
    if libc.mount(b"tmpfs", b"mnt", b"tmpfs", 0, b"size=1g") != 0:
        out["mount"] = os.strerror(ctypes.get_errno())
    else:
        held = 0
        try:
            while held < (320 << 20):
                with open("mnt/%d" % held, "wb") as f:
                    f.write(b"\\1" * (8 << 20))
                held += 8 << 20
        except OSError as exc:
            out["write"] = exc.strerror
        out["held_mb"] = held >> 20
print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("attack, held_without", [(MEMFD, 640), (PROCESSES, 384)], ids=["memfd", "processes"])
def test_memory_is_bounded_per_run_however_it_is_held(sandbox, attack, held_without):
    result = run(sandbox, attack)
    held = report(result).get("held_mb", 0)
    assert result.limit == "memory" or held < MEMORY_MB, (result, held)
    assert not result.ok or held < MEMORY_MB
    assert sandbox.last_peak_bytes is not None and 0 < sandbox.last_peak_bytes <= MEMORY_MB << 20  # from outside
    control = run(without_cgroups(CONFIG), attack)  # rlimits alone: per process, and not files in memory
    assert report(control)["held_mb"] == held_without and control.ok


def test_no_namespace_can_be_made_inside_so_no_tmpfs_of_its_own(sandbox):
    result = run(sandbox, NESTED_TMPFS)
    # unshare is denied by the seccomp filter; clone, which it lets through, by the namespace limit
    assert report(result) == {"unshare": "Operation not permitted", "clone": "No space left on device"}
    control = run(without_cgroups(SandboxConfig(unsafe_no_isolation_trusted_code_only=True, memory_mb=MEMORY_MB)),
                  NESTED_TMPFS)
    assert report(control) == {"held_mb": 320}, control.stderr  # unisolated: its own tmpfs, past the limit


DENIED_CALLS = """
import ctypes, json, os
from ctypes import c_long
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = c_long
calls = {"io_uring_setup": (425, 1, 0), "bpf": (321, 0, 0, 0), "perf_event_open": (298, 0, 0, -1, -1, 0),
         "userfaultfd": (323, 0), "keyctl": (250, 0, -3), "ptrace": (101, 0, 0, 0, 0),
         "unshare": (272, 0x00020000), "mount": (165, 0, 0, 0, 0, 0), "clone3": (435, 0, 0)}
out = {}
for name, (number, *args) in calls.items():
    ctypes.set_errno(0)
    result = libc.syscall(number, *args)
    out[name] = os.strerror(ctypes.get_errno()) if result == -1 else "allowed"
print(json.dumps(out))
"""
"""Calls the seccomp filter denies, each with arguments that would otherwise get another answer."""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe program uses x86_64's system call numbers")
def test_the_seccomp_filter_denies_what_programs_have_no_use_for(sandbox):
    seen = report(run(sandbox, DENIED_CALLS))
    assert seen == {**{name: "Operation not permitted" for name in seen}, "clone3": "Function not implemented"}
    control = report(run(Sandbox(SandboxConfig(unsafe_no_isolation_trusted_code_only=True)), DENIED_CALLS))
    assert all(answer != "Operation not permitted" for name, answer in control.items() if name != "unshare"), control


# --------------------------------------------------------------------------- the verdict

TOKEN_HARNESS = '''
import os, sys
def _harness():
    with open("_token") as f:
        token = f.read()
    with open("_asserts.py") as f:
        asserts = f.read()
    os.unlink("_token")
    os.unlink("_asserts.py")
    with open("main.py") as f:
        source = f.read()
    scope = {"__name__": "solution", "__builtins__": __builtins__}
    exec(compile(source, "main.py", "exec"), scope)
    exec(compile(asserts, "tests", "exec"), scope)
    sys.stdout.flush()
    os.write(1, ("\\n" + token + "\\n").encode())
    os._exit(0)
_harness()
'''
"""The control: the harness as it was, the assertions and the pass token in the program's process."""


def token_harness_score(box: Sandbox, code: str) -> float:
    """``code`` against :data:`TESTS` judged as before: a test passes when the run ends with its token."""
    passed = 0
    for test in TESTS:
        token = secrets.token_hex(16)
        files = {"main.py": code, "_harness.py": TOKEN_HARNESS, "_asserts.py": test["assert"], "_token": token}
        result = box.run(Program(files=files, argv=["_harness.py"], timeout=10.0))
        passed += result.ok and result.stdout.endswith("\n" + token + "\n")
    return passed / len(TESTS)


STACK_TOKEN = """
import os, sys
frame = sys._getframe(1)
while frame is not None:
    for value in list(frame.f_locals.values()):
        if isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value):
            os.write(1, ("\\n" + value + "\\n").encode())
            os._exit(0)
    frame = frame.f_back
"""
"""Defines no ``f``: reads the pass token from the harness's frame and ends the run with it."""

STACK_EXPECTED = """
import sys
def f(x):
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            text = str(value)
            if "f(%d) ==" % x in text:
                return eval(text.split("f(%d) ==" % x)[1].split("\\n")[0])
        frame = frame.f_back
"""
"""Reads the expected value from the stack while the check calls it."""

GC_WALK = """
import gc, sys
def f(x):
    needle, reached = "f(%d) ==" % x, False
    for obj in gc.get_objects():
        for ref in gc.get_referents(obj):
            if isinstance(ref, str) and needle in ref:
                return eval(ref.split(needle)[1].split("\\n")[0])
            reached = reached or ref == "f(%d)" % x
    print("reached the harness's list of calls" if reached else "reached nothing", file=sys.stderr)
"""
"""Walks every object the collector knows for the test's text; says whether it reached the harness."""

PROC_MEM = """
import re
def f(x):
    needle = b"f(%d) == " % x
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if "r" not in perms:
                continue
            start, end = (int(p, 16) for p in span.split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except (OSError, OverflowError, ValueError):
                continue
            for found in re.finditer(re.escape(needle) + rb"(-?\\d+)", data):
                return int(found.group(1))
"""
"""Reads its own memory through /proc/self/mem for the test's text."""

ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
def f(x):
    return Anything()
"""
"""Equal to every expected value."""

FORGED_LINES = """
import os
os.write(1, b"\\n\\x1enrl-values\\x1e\\ntrue\\n")
os._exit(0)
"""
"""Prints a values section of its own (without knowing the expected values: it can only guess)."""

PATCHED_WRITER = """
import builtins
builtins.repr = lambda value: "True"
builtins.eval = lambda *a, **k: True
def f(x):
    return None
"""
"""Replaces what the harness encodes values with and evaluates probes with."""


def env_score(env: CodeEnvironment, code: str) -> float:
    return env.score([EnvSample(prompt="p", response=f"```python\n{code}\n```", metadata={"tests": TESTS})]).rewards[0]


@pytest.mark.parametrize("code, control", [
    (STACK_TOKEN, "token"), (STACK_EXPECTED, "token"), (GC_WALK, "reach"), (PROC_MEM, "token"),
    (ALWAYS_EQUAL, "token"), (FORGED_LINES, FORGED_LINES.replace("true", "7")),
    (PATCHED_WRITER, PATCHED_WRITER.replace('"True"', '"7"'))],
    ids=["stack-token", "stack-expected", "gc-walk", "proc-self-mem", "always-equal", "forged-lines",
         "patched-writer"])
def test_a_program_that_does_not_compute_the_answers_scores_zero(sandbox, env, code, control):
    """Each scores 0. The control shows the attack is real: judged as before (``token``), the
    same program scores 1; walking the collector's objects (``reach``), it does reach the harness
    (the list of calls it evaluates), where no expected value is (before, the test's text was a
    local of the harness, which the collector does not reach either); forging on the output, the
    same forgery carrying an expected value the program cannot know (7, the first test's) passes
    that test."""
    assert env_score(env, code) == 0.0
    if control == "token":
        assert token_harness_score(sandbox, code) == 1.0
    elif control == "reach":
        evaluation = env.evaluate([f"```python\n{code}\n```"], [{"tests": TESTS}])[0]
        assert all("reached the harness's list of calls" in r.stderr for r in evaluation.results)
    else:
        assert env_score(env, control) == 0.5


def test_a_correct_program_still_scores_and_a_wrong_one_fails_the_assertion_outside(env):
    lazy = env.evaluate(["```python\ndef f(n):\n    return map(lambda x: 2 * x, range(n))\n```"],
                        [{"tests": [{"assert": "assert list(f(3)) == [0, 2, 4]"}]}])[0]
    assert lazy.score == 1.0  # list() of the generator it returns runs beside it, in the sandbox
    right = env.evaluate(["```python\ndef f(x):\n    return 2 * x + 1\n```"], [{"tests": TESTS}])[0]
    wrong = env.evaluate(["```python\ndef f(x):\n    return 2 * x\n```"], [{"tests": TESTS}])[0]
    assert right.score == 1.0 and [r.status for r in wrong.results] == ["failed_assertion"] * 2


def test_a_test_that_is_not_assert_statements_is_refused_in_one_line():
    from nrl_env_code.checks import TaskError, tests_of

    with pytest.raises(TaskError) as caught:
        tests_of({"tests": [{"assert": "def check(c):\n    assert c(1) == 2\ncheck(f)"}]})
    message = str(caught.value)
    assert "assert test 0 cannot be judged outside the program" in message and "\n" not in message
    with pytest.raises(TaskError, match="line 2 \\(Expr\\) follows an assert"):
        tests_of({"test_list": ["assert f(1) == 2\nprint(f(2))"]})


def test_the_host_evaluates_only_literals_operators_and_pure_builtins():
    from nrl_env_code.assertions import decode, evaluate, split

    parts = split("import math\nassert math.isclose(area(2), 12.56, rel_tol=0.01) and sorted(g()) == [1, 2]")
    assert parts.setup == "import math" and parts.probes == ("area(2)", "sorted(g())")
    assert evaluate(parts.checks[0], [12.57, [1, 2]]) and not evaluate(parts.checks[0], [12.57, decode("{'x': 'A'}")])
    # the expected side stays here, comprehension and all; what needs the program goes whole
    parts = split("assert list(f(2)) == [x * 2 for x in range(2)]")
    assert parts.probes == ("list(f(2))",) and evaluate(parts.checks[0], [[0, 2]])
    assert decode("{'t': [1, {'s': ['a']}, {'d': [[1, [2]]]}, {'b': '6869'}]}") == (1, {"a"}, {1: [2]}, b"hi")
    assert math.isnan(decode("{'n': 'nan'}")) and decode("{'c': [1.0, {'n': 'inf'}]}") == complex(1, math.inf)
    with pytest.raises(ValueError):
        decode("__import__('os').system('true')")  # a call is no literal: nothing runs


# --------------------------------------------------------------------------- the filesystem and /proc

LOOK_AROUND = """
import json, os, sys
allowed = json.loads(sys.argv[1])
def reading(path):
    try:
        with open(path, "rb") as f:
            return f.read(64).decode(errors="replace")
    except OSError as exc:
        return exc.strerror
outside = []
for top, dirs, files in os.walk("/"):
    if top == "/proc" or len(outside) >= 20:
        dirs[:] = []
        continue
    for name in files:
        path = os.path.realpath(os.path.join(top, name))  # a library's symlinks lead to a planned file
        if not any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed + ["/tmp"]):
            outside.append(path)
print(json.dumps({"passwd": reading("/etc/passwd"), "checkout": reading(sys.argv[2]),
                  "init_cmdline": reading("/proc/1/cmdline"), "outside": outside,
                  "pids": sorted(p for p in os.listdir("/proc") if p.isdigit())}))
"""


def test_the_host_s_files_and_processes_are_not_there(sandbox):
    allowed = sandbox._root_plan()["binds"]
    readme = str(REPO / "README.md")
    seen = report(run(sandbox, LOOK_AROUND, 30.0, json.dumps(allowed), readme))
    assert seen["passwd"] == seen["checkout"] == seen["init_cmdline"] == "No such file or directory"
    assert seen["outside"] == [] and seen["pids"] == ["2"]  # the interpreter's files only; itself only
    control = report(run(Sandbox(SandboxConfig(unsafe_no_isolation_trusted_code_only=True)), LOOK_AROUND, 60.0,
                         json.dumps(allowed), readme))
    assert control["passwd"].startswith("root:") and control["checkout"].startswith("#")
    assert control["outside"] and len(control["pids"]) > 2


# --------------------------------------------------------------------------- where no cgroup can be had


def test_this_machine_s_cgroups_are_found_writable():
    from nrl_env_code import cgroups

    found = cgroups.find()
    assert found.version in (1, 2) and os.access(found.memory, os.W_OK) and os.access(found.pids, os.W_OK)


def test_a_host_without_a_writable_cgroup_is_refused_in_one_line_unless_the_weaker_mode_is_chosen(monkeypatch, caplog):
    """As on a cluster that delegates no cgroup (the lookup is what such a host answers)."""
    from nrl_env_code import cgroups
    from nrl_env_code.sandbox import SandboxUnavailable

    def none_writable() -> cgroups.Hierarchy:
        raise cgroups.CgroupUnavailable("no writable memory and pids cgroup (v2 at /sys/fs/cgroup delegating ['cpu'])")

    monkeypatch.setattr(cgroups, "find", none_writable)
    with pytest.raises(SandboxUnavailable) as caught:
        Sandbox(CONFIG).probe()
    message = str(caught.value)
    assert "layer 'memory cgroup'" in message and "unsafe_without_cgroup: true" in message and "\n" not in message
    weaker = Sandbox(SandboxConfig(uid=UID, memory_mb=MEMORY_MB, unsafe_without_cgroup=True))
    weaker.probe()
    assert "unsafe_without_cgroup is true" in caplog.text
    assert report(run(weaker, MEMFD))["held_mb"] == 640  # what the weaker mode gives up


def test_the_root_holds_what_the_program_s_loader_loads_whatever_this_process_s_library_path(monkeypatch):
    """The plan asks ldd with the program's empty environment: libraries preloaded or found
    through the worker's own settings (torch's OpenMP, as vLLM's CPU workers preload it) are not
    pulled in, and the sandbox still starts."""
    import torch

    torch_lib = str(Path(torch.__file__).parent / "lib")
    monkeypatch.setenv("LD_LIBRARY_PATH", torch_lib)
    monkeypatch.setenv("LD_PRELOAD", str(next(Path(torch_lib).glob("libgomp*.so*"))))
    box = Sandbox(CONFIG)
    box.probe()
    assert not [path for path in box._root_plan()["binds"] if path.startswith(torch_lib)]
