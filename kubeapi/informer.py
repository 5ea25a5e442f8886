"""List then watch one kind, as client-go's reflector does.

- The first list (and every relist) is paginated and its HTTP status checked: while a resource cannot be listed
  (403, 404 when a CRD is missing, 429, 5xx, no answer) the informer is not ``healthy``, logs one clear line per
  change of error, keeps what it had (an error is never taken for an empty list) and retries with exponential
  backoff and jitter.
- The watch asks for bookmarks and resumes from the last resourceVersion seen (bookmarks move it too); the server
  closes it after a jittered ``timeoutSeconds`` and it is reopened at once; no data for longer than that plus a
  margin ends a half-open connection; a 410 Gone (on the watch or as an ERROR event) relists.
- A watch that keeps failing backs off the same way, so a misbehaving server is never hammered.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kubeapi.client import KubeClient, backoff_delay
from kubeapi.errors import ApiError, Expired
from kubeapi.resources import Resource

YIELD_AFTER = 0.001  # seconds of event handling before a watch lets other tasks run

log = logging.getLogger("accelstack.kube.informer")
Handler = Callable[[str, dict[str, Any]], None]  # (ADDED|MODIFIED|DELETED, object)
Sync = Callable[[list[dict[str, Any]]], "Awaitable[None] | None"]  # a relist's items; may be a coroutine function


class Informer:
    def __init__(self, client: KubeClient, resource: Resource, on_event: Handler,
                 on_sync: Sync, *, name: str = "", namespace: str | None = None,
                 label_selector: str = "", watch_timeout: tuple[int, int] = (300, 600), read_margin: float = 30.0,
                 backoff: tuple[float, float] = (0.5, 30.0), rng: random.Random | None = None) -> None:
        self.client = client
        self.resource = resource
        self.on_event = on_event
        self.on_sync = on_sync
        self.name = name or resource.plural
        self.namespace = namespace
        self.label_selector = label_selector
        self.watch_timeout = watch_timeout
        self.read_margin = read_margin
        self.backoff = backoff
        self.rng = rng or random.Random()
        self.synced = asyncio.Event()
        self.healthy = False
        self.last_error = ""
        self.relists = 0
        self.watches = 0
        self.resource_version = ""
        self._gauge = client.metrics.informer_healthy.labels(self.name)

    def _set_health(self, healthy: bool, error: str = "") -> None:
        if not healthy and error != self.last_error:
            log.warning("cannot list/watch; keeping the last state and retrying",
                        extra={"informer": self.name, "error": error[:300]})
        elif healthy and not self.healthy and self.last_error:
            log.info("list/watch recovered", extra={"informer": self.name})
        self.healthy = healthy
        self.last_error = "" if healthy else error
        self._gauge.set(1 if healthy else 0)

    async def _list(self) -> None:
        items, rv = await self.client.list(self.resource, self.namespace, label_selector=self.label_selector)
        self.resource_version = rv
        taken = self.on_sync(items)
        if inspect.isawaitable(taken):  # a view that takes a large relist in slices (its events wait meanwhile)
            await taken
        self.relists += 1
        self.client.metrics.relists.labels(self.name).inc()
        self.synced.set()
        self._set_health(True)

    async def _watch(self) -> int:
        """One watch until the server ends it; the events seen (bookmarks count)."""
        timeout = self.rng.randint(*self.watch_timeout)
        seen = 0
        self.watches += 1
        held = time.perf_counter()
        async for kind, obj in self.client.watch(self.resource, self.namespace,
                                                 resource_version=self.resource_version, timeout_seconds=timeout,
                                                 read_timeout=timeout + self.read_margin,
                                                 label_selector=self.label_selector):
            seen += 1
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self.resource_version = str(rv)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self.on_event(kind, obj)
            # events that arrived together are read from the buffer without a pause: give the loop back every
            # YIELD_AFTER seconds, so a burst (a controller writing hundreds of statuses) never holds a request
            if time.perf_counter() - held >= YIELD_AFTER:
                await asyncio.sleep(0)
                held = time.perf_counter()
        return seen

    async def run(self, stop: asyncio.Event) -> None:
        need_list, failures, expired = True, 0, 0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                if need_list:
                    await self._list()
                    need_list = False
                started = loop.time()
                seen = await self._watch()
                if seen or loop.time() - started >= 1.0:
                    failures = expired = 0
                    continue
                failures += 1  # closed at once with nothing: a server or proxy in trouble; do not spin
            except Expired:
                log.info("resourceVersion expired; relisting", extra={"informer": self.name})
                need_list = True
                expired += 1
                if expired == 1:
                    continue  # relist at once; a relist that expires again backs off
                failures += 1
            except ApiError as exc:
                failures += 1
                if need_list:
                    self._set_health(False, str(exc))
                else:
                    log.warning("watch failed; resuming", extra={"informer": self.name, "error": str(exc)[:300]})
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # a handler's bug must not end the informer
                failures += 1
                log.exception("informer handler failed", extra={"informer": self.name, "error": str(exc)[:300]})
                need_list = True
            await self._pause(stop, backoff_delay(failures, self.backoff[0], self.backoff[1], self.rng))

    @staticmethod
    async def _pause(stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
