"""The divergence guard: stop training before a non-finite loss or gradient reaches the weights.

A NaN/Inf loss or gradient norm, once the optimizer steps on it, poisons every weight, and every
checkpoint saved after it is a NaN model that ``keep_top_k`` may prefer over good ones. Each
training backend therefore calls :func:`check_finite` after the backward pass and before the
optimizer step, with values that are identical on every rank (the globally reduced loss and the
global gradient norm), so every rank raises together and no collective is left waiting.

``policy.check_for_nan`` (default true) turns the guard on or off for every backend. Megatron-Core
has its own check inside the gradient reduction (``policy.megatron_cfg.check_for_nan_in_grad``);
the Megatron backend runs it only when both keys are true, so ``policy.check_for_nan: false``
alone trains on through divergence on either backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nrl_core.errors import NrlError

KEY = "policy.check_for_nan"


class NonFiniteError(NrlError):
    """Training produced a NaN/Inf loss or gradient; the optimizer step was not taken."""


def guard_enabled(policy: Mapping[str, Any]) -> bool:
    """Whether the guard is on for this ``policy`` section (on unless set false)."""
    value = policy.get("check_for_nan")
    return True if value is None else bool(value)


def check_finite(step: int, values: Mapping[str, float], *, backend: str) -> None:
    """Raise :class:`NonFiniteError` naming ``step`` and every non-finite entry of ``values``."""
    bad = [f"{name}={value}" for name, value in values.items() if value is None or not math.isfinite(value)]
    if bad:
        raise NonFiniteError(f"training step {step} ({backend}): non-finite {', '.join(bad)}; stopped before the "
                             f"optimizer step, so no checkpoint holds it (lower the learning rate or resume from the "
                             f"last checkpoint; {KEY}: false trains on regardless)")
