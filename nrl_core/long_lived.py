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
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["long_lived_objects"]


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
