"""List then watch one kind, as client-go's reflector does.

- The first list (and every relist) is paginated and its HTTP status checked: while a resource cannot be listed
  (403, 404 when a CRD is missing, 429, 5xx, no answer) the informer is not ``healthy``, logs one clear line per
  change of error, keeps what it had (an error is never taken for an empty list) and retries with exponential
  backoff and jitter. Its items are decoded one by one, the loop given back every millisecond, and handed to
  ``on_sync``, which may be a coroutine function that takes them in slices too (it is awaited).
- The watch asks for bookmarks and resumes from the last resourceVersion seen (bookmarks move it too); the server
  closes it after a jittered ``timeoutSeconds`` and it is reopened at once; no data for longer than that plus a
  margin ends a half-open connection; a 410 Gone (on the watch or as an ERROR event) relists.
- A watch that keeps failing backs off the same way, so a misbehaving server is never hammered.
- Until the first list succeeded the retry gap is capped at ``first_list_cap`` (4 s): a process waiting for its
  first list serves nothing and its start deadline runs, and a 403 or 404 then is most often RBAC or a CRD being
  applied in the same rollout. With the full cap (30 s) an extender whose RBAC came back 8 s before its 30 s
  start deadline still exited: its next list was due 9-16 s later.
- A watch that gets no answer at all (connection refused or reset, read timeout: the API server is down or
  unreachable) makes the informer not ``healthy`` too, until a watch is answered again (or a relist succeeds):
  the view is then only as current as the outage is long, and ``/readyz`` must say so. A watch the server
  answers with an error while lists still work (a 500 on the watch alone) leaves it healthy. While it is not
  healthy and only its watch is retried, the gap is capped at ``first_list_cap`` too, so ``/readyz`` turns 200
  within seconds of the server's return; a failing relist keeps the full cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, overload

import orjson

from kubeapi.client import KubeClient, backoff_delay
from kubeapi.collector import collector_paused
from kubeapi.errors import ApiError, Expired, log_failure
from kubeapi.resources import Resource

YIELD_AFTER = 0.001  # seconds of event handling before a watch lets other tasks run

log = logging.getLogger("accelstack.kube.informer")
Handler = Callable[[str, dict[str, Any]], None]  # (ADDED|MODIFIED|DELETED, object)
# a relist's items (a list, or a Listed for a lazy informer); may be a coroutine function. It may keep the items,
# not the list: what it leaves is freed a slice at a time once it returns
Sync = Callable[[list[dict[str, Any]]], "Awaitable[None] | None"] | Callable[[Sequence[dict[str, Any]]],
                                                                           "Awaitable[None] | None"]


class Listed(Sequence[dict[str, Any]]):
    """A relist's items, each decoded from its JSON when it is read and not kept: a consumer that takes them
    in slices (:func:`service.loop.slices` slices a sequence) never holds them all decoded at once.
    5,000 real Node objects are some 90 MB of JSON; decoded all together they were built in one go and freed
    in one go (17-20 ms for 600 of them at the end of a relist), and so many survivors set off full
    collections of the cyclic collector (80-100 ms each) in the middle of the decode. Each read decodes
    afresh: iterate once, or make a list first."""

    def __init__(self, raw: list[Any]) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [orjson.loads(memoryview(r)) for r in self._raw[index]]
        decoded: dict[str, Any] = orjson.loads(memoryview(self._raw[index]))
        return decoded

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for r in self._raw:
            yield orjson.loads(memoryview(r))


class Informer:
    def __init__(self, client: KubeClient, resource: Resource, on_event: Handler,
                 on_sync: Sync, *, name: str = "", namespace: str | None = None,
                 label_selector: str = "", watch_timeout: tuple[int, int] = (300, 600), read_margin: float = 30.0,
                 backoff: tuple[float, float] = (0.5, 30.0), rng: random.Random | None = None,
                 page_size: int = 100, lazy: bool = False, first_list_cap: float = 4.0) -> None:
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
        self.first_list_cap = first_list_cap  # the retry gap's cap until the first list succeeded
        # items per list page (client-go: 500): each page is scanned at once, 1.8 ms for 100 real nodes (18 KB each)
        self.page_size = page_size
        self.lazy = lazy  # on_sync gets a Listed (decoded as read) instead of a list decoded beforehand
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
        raw, rv = await self.client.list_raw(self.resource, self.namespace, label_selector=self.label_selector,
                                             page_size=self.page_size)
        held = time.perf_counter()
        for i, item in enumerate(raw):  # well-formed JSON (the page was scanned); each must be an object
            if bytes(memoryview(item)[:1]) != b"{":
                raise ApiError(500, "BadList", f"list of {self.resource.plural}: item {i} is not an object")
            if time.perf_counter() - held >= YIELD_AFTER:
                await asyncio.sleep(0)
                held = time.perf_counter()
        # what a relist builds and drops has no cycles (no full collections meanwhile); what it keeps is frozen
        with collector_paused() as pause:
            items: Any = Listed(raw) if self.lazy else await self._decoded(raw)
            self.resource_version = rv
            taken = self.on_sync(items)
            if inspect.isawaitable(taken):  # a view that takes a large relist in slices (its events wait meanwhile)
                await taken
            if isinstance(items, list):  # what on_sync did not keep is freed a slice at a time
                held = time.perf_counter()
                while items:
                    del items[-64:]
                    if time.perf_counter() - held >= YIELD_AFTER:
                        await asyncio.sleep(0)
                        held = time.perf_counter()
            pause.freeze()
        self.relists += 1
        self.client.metrics.relists.labels(self.name).inc()
        self.synced.set()
        self._set_health(True)

    async def _decoded(self, raw: list[Any]) -> list[dict[str, Any]]:
        """The listed items decoded one by one, giving the loop back every YIELD_AFTER seconds: 5,000 real Node
        objects are about 90 MB of JSON, and a page of 500 of them decoded at once held the loop for 70-180 ms
        (the more when the cyclic collector ran in the middle of it)."""
        items: list[dict[str, Any]] = []
        held = time.perf_counter()
        for item in raw:
            items.append(orjson.loads(memoryview(item)))
            if time.perf_counter() - held >= YIELD_AFTER:
                await asyncio.sleep(0)
                held = time.perf_counter()
        return items

    async def _watch(self) -> int:
        """One watch until the server ends it; the events seen (bookmarks count)."""
        timeout = self.rng.randint(*self.watch_timeout)
        seen = 0
        self.watches += 1
        held = time.perf_counter()
        async for kind, obj in self.client.watch(self.resource, self.namespace,
                                                 resource_version=self.resource_version, timeout_seconds=timeout,
                                                 read_timeout=timeout + self.read_margin,
                                                 label_selector=self.label_selector, on_open=self._watch_opened):
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

    def _watch_opened(self) -> None:
        if not self.healthy and self.synced.is_set():  # the server answers again: the outage is over
            self._set_health(True)

    async def run(self, stop: asyncio.Event) -> None:
        need_list, failures, expired = True, 0, 0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            unreachable = False
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
                unreachable = exc.status == 0
                if need_list or exc.status == 0:  # a list failed, or no answer at all (the server is unreachable)
                    self._set_health(False, str(exc))
                else:
                    log.warning("watch failed; resuming", extra={"informer": self.name, "error": str(exc)[:300]})
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # a handler's bug must not end the informer
                failures += 1
                log_failure(log, "informer handler failed", exc, {"informer": self.name})
                need_list = True
            # Retries are at most first_list_cap apart before the first list, while the server gives no answer at
            # all (a refused connection costs it nothing) and while an outage is over but for the watch (a watch is
            # cheap; a relist is not, and a failing one keeps the full cap): until its next try the informer is
            # not healthy and /readyz says 503, and with the 30 s cap an extender stayed unready for up to 30 s
            # after a 3 s API-server restart (its watches had met a refused connection, then a starting server)
            short = not self.synced.is_set() or unreachable or (not self.healthy and not need_list)
            cap = min(self.backoff[1], self.first_list_cap) if short else self.backoff[1]
            await self._pause(stop, backoff_delay(failures, self.backoff[0], cap, self.rng))

    @staticmethod
    async def _pause(stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
