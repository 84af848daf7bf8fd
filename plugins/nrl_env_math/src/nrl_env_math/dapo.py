"""DAPO's math verifier (NeMo RL's ``math_verify_impl: dapo_math_verify``, from verl's
``math_dapo``): the response's last ``Answer: ...`` line, normalised, must equal the normalised
ground truth as a string. No symbolic parsing: the rule DAPO was trained with, strict and cheap.

Only the last 300 characters of a response are read (the answer line is at its end, and a bounded
input keeps every step linear); model output is only ever compared as text.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

#: Plain replacements, in order (articles, spaces, dollar signs, spelling variants of \text).
_REPLACEMENTS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))

#: Units and LaTeX decorations dropped from an answer.
_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots")

#: Regular-expression rewrites, in order: the math between dollars, the content of \text, \textbf,
#: \overline and \boxed, then shorthand \fracab and \sqrta spelled out.
_REWRITES = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"), (r"(\\text\{)(.*?)(\})", "\\2"),
             (r"(\\textbf\{)(.*?)(\})", "\\2"), (r"(\\overline\{)(.*?)(\})", "\\2"), (r"(\\boxed\{)(.*)(\})", "\\2"),
             (r"(frac)([^{])(.)", "frac{\\2}{\\3}"), (r"(sqrt)([^{])", "sqrt{\\2}"))


def normalize_answer(answer: str) -> str:
    """The canonical string of a final answer: what follows its last ``=``, without units,
    spaces, dollar signs and LaTeX wrappers, digit groups joined (``1,000`` is ``1000``)."""
    text = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for dropped in _DROPPED:
        text = text.replace(dropped, "")
    for pattern, replacement in _REWRITES:
        text = re.sub(pattern, replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def stated_answer(response: str) -> str | None:
    """The last ``Answer: ...`` of the response's tail, or None."""
    found = _ANSWER_LINE.findall(response[-TAIL_CHARS:])
    return found[-1] if found else None


def verify_response(response: str, ground_truth: str) -> bool:
    """Whether the response's stated answer equals the ground truth after normalisation (the
    ``env.math.verifier`` signature)."""
    answer = stated_answer(response)
    return answer is not None and normalize_answer(answer) == normalize_answer(ground_truth)
