"""What every long-running process of accelstack serves besides its work, and how it runs until told to stop.

- :func:`probe_routes`: ``/healthz`` (the process answers), ``/readyz`` (200, or 503 naming each problem: an
  informer not synced or not healthy, with its last error, or whatever else the process says) and ``/metrics``
  (the registries given, then the default one).
- :func:`informer_problems`: the problems of a list of informers, as ``/readyz`` says them.
- :func:`serve_until_signal`: start, log that it started, wait for SIGTERM or SIGINT, then log and stop (stop runs
  whatever happened meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest


def informer_problems(informers: Iterable[Any]) -> list[str]:
    """``name: last error`` (or ``not synced``) of each informer that is not synced and healthy."""
    return [f"{i.name}: {i.last_error or 'not synced'}" for i in informers if not (i.synced.is_set() and i.healthy)]


def probe_routes(problems: Callable[[], list[str]], registries: Iterable[CollectorRegistry] = (),
                 before_metrics: Callable[[], None] = lambda: None) -> list[web.RouteDef]:
    """``/healthz``, ``/readyz`` (``problems()`` empty: ready) and ``/metrics`` (``before_metrics`` runs first, to
    set gauges read at scrape time)."""
    regs = [*registries, REGISTRY]

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        wrong = problems()
        return web.Response(text="ok\n") if not wrong else \
            web.Response(status=503, text=f"not ready: {', '.join(wrong)}\n")

    async def metrics(_: web.Request) -> web.Response:
        before_metrics()
        return web.Response(body=b"".join(generate_latest(r) for r in regs),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    return [web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics)]


async def serve_until_signal(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]],
                             started: Callable[[], None], log: logging.Logger) -> None:
    """``start()``, ``started()`` (its log line), then wait for SIGTERM or SIGINT; ``stop()`` on the way out,
    whatever ended the wait."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await start()
        started()
        await stopping.wait()
    finally:
        log.info("shutting down")
        await stop()
