"""A task's tests, each turned into one sandboxed run, and each run judged.

Tests come in a task's metadata in one of three shapes (the datasets they come from use them):

* ``tests``: a list of ``{"input": ..., "output": ...}`` (stdin/stdout) and ``{"assert": ...}``
  (assert-style) cases, each with an optional ``timeout`` in seconds;
* ``test_list`` (MBPP): assert statements, with ``test_setup_code`` run before them;
* ``input_output`` (APPS): ``{"inputs": [...], "outputs": [...]}``, possibly as a JSON string.

Every test is its own run, with its own wall-time limit, so one test that hangs costs only itself.
A stdin/stdout test passes when the program exits 0 and its output equals the expected output
line by line, trailing whitespace and blank lines aside. An assert test passes when the program,
then the assertions, ran to the end: the harness prints a one-time token the program never sees
on disk (it is deleted before the program starts), so ``exit(0)`` or ``os._exit(0)`` before the
assertions is a failure, not a pass.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from nrl_core.errors import NrlError
from nrl_env_code.sandbox import Program, RunResult

__all__ = ["TestCase", "TestResult", "judge", "program_for", "tests_of"]

MAIN = "main.py"
HARNESS = "_harness.py"
ASSERTS = "_asserts.py"
TOKEN = "_token"

HARNESS_SOURCE = f'''
import os, sys
def _harness():
    with open("{TOKEN}") as f:
        token = f.read()
    with open("{ASSERTS}") as f:
        asserts = f.read()
    os.unlink("{TOKEN}")
    os.unlink("{ASSERTS}")
    with open("{MAIN}") as f:
        source = f.read()
    scope = {{"__name__": "solution", "__builtins__": __builtins__}}
    exec(compile(source, "{MAIN}", "exec"), scope)
    exec(compile(asserts, "tests", "exec"), scope)
    sys.stdout.flush()
    os.write(1, ("\\n" + token + "\\n").encode())
    os._exit(0)
_harness()
'''
"""Runs the program as a module named ``solution``, then the assertions in its namespace."""


@dataclass(frozen=True, kw_only=True)
class TestCase:
    """One test: ``kind`` is ``stdio`` (``stdin`` -> ``expected``) or ``assert`` (``code``)."""

    __test__ = False  # not a pytest class

    kind: str
    stdin: str = ""
    expected: str = ""
    code: str = ""
    timeout: float | None = None


@dataclass(kw_only=True)
class TestResult:
    """How one test went; ``status`` is ``passed``, ``wrong_output``, ``error`` (a nonzero exit,
    an exception, an assertion), ``wall_time``, ``cpu_time`` or ``output`` (a limit ended it)."""

    __test__ = False

    kind: str
    passed: bool
    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TaskError(NrlError):
    """A task whose metadata holds no usable tests (a dataset problem, not the model's)."""


def tests_of(metadata: Mapping[str, Any]) -> list[TestCase]:
    """The tests of a task from its metadata (the module docstring lists the shapes)."""
    if "tests" in metadata:
        raw = _json(metadata["tests"])
        return [_case(t, i) for i, t in enumerate(raw)]
    if "test_list" in metadata:
        setup = str(metadata.get("test_setup_code") or "")
        return [TestCase(kind="assert", code=f"{setup}\n{t}" if setup else str(t)) for t in _json(metadata["test_list"])]
    if "input_output" in metadata:
        io = _json(metadata["input_output"])
        return [TestCase(kind="stdio", stdin=_text(i), expected=_text(o)) for i, o in zip(io["inputs"], io["outputs"])]
    raise TaskError("env.code: a task's metadata has no tests (expected 'tests', 'test_list' or 'input_output'); "
                    f"its keys are {sorted(metadata)}")


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _case(test: Mapping[str, Any], index: int) -> TestCase:
    timeout = float(test["timeout"]) if test.get("timeout") is not None else None
    if "assert" in test:
        return TestCase(kind="assert", code=str(test["assert"]), timeout=timeout)
    if "input" in test and "output" in test:
        return TestCase(kind="stdio", stdin=_text(test["input"]), expected=_text(test["output"]), timeout=timeout)
    raise TaskError(f"env.code: test {index} has neither 'assert' nor 'input' and 'output' (keys {sorted(test)})")


def program_for(code: str, test: TestCase, timeout: float) -> tuple[Program, str]:
    """The run of ``code`` against ``test``, and the token an assert run must print to pass."""
    seconds = test.timeout if test.timeout is not None else timeout
    if test.kind == "stdio":
        return Program(files={MAIN: code}, argv=[MAIN], stdin=test.stdin, timeout=seconds), ""
    token = secrets.token_hex(16)
    files = {MAIN: code, HARNESS: HARNESS_SOURCE, ASSERTS: test.code, TOKEN: token}
    return Program(files=files, argv=[HARNESS], timeout=seconds), token


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def judge(test: TestCase, run: RunResult, token: str, excerpt: int) -> TestResult:
    """Whether ``run`` passed ``test``; stdout and stderr kept to their last ``excerpt`` characters."""
    stdout = run.stdout
    finished = False
    if token:
        head, sep, tail = stdout.rpartition("\n" + token + "\n")
        finished = bool(sep) and not tail
        stdout = head if finished else stdout
    if run.limit is not None:
        status = run.limit
    elif run.exit_code != 0 or (test.kind == "assert" and not finished):
        status = "error"
    elif test.kind == "stdio" and _lines(stdout) != _lines(test.expected):
        status = "wrong_output"
    else:
        status = "passed"
    return TestResult(kind=test.kind, passed=status == "passed", status=status, exit_code=run.exit_code,
                      stdout=_tail(stdout, excerpt), stderr=_tail(run.stderr, excerpt), seconds=round(run.seconds, 4))


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[len(text) - limit:]
