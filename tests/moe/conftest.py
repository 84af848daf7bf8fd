import sys
from pathlib import Path
from typing import Any

import pytest

# `moe_scenarios` (rank functions, importable by spawned ranks) and the Megatron tests' `_helpers`
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "megatron"))


@pytest.fixture(scope="session")
def megatron_w1() -> dict[str, Any]:
    """The one-rank Megatron scenarios (moe_scenarios.megatron_world1), run once per session: the
    DTensor tests compare against its baseline."""
    pytest.importorskip("megatron.core", reason="nrl-backend-megatron's engine is not installed")
    import moe_scenarios
    from _helpers import run_world

    (result,) = run_world(moe_scenarios.megatron_world1, 1, moe_scenarios.moe_paths())  # the session's conversions
    return result
