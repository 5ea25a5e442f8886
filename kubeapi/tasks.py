"""Supervised background tasks: a crash is logged with its traceback (an unreachable API server in one line), counted and the task restarted with
backoff (never a silently dead loop); leader-only work runs only while the Lease is held."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from kubeapi.client import backoff_delay
from kubeapi.errors import log_failure
from kubeapi.leader import LeaderElector
from kubeapi.metrics import api_metrics

log = logging.getLogger("accelstack.tasks")
TaskFactory = Callable[[asyncio.Event], Awaitable[None]]  # run until the event is set


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def supervise(name: str, factory: TaskFactory, stop: asyncio.Event, *, backoff: tuple[float, float] = (1.0, 30.0),
                    rng: random.Random | None = None) -> None:
    """Run ``factory(stop)`` until ``stop`` is set, restarting it whenever it raises or returns early."""
    rng = rng or random.Random()
    restarts = api_metrics().task_restarts.labels(name)
    failures = 0
    while not stop.is_set():
        try:
            await factory(stop)
            if stop.is_set():
                return
            log.warning("background task returned early; restarting", extra={"task": name})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an unreachable API server is one line; a bug keeps its traceback
            log_failure(log, "background task crashed; restarting", exc, {"task": name})
        failures += 1
        restarts.inc()
        await _wait(stop, backoff_delay(failures, backoff[0], backoff[1], rng))


async def while_leading(elector: LeaderElector, stop: asyncio.Event, tasks: dict[str, TaskFactory]) -> None:
    """Run ``tasks`` (supervised) for each term this replica leads, and cancel them the moment it stops."""
    while not stop.is_set():
        await _first(stop, elector.leading)
        if stop.is_set():
            return
        term = asyncio.Event()
        running = [asyncio.create_task(supervise(name, factory, term), name=f"leader-{name}")
                   for name, factory in tasks.items()]
        try:
            await _first(stop, elector.following)
        finally:  # also when this task itself is cancelled: leader work never outlives the term
            term.set()
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class _Observer(Protocol):
    def observe(self, amount: float) -> None: ...


async def watch_loop_lag(lag: _Observer, stop: asyncio.Event, every: float = 0.1) -> None:
    """Observe, ``every`` seconds, how late the event loop woke this task: how long anything scheduled on the
    loop (a request the scheduler waits for included) had to wait behind whatever ran before it. A process
    whose hot path must never wait for CPU-heavy work (the extender's verbs and webhooks) exports it, so that
    a slow filter can be told from a busy loop (``accelstack_extender_loop_lag_seconds``)."""
    while not stop.is_set():
        # the clock itself, not loop.time(): uvloop's is libuv's, cached per loop iteration in whole milliseconds
        due = time.perf_counter() + every
        await _wait(stop, every)
        if not stop.is_set():
            lag.observe(max(0.0, time.perf_counter() - due))
