import sys
from pathlib import Path

# the backends' test helpers (`common` for dtensor, `_helpers` for megatron), also in spawned ranks
for sub in ("dtensor", "megatron"):
    sys.path.insert(0, str(Path(__file__).parent.parent / sub))
