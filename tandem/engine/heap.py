"""The start-up heap kept out of the garbage collector's full collections.

A full (generation 2) collection walks every object the process tracks: after loading torch,
transformers and the models that is some 200,000 objects, and at 256 running requests on the dev
CPU a collection paused a step 100-210 ms, every 50-200 steps (bench/host_step.py: ~1.5 ms
frozen). Nearly all of them live as long as the engine, so once it has started they are
collected once and frozen (gc.freeze: later collections skip them); what serving creates is
still collected as usual. When the engine is released the frozen objects are handed back
(gc.unfreeze), so that any cycles among them can be reclaimed once it is gone; another engine
still alive then goes unfrozen until the next one starts (one process, one heap).
"""
from __future__ import annotations

import gc
import weakref


def freeze_startup_heap(owner: object) -> None:
    """Collect, then freeze every object the process tracks, until owner is released."""
    gc.collect()  # the garbage of start-up first: frozen, it would never be reclaimed
    gc.freeze()
    thaw = weakref.finalize(owner, gc.unfreeze)
    thaw.atexit = False  # nothing to reclaim at exit
