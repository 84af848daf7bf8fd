"""nrl-env-math: the ``math`` reward environment (answers checked with math-verify in Ray workers)."""

__version__ = "0.1.2"
