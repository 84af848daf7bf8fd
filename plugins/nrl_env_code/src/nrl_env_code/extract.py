"""Cutting the program out of a model's response.

A response holds its program in a fenced block (````` ```python ... ``` `````, ````` ```py `````,
````` ```python3 `````, or a fence with no language), or between NeMo RL's ``<code>`` and
``</code>`` tags (its code environment's convention, whose stop string is ``</code>``). When there
are several, the last one wins: models draft, then correct themselves. A block still open at the
end of the response (the generation stopped inside it) counts as the last block. Blocks in another
language (```` ```bash ````) are not programs to run. Nothing outside a block is ever run.
"""

from __future__ import annotations

import re

__all__ = ["extract_code", "PYTHON_TAGS"]

PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})
"""Fence info strings taken as Python (compared in lower case)."""

_FENCE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_TAG = re.compile(r"<code>(.*?)(?:</code>|\Z)", re.DOTALL)


def _blocks(response: str) -> list[tuple[int, str]]:
    """Every Python block as ``(start, code)``, fenced and tagged alike."""
    found = [(m.start(), m.group(2)) for m in _FENCE.finditer(response)
             if m.group(1).strip().lower() in PYTHON_TAGS]
    found += [(m.start(), m.group(1)) for m in _TAG.finditer(response)]
    return sorted(found)


def extract_code(response: str) -> str | None:
    """The program in ``response`` (the last block), or None when it has none or only blank ones."""
    for _, code in reversed(_blocks(response)):
        code = code.strip("\n")
        if code.strip():
            return code + "\n"
    return None
