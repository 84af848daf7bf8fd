"""Verifiers for tests, loaded by the math environment's Ray workers
(``env.math.verifier: tests.plugins.math_verifiers:<name>``): one that misbehaves on purpose, one
lenient enough that an untrained model's responses get different rewards."""

from __future__ import annotations

import os
import signal
import time

from nrl_env_math.verify import verify_response


def misbehave_on_marker(response: str, ground_truth: str) -> bool:
    """``CRASH`` ends the worker process abruptly (like a segfault or the OOM killer); ``HANG``
    blocks the alarm signal and sleeps, stuck where the per-sample timeout cannot reach (like a
    long computation inside a C extension). Anything else is verified normally."""
    if response == "CRASH":
        os._exit(3)
    if response == "HANG":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(600)
    return verify_response(response, ground_truth)


def mentions_the_answer_s_first_digit(response: str, ground_truth: str) -> bool:
    """Whether the response contains the ground truth's first character: a reward an untrained
    tiny model earns about half the time, so a group's rewards differ and GRPO has a gradient."""
    return bool(ground_truth) and ground_truth.strip()[:1] in response

