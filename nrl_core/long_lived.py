"""Build what lives for the whole run without the cyclic garbage collector walking it again and again.

Start-up creates a few hundred thousand long-lived Python objects (torch's, transformers' and
vLLM's modules, the model, the optimizer). Python's automatic full collections during those
imports, and vLLM's own ``gc.collect()`` calls while its engine starts, each walk every one of
them: in a colocated actor that was 6 full collections and 1.4-2.3 s of the engine's start, and 7
and 0.7 s of the DTensor worker's build (``benchmarks/startup_profile.py``, docs/benchmarks.md).
:func:`long_lived_objects` pauses the automatic collector while the block runs, then collects once
and freezes what survived (``gc.freeze``), so later collections walk only newer objects. vLLM
freezes the whole heap at the end of its engine start anyway (``freeze_gc_heap``); this does the
same for the objects built before it, earlier.

At exit CPython walks the whole heap once more for cycles to free, memory the operating system
takes back anyway: a second or more in a process holding torch, paid by every run's driver, its
workers and the tests' spawned ranks. :func:`freeze_at_exit` freezes the heap first (as vLLM's own
engine core does on ROCm). atexit handlers, module teardown and every object freed by reference
count run as before, so files close and buffers flush; only garbage already in a cycle when the
process ends is left to the operating system. nanobind objects to it: it reports every object of
its modules still alive at exit as a leak, dozens of lines, so a process that loaded a nanobind
module (triton is one; vLLM loads it) collects at exit as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
import types
from collections.abc import Iterator

__all__ = ["freeze_at_exit", "long_lived_objects"]

_freezes_at_exit = False


@contextlib.contextmanager
def long_lived_objects(freeze: bool = True) -> Iterator[None]:
    """Run the block with automatic garbage collection paused and restore it on the way out (also
    on an error). With ``freeze`` (for a worker process, whose objects live as long as it does),
    then collect once and freeze the survivors; without it (a process that may go on to do other
    things, e.g. a test calling the CLI), only the pause."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        if freeze:
            gc.collect()
            gc.freeze()


def freeze_at_exit() -> None:
    """Freeze the heap when this process exits, so its last collection walks nothing (idempotent)."""
    global _freezes_at_exit
    if not _freezes_at_exit:
        _freezes_at_exit = True
        atexit.register(_freeze_unless_nanobind)


def _freeze_unless_nanobind() -> None:
    if not nanobind_loaded():
        gc.freeze()


def nanobind_loaded() -> bool:
    """Whether an extension module built with nanobind is loaded (its functions are ``nb_func``s,
    its classes made by ``nb_meta``)."""
    for module in list(sys.modules.values()):
        if str(getattr(module, "__file__", None) or "").endswith((".so", ".pyd")) and _has_nanobind_objects(module):
            return True
    return False


def _has_nanobind_objects(module: types.ModuleType, depth: int = 1) -> bool:
    for value in list(vars(module).values()):
        if type(value).__name__ == "nb_func" or type(type(value)).__name__ == "nb_meta":
            return True
        if depth > 0 and isinstance(value, types.ModuleType) and _has_nanobind_objects(value, depth - 1):
            return True
    return False
