"""The cyclic garbage collector held off while a large amount of data without reference cycles is built and
thrown away: an informer's relist, a controller pass. With the collector running, the many young survivors of
such work set off full collections over the whole heap in the middle of it (60-130 ms each, in one piece, at
a few thousand real Node objects) on the event loop that answers the scheduler; held off, the objects die by
reference counting, and what other tasks left in cycles meanwhile is collected once the pause ends."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_pauses = 0
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold the cyclic collector off for the block. Nested and concurrent blocks, in tasks or in threads, share
    one pause, which ends with the last of them (the collector is enabled again only if it was before)."""
    global _pauses, _was_enabled
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
