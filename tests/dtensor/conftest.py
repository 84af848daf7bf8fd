import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `common` and `scenarios`, also in spawned ranks
os.environ.setdefault("NRL_CHECK_DEVICES", "1")  # the worker checks the loss's batch device (nrl_core.device)


@pytest.fixture(scope="session", autouse=True)
def _single_process_group():
    """World-size-1 tests share one gloo group in the pytest process (multi-rank tests spawn)."""
    import torch

    torch.set_num_threads(1)
    yield
