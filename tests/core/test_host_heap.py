"""The host allocator's policy for training workers: large buffers get pages of their own and give
them back when freed, so a sharded step's freed layer-sized buffers leave no slack in the heap.

Each case runs in a fresh interpreter: glibc's threshold is process-wide and only ever moves once.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

FREED_BYTES = """
import sys
import torch
from nrl_core.device import map_large_host_allocations

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

if sys.argv[1] == "mapped":
    map_large_host_allocations()
first = torch.ones(6 << 20)  # a 24 MiB buffer freed: glibc's dynamic threshold rises to it
del first
layer = torch.ones(3 << 20)  # a 12 MiB one, then a small tensor kept after it, as a step keeps activations
kept = torch.ones(16)
before = rss()
del layer
print(before - rss())
"""


def freed_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", FREED_BYTES, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_a_freed_layer_sized_buffer_goes_back_to_the_system() -> None:
    """With the policy the 12 MiB buffer's pages leave the process when it is freed; without it
    they stay in the heap, behind the small tensor allocated after them."""
    assert freed_bytes("mapped") >= 12 << 20
    assert freed_bytes("default") < 1 << 20
