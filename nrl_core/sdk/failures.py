"""Checkpoint failures in one line. torch's distributed checkpoint raises ``CheckpointException``
(a ``BaseException``) that says only which ranks failed; the first rank's own exception says why."""

from __future__ import annotations


def first_failure(exc: BaseException) -> BaseException:
    """The first failing rank's own exception inside a ``CheckpointException`` (else ``exc``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = sorted(failures.items())[0][1]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return first_failure(inner)
    return exc


def describe_failure(exc: BaseException) -> str:
    """One line: ``rank N: Type: first line`` of the first failing rank's own exception (the
    rank is left out when ``exc`` is not a distributed-checkpoint failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return f"rank {rank}: {describe_failure(inner)}"
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
