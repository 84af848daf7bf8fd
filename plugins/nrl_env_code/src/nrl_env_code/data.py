"""Generated code tasks a tiny model can learn: short programs, a fixed phrase for each.

Each task is a sentence ("Write a Python program that reads two integers and prints their sum.")
whose canonical solution is two lines at most, and a few tests with numbers or words drawn per
task, so a program that prints a constant fails. Families: stdin/stdout arithmetic on two integers
(``pair``), an integer scaled or shifted by a constant (``scale``), string transforms
(``string``), the sum 1..n (``series``) and a function checked by assertions (``function``).

``data.dataset_name: code`` draws them (keywords in ``data.generate``); processor ``code`` makes
prompts for GRPO (the tests go to the metadata the environment reads), ``code_sft`` prompt and
canonical solution (a fenced block) for SFT.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nrl_core.api import ConfigError, DatumSpec, PromptConfig, build_prompt, sft_processor

__all__ = ["FAMILIES", "code_processor", "code_sft_processor", "code_splits", "fenced"]

# name in the prompt -> (the expression the solution prints, what it computes)
_PAIR_OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "sum": ("a + b", lambda a, b: a + b), "difference": ("a - b", lambda a, b: a - b),
    "product": ("a * b", lambda a, b: a * b), "maximum": ("max(a, b)", max), "minimum": ("min(a, b)", min)}
_STRING_OPS: dict[str, tuple[str, Callable[[str], object]]] = {
    "reversed": ("s[::-1]", lambda s: s[::-1]), "in upper case": ("s.upper()", str.upper),
    "with its length": ("len(s)", len), "twice": ("s + s", lambda s: s + s),
    "without its first letter": ("s[1:]", lambda s: s[1:])}


@dataclass(frozen=True)
class Task:
    problem: str
    solution: str
    tests: list[dict[str, str]]


Family = Callable[[random.Random, int, int], Task]


def _pair(rng: random.Random, n_tests: int, top: int) -> Task:
    name = rng.choice(sorted(_PAIR_OPS))
    expr, fn = _PAIR_OPS[name]
    pairs = [(rng.randint(0, top), rng.randint(0, top)) for _ in range(n_tests)]
    tests = [{"input": f"{a} {b}\n", "output": f"{fn(a, b)}\n"} for a, b in pairs]
    return Task(f"Write a Python program that reads two integers and prints their {name}.",
                f"a, b = map(int, input().split())\nprint({expr})", tests)


def _scale(rng: random.Random, n_tests: int, top: int) -> Task:
    k, op = rng.randint(2, 9), rng.choice(["*", "+"])
    xs = [rng.randint(0, top) for _ in range(n_tests)]
    tests = [{"input": f"{x}\n", "output": f"{x * k if op == '*' else x + k}\n"} for x in xs]
    return Task(f"Write a Python program that reads an integer n and prints n {op} {k}.",
                f"n = int(input())\nprint(n {op} {k})", tests)


def _string(rng: random.Random, n_tests: int, top: int) -> Task:
    name = rng.choice(sorted(_STRING_OPS))
    expr, fn = _STRING_OPS[name]
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 6))) for _ in range(n_tests)]
    tests = [{"input": f"{w}\n", "output": f"{fn(w)}\n"} for w in words]
    return Task(f"Write a Python program that reads a word and prints it {name}.", f"s = input()\nprint({expr})", tests)


def _series(rng: random.Random, n_tests: int, top: int) -> Task:
    ns = [rng.randint(1, top) for _ in range(n_tests)]
    return Task("Write a Python program that reads an integer n and prints 1 + 2 + ... + n.",
                "n = int(input())\nprint(n * (n + 1) // 2)",
                [{"input": f"{n}\n", "output": f"{n * (n + 1) // 2}\n"} for n in ns])


def _function(rng: random.Random, n_tests: int, top: int) -> Task:
    k, op = rng.randint(2, 9), rng.choice(["*", "+"])
    xs = [rng.randint(0, top) for _ in range(n_tests)]
    tests = [{"assert": f"assert f({x}) == {x * k if op == '*' else x + k}"} for x in xs]
    return Task(f"Write a Python function f(x) that returns x {op} {k}.", f"def f(x):\n    return x {op} {k}", tests)


FAMILIES: dict[str, Family] = {"pair": _pair, "scale": _scale, "string": _string, "series": _series,
                               "function": _function}


def fenced(code: str) -> str:
    """A program as the model should write it: one fenced Python block."""
    return f"```python\n{code}\n```"


def code_splits(num_train: int = 1024, num_val: int = 128, families: list[str] | None = None, tests_per_task: int = 3,
                max_value: int = 99, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``data.generate`` keywords: how many tasks, which families (default all), tests per task, the
    largest number drawn, the seed. Records: ``problem``, ``expected_answer`` (the fenced canonical
    solution), ``tests`` (JSON) and ``family``."""
    chosen = list(families) if families is not None else list(FAMILIES)
    unknown = sorted(set(chosen) - set(FAMILIES))
    if unknown or not chosen:
        raise ConfigError("data.generate.families", f"unknown families {unknown or '(none)'}; use some of "
                                                    f"{', '.join(FAMILIES)}")
    if tests_per_task < 1 or max_value < 1:
        raise ConfigError("data.generate", "tests_per_task and max_value must be at least 1")
    rng = random.Random(seed)
    records = []
    for _ in range(num_train + num_val):
        family = rng.choice(chosen)
        task = FAMILIES[family](rng, tests_per_task, max_value)
        records.append({"problem": task.problem, "expected_answer": fenced(task.solution),
                        "tests": json.dumps(task.tests), "family": family})
    return records[:num_train], records[num_train:]


def code_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """A task's prompt; its tests go to the metadata (``tests``), where the environment reads them."""
    text, ids = build_prompt(str(record[cfg.input_key]), tokenizer, cfg)
    return DatumSpec(idx=idx, prompt_text=text, prompt_ids=ids, metadata=_tests(record))


def code_sft_processor(record: Mapping[str, Any], idx: int, tokenizer: Any, cfg: PromptConfig) -> DatumSpec:
    """The prompt and the canonical solution (``output_key``, a fenced block) as the target."""
    datum = sft_processor(record, idx, tokenizer, cfg)
    datum.metadata.update(_tests(record))
    return datum


def _tests(record: Mapping[str, Any]) -> dict[str, Any]:
    tests = record["tests"]
    return {"tests": json.loads(tests) if isinstance(tests, str) else list(tests)}
