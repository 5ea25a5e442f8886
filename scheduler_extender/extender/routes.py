"""The HTTP extender kube-scheduler calls: ``POST <prefix>/filter``, ``/prioritize``, ``/preempt``, ``/bind`` with
the exact upstream JSON, in both ``nodeCacheCapable`` modes, plus ``/healthz``, ``/readyz`` and ``/metrics``.

Malformed JSON (JSON nested too deeply included) or wrong types answer HTTP 400 with the ``Error`` field set;
a body over the size limit answers 413, a body that does not arrive within the body-read timeout 408 (and the
connection is closed); a refused body is logged as one line (``request refused``) and counted in
``accelstack_extender_bad_requests_total``. Pods that request no managed resource pass straight through filter
and prioritize, but bind refuses them unless they belong to a GPR: the profile routes only pods that request a
managed resource to the extender, so any other bind request is not the scheduler's (nor accelstack's to
decide). Names in a bind longer than Kubernetes allows are refused as malformed, and every field a verb logs is
cut to :data:`LOG_FIELD_MAX` characters (a 3 MB node name is not a 3 MB log line).

With the view's ledger "memory" only the replica holding the binder Lease answers the verbs; another answers 503
with ``Error`` set and closes the connection, so kube-scheduler retries the pod on a new connection, which the
verbs Service routes to the replica labelled ``accelstack.io/binder``.

The view follows the API server through separate watches, so a pod can reach filter before the status that
admitted its GPR reaches the view (the controller writes the status, then lifts the gate; the scheduler sees the
pod on its own watch). A refusal then would leave the pod in kube-scheduler's unschedulable queue until some
other cluster event, up to its 5-minute flush on a quiet cluster. So when the view says a scheduled pod's GPR is
missing or not admitted, filter reads that GPR afresh once (at most once a second per GPR, within
``catch_up_timeout``) and answers from it when it is newer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from scheduler_extender.extender import wire
from scheduler_extender.extender.binder import Binder
from scheduler_extender.extender.verbs import PodAsk, ask_of, filter_nodes, preempt, prioritize
from scheduler_extender.objects.cluster import GPR_LABEL, ClusterView, pod_view
from scheduler_extender.objects.kube import ApiError
from service.h2_server import Request, Routes
from service.http_body import DEFAULT_BODY_TIMEOUT, BodyError, closing, read_body
from service.http_listener import client_refusal

log = logging.getLogger("accelstack.extender")
JSON = "application/json"
VERBS = ("filter", "prioritize", "preempt", "bind")
CATCH_UP_EVERY = 1.0  # seconds between catch-up reads of one GPR
CATCH_UP_TIMEOUT = 0.5  # the most a filter waits for one
FetchGPR = Callable[[str, str], Awaitable[dict[str, Any]]]
LOG_FIELD_MAX = 256  # characters of one logged field
# the longest each ExtenderBindingArgs field can be in Kubernetes (namespace: a DNS label; names: DNS subdomains)
NAME_MAX = {"PodName": 253, "PodNamespace": 63, "PodUID": 128, "Node": 253}


def cap(value: Any, limit: int = LOG_FIELD_MAX) -> str:
    """``value`` as text, cut to ``limit`` characters (with how long it was) for a log line."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


class ExtenderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        p = "accelstack_extender_"
        self.latency = Histogram(p + "request_seconds", "Extender verb handling time", ["verb"],
                                 buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                          0.5, 1.0, 2.5, 5.0),  # bind's API round trips: against its 1 s target
                                 registry=self.registry)
        self.decisions = Counter(p + "decisions_total", "Extender outcomes by verb and result", ["verb", "result"],
                                 registry=self.registry)
        self.bad_requests = Counter(p + "bad_requests_total", "Requests refused as malformed", ["verb"],
                                    registry=self.registry)
        self.evictions = Counter(p + "evictions_total", "Evictions started to make room at bind",
                                 registry=self.registry)
        self.catch_up = Counter(p + "catch_up_reads_total", "GPRs read afresh by filter because the view said a "
                                "scheduled pod's GPR was missing or not admitted, by outcome (newer: the view lagged; "
                                "same: it did not; failed: not read - not found, an API error or no answer in time)", ["outcome"], registry=self.registry)
        self.binder_active = Gauge(p + "binder_active", "1 while this replica binds (ledger \"node\": every "
                                   "replica; \"memory\": the holder of the binder Lease, after its first read of the "
                                   "pods)", registry=self.registry)
        self.loop_lag = Histogram(p + "loop_lag_seconds", "How late the event loop that serves the verbs and "
                                  "webhooks ran a timer due now (time a request waits behind other work)",
                                  # from 1 ms: an idle loop already runs a timer up to ~0.5 ms late
                                  buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                                  registry=self.registry)


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=wire.encoder.encode(wire.ExtenderBindingResult(Error=message)),
                        content_type=JSON)


def _node_names(args: wire.ExtenderArgs) -> tuple[list[str], list[msgspec.Raw] | None]:
    """(names, raw node items or None): NodeNames when nodeCacheCapable, else the names of Nodes.items."""
    if args.NodeNames is not None:
        return list(args.NodeNames), None
    if args.Nodes is not None:
        items = list(args.Nodes.items or [])
        return [wire.node_item.decode(raw).metadata.name for raw in items], items
    raise ValueError("neither NodeNames nor Nodes was sent")


class Extender:
    def __init__(self, view: ClusterView, binder: Binder, metrics: ExtenderMetrics | None = None,
                 require_gpr: bool = False, ready: Callable[[], bool] = lambda: True,
                 registries: tuple[CollectorRegistry, ...] = (),
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, fetch_gpr: FetchGPR | None = None,
                 catch_up_every: float = CATCH_UP_EVERY, catch_up_timeout: float = CATCH_UP_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic, binding: Callable[[], bool] = lambda: True) -> None:
        self.view = view
        self.binding = binding  # False: another replica binds (the view's ledger "memory"): verbs answer 503
        self.fetch_gpr = fetch_gpr
        self.catch_up_every, self.catch_up_timeout, self.clock = catch_up_every, catch_up_timeout, clock
        self._read_at: dict[str, float] = {}  # GPR key -> when filter last read it afresh
        self.body_timeout = body_timeout
        self.binder = binder
        self.metrics = metrics or ExtenderMetrics()
        self.require_gpr = require_gpr
        self.ready = ready
        self.registries = (self.metrics.registry, *registries)

    def _verbs(self) -> dict[str, Callable[[bytes], Awaitable[web.Response]]]:
        return {"filter": self.filter, "prioritize": self.prioritize, "preempt": self.preempt, "bind": self.bind}

    def routes(self, prefix: str = "/scheduler") -> list[web.RouteDef]:
        prefix = prefix.rstrip("/")
        out = [web.post(f"{prefix}/{verb}", self._wrap(verb, handler)) for verb, handler in self._verbs().items()]
        out += [web.get("/healthz", self.healthz), web.get("/readyz", self.readyz), web.get("/metrics", self.metrics_view)]
        return out

    def h2_routes(self, prefix: str, clients: frozenset[str], max_body: int) -> Routes:
        """The same verbs and health endpoints for HTTP/2 connections (:mod:`service.h2_server`: what
        kube-scheduler's client speaks when the listener offers it), behind the same client-certificate check
        (``clients``: the common names allowed; empty: any the CA signed)."""
        prefix = prefix.rstrip("/")

        def checked(answer: Callable[[Request], Awaitable[web.Response]]) -> Callable[[Request], Awaitable[web.Response]]:
            async def route(request: Request) -> web.Response:
                return client_refusal(clients, request.peercert, request.remote) or await answer(request)
            return route

        def verb(name: str, handler: Callable[[bytes], Awaitable[web.Response]]) -> Callable[[Request], Awaitable[web.Response]]:
            async def answer(request: Request) -> web.Response:
                async def body() -> bytes:
                    return request.body  # read whole by the connection, within its bounds
                return await self.answer(name, handler, body, request.remote)
            return checked(answer)

        routes: dict[tuple[str, str], Callable[[Request], Awaitable[web.Response]]] = {
            ("POST", f"{prefix}/{name}"): verb(name, handler) for name, handler in self._verbs().items()}
        def page(view: Callable[[web.Request | None], Awaitable[web.Response]]) -> Callable[[Request], Awaitable[web.Response]]:
            async def answer(_: Request) -> web.Response:
                return await view(None)
            return checked(answer)

        for path, view in (("/healthz", self.healthz), ("/readyz", self.readyz), ("/metrics", self.metrics_view)):
            routes[("GET", path)] = page(view)
        return Routes(routes, max_body=max_body, body_timeout=self.body_timeout)

    async def answer(self, verb: str, handler: Callable[[bytes], Awaitable[web.Response]],
                     read: Callable[[], Awaitable[bytes]], remote: str) -> web.Response:
        """``verb``'s answer to a request whose body ``read`` returns (HTTP/1.1 or HTTP/2): 503 and a closed
        connection from a replica that is not the binder, the verb's ``Error`` for a refused or malformed body,
        never a 500 without it."""
        started = time.perf_counter()
        if not self.binding():  # one replica decides: its filter claims and its binds share one memory
            self.metrics.decisions.labels(verb, "not-binder").inc()
            answer = _error(503, f"{verb}: this accelstack extender replica is not the active binder now; "
                                 "retry (a new connection reaches the one that is)")
            answer.force_close()  # kube-scheduler's kept connection may lead here: its next one is routed anew
            return answer
        try:
            return await handler(await read())
        except BodyError as exc:  # the body never arrived whole: one line, no traceback
            self.metrics.bad_requests.labels(verb).inc()
            log.warning("request refused", extra={"verb": verb, "status": exc.status, "error": cap(exc.message),
                                                  "remote": remote})
            return _error(exc.status, f"{verb}: {exc.message}")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.metrics.bad_requests.labels(verb).inc()
            return _error(400, f"{verb}: malformed request: {exc}")
        except Exception as exc:  # never a 500 without the Error field
            log.exception("extender verb failed", extra={"verb": verb})
            return _error(500, f"{verb}: internal error: {type(exc).__name__}: {exc}")
        finally:
            self.metrics.latency.labels(verb).observe(time.perf_counter() - started)

    def _wrap(self, verb: str, handler: Callable[[bytes], Awaitable[web.Response]]) -> Any:
        async def handle(request: web.Request) -> web.Response:
            response = await self.answer(verb, handler, lambda: read_body(request, self.body_timeout),
                                         request.remote or "")
            return await closing(request, response)  # a 408: the rest of that body may still come
        return handle

    async def filter(self, body: bytes) -> web.Response:
        args = wire.filter_args.decode(body)
        if args.Pod is None:
            raise ValueError("Pod is missing")
        names, items = _node_names(args)
        ask = ask_of(self.view, args.Pod, self.require_gpr)
        if ask.problem and ask.gpr_key and self.fetch_gpr is not None:
            ask = await self._caught_up(ask, args.Pod)
        outcome = filter_nodes(self.view, ask, names)
        result = wire.ExtenderFilterResult(FailedNodes=outcome.failed,
                                           FailedAndUnresolvableNodes=outcome.unresolvable)
        if items is None:
            result.NodeNames = outcome.passed
        else:
            keep = set(outcome.passed)
            assert args.Nodes is not None
            result.Nodes = wire.NodeList(items=[raw for raw, name in zip(items, names, strict=True) if name in keep],
                                         metadata=args.Nodes.metadata)
        self.metrics.decisions.labels("filter", "passed" if outcome.passed else "none").inc()
        return web.Response(body=wire.encoder.encode(result), content_type=JSON)

    async def _caught_up(self, ask: PodAsk, pod: wire.Pod) -> PodAsk:
        """The pod's ask after reading its GPR afresh, when the view may lag behind (see the module's doc)."""
        assert self.fetch_gpr is not None
        now = self.clock()
        if now - self._read_at.get(ask.gpr_key, -math.inf) < self.catch_up_every:
            return ask
        if len(self._read_at) >= 1024:  # keep only the recent ones
            self._read_at = {k: t for k, t in self._read_at.items() if now - t < self.catch_up_every}
        self._read_at[ask.gpr_key] = now
        namespace, name = ask.gpr_key.split("/", 1)
        try:
            async with asyncio.timeout(self.catch_up_timeout):
                obj = await self.fetch_gpr(namespace, name)
        except Exception as exc:
            self.metrics.catch_up.labels("failed").inc()
            log.debug("catch-up read failed", extra={"gpr": cap(ask.gpr_key), "error": str(exc)[:200]})
            return ask
        if not self.view.take_fresher_gpr(obj):
            self.metrics.catch_up.labels("same").inc()
            return ask
        self.metrics.catch_up.labels("newer").inc()
        log.info("GPR read afresh ahead of its watch", extra={"gpr": cap(ask.gpr_key),
                                                              "resourceVersion": (obj.get("metadata") or {}).get(
                                                                  "resourceVersion", "")})
        return ask_of(self.view, pod, self.require_gpr)

    async def prioritize(self, body: bytes) -> web.Response:
        args = wire.filter_args.decode(body)
        if args.Pod is None:
            raise ValueError("Pod is missing")
        names, _ = _node_names(args)
        scores = prioritize(self.view, ask_of(self.view, args.Pod, self.require_gpr), names)
        result = [wire.HostPriority(Host=name, Score=score) for name, score in scores]
        return web.Response(body=wire.encoder.encode(result), content_type=JSON)

    async def preempt(self, body: bytes) -> web.Response:
        args = wire.preemption_args.decode(body)
        if args.Pod is None:
            raise ValueError("Pod is missing")
        victims: dict[str, list[str]] = {}
        pdb: dict[str, int] = {}
        if args.NodeNameToMetaVictims is not None:
            for node, meta in args.NodeNameToMetaVictims.items():
                victims[node] = [p.UID for p in meta.Pods]
                pdb[node] = meta.NumPDBViolations
        elif args.NodeNameToVictims is not None:
            for node, full in args.NodeNameToVictims.items():
                victims[node] = [p.metadata.uid for p in full.Pods]
                pdb[node] = full.NumPDBViolations
        ask = ask_of(self.view, args.Pod, self.require_gpr)
        if not ask.requests:  # not ours to shape: every candidate stays
            kept = {n: wire.MetaVictims(Pods=[wire.MetaPod(UID=u) for u in uids], NumPDBViolations=pdb.get(n, 0))
                    for n, uids in victims.items()}
        else:
            kept = preempt(self.view, ask, victims, pdb)
        self.metrics.decisions.labels("preempt", "kept" if kept else "none").inc()
        return web.Response(body=wire.encoder.encode(wire.ExtenderPreemptionResult(NodeNameToMetaVictims=kept)),
                            content_type=JSON)

    async def bind(self, body: bytes) -> web.Response:
        args = wire.binding_args.decode(body)
        for field, longest in NAME_MAX.items():
            if not getattr(args, field):
                raise ValueError(f"{field} is empty")
            if len(getattr(args, field)) > longest:
                raise ValueError(f"{field} is {len(getattr(args, field))} characters, over the {longest} Kubernetes "
                                 "allows")
        evictions_before = self.binder.evictions
        error = await self._not_ours(args) or await self.binder.bind(args.PodNamespace, args.PodName, args.PodUID,
                                                                     args.Node)
        self.metrics.evictions.inc(self.binder.evictions - evictions_before)
        self.metrics.decisions.labels("bind", "error" if error else "bound").inc()
        if error:
            log.info("bind refused", extra={"pod": cap(f"{args.PodNamespace}/{args.PodName}"), "node": cap(args.Node),
                                            "error": cap(error)})
        return web.Response(body=wire.encoder.encode(wire.ExtenderBindingResult(Error=error)), content_type=JSON)

    async def _not_ours(self, args: wire.ExtenderBindingArgs) -> str:
        """Why accelstack will not bind this pod ('' when it will): a pod that requests no managed resource and
        belongs to no GPR is one the shipped profile never sends here (``managedResources``), so the request did
        not come from the scheduler's decision for an accelstack pod. The view holds every pod that requests a
        managed resource; any other is read afresh (the view may lag behind a pod created a moment ago)."""
        if args.PodUID in self.view.pods:
            return ""
        key = f"{args.PodNamespace}/{args.PodName}"
        try:
            obj = await self.binder.pod_now(args.PodNamespace, args.PodName, args.PodUID)
        except ApiError as exc:
            return f"cannot bind {key} now: the API server failed a call ({cap(exc.reason, 100)}); retry"
        if obj is None:
            return ""  # gone, or its name is another pod's now: the binder says which
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(GPR_LABEL) or pod_view(obj, self.view.resources) is not None:
            return ""
        return (f"pod {key} requests no resource accelstack manages ({', '.join(self.view.resources)}) and belongs "
                "to no GPR: not the accelstack extender's to bind")

    async def healthz(self, _: web.Request | None) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, _: web.Request | None) -> web.Response:
        return web.Response(text="ok\n") if self.ready() else web.Response(
            status=503, text="not ready: a resource cannot be listed from the API server (see the logs)\n")

    async def metrics_view(self, _: web.Request | None) -> web.Response:
        body = b"".join(generate_latest(r) for r in self.registries)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
