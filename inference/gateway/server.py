"""The gateway's HTTP server: the OpenAI API in front of the replicas the routing core picks.

One request's way: parse the body (``model``, ``stream``), authenticate the API key, check the endpoint's access
map and the key's rate limit, take a replica with room (or wait in the model's bounded FIFO queue, then 429 with
``Retry-After``), forward the body, and pass the answer back: a JSON body whole, a server-sent-event stream chunk by
chunk as the replica writes it. A connection error, a timeout or a 5xx from the replica before anything reached
the client is retried once on another replica; after the first byte it is final. A client that disconnects
cancels the handler (the listener does, on the connection's loss), which closes the upstream connection, so
the runtime stops generating.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inference.access import Access, Caller, TokenBucket, admits, bearer_token, digest
from inference.discovery import RouteSpec
from inference.gateway.listener import BrokenBody, Request, Response, Stream, lookup
from inference.gateway.metrics import GatewayMetrics, replica_label
from inference.gateway.upstream import Answer, Pool, UpstreamError, request_head, split_url
from inference.names import POOL_BURST, POOLS
from inference.routing import (
    EjectionPolicy,
    ModelRoute,
    Replica,
    has_room,
    pick,
    pick_round_robin,
    record_failure,
    record_latency,
    record_success,
)

log = logging.getLogger("accelstack.gateway")
access_log = logging.getLogger("accelstack.gateway.access")

API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
POLICIES = ("least-request", "round-robin")
_FORWARDED_HEADERS = ("Accept", "User-Agent", "OpenAI-Organization", "OpenAI-Project")
_FORWARDED = tuple((name, name.lower()) for name in _FORWARDED_HEADERS)


@dataclass(frozen=True)
class Settings:
    auth: bool = True
    policy: str = "least-request"
    request_timeout: float = 300.0  # to the whole answer (JSON) or to the first chunk (stream)
    idle_timeout: float = 60.0  # between two chunks of a stream
    connect_timeout: float = 2.0
    queue_timeout: float = 30.0
    retries: int = 1
    max_body: int = 8 * 1024 * 1024
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    drain_seconds: float = 5.0
    shutdown_timeout: float = 30.0
    body_timeout: float = 60.0  # to receive a request's whole body (the listener's header and idle timeouts: main)
    queue_metric: str = "vllm:num_requests_waiting"
    load_poll_interval: float = 0.0
    access_log: bool = False  # one INFO line per API request on the logger accelstack.gateway.access


FAILED_AUTH_BURST, FAILED_AUTH_RATE = 10.0, 1.0  # failed TokenReviews per client address: at once, then a second


def looks_like_jwt(token: str) -> bool:
    """Whether a bearer token could be a service-account token (a JWT: three base64url parts): only those are
    worth a TokenReview; anything else that is no API key is refused at once."""
    parts = token.split(".")
    return len(parts) == 3 and all(parts) and all(
        c.isalnum() or c in "-_" for part in parts for c in part) and len(token) <= 16384


class Rejected(Exception):
    """A request the gateway answers itself with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, type_: str, code: str, reason: str,
                 retry_after: float | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.reason = status, message, type_, code, reason
        self.retry_after, self.close = retry_after, close

    def response(self, request_id: str) -> Response:
        headers = {"x-request-id": request_id} if request_id else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        response = error_response(self.status, self.message, self.type, self.code, headers)
        # the connection is in no state for another request (a body left half-read)
        response.close = self.close
        return response


def error_response(status: int, message: str, type_: str, code: str | None,
                   headers: Mapping[str, str] | None = None) -> Response:
    body = orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
    return Response(status, body, headers, content_type="application/json")


def _sse_error(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                               "code": code}}) + b"\n\n"


@dataclass(eq=False)
class Waiter:
    """A request waiting in a model's queue. Identity-hashed: the same request may queue again at the front."""

    future: asyncio.Future[None]
    exclude: tuple[str, ...] = ()  # replicas this request already tried (a retry waits for another one)


@dataclass
class LiveRoute:
    """A model's routing state: the pure core's ModelRoute plus the queue and what the handlers need.

    The queue's accounting has two containers and nothing else: ``waiters`` (queued, not woken; their futures are
    never done) and ``woken`` (woken by a free slot, not yet back on the CPU to take it). A waiter is in at most one
    of them, and every way out of ``_acquire`` (a replica taken, a timeout, a cancellation at any await) takes it
    out of both; a woken one leaving without its slot passes the wake-up on. There is no counter to leak: the
    number of pending wake-ups *is* ``len(woken)``.
    """

    core: ModelRoute
    access: Access
    max_queue: int
    waiters: deque[Waiter] = field(default_factory=deque)
    woken: set[Waiter] = field(default_factory=set)  # arrivals must not overtake them
    rr: int = 0
    mean_latency: float = 1.0  # EWMA of request seconds, for Retry-After
    bursting: bool | None = None  # what the bursting gauge says (None: not set yet)


@dataclass
class _StreamState:
    request_id: str = ""
    caller: str = ""  # namespace/name of the key or service account; "" without auth
    done_sent: bool = False  # the replica's ``data: [DONE]`` was written to the client


class Gateway:
    def __init__(self, settings: Settings, metrics: GatewayMetrics | None = None,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        self.rng = rng or random.Random()
        self.clock = clock
        self.routes: dict[str, LiveRoute] = {}
        self.keys: dict[str, Caller] = {}
        # Authorization header -> the API key's caller, for keys that matched: a SHA-256 per request was ~2% of the
        # CPU per proxied request. Only known keys get in (a flood of bogus tokens cannot grow it), it is bounded,
        # and it is emptied whenever the key table changes (a revoked key stops working at the next apply)
        self._known_auth: dict[str, Caller] = {}
        self.buckets: dict[str, TokenBucket] = {}
        self.synced = False
        self.draining = False
        self.inflight = 0
        self._pool: Pool | None = None  # keep-alive connections to the replicas (upstream.py)
        self._targets: dict[str, tuple[str, int, str]] = {}  # replica URL -> host, port, Host header
        self._poller: asyncio.Task[None] | None = None
        # who a bearer token that is no API key belongs to (a service-account token, by TokenReview); None: nobody
        self.reviewer: Callable[[str], Awaitable[Caller | None]] | None = None
        # failed authentications per client address that cost a TokenReview: a bucket each (FAILED_AUTH_BURST at
        # once, then FAILED_AUTH_RATE a second); past it, 429 and no TokenReview (distinct bogus tokens defeat any
        # cache: 20,000 of them were 20,000 TokenReviews at the API server)
        self.auth_failures: dict[str, TokenBucket] = {}
        self._notes: set[str] = set()  # discovery notes logged and still true
        # request ids: a random per-process prefix and a counter (unique as uuid4's, without its 3 % of the CPU)
        self._id_prefix, self._id_count = uuid.uuid4().hex[:16], 0
        self._pages: dict[str, Callable[[], Response]] = {
            "/healthz": self.healthz, "/readyz": self.readyz, "/metrics": self.metrics_page}

    # ---- configuration from discovery ---------------------------------------------------------------------
    def apply(self, table: Mapping[str, RouteSpec], keys: Mapping[str, Caller], problems: list[str],
              notes: Sequence[str] = ()) -> None:
        """Install a new route table and key table; live replicas keep their load and ejection state.

        ``notes`` (a replica listed twice, one shared by two endpoints) are logged once each while they last, not
        at every rebuild."""
        for model in [m for m in self.routes if m not in table]:
            route = self.routes.pop(model)
            for gone in route.core.replicas.values():
                self._forget_if_idle(model, gone)
            while route.waiters:
                route.waiters.popleft().future.set_result(None)  # they find no route and fail with model_not_found
        for model, spec in table.items():
            live = self.routes.get(model)
            if live is None:
                live = self.routes[model] = LiveRoute(ModelRoute(model), spec.access, spec.max_queue)
            live.core.endpoint, live.core.max_inflight = spec.endpoint, spec.max_inflight
            live.access, live.max_queue = spec.access, spec.max_queue
            before = dict(live.core.replicas)
            live.core.set_replicas(spec.replicas)
            for url, gone in before.items():
                if url not in live.core.replicas:
                    self._forget_if_idle(model, gone)
            self._wake(live)
            # series exist from the start, so rate() sees their first increase
            self.metrics.child(self.metrics.queue_seconds, model)
            self.metrics.child(self.metrics.queue_depth, model)
            self.metrics.child(self.metrics.inflight, model)
            self.metrics.child(self.metrics.queue_stalled, model)
        self.keys = dict(keys)
        self._known_auth = {}
        self.buckets = {name: b for name, b in self.buckets.items() if any(c.name == name for c in keys.values())}
        self.metrics.config_errors.set(len(problems))
        for line in problems:
            log.warning("discovery", extra={"problem": line})
        for line in notes:
            if line not in self._notes:
                log.info("discovery", extra={"note": line})
        self._notes = set(notes)
        self.synced = True
        self._export_replicas()

    def _export_replicas(self) -> None:
        now = self.clock()
        self.metrics.replicas.clear()
        for model, live in self.routes.items():
            counts = {(pool, state): 0 for pool in POOLS for state in ("ready", "ejected")}
            for replica in live.core.replicas.values():
                counts[(replica.pool, "ejected" if replica.ejected(now) else "ready")] += 1
            for (pool, state), n in counts.items():
                self.metrics.replicas.labels(model, pool, state).set(n)
            stalled = self.stalled(live)
            self.metrics.child(self.metrics.queue_stalled, model).set(stalled)
            if stalled:  # a leak, or an ejection that ran out with nothing released since: wake them now
                log.warning("queue stalled: requests waited while a replica had room", extra={
                    "model": model, "stalled": stalled, "waiters": len(live.waiters), "woken": len(live.woken)})
                self._wake(live)

    # ---- the routes (served by listener.Listener) --------------------------------------------------------------
    async def handle(self, request: Request) -> Response | Stream:
        """Answer ``request``: the proxied API, the model list, health, readiness and metrics; 404 and 405 in the
        OpenAI error shape. GET routes answer HEAD too (the listener leaves the body out)."""
        path, method = request.path, request.method
        if path in API_PATHS:
            if method != "POST":
                return self._not_allowed("POST")
            return await self.proxy(request)
        if path.startswith("/v1/models") and path[10:11] in ("", "/"):
            if method not in ("GET", "HEAD"):
                return self._not_allowed("GET")
            name = unquote(path[11:])
            return await (self.model(request, name) if name else self.models(request))
        page = self._pages.get(path)
        if page is None:
            return error_response(404, f"No route for {path[:200]}.", "invalid_request_error", "not_found")
        if method not in ("GET", "HEAD"):
            return self._not_allowed("GET")
        return page()

    @staticmethod
    def _not_allowed(allowed: str) -> Response:
        return error_response(405, f"Method not allowed here; use {allowed}.", "invalid_request_error",
                              "method_not_allowed", {"Allow": allowed})

    async def start(self) -> None:
        """Open the upstream pool and start the load poller (before the listener serves)."""
        self._pool = Pool(connect_timeout=self.settings.connect_timeout)
        if self.settings.load_poll_interval > 0:
            self._poller = asyncio.create_task(self._poll_load())

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
        if self._pool:
            self._pool.close()

    def healthz(self) -> Response:
        return Response(body=b"ok")

    def readyz(self) -> Response:
        if self.draining:
            return Response(503, b"draining")
        if not self.synced:
            return Response(503, b"discovery not synced")
        return Response(body=b"ok")

    def metrics_page(self) -> Response:
        self._export_replicas()
        return Response(body=generate_latest(self.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    # ---- authentication and access ---------------------------------------------------------------------------
    async def _caller(self, request: Request) -> Caller | None:
        if not self.settings.auth:
            return None
        authorization = lookup(request.headers, "authorization")
        if authorization is not None and (known := self._known_auth.get(authorization)) is not None:
            return known
        token = bearer_token(authorization)
        caller = self.keys.get(digest(token)) if token else None
        if caller is not None and authorization is not None:
            if len(self._known_auth) >= 4096:
                self._known_auth.clear()
            self._known_auth[authorization] = caller
        if caller is None and token and self.reviewer is not None and looks_like_jwt(token):
            client = request.remote or ""
            bucket = self.auth_failures.get(client)
            if bucket is not None:
                bucket.tokens = min(bucket.burst, bucket.tokens + (self.clock() - bucket.updated) * bucket.rate)
                bucket.updated = self.clock()
                if bucket.tokens < 1.0:
                    raise Rejected(429, "Too many failed authentications from this address; retry later.",
                                   "invalid_request_error", "rate_limit_exceeded", "too_many_failed_authentications",
                                   retry_after=(1.0 - bucket.tokens) / bucket.rate)
            caller = await self.reviewer(token)
            if caller is None:
                if len(self.auth_failures) >= 10_000:  # bounded: forget the clients whose buckets are full again
                    now = self.clock()
                    self.auth_failures = {c: b for c, b in self.auth_failures.items()
                                          if b.tokens + (now - b.updated) * b.rate < b.burst}
                self.auth_failures.setdefault(client, TokenBucket(FAILED_AUTH_RATE, FAILED_AUTH_BURST)).take(
                    self.clock())
        if caller is None:
            raise Rejected(401, "Missing or incorrect API key. Send it as 'Authorization: Bearer <key>'; keys are "
                           "Secrets labelled accelstack.io/api-key=true (or a service-account token).", "invalid_request_error",
                           "invalid_api_key", "unauthorized")
        return caller

    def _route(self, model: str, caller: Caller | None) -> LiveRoute:
        live = self.routes.get(model)
        if live is None:
            raise Rejected(404, f"The model '{model}' does not exist.", "invalid_request_error", "model_not_found",
                           "model_not_found")
        if caller is not None:
            ok, why = admits(live.access, caller)
            if not ok:
                raise Rejected(403, f"The model '{model}' is not open to {caller.name}: {why}.", "permission_error",
                               "model_access_denied", "forbidden")
            wait = self._bucket(caller).take(self.clock())
            if wait > 0:
                raise Rejected(429, f"Rate limit of {caller.rate:g} requests/s for {caller.name} reached.",
                               "rate_limit_error", "rate_limit_exceeded", "rate_limited", retry_after=wait)
        return live

    def _bucket(self, caller: Caller) -> TokenBucket:
        bucket = self.buckets.get(caller.name)
        if bucket is None or bucket.rate != caller.rate or bucket.burst != caller.burst:
            bucket = self.buckets[caller.name] = TokenBucket(caller.rate, caller.burst)
        return bucket

    async def models(self, request: Request) -> Response:
        try:
            caller = await self._caller(request)
        except Rejected as exc:
            return exc.response("")
        data = [self._model_object(m, live) for m, live in sorted(self.routes.items())
                if caller is None or admits(live.access, caller)[0]]
        return Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")

    async def model(self, request: Request, name: str) -> Response:
        try:
            caller = await self._caller(request)
            live = self.routes.get(name)
            if live is None or (caller is not None and not admits(live.access, caller)[0]):
                raise Rejected(404, f"The model '{name}' does not exist.", "invalid_request_error",
                               "model_not_found", "model_not_found")
        except Rejected as exc:
            return exc.response("")
        return Response(body=orjson.dumps(self._model_object(name, live)), content_type="application/json")

    @staticmethod
    def _model_object(model: str, live: LiveRoute) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": live.core.endpoint.split("/", 1)[0]}

    # ---- replicas and the wait queue --------------------------------------------------------------------------
    def _pick(self, live: LiveRoute, exclude: list[str]) -> Replica | None:
        now = self.clock()
        if self.settings.policy == "round-robin":
            live.rr += 1
            replica = pick_round_robin(live.core, live.rr, now)
            if replica is not None and replica.url in exclude:
                replica = None
        else:
            replica = pick(live.core, self.rng, now, exclude)
        if replica is not None:
            replica.outstanding += 1
            self.metrics.child(self.metrics.replica_inflight, live.core.model, replica.spec.namespace,
                               replica_label(replica)).inc()
            bursting = replica.pool == POOL_BURST
            if bursting is not live.bursting:  # a gauge write (a lock) only when it changes, not per request
                live.bursting = bursting
                self.metrics.child(self.metrics.bursting, live.core.model).set(1 if bursting else 0)
        return replica

    def _wake(self, live: LiveRoute) -> None:
        """Wake queued requests, in order, while free slots outnumber the requests already woken.

        A waiter is woken only when a replica with room is one it may use (a retry skips the replica it tried), so
        a wake-up is never spent on a request that cannot take the slot.
        """
        if not live.waiters:
            return
        now = self.clock()
        limit = live.core.max_inflight
        room = [r.url for r in live.core.replicas.values() if has_room(r, limit, now)]
        spare = sum(limit - live.core.replicas[url].outstanding for url in room) - len(live.woken)
        index = 0
        while spare > 0 and index < len(live.waiters):
            waiter = live.waiters[index]
            if waiter.exclude and all(url in waiter.exclude for url in room):
                index += 1
                continue
            del live.waiters[index]
            waiter.future.set_result(None)
            live.woken.add(waiter)
            spare -= 1

    def stalled(self, live: LiveRoute) -> int:
        """Queued requests a free slot could serve now that nobody has woken: always 0 unless the queue's
        accounting leaked (the watchdog metric ``queue_stalled``)."""
        if not live.waiters or live.woken:
            return 0
        now = self.clock()
        room = [r.url for r in live.core.replicas.values() if has_room(r, live.core.max_inflight, now)]
        return sum(1 for w in live.waiters if any(url not in w.exclude for url in room))

    def _release(self, live: LiveRoute, replica: Replica) -> None:
        replica.outstanding -= 1
        self.metrics.child(self.metrics.replica_inflight, live.core.model, replica.spec.namespace,
                           replica_label(replica)).dec()
        current = self.routes.get(live.core.model)
        if current is not None:
            self._wake(current)
        if current is None or current.core.replicas.get(replica.url) is not replica:
            self._forget_if_idle(live.core.model, replica)  # it left while busy; now it is done

    def _forget_if_idle(self, model: str, replica: Replica) -> None:
        """Drop the series of a replica that left, once nothing is outstanding there, unless a current replica
        of the model goes by the same name (a pod recreated under its name)."""
        if replica.outstanding > 0:
            return
        live = self.routes.get(model)
        if live is not None and any(replica_label(r) == replica_label(replica) for r in live.core.replicas.values()):
            return
        self.metrics.forget_replica(model, replica)

    async def _acquire(self, live: LiveRoute, exclude: list[str]) -> Replica:
        if not live.waiters and not live.woken:
            replica = self._pick(live, exclude)
            if replica is not None:
                self.metrics.child(self.metrics.queue_seconds, live.core.model).observe(0.0)  # the mean counts it
                return replica
        if not live.core.replicas:
            raise Rejected(503, f"The model '{live.core.model}' has no ready replica.", "server_error",
                           "no_ready_replica", "no_replica", retry_after=5)
        if len(live.waiters) >= live.max_queue:
            raise Rejected(429, f"The model '{live.core.model}' is at capacity and its queue is full.",
                           "rate_limit_error", "model_overloaded", "queue_full", retry_after=self._retry_after(live))
        loop = asyncio.get_running_loop()
        model = live.core.model
        start = self.clock()
        deadline = start + self.settings.queue_timeout
        waiter = Waiter(loop.create_future(), tuple(exclude))
        queued = live  # the route whose containers hold the waiter (a model removed and re-added is a new one)
        queued.waiters.append(waiter)
        depth = self.metrics.child(self.metrics.queue_depth, model)
        depth.inc()
        try:
            self._wake(queued)  # a slot may be free already: requests woken before us left some over
            while True:
                if not waiter.future.done():
                    remaining = deadline - self.clock()
                    if remaining <= 0:
                        raise Rejected(429, f"No replica of '{model}' had room within "
                                       f"{self.settings.queue_timeout:g} s.", "rate_limit_error",
                                       "model_overloaded", "queue_timeout", retry_after=self._retry_after(queued))
                    try:
                        await asyncio.wait_for(asyncio.shield(waiter.future), remaining)
                    except TimeoutError:
                        continue  # woken at the deadline: the loop takes the slot; otherwise it answers 429
                queued.woken.discard(waiter)
                current = self.routes.get(model)
                if current is None:
                    raise Rejected(404, f"The model '{model}' does not exist.", "invalid_request_error",
                                   "model_not_found", "model_not_found")
                replica = self._pick(current, exclude)
                if replica is not None:
                    return replica
                waiter = Waiter(loop.create_future(), tuple(exclude))
                queued = current
                queued.waiters.appendleft(waiter)  # woken but beaten to it: keep its place at the front
                self._wake(queued)
        finally:
            # every way out (a slot taken, 429, 404, a cancellation at any await) leaves the containers consistent
            if waiter in queued.woken:  # woken, leaving without its slot: the next request gets the wake-up
                queued.woken.discard(waiter)
                if self.routes.get(model) is queued:
                    self._wake(queued)
            elif not waiter.future.done():
                waiter.future.cancel()
                try:
                    queued.waiters.remove(waiter)
                except ValueError:
                    pass
            depth.dec()
            self.metrics.child(self.metrics.queue_seconds, model).observe(self.clock() - start)

    def _retry_after(self, live: LiveRoute) -> float:
        capacity = max(1, live.core.capacity(self.clock()))
        return min(60.0, max(1.0, (len(live.waiters) + 1) * live.mean_latency / capacity))

    # ---- proxying ---------------------------------------------------------------------------------------------
    def proxy(self, request: Request) -> Coroutine[Any, Any, Response | Stream]:
        """The proxied request, with its access-log line when ``access_log`` is on (no extra coroutine when it
        is off: every resumption of a request's task goes through each coroutine it awaits)."""
        return self._proxy(request, {}) if not self.settings.access_log else self._logged(request)

    async def _logged(self, request: Request) -> Response | Stream:
        start = self.clock()
        seen: dict[str, str] = {}
        status = 499  # the client left before an answer (nginx's code for it)
        try:
            response = await self._proxy(request, seen)
            status = response.status
            return response
        finally:
            # one line per request; the caller is the key's Secret or service account name, never the key
            access_log.info("access", extra={
                "request_id": seen.get("request_id", ""), "caller": seen.get("caller", ""),
                "model": seen.get("model", "-"), "path": request.path, "status": status,
                "duration_ms": round((self.clock() - start) * 1000, 1)})

    async def _proxy(self, request: Request, seen: dict[str, str]) -> Response | Stream:
        request_id = seen["request_id"] = lookup(request.headers, "x-request-id") or self._next_id()
        model = "-"
        self.inflight += 1
        try:
            try:
                caller = await self._caller(request)  # before the body: a caller without a key costs no memory
                seen["caller"] = caller.name if caller else ""
                body = await self._read_body(request)
                model, stream = self._parse(body)
                seen["model"] = model if model in self.routes else "-"  # names anyone sends are not logged
                live = self._route(model, caller)
            except Rejected as exc:
                # a label only for models that exist: names sent by anyone must not grow the series without bound
                self.metrics.child(self.metrics.errors, model if model in self.routes else "-", exc.reason).inc()
                return exc.response(request_id)  # a body left unread closes the connection (the listener)
            inflight = self.metrics.child(self.metrics.inflight, model)
            inflight.inc()
            try:
                return await self._forward(request, live, body, stream, request_id, caller)
            finally:
                inflight.dec()
        finally:
            self.inflight -= 1

    def _next_id(self) -> str:
        self._id_count += 1
        return f"{self._id_prefix}{self._id_count:016x}"

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed ``max_body``: by its Content-Length before
        a byte is read, or (chunked) while it streams in. Never more than ``max_body`` is held per request."""
        limit = self.settings.max_body
        length = request.content_length
        if length is not None and length > limit:
            raise self._too_large()
        if length:  # the usual small body arrived with its head: take it without arming a timer
            ready = request.content.read_nowait(length)
            if len(ready) == length:
                return ready
            first: bytes | None = ready
        else:
            first = None
        # one growing buffer, not a list of the socket's chunks: each chunk is freed as soon as it is copied, so
        # a burst of big bodies leaves no heap of small blocks behind (the buffer itself is one mapping; see
        # main.return_big_buffers_to_the_os)
        try:
            async with asyncio.timeout(self.settings.body_timeout):
                if not first:
                    first = await request.content.readany()
                if len(first) > limit:
                    raise self._too_large()
                chunk = await request.content.readany() if first else b""
                if not chunk:
                    return first  # the usual small body, in one piece: no copy
                body = bytearray(first)
                while chunk:
                    if len(body) + len(chunk) > limit:
                        raise self._too_large()
                    body += chunk
                    chunk = await request.content.readany()
                return bytes(body)
        except TimeoutError:
            raise Rejected(408, f"The request body did not arrive within {self.settings.body_timeout:g} s.",
                           "invalid_request_error", "request_timeout", "body_timeout", close=True) from None
        except BrokenBody as exc:
            raise Rejected(400, f"The request body is malformed: {exc}.", "invalid_request_error", "invalid_body",
                           "bad_request", close=True) from None

    def _too_large(self) -> Rejected:
        return Rejected(413, f"The request body is larger than {self.settings.max_body} bytes.",
                        "invalid_request_error", "request_too_large", "body_too_large", close=True)

    @staticmethod
    def _parse(body: bytes) -> tuple[str, bool]:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise Rejected(400, f"The request body is not valid JSON: {exc}", "invalid_request_error",
                           "invalid_json", "bad_request") from None
        if not isinstance(doc, dict):
            raise Rejected(400, "The request body must be a JSON object.", "invalid_request_error",
                           "invalid_json", "bad_request")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise Rejected(400, "'model' is required and must be a non-empty string.", "invalid_request_error",
                           "missing_model", "bad_request")
        stream = doc.get("stream", False)
        if not isinstance(stream, bool):
            raise Rejected(400, "'stream' must be a boolean.", "invalid_request_error", "invalid_type",
                           "bad_request")
        return model, stream

    async def _forward(self, request: Request, live: LiveRoute, body: bytes, stream: bool, request_id: str,
                       caller: Caller | None) -> Response | Stream:
        model = live.core.model
        start = self.clock()
        tried: list[str] = []
        last: Rejected | None = None
        for attempt in range(self.settings.retries + 1):
            if attempt:
                now = self.clock()
                others = [r for r in live.core.replicas.values() if r.url not in tried and not r.ejected(now)]
                if not others:  # none left to try (an ejected one would only make the retry wait)
                    break
                self.metrics.child(self.metrics.retries, model).inc()
            try:
                replica = await self._acquire(live, tried)
            except Rejected as exc:
                if last is not None and attempt:
                    break
                self.metrics.child(self.metrics.errors, model, exc.reason).inc()
                return exc.response(request_id)
            tried.append(replica.url)
            try:
                outcome = await self._attempt(request, live, replica, body, stream, request_id, start,
                                              caller.name if caller else "")
            finally:
                self._release(live, replica)
            if isinstance(outcome, Rejected):
                last = outcome
                continue
            return outcome
        assert last is not None
        self.metrics.child(self.metrics.errors, model, last.reason).inc()
        # the client learns how many replicas failed and how the last one did, never which (pod names and
        # addresses are the cluster's business); the log has them, with the request id to find the line by
        log.warning("upstream failed", extra={"model": model, "request_id": request_id, "replicas": tried,
                                              "pods": [replica_label(live.core.replicas[url]) if url in
                                                       live.core.replicas else url for url in tried],
                                              "error": last.message, "caller": caller.name if caller else ""})
        n = len(tried)
        last.message = (f"The replica of '{model}' tried {last.message}." if n == 1 else
                        f"All {n} replicas of '{model}' tried failed; the last {last.message}.")
        return last.response(request_id)

    def _target(self, url: str) -> tuple[str, int, str]:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 4096:  # replicas come and go: keep the cache bounded
                self._targets.clear()
            target = self._targets[url] = split_url(url)
        return target

    async def _attempt(self, request: Request, live: LiveRoute, replica: Replica, body: bytes, stream: bool,
                       request_id: str, start: float, caller: str = "") -> Response | Stream | Rejected:
        """One try at one replica: the final response, or a Rejected the caller may retry elsewhere."""
        assert self._pool is not None
        model = live.core.model
        label = replica_label(replica)
        host, port, host_header = self._target(replica.url)
        headers = [(k, v) for k, low in _FORWARDED if (v := lookup(request.headers, low))]
        headers.append(("Content-Type", "application/json"))
        headers.append(("x-request-id", request_id))
        head = request_head("POST", request.path, host_header, headers, len(body))
        upstream: Answer | None = None
        sent = False
        stream_state = _StreamState(request_id, caller)
        sent_at = self.clock()  # the replica's own time, without the queue: what balancing compares
        try:
            try:
                # request_timeout bounds the whole answer (JSON) or its first chunk (a stream): a deadline the
                # upstream connection keeps (one lazy timer per connection, not an asyncio.timeout per request);
                # past it the wait raises UpstreamTimeout, a TimeoutError
                upstream = await self._pool.request(host, port, head, body, self.settings.request_timeout)
                if upstream.status >= 500 or upstream.status == 429:
                    await upstream.read()
                    if upstream.status >= 500:
                        self._failed(live, replica)
                    return Rejected(502 if upstream.status != 429 else 429,
                                    f"answered HTTP {upstream.status}", "server_error",
                                    "upstream_error", "upstream_error", retry_after=1)
                content_type = upstream.headers.get("content-type", "")
                is_sse = content_type.startswith("text/event-stream")
                if not (stream and is_sse):
                    payload = await upstream.read()
                    first = self.clock()
                else:
                    first_chunk = await upstream.readany()
                    upstream.end_deadline()  # from here each chunk has idle_timeout (_pump)
                    first = self.clock()
            except (TimeoutError, UpstreamError) as exc:
                self._failed(live, replica)
                timeout = isinstance(exc, TimeoutError)
                return Rejected(504 if timeout else 502,
                                "did not answer in time" if timeout else str(exc),
                                "server_error", "upstream_timeout" if timeout else "upstream_error",
                                "upstream_timeout" if timeout else "upstream_error", retry_after=1)
            self.metrics.child(self.metrics.ttfb, model, label).observe(first - start)
            if not (stream and is_sse):
                record_success(replica)
                record_latency(replica, self.clock() - sent_at)
                if upstream.status == 200 and b'"usage"' in payload:
                    self._count_usage(model, payload)
                self._done(live, label, upstream.status, start)
                return Response(upstream.status, payload, {"x-request-id": request_id},
                                content_type=content_type or "application/json")
            if not first_chunk:
                self._failed(live, replica)
                return Rejected(502, "closed the stream before sending anything",
                                "server_error", "upstream_error", "upstream_error", retry_after=1)
            response = request.stream(upstream.status, {
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "x-request-id": request_id})
            sent = True
            await self._pump(response, upstream, live, replica, first_chunk, stream_state)
            record_latency(replica, first - sent_at)  # a stream's length is the prompt's, not the replica's speed
            self._done(live, label, upstream.status, start)
            return response
        except asyncio.CancelledError:
            self._client_left(live, replica, label, start, stream_state)
            raise
        except ConnectionResetError:
            if sent:  # the client went away mid-stream
                self._client_left(live, replica, label, start, stream_state)
                return response
            raise
        finally:
            if upstream is not None:
                upstream.close()  # back to the pool after a whole answer; otherwise aborts the runtime's generation

    def _client_left(self, live: LiveRoute, replica: Replica, label: str, start: float, state: _StreamState) -> None:
        """The client closed its connection. After ``[DONE]`` reached it that is how a stream ends (the official
        client closes right away), so it is a success; before, the request is a ``client_disconnected`` error."""
        if state.done_sent:
            record_success(replica)
            self._done(live, label, 200, start)
        else:
            self.metrics.child(self.metrics.errors, live.core.model, "client_disconnected").inc()

    async def _pump(self, response: Stream, upstream: Answer, live: LiveRoute,
                    replica: Replica, chunk: bytes, state: _StreamState) -> None:
        """Pass the stream through as it comes; after an idle timeout or a broken stream, end it with an error."""
        model = live.core.model
        tail = b""
        while chunk:
            await response.write(chunk)
            if not state.done_sent:  # the marker may straddle two chunks: look at the end of the last one too
                state.done_sent = b"data: [DONE]" in tail + chunk
                tail = chunk[-16:]
            if b'"usage"' in chunk:
                self._count_stream_usage(model, chunk)
            try:
                chunk = await upstream.readany_within(self.settings.idle_timeout)  # UpstreamTimeout past it
            except (TimeoutError, UpstreamError) as exc:
                self._failed(live, replica)
                timeout = isinstance(exc, TimeoutError)
                self.metrics.child(self.metrics.errors, model, "stream_interrupted").inc()
                log.warning("stream interrupted", extra={"model": model, "replica": replica_label(replica),
                                                         "timeout": timeout, "request_id": state.request_id,
                                                         "caller": state.caller})
                message = (f"The replica sent nothing for {self.settings.idle_timeout:g} s." if timeout
                           else f"The replica broke the stream: it {exc}.")
                await response.write(_sse_error(message, "upstream_timeout" if timeout else "upstream_error"))
                await response.write_eof()
                return
        record_success(replica)
        await response.write_eof()

    def _failed(self, live: LiveRoute, replica: Replica) -> None:
        if record_failure(live.core, replica, self.clock(), self.settings.ejection):
            self.metrics.child(self.metrics.ejections, live.core.model, replica_label(replica)).inc()
            log.warning("replica ejected", extra={"model": live.core.model, "replica": replica_label(replica),
                                                  "seconds": round(replica.ejected_until - self.clock(), 1)})

    def _done(self, live: LiveRoute, label: str, status: int, start: float) -> None:
        elapsed = self.clock() - start
        live.mean_latency += 0.1 * (elapsed - live.mean_latency)
        model = live.core.model
        self.metrics.child(self.metrics.latency, model, label).observe(elapsed)
        self.metrics.child(self.metrics.requests, model, label, str(status)).inc()

    def _count_usage(self, model: str, payload: bytes) -> None:
        try:
            usage = orjson.loads(payload).get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            return
        self._add_tokens(model, usage)

    def _count_stream_usage(self, model: str, chunk: bytes) -> None:
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    self._add_tokens(model, orjson.loads(line[6:]).get("usage"))
                except (orjson.JSONDecodeError, AttributeError):
                    continue

    def _add_tokens(self, model: str, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        for kind, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
            value = usage.get(key)
            if isinstance(value, int) and value > 0:
                self.metrics.child(self.metrics.tokens, model, kind).inc(value)

    # ---- the runtimes' reported queues -----------------------------------------------------------------------
    async def _poll_load(self) -> None:
        """Read each replica's waiting-request gauge (``queue_metric``) from its /metrics now and then, over the
        same keep-alive pool as the requests (a connection per poll and a full exposition parser were most of the
        gateway's CPU at 100 requests/s with a 0.1 s interval)."""
        assert self._pool is not None
        pool = self._pool
        name = self.settings.queue_metric.encode()
        timeout = max(0.2, self.settings.load_poll_interval)

        heads: dict[str, tuple[str, int, bytes]] = {}

        async def one(replica: Replica) -> None:
            target = heads.get(replica.url)
            if target is None:
                if len(heads) > 4096:  # replicas come and go: keep the cache bounded
                    heads.clear()
                host, port, host_header = self._target(replica.url)
                target = heads[replica.url] = host, port, request_head("GET", "/metrics", host_header, (), 0)
            answer: Answer | None = None
            try:
                # the pool's deadline bounds connecting and the whole answer: no asyncio.timeout per poll
                answer = await pool.request(target[0], target[1], target[2], b"", timeout)
                text = await answer.read()
            except (TimeoutError, UpstreamError):
                return
            finally:
                if answer is not None:
                    answer.close()
            if answer.status == 200 and (total := gauge_total(text, name)) is not None:
                replica.reported_queue = total

        while True:
            replicas = [r for live in self.routes.values() for r in live.core.replicas.values()]
            await asyncio.gather(*(one(r) for r in replicas))
            await asyncio.sleep(self.settings.load_poll_interval)


def gauge_total(text: bytes, name: bytes) -> float | None:
    """The sum of the samples of ``name`` in a Prometheus text exposition, all label sets together (0 when it has
    none); None when one of its lines is malformed. Only the lines of that metric are looked at."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest[:1] == b"{":
            close = rest.rfind(b"}")  # label values may hold '}', the value and timestamp never do
            if close < 0:
                return None
            rest = rest[close + 1:]
        elif rest[:1] not in (b" ", b"\t"):
            continue  # another metric whose name starts with this one
        fields = rest.split()
        try:
            total += float(fields[0])
        except (IndexError, ValueError):
            return None
    return total
