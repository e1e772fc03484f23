"""The start-up heap, frozen out of the garbage collector's full collections.

Importing the model libraries (torch, transformers, qwen_tts, scipy, librosa) and loading the
engine leave about half a million objects tracked by CPython's cyclic garbage collector, and
they live as long as the process. A full (generation-2) collection walks every one of them,
holding the GIL: on the 2-core CI machine it took 290-410 ms, and a gateway carrying 64
cached-prompt calls ran two of them in 68 s (``gc.callbacks`` in the served process). For
those 0.3-0.4 s no call's media moves: a SIP caller, paced frame by frame, hears a gap; every
inbound message, DTMF key and first chunk of a live turn waits.

:func:`hold` moves everything tracked at that moment into the permanent generation
(:func:`gc.freeze`), which collections skip; what calls allocate afterwards is collected as
usual, and a full collection walks only that. ``bench/gc_pause.py`` measures the pause
before and after. Freezing is O(1) (the generation lists are spliced), so it is done without a
collection first: the few start-up cycles already garbage then stay until :func:`release`.

The price: an object frozen here that later falls out of use inside a reference cycle stays
until the gateway stops (what is built after start-up is collected as usual). That is a
one-time cost for what start-up builds and later replaces: the first version of the scripts
after a reload, and the engines' buffers and graphs after a failure's rebuild, the one that
matters (GPU memory). Those go by reference counting alone; tests/unit/tts/test_engine.py and
tests/unit/tts/test_batch_engine.py check it.

A process can hold it more than once (the test suite runs gateways in-process): the first
hold freezes, later ones only count, so the garbage of other work in the process is not
frozen with each; the last one to let go hands the frozen objects back to the collector. A
served gateway is its process's only holder.
"""

from __future__ import annotations

import gc
import logging
import threading

__all__ = ["hold", "holders", "release"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0


def hold() -> None:
    """Count this holder; the first one freezes what is tracked now (call it once start-up is
    done)."""
    global _holders
    with _lock:
        _holders += 1
        if _holders > 1:
            return
        gc.freeze()
        frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects out of the collector's full collections", frozen)


def release() -> None:
    """Let go of a :func:`hold`; the last holder gives the frozen objects back to the
    collector (so a stopped gateway's cycles can be freed)."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("heap.release() without a hold()")
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()


def holders() -> int:
    """How many holds are in force (0: nothing frozen by us)."""
    return _holders
