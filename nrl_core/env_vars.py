"""Environment variables set for a block: what the processes started inside it inherit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` applied while the block runs (a value of None or ``""``
    removes the variable), restored after it."""
    saved = {name: os.environ.get(name) for name in changes}
    for name, value in changes.items():
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous
