"""The loop every level-triggered controller runs while it leads (workspaces and accelerator nodes in
``accelstack-controller``, the hub's Cluster judgement and GPR dispatch, a member agent's dispatch follower): a pass
on a change (coalesced, at most one per ``min_interval``) and every ``resync`` seconds, never on a partial view,
and a pass that raises retried with a backoff (1 s doubling to 30 s)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Mapping, MutableMapping
from typing import Any, TypeVar

from kubeapi.errors import log_failure


def resource_version(obj: Mapping[str, Any] | None) -> int:
    """An object's resourceVersion as a number (0 when absent): which of two copies an informer saw later."""
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


K = TypeVar("K", bound=Hashable)


def keep_newer(store: MutableMapping[K, dict[str, Any]], key: K, written: dict[str, Any], *,
               created: bool = False) -> bool:
    """Put the answer to our own write into an informer-fed ``store`` (so the next pass sees it before the watch
    brings it), unless the store holds a later version, or (``created`` false: anything but a create, or an
    informer event) no longer holds the object at all. The watch can deliver another writer's change, or the
    object's deletion, before the loop reads our answer: the older answer would then hide that change, or bring a
    deleted object back, until something else touches it (for a deleted one, never: no event comes for it; a hub
    that kept a member that had left placed work on it forever). True when kept."""
    held = store.get(key)
    if held is None and not created:
        return False
    if resource_version(written) < resource_version(held):
        return False
    store[key] = written
    return True


async def wait_first(stop: asyncio.Event, poke: asyncio.Event | None, timeout: float) -> None:
    """Until ``stop`` or ``poke`` is set, or ``timeout`` seconds."""
    if timeout <= 0 or math.isnan(timeout):
        return
    waits = [asyncio.create_task(stop.wait())] + ([asyncio.create_task(poke.wait())] if poke is not None else [])
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), timeout)
    finally:
        for w in waits:
            w.cancel()


async def run_passes(stop: asyncio.Event, poke: asyncio.Event, *, synced: Callable[[], bool],
                     reconcile: Callable[[], Awaitable[Any]], resync: float, min_interval: float,
                     clock: Callable[[], float], log: logging.Logger, what: str,
                     retry_at: Callable[[], float | None] = lambda: None) -> None:
    """Passes until ``stop``. ``retry_at``: the earliest time a failed write may be tried again (None: none
    waits), which wakes the loop before ``resync``."""
    failures = 0
    while not stop.is_set():
        if not synced():  # never plan on a partial view: it would look like objects must be created or deleted
            poke.clear()
            await wait_first(stop, poke, timeout=0.2)
            continue
        poke.clear()
        started = clock()
        try:
            await reconcile()
            failures = 0
        except Exception as exc:
            failures += 1
            log_failure(log, f"{what} pass failed; retrying", exc)
        wait = min(30.0, 0.5 * 2 ** failures) if failures else resync
        retry = retry_at()
        if retry is not None:
            wait = min(wait, max(0.0, retry - clock()))
        await wait_first(stop, None, timeout=max(0.0, started + min_interval - clock()))
        await wait_first(stop, poke, timeout=wait)
