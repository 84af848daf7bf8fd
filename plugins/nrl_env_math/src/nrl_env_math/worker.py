"""The verifier worker: scores (response, ground truth) pairs with a time limit per sample.

Why a signal-based limit: symbolic checking of a hostile or degenerate answer (``9^{9^{9}}``) can
run for minutes. Ray runs a plain actor's methods on the process's main thread, so an
``ITIMER_REAL`` alarm can interrupt the verifier between Python bytecodes; the sample then scores
as a timeout and the worker moves on. Code that ignores the alarm (stuck inside C, signals
blocked) is caught one level up: the environment stops waiting for the worker, kills it and
reports it by name (see :mod:`nrl_env_math.environment`).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any, Literal

Status = Literal["correct", "incorrect", "timeout", "error"]


class _SampleTimeout(BaseException):
    """Raised by the alarm; a BaseException so a verifier's ``except Exception`` cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _SampleTimeout()


class VerifierWorker:
    """Plain class (a Ray actor in production, callable directly in tests).

    ``verifier`` is an import path ``"module:function"`` of ``(response, ground_truth) -> bool``.
    """

    def __init__(self, label: str, verifier: str, timeout_seconds: float) -> None:
        from nrl_core.api import import_object

        self.label = label
        self.timeout_seconds = float(timeout_seconds)
        self._verify: Callable[[str, str], bool] = import_object(verifier)
        self._can_alarm = threading.current_thread() is threading.main_thread()
        if self._can_alarm:
            signal.signal(signal.SIGALRM, _on_alarm)
        # Warm up the symbolic path (lazy imports, parser tables) so the first real sample is not
        # charged for them against its time limit. Unequal strings, so no shortcut skips sympy.
        self._verify("\\boxed{\\frac{1}{2}}", "0.5")
        self._verify("2", "1")

    def info(self) -> dict[str, Any]:
        """Who this worker is; answering also proves it started."""
        return {"label": self.label, "pid": os.getpid(), "per_sample_timeout": self._can_alarm}

    def score(self, pairs: list[tuple[str, str]]) -> list[Status]:
        """One status per ``(response, ground_truth)`` pair, in order."""
        return [self._score_one(response, truth) for response, truth in pairs]

    def _score_one(self, response: str, ground_truth: str) -> Status:
        try:
            if self._can_alarm:
                signal.setitimer(signal.ITIMER_REAL, self.timeout_seconds)
            try:
                ok = self._verify(response, ground_truth)
            finally:
                if self._can_alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except _SampleTimeout:
            return "timeout"
        except Exception:  # a verifier bug on one odd answer must not fail the batch
            return "error"
        return "correct" if ok else "incorrect"
