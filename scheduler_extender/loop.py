"""Sharing the event loop that answers the scheduler and the webhooks: work over many objects (a sweep of the
view for the wait-time index or a portal page) runs in slices, giving the loop back between them, so a filter
or bind request waits for one slice (about a millisecond), never for the whole sweep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")
SLICE = 1000  # objects handled between two yields to the loop


async def slices(items: Sequence[T], size: int | None = None) -> AsyncIterator[Sequence[T]]:
    """``items`` in slices of ``size`` (default :data:`SLICE`), the loop given back before every slice after the
    first. Iterate over a copy when the loop may change the collection meanwhile."""
    step = size or SLICE
    for start in range(0, len(items), step):
        if start:
            await asyncio.sleep(0)
        yield items[start:start + step]
