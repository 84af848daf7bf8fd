"""A seeded arithmetic dataset: the demo's and the tests' data, generated locally in milliseconds.

Why arithmetic: a model of a million parameters can learn it on two CPU cores in minutes, the
answer is a single number the math verifier scores exactly, and the locally trained tokenizer
(:mod:`nrl_core.testing.tiny_models`) was trained on exactly these shapes, so a prompt is a handful
of tokens and an answer usually one.

Problems are drawn without replacement from the whole problem space (every ``a op b`` with both
operands in range), so train and val never share a problem, and the same arguments always give
the same records.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nrl_core.data.datasets import write_jsonl
from nrl_core.errors import ConfigError

__all__ = ["ArithmeticConfig", "arithmetic_splits", "generate_arithmetic", "sft_response", "to_sft",
           "write_arithmetic_splits"]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
ANSWER_FORMATS = ("plain", "boxed")


@dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """What to generate. Operands are drawn from ``[min_operand, max_operand]``; ``ops`` from
    ``+``, ``-`` and ``*``; ``non_negative`` keeps only problems whose answer is >= 0."""

    num_train: int = 1000
    num_val: int = 100
    min_operand: int = 0
    max_operand: int = 20
    ops: tuple[str, ...] = ("+", "-")
    non_negative: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.min_operand > self.max_operand:
            raise ConfigError("data.generate", f"min_operand {self.min_operand} > max_operand {self.max_operand}")
        unknown = [op for op in self.ops if op not in _OPS]
        if unknown or not self.ops:
            raise ConfigError("data.generate.ops", f"unknown operators {unknown or '(none)'}; use some of + - *")
        if self.num_train < 0 or self.num_val < 0:
            raise ConfigError("data.generate", "num_train and num_val must be >= 0")

    @property
    def space_size(self) -> int:
        width = self.max_operand - self.min_operand + 1
        return width * width * len(self.ops)


def _problem(cfg: ArithmeticConfig, index: int) -> dict[str, str] | None:
    """The ``index``-th problem of the space (op-major, then a, then b); None if filtered out."""
    width = cfg.max_operand - cfg.min_operand + 1
    op_i, rest = divmod(index, width * width)
    a_i, b_i = divmod(rest, width)
    a, b, op = cfg.min_operand + a_i, cfg.min_operand + b_i, cfg.ops[op_i]
    answer = _OPS[op](a, b)
    if cfg.non_negative and answer < 0:
        return None
    return {"problem": f"What is {a} {op} {b}?", "expected_answer": str(answer)}


def generate_arithmetic(cfg: ArithmeticConfig) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train, val)`` records, disjoint, deterministic for ``cfg``.

    Records look like ``{"problem": "What is 12 + 7?", "expected_answer": "19"}``.
    """
    wanted = cfg.num_train + cfg.num_val
    rng = random.Random(cfg.seed)
    # random.sample over a range never materialises it, so large operand ranges stay cheap; a
    # filtered space (non_negative) is sampled in growing rounds until enough problems survive.
    records: list[dict[str, str]] = []
    order = rng.sample(range(cfg.space_size), cfg.space_size) if cfg.space_size <= 1_000_000 else None
    if order is not None:
        for index in order:
            rec = _problem(cfg, index)
            if rec is not None:
                records.append(rec)
                if len(records) == wanted:
                    break
    else:
        seen: set[int] = set()
        while len(records) < wanted and len(seen) < cfg.space_size:
            index = rng.randrange(cfg.space_size)
            if index in seen:
                continue
            seen.add(index)
            rec = _problem(cfg, index)
            if rec is not None:
                records.append(rec)
    if len(records) < wanted:
        raise ConfigError("data.generate", f"only {len(records)} distinct problems exist for these operands and "
                                           f"operators but {wanted} were asked for; widen the operand range")
    return records[: cfg.num_train], records[cfg.num_train:]


def arithmetic_splits(**kwargs: Any) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The ``data.dataset_name: arithmetic`` generator (registered by nrl_core/builtin.py);
    ``data.generate`` holds the
    :class:`ArithmeticConfig` fields (``ops`` may be a list)."""
    if "ops" in kwargs:
        kwargs["ops"] = tuple(kwargs["ops"])
    return generate_arithmetic(ArithmeticConfig(**kwargs))


def sft_response(answer: str, answer_format: str = "plain") -> str:
    """The worked answer an SFT example teaches: ``"19"`` (plain: one token with the tiny
    tokenizer) or ``"\\boxed{19}"`` (boxed). The math environment scores both."""
    if answer_format == "plain":
        return answer
    if answer_format == "boxed":
        return f"\\boxed{{{answer}}}"
    raise ConfigError("data.generate.answer_format", f"must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")


def to_sft(records: list[dict[str, str]], answer_format: str = "plain",
           response_key: str = "response") -> list[dict[str, str]]:
    """Copies of ``records`` with ``response_key`` set to the :func:`sft_response` of the answer;
    an SFT run reads them with ``data.output_key: response``."""
    return [{**r, response_key: sft_response(r["expected_answer"], answer_format)} for r in records]


def write_arithmetic_splits(out_dir: str | os.PathLike[str], cfg: ArithmeticConfig | None = None, *,
                            sft: bool = False, answer_format: str = "plain") -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` under ``out_dir`` (with an SFT ``response`` field
    when ``sft``); returns the two paths."""
    train, val = generate_arithmetic(cfg or ArithmeticConfig())
    if sft:
        train, val = to_sft(train, answer_format), to_sft(val, answer_format)
    out = Path(out_dir)
    return write_jsonl(train, out / "train.jsonl"), write_jsonl(val, out / "val.jsonl")
