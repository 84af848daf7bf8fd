"""Every random number generator a training step may draw from, captured for a checkpoint and
restored on resume (``load_rng``): torch's (CPU and every CUDA device), Python's and NumPy's.

The state holds tensors and plain values only, so ``torch.load(weights_only=True)`` reads it.
:func:`set_rng_state` also takes the raw ``random.getstate()``/``np.random.get_state()`` tuples
that checkpoints written before the SDK hold."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    if isinstance(n, Mapping):
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    else:  # np.random.get_state()'s own tuple
        np.random.set_state(n)
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, torch.Tensor):  # one device's state
            torch.cuda.set_rng_state(cuda)
        else:
            torch.cuda.set_rng_state_all(cuda)
