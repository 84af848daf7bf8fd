"""A task's tests, each turned into one sandboxed run, and each run judged.

Tests come in a task's metadata in one of three shapes (the datasets they come from use them):

* ``tests``: a list of ``{"input": ..., "output": ...}`` (stdin/stdout) and ``{"assert": ...}``
  (assert-style) cases, each with an optional ``timeout`` in seconds;
* ``test_list`` (MBPP): assert statements, with ``test_setup_code`` run before them;
* ``input_output`` (APPS): ``{"inputs": [...], "outputs": [...]}``, possibly as a JSON string.

Every test is its own run, with its own wall-time limit, so one test that hangs costs only itself.
The verdict is always reached here, outside the sandbox, from what the program printed and never
from anything it could reach. A stdin/stdout test passes when the program exits 0 and its output
equals the expected output line by line, trailing whitespace and blank lines aside. An assert test
is split (:mod:`nrl_env_code.assertions`): the sandbox runs the program and evaluates the parts of
each assertion that need it, prints their values, and the host compares them with the expected
side, which never entered the sandbox. A program that exits before the values are printed fails.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from nrl_core.api import NrlError
from nrl_env_code.assertions import VALUES_MARK, NotAssertions, Split, decode, encode_source, evaluate, split
from nrl_env_code.sandbox import Program, RunResult

__all__ = ["TestCase", "TestResult", "judge", "program_for", "tests_of"]

MAIN = "main.py"
HARNESS = "_harness.py"
PROBES = "_probes.py"

HARNESS_SOURCE = encode_source() + f'''
import os, sys
def _harness():
    with open("{PROBES}") as f:  # written by the host, read before the program runs
        setup, probes = eval(f.read(), {{"__builtins__": {{}}}})
    with open("{MAIN}") as f:
        source = f.read()
    scope = {{"__name__": "solution", "__builtins__": __builtins__}}
    exec(compile(source, "{MAIN}", "exec"), scope)
    exec(compile(setup, "setup", "exec"), scope)
    lines = []
    for probe in probes:
        try:
            value = _encode(eval(compile(probe, "test", "eval"), scope))
        except BaseException as exc:
            value = {{"e": type(exc).__name__}}
        try:
            lines.append(repr(value))
        except BaseException as exc:
            lines.append(repr({{"x": type(exc).__name__}}))
    sys.stdout.flush()
    data = ("\\n" + {VALUES_MARK!r} + "\\n" + "\\n".join(lines) + "\\n").encode()
    while data:
        data = data[os.write(1, data):]
    os._exit(0)
_harness()
'''
"""Runs the program as a module named ``solution``, then the setup code, then prints each probe's value."""


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
    """How one test went; ``status`` is ``passed``, ``wrong_output``, ``failed_assertion``,
    ``error`` (a nonzero exit, an exception, no values printed), ``wall_time``, ``cpu_time``,
    ``output`` or ``memory`` (a limit ended it)."""

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
        return [_checked(TestCase(kind="assert", code=f"{setup}\n{t}" if setup else str(t)), i)
                for i, t in enumerate(_json(metadata["test_list"]))]
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
        return _checked(TestCase(kind="assert", code=str(test["assert"]), timeout=timeout), index)
    if "input" in test and "output" in test:
        return TestCase(kind="stdio", stdin=_text(test["input"]), expected=_text(test["output"]), timeout=timeout)
    raise TaskError(f"env.code: test {index} has neither 'assert' nor 'input' and 'output' (keys {sorted(test)})")


def _checked(case: TestCase, index: int) -> TestCase:
    """``case`` if its code splits into probes and checks (see :mod:`nrl_env_code.assertions`)."""
    try:
        split(case.code)
    except NotAssertions as exc:
        raise TaskError(f"env.code: assert test {index} cannot be judged outside the program: {exc}; write it as "
                        "imports and setup, then assert statements") from None
    return case


def program_for(code: str, test: TestCase, timeout: float) -> tuple[Program, Split | None]:
    """The run of ``code`` against ``test``, and for an assert test its split (the checks the host
    evaluates on the values the run prints)."""
    seconds = test.timeout if test.timeout is not None else timeout
    if test.kind == "stdio":
        return Program(files={MAIN: code}, argv=[MAIN], stdin=test.stdin, timeout=seconds), None
    parts = split(test.code)
    files = {MAIN: code, HARNESS: HARNESS_SOURCE, PROBES: repr([parts.setup, list(parts.probes)])}
    return Program(files=files, argv=[HARNESS], timeout=seconds), parts


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def judge(test: TestCase, run: RunResult, parts: Split | None, excerpt: int) -> TestResult:
    """Whether ``run`` passed ``test`` (for an assert test, ``parts`` from :func:`program_for`);
    stdout and stderr kept to their last ``excerpt`` characters."""
    stdout = run.stdout
    values = None
    if parts is not None:
        head, sep, tail = stdout.rpartition("\n" + VALUES_MARK + "\n")
        if sep:
            stdout, values = head, _values(tail, len(parts.probes))
    if run.limit is not None:
        status = run.limit
    elif run.exit_code != 0 or (parts is not None and values is None):
        status = "error"
    elif parts is not None:
        assert values is not None
        status = "passed" if all(evaluate(check, values) for check in parts.checks) else "failed_assertion"
    elif _lines(stdout) != _lines(test.expected):
        status = "wrong_output"
    else:
        status = "passed"
    return TestResult(kind=test.kind, passed=status == "passed", status=status, exit_code=run.exit_code,
                      stdout=_tail(stdout, excerpt), stderr=_tail(run.stderr, excerpt), seconds=round(run.seconds, 4))


def _values(text: str, count: int) -> list | None:
    """The probes' values from the lines after the mark; None unless there is exactly one per probe."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != count:
        return None
    try:
        return [decode(line) for line in lines]
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, AttributeError):
        return None


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[len(text) - limit:]
