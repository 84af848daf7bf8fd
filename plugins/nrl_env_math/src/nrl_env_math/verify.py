"""Answer extraction and verification. Model output is only ever *parsed*, never executed.

Why this is safe: the answer is cut out of the response with regular expressions (the last
``\\boxed{...}``, else the last number), and only that short string reaches math-verify, which is
configured with its LaTeX extractor alone. math-verify's expression extractor is deliberately not
used: it calls ``sympy.parse_expr``, which ``eval``\\ s its input. There is no ``eval``, ``exec``
or import of anything derived from the response anywhere in this package.

math-verify's own timeouts are switched off (they install ``SIGALRM`` handlers that would clash
with the worker's per-sample timeout, see :mod:`nrl_env_math.worker`).
"""

from __future__ import annotations

import logging
import re

__all__ = ["MAX_ANSWER_CHARS", "extract_answer", "verify_response"]

MAX_ANSWER_CHARS = 256
"""An extracted answer longer than this is not parsed (scored incorrect): answers are short, and
pathological inputs are where symbolic parsing gets slow."""

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The answer a response states: its last ``\\boxed{...}`` content, else its last number
    (thousands separators removed), else None."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(text)
    if numbers:
        return re.sub(r"[,\s]", "", numbers[-1])
    return None


def _drop_timeout_disabled_notice(record: logging.LogRecord) -> bool:
    # math-verify warns on every call that its own timeout is off; here that is by design.
    return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_disabled_notice)


def _parse(answer: str) -> list[object]:
    from math_verify import LatexExtractionConfig, parse

    return parse(f"\\boxed{{{answer}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)


def verify_response(response: str, ground_truth: str) -> bool:
    """Whether ``response`` states ``ground_truth``: equal strings after extraction, or
    mathematically equal according to math-verify (``1/2`` equals ``0.5`` and ``\\frac{1}{2}``)."""
    predicted = extract_answer(response)
    gold = extract_answer(ground_truth) if "\\boxed" in ground_truth else ground_truth.strip()
    if not predicted or not gold or len(predicted) > MAX_ANSWER_CHARS:
        return False
    if predicted == gold:
        return True
    from math_verify import verify

    gold_parsed, predicted_parsed = _parse(gold), _parse(predicted)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=None))
