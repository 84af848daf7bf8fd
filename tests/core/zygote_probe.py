"""What tests/core/test_worker_zygote.py's spawned process runs (importable from its PYTHONPATH)."""

import sys


def exit_with_what_was_imported() -> None:
    """Exit 3 when torch was imported before this process imported anything of its own, else 4."""
    sys.exit(3 if "torch" in sys.modules else 4)
