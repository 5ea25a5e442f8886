"""The cyclic garbage collector held off while a large amount of data without reference cycles is built and
thrown away: an informer's relist, a controller pass. With the collector running, the many young survivors of
such work set off full collections over the whole heap in the middle of it (60-130 ms each, in one piece, at
a few thousand real Node objects) on the event loop that answers the scheduler; held off, the objects die by
reference counting, and what other tasks left in cycles meanwhile is collected once the pause ends.

A block that has built long-lived data (a relist: the informers' new view of the cluster) asks for a freeze once
it has succeeded (``pause.freeze()``): when the pause ends, everything then alive is moved out of the collector's
reach (``gc.freeze()``, as a server does
once its first sync is done). Otherwise the young collection that follows the pause walks every object the
relist kept (15-30 ms in one piece at 5,000 real nodes), and full collections walk them again for the rest of
the process's life. The price: what other tasks left in reference cycles during the pause is frozen too and
never collected, a few hundred kilobytes at most per relist, and relists are rare (at start, after a 410).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_pauses = 0
_was_enabled = False
_freeze = False


class Pause:
    """The handle a :func:`collector_paused` block gets."""

    def freeze(self) -> None:
        """Freeze what is alive when the pause ends (ask only once the long-lived data is built: a block that
        failed half way has nothing worth keeping out of the collector's reach)."""
        global _freeze
        with _lock:
            _freeze = True


@contextlib.contextmanager
def collector_paused() -> Iterator[Pause]:
    """Hold the cyclic collector off for the block. Nested and concurrent blocks, in tasks or in threads, share
    one pause, which ends with the last of them (the collector is enabled again only if it was before); a freeze
    asked for in any of them is done then, once."""
    global _pauses, _was_enabled, _freeze
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield Pause()
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0:
                if _freeze:
                    gc.freeze()
                    _freeze = False
                if _was_enabled:
                    gc.enable()
