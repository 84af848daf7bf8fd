"""The run's side of a loss plugin. The loss is pickled to the training workers and called there,
once per micro-batch, deep inside a backend's training loop, so what it raises would reach the
user as the backend's fault with Ray's traceback. Wrapped, it stops the run in one line naming the
loss's plugin and method (:mod:`nrl_core.plugin_faults`), and a wrong answer is named before the
backend tries to differentiate it."""

from __future__ import annotations

from typing import Any

from nrl_core.contracts import TokenBatch
from nrl_core.plugin_faults import PluginBoundary


class GuardedLoss(PluginBoundary):
    """A loss as the training workers call it; any other attribute (``gather_ids_field``,
    ``reads_values``, a loss's own settings) is the plugin's object's, which :attr:`plugin_object` holds."""

    def __call__(self, outputs: Any, batch: TokenBatch, *, global_valid_tokens: float,
                 global_valid_seqs: float) -> tuple[Any, dict[str, float]]:
        loss = self.plugin_object
        result = self._call("__call__", lambda: loss(outputs, batch, global_valid_tokens=global_valid_tokens,
                                                     global_valid_seqs=global_valid_seqs))
        if self._owner.is_core:
            return result
        if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[1], dict):
            raise self._wrong("__call__", f"returned {_shape_of(result)}; it must return (a scalar loss tensor, "
                                          "a dict of float metrics)")
        value = result[0]
        if type(value).__name__ != "Tensor" or getattr(value, "ndim", None) != 0:
            raise self._wrong("__call__", f"returned {_shape_of(value)} as its loss; it must be a scalar tensor "
                                          "(0 dimensions)")
        return result


def _shape_of(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    shape = getattr(value, "shape", None)
    return f"a tensor of shape {list(shape)}" if shape is not None else type(value).__name__
