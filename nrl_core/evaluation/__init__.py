"""``nrl eval``: scoring a model on a dataset (docs/evaluation.md)."""
