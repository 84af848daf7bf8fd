"""Start-up builds with the cyclic collector paused, then frozen: run in a child interpreter, so
this test process's own heap is never frozen."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import gc, json
from nrl_core.long_lived import long_lived_objects

class Node:
    alive = 0

    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it
        Node.alive += 1

    def __del__(self):
        Node.alive -= 1

out = {}
with long_lived_objects():
    out["enabled_inside"] = gc.isenabled()
    kept = [Node() for _ in range(1000)]
    for _ in range(1000):
        Node()  # garbage in cycles: collected once on the way out, not frozen
out["enabled_after"] = gc.isenabled()
out["frozen"] = gc.get_freeze_count()
out["kept_frozen"] = all(o is not kept for o in gc.get_objects())  # frozen: out of the collected generations
out["alive"] = Node.alive

gc.unfreeze()
gc.disable()
before = gc.get_freeze_count()
try:
    with long_lived_objects(freeze=False):
        raise RuntimeError("a failed build")
except RuntimeError:
    pass
out["disabled_stays_disabled"] = not gc.isenabled()
out["no_freeze_without_freeze"] = gc.get_freeze_count() == before
print(json.dumps(out))
"""


def test_the_collector_pauses_inside_and_what_survives_is_frozen():
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True,
                                    text=True).stdout)
    assert out["enabled_inside"] is False and out["enabled_after"] is True
    assert out["frozen"] > 1000  # the kept nodes (and the interpreter's objects) are frozen
    assert out["kept_frozen"] is True
    assert out["alive"] == 1000  # the cycles that died inside were collected before the freeze
    assert out["disabled_stays_disabled"] is True and out["no_freeze_without_freeze"] is True


EXIT_CHILD = r"""
import atexit, gc, sys
from nrl_core.long_lived import freeze_at_exit

# registered first, so it runs after the freeze (atexit runs last-registered first)
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
freeze_at_exit()
freeze_at_exit()
print("registered:", atexit._ncallbacks(), flush=True)
unclosed = open(sys.argv[1], "w")
unclosed.write("written before exit")  # buffered, never closed: flushed when module teardown frees it
"""


def test_the_heap_freezes_at_exit_once_and_unclosed_files_still_flush(tmp_path):
    path = tmp_path / "unclosed.txt"
    out = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(path)], check=True, capture_output=True,
                         text=True).stdout.splitlines()
    assert out == ["registered: 2", "frozen at exit: True"]
    assert path.read_text() == "written before exit"


def test_a_process_with_a_nanobind_module_collects_at_exit_as_usual():
    """nanobind reports the objects of its modules a frozen heap keeps alive as leaks, line after
    line: with triton (a nanobind module) loaded nothing is frozen and nothing is reported."""
    child = ("import atexit, gc\n"
             "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))\n"
             "from nrl_core.long_lived import freeze_at_exit, nanobind_loaded\n"
             "freeze_at_exit()\n"
             "before = nanobind_loaded()\n"
             "import triton._C.libtriton\n"
             "print('nanobind', before, nanobind_loaded(), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", child], check=True, capture_output=True, text=True)
    assert proc.stdout.split() == ["nanobind", "False", "True", "frozen", "False"]
    assert "leaked" not in proc.stderr
