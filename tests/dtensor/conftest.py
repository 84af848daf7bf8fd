import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `common` and `scenarios`, also in spawned ranks


@pytest.fixture(scope="session", autouse=True)
def _single_process_group():
    """World-size-1 tests share one gloo group in the pytest process (multi-rank tests spawn)."""
    import torch

    torch.set_num_threads(1)
    yield
