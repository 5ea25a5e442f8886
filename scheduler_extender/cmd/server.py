"""The extender process and the controller service.

``ExtenderServer`` is what answers kube-scheduler and the API server on the hot path: informers feeding the
cluster view, the extender verbs, the binder, the REST API and the admission webhook. With ``verbs_apart`` the
verbs are served on a listener of their own (``start(verbs_port=..., verbs_ssl=...)``: the shipped layout, where
that listener requires kube-scheduler's client certificate), and the main listener answers 404 there; without
it everything shares one listener (tests, a scheduler that reaches the extender over loopback). Every listener
is :mod:`.http_listener`'s: fixed answers to malformed HTTP, header and idle timeouts.

``ControllerService`` is the leader-elected GPR controller and the ledger sweep. It runs in its own process
(``accelstack-controller``, the layout the manifests ship: a second container beside the extender) so that its
CPU-bound passes never compete with the verbs for the interpreter, or — with ``run_controller=True`` — inside the
extender process on the same view (small clusters, tests), where passes still run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry

from kubeapi.informer import Informer, Sync
from kubeapi.leader import LeaderElector
from kubeapi.resources import GPRS, NODES, PODS
from kubeapi.tasks import supervise, watch_loop_lag, while_leading
from scheduler_extender.api.app import RateLimiter, RestAPI
from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.views import DEFAULT_GROUP_LABEL
from scheduler_extender.controller.accelerator_nodes import AcceleratorNodeController
from scheduler_extender.controller.gpr_controller import GPRController
from scheduler_extender.controller.workspaces import WorkspaceController
from scheduler_extender.extender.binder import Binder
from scheduler_extender.extender.routes import VERBS, Extender, ExtenderMetrics
from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import HOLDING, TERMINAL_POD_PHASES, ClusterView, NodeView, PodView
from scheduler_extender.objects.kube import ApiError, Kube
from service.http_body import DEFAULT_BODY_TIMEOUT
from service.http_listener import Limits, client_names, serve_app

log = logging.getLogger("accelstack.extender.server")
BINDER_LABEL = "accelstack.io/binder"  # on the extender pod that binds (ledger "memory"): the verbs Service selects it
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # 5,000 node names and a pod fit in well under 1 MiB


def _pod_facts(p: PodView) -> tuple[Any, ...]:
    """What a pass reads of a pod, but its node."""
    return p.phase, p.gates, p.terminating, p.gpr, p.ended_at, p.node_selector, p.affinity, p.tolerations


def _pod_matters(old: PodView | None, new: PodView | None) -> bool:
    """Whether a pod change of the view can change a controller decision (what pods that ask for no managed resource
    request of a node's CPU and memory counts through :meth:`ControllerService.host_freed`)."""
    if old is None or new is None:
        return old is not new
    return old.node != new.node or _pod_facts(old) != _pod_facts(new)


def _held_here(view: ClusterView, gpr: str, node: str) -> bool:
    """Whether GPR ``gpr`` holds devices (Admitted or Running, as the view has it) with ``node`` in its
    reservation (``node`` empty: anywhere, for a pod not bound yet): a pod of it that lands there takes what its
    reservation already took."""
    g = view.gprs.get(gpr) if gpr else None
    return g is not None and g.phase in HOLDING and (not node or node in g.reservation)


def bound_as_reserved(view: ClusterView, old: PodView | None, new: PodView | None) -> bool:
    """A pod bound (nothing else about it changed) to a node its GPR's reservation holds: no pass decides anything
    new from that. Its devices were counted as its GPR's since the admission; the GPR turns Running when its pods
    run, not when they are bound; a pod outside any GPR, or of a GPR the view does not see holding that node
    (Queued, Evicting, another node, a view behind the status write), still asks for a pass."""
    return (old is not None and new is not None and not old.node and bool(new.node) and new.live
            and _pod_facts(old) == _pod_facts(new) and _held_here(view, new.gpr, new.node))


def arrived_as_reserved(view: ClusterView, old: PodView | None, new: PodView | None) -> bool:
    """A new pod of a GPR that holds devices, not gated (the webhook narrowed it to the reservation) and bound, if
    at all, to a node of the reservation: no pass decides anything new from that either (there is no gate to lift,
    its devices were its GPR's since the admission, and the GPR turns Running when its pods run). A gated pod, one
    of a GPR the view does not see holding, or one bound elsewhere still asks for a pass."""
    return old is None and new is not None and new.live and not new.gates and _held_here(view, new.gpr, new.node)


def direct_as_pinned(view: ClusterView, old: PodView | None, new: PodView | None) -> bool:
    """A pod the webhook admitted directly (no GPR: ``--auto-gpr-direct``), new and pinned to its node, or then
    bound there, nothing else about it changed, while no GPR waits for devices (ClusterView.waiting) and no GPR
    holds devices on that node: no pass decides anything new from that (the webhook gave it free devices only; the
    next pass counts them as used there all the same). Where a GPR waits or holds the node, it still asks for a
    pass (estimates, a reservation the pod may have taken in a race)."""
    if new is None or not new.direct or not new.pinned or not new.live or new.gates or new.terminating:
        return False
    if old is None:
        fresh = new.node in ("", new.pinned)
    else:
        fresh = (old.direct and not old.node and new.node == new.pinned and old.pinned == new.pinned
                 and _pod_facts(old) == _pod_facts(new))
    return fresh and not view.waiting and not view.reserved.get(new.pinned)


def ledger_grew_as_reserved(view: ClusterView, old: NodeView, new: NodeView, labels: Iterable[str]) -> bool:
    """A node whose only change is ledger entries added for pods of GPRs that hold it in their reservations (the
    binder's record of :func:`bound_as_reserved` pods): no pass decides anything new from that either. An entry
    taken back (devices given back) or changed, or anything else about the node, still asks for one."""
    if len(new.ledger) <= len(old.ledger) or old.ledger_error or new.ledger_error:
        return False
    for uid, entry in old.ledger.items():
        if new.ledger.get(uid) != entry:
            return False
    if not all(_held_here(view, e.gpr, new.name) for uid, e in new.ledger.items() if uid not in old.ledger):
        return False
    return old.same_capacity(dataclasses.replace(new, ledger=old.ledger, used={}, used_by={}), labels)


def make_informers(kube: Kube, view: ClusterView, on_node: Callable[[str, dict[str, Any]], None],
                   on_pod: Callable[[str, dict[str, Any]], None], on_gpr: Callable[[str, dict[str, Any]], None],
                   sync_gprs: Sync, watch_timeout: tuple[int, int] = (300, 600),
                   sync_nodes: Sync | None = None) -> list[Informer]:
    """The informers that keep ``view``: a relist's items are decoded as they are read (``Listed``) and nodes and
    pods are taken in slices (a relist of 5,000 nodes or 20,000 pods is a few hundred milliseconds of parsing);
    GPRs go through ``sync_gprs`` (each read of a ``Listed`` decodes afresh: one that reads twice decodes once)."""
    return [
        Informer(kube.client, NODES, on_node, sync_nodes or view.resync_nodes, name="nodes",
                 watch_timeout=watch_timeout, lazy=True),
        Informer(kube.client, PODS, on_pod, view.resync_pods, name="pods", watch_timeout=watch_timeout, lazy=True),
        Informer(kube.client, GPRS, on_gpr, sync_gprs, name="gprs", watch_timeout=watch_timeout, lazy=True),
    ]


async def wait_synced(informers: list[Informer], timeout: float) -> None:
    try:
        await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in informers)), timeout)
    except TimeoutError:
        missing = [i for i in informers if not i.synced.is_set()]
        hint = " (is the GPUProvisioningRequest CRD installed?)" if any(i.name == "gprs" for i in missing) else ""
        detail = "; ".join(f"{i.name}: {i.last_error or 'no answer'}" for i in missing)
        raise RuntimeError(f"could not list {', '.join(i.name for i in missing)} from the API server in "
                           f"{timeout:g}s{hint}: {detail}") from None


async def sweep_ledgers(view: ClusterView, binder: Binder, now: float | None = None, unbound_ttl: float = 120.0,
                        unseen_grace: float = 120.0) -> tuple[int, int]:
    """Make every node's ledger match the pods: give back entries of pods that ended, are bound elsewhere, were
    never bound within ``unbound_ttl`` (a bind that crashed half way, or a Binding whose answer was lost and that
    never landed) or are gone — the last only once the entry is older than ``unseen_grace``, because a pod
    bound a moment ago may not have reached this replica's informer yet. The last two are judged on a fresh
    read of the pod, not on the informer's view, which may lag. Adopt bound pods a ledger lacks. A ledger
    that cannot be read is never overwritten. Returns (released, adopted)."""
    now = time.time() if now is None else now
    released = adopted = 0
    bound: dict[str, list[Any]] = {}
    for p in view.pods.values():
        if p.node and p.live:
            bound.setdefault(p.node, []).append(p)
    for node in list(view.nodes.values()):
        if node.ledger_error:
            continue
        stale = []
        for uid, entry in list(node.ledger.items()):
            holder = view.pods.get(uid)
            if holder is not None and (not holder.live or holder.node not in ("", node.name)):
                stale.append(uid)  # ended, or bound elsewhere: pods never move
                continue
            overdue = now - entry.since > (unseen_grace if holder is None else unbound_ttl)
            if overdue and (holder is None or not holder.node) and not await _holds(binder, entry, node.name):
                stale.append(uid)
        if stale:
            released += await binder.release(node.name, stale)
        if bound.get(node.name):
            adopted += await binder.adopt(node.name, bound[node.name])
    return released, adopted


async def _holds(binder: Binder, entry: ledger.Entry, node: str) -> bool:
    """Whether the entry's pod, read afresh, is (or, when it cannot be read, may be) bound to ``node`` and live."""
    namespace, _, name = entry.pod.partition("/")
    try:
        obj = await binder.pod_now(namespace, name, entry.uid)
    except ApiError:
        return True  # the next sweep looks again
    return obj is not None and (obj.get("spec") or {}).get("nodeName") == node and \
        (obj.get("status") or {}).get("phase") not in TERMINAL_POD_PHASES


class ControllerService:
    """The leader-elected GPR controller and ledger sweep over a cluster view that someone keeps current."""

    def __init__(self, kube: Kube, view: ClusterView, *, lease_namespace: str = "accelstack-system",
                 lease_name: str = "accelstack-gpr-controller", identity: str = "", policy: str = "bestfit",
                 resync: float = 5.0, lease_seconds: float = 15.0, sweep_every: float = 60.0,
                 registry: CollectorRegistry | None = None, nr1_vendors: Iterable[str] = (),
                 onboard_selector: str = "", onboard_timeout: float = 900.0, node_usage_qps: float = 5.0,
                 node_usage_burst: int = 50, **controller: Any) -> None:
        self.kube = kube
        self.view = view
        controller.setdefault("history_namespace", lease_namespace)
        self.controller = GPRController(kube, view, policy=policy, resync=resync, registry=registry, **controller)
        self.binder = Binder(kube, view)
        self.elector = LeaderElector(kube.client, lease_namespace, lease_name,
                                     identity or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}",
                                     lease_duration=lease_seconds, renew_deadline=lease_seconds * 2 / 3,
                                     retry_period=lease_seconds * 2 / 15)
        self.sweep_every = sweep_every
        # workspaces: namespaces, RBAC objects, status; their namespace map and quotas feed the GPR passes
        self.workspaces = WorkspaceController(kube, view, lambda: list(self.controller.objects.values()),
                                              namespace=lease_namespace, resync=resync, registry=registry,
                                              on_index=self.controller.changed)
        self.controller.workspaces = self.workspaces.index
        # accelerator nodes: an AcceleratorNode per node with GPUs or NR1 modules, what was found and who serves it
        self.accelerator_nodes = AcceleratorNodeController(kube, view, nr1_vendors=nr1_vendors,
                                                           resync=max(resync, 30.0), registry=registry,
                                                           onboard_selector=onboard_selector,
                                                           onboard_timeout=onboard_timeout,
                                                           usage_qps=node_usage_qps, usage_burst=node_usage_burst)
        # the owner of the view runs them with its own
        self.informers = self.workspaces.informers + self.accelerator_nodes.informers
        self.released: int = 0  # ledger entries given back by sweeps
        self._tasks: list[asyncio.Task[None]] = []

    # events from the informers (the owner of the view calls these after updating it)
    def node_changed(self, old: NodeView | None, new: NodeView | None) -> None:
        keys = self.view.selector_keys
        if old is None or new is None or not (old.same_capacity(new, keys)
                                              or ledger_grew_as_reserved(self.view, old, new, keys)):
            self.controller.changed()

    def on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        self.controller.on_gpr(kind, obj)
        self.workspaces.changed()

    def sync_gprs(self, items: Iterable[dict[str, Any]]) -> None:
        self.controller.sync_gprs(items)
        self.workspaces.changed()

    def pod_changed(self, old: PodView | None, new: PodView | None) -> None:
        if (_pod_matters(old, new) and not bound_as_reserved(self.view, old, new)
                and not arrived_as_reserved(self.view, old, new) and not direct_as_pinned(self.view, old, new)):
            self.controller.changed()
        self.accelerator_nodes.pod_changed(old, new)

    def node_event(self, kind: str, obj: dict[str, Any]) -> None:
        """An informer's node event: the view takes it, then a pass is triggered if it changed what passes read;
        the accelerator-node controller takes it too (the process's one node watch)."""
        name = (obj.get("metadata") or {}).get("name", "")
        old = self.view.nodes.get(name)
        self.view.on_node(kind, obj)
        self.node_changed(old, self.view.nodes.get(name))
        self.accelerator_nodes.on_node(kind, obj)

    async def sync_nodes(self, items: Sequence[dict[str, Any]]) -> None:
        """A relist of the node informer: the view's, then the accelerator-node controller's (each reads the
        items as they are decoded)."""
        await self.view.resync_nodes(items)
        await self.accelerator_nodes.sync_nodes(items)

    def pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        """An informer's pod event: the view takes it, then a pass is triggered if the pod is one passes read, or
        if it gave back CPU or memory on a node with devices (a pod that asks for no device included)."""
        uid = (obj.get("metadata") or {}).get("uid", "")
        old, host = self.view.pods.get(uid), self.view.host_of.get(uid)
        self.view.on_pod(kind, obj)
        self.pod_changed(old, self.view.pods.get(uid))
        if host is not None and self.view.host_of.get(uid) != host:
            self.host_freed(host[0])

    def host_freed(self, node: str) -> None:
        """A pod (one that asks for no managed resource, say) ended, left or changed what it requests on ``node``:
        CPU or memory a queued GPR's pods wait for may be free there."""
        view = self.view.nodes.get(node)
        if view is not None and any(view.allocatable.values()):
            self.controller.changed()

    def start(self, stop: asyncio.Event) -> None:
        self._tasks = [
            asyncio.create_task(supervise("leader-election", self.elector.run, stop), name="leader-election"),
            asyncio.create_task(while_leading(self.elector, stop, {
                "gpr-controller": self.controller.run,
                # ledger "memory": the ledger is the pods' (and the active binder's, which sweeps its own)
                **({"ledger-sweep": self._sweeper} if self.view.ledger_source == "node" else {}),
                "workspace-controller": self.workspaces.run,
                "accelerator-node-controller": self.accelerator_nodes.run}), name="leader-work"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.elector.leading.is_set():
            self.elector.leading.clear()
            self.elector.following.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.elector.release(), 5)

    async def sweep(self, now: float | None = None, unbound_ttl: float = 120.0,
                    unseen_grace: float = 120.0) -> tuple[int, int]:
        released, adopted = await sweep_ledgers(self.view, self.binder, now, unbound_ttl, unseen_grace)
        self.released += released
        return released, adopted

    async def _sweeper(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            released, adopted = await self.sweep()
            if released or adopted:
                log.info("ledger sweep", extra={"released": released, "adopted": adopted})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.sweep_every)


class ExtenderServer:
    def __init__(self, kube: Kube, resources: tuple[str, ...] = ("nvidia.com/gpu", "neureality.com/nr1"),
                 prefix: str = "/scheduler", require_gpr: bool = False, max_body: int = DEFAULT_MAX_BODY,
                 extra_routes: Callable[[web.Application], None] | None = None, run_controller: bool = True,
                 lease_namespace: str = "accelstack-system", lease_name: str = "accelstack-gpr-controller",
                 identity: str = "", policy: str = "bestfit", resync: float = 5.0, lease_seconds: float = 15.0,
                 sweep_every: float = 60.0, rest_auth: bool = True, watch_timeout: tuple[int, int] = (300, 600),
                 waittime_qps: float = 10.0, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 node_group_label: str = DEFAULT_GROUP_LABEL, verbs_apart: bool = False,
                 verbs_clients: Iterable[str] = (), limits: Limits | None = None, ledger: str = "node",
                 binder_lease: str = "accelstack-binder", pod_name: str = "", pod_namespace: str = "",
                 verbs_http2: bool = False, **controller: Any) -> None:
        self.kube = kube
        self.limits = limits or Limits()
        self.view = ClusterView(resources, ledger=ledger)
        self.binder = Binder(kube, self.view)
        self.metrics = ExtenderMetrics()
        self.sweep_every = sweep_every
        # ledger "memory": one replica binds at a time, the holder of the Lease ``binder_lease``; the others answer
        # the verbs 503 and close the connection (kube-scheduler retries, and its next connection reaches the
        # holder: the verbs Service selects the pod labelled BINDER_LABEL). Ledger "node": every replica binds.
        self.binder_elector: LeaderElector | None = None
        self.binding = ledger == "node"
        self.handover_settle = 2.0  # seconds a new binder waits for the last one's pods in flight (_binder_term)
        self.pod_name, self.pod_namespace = pod_name, pod_namespace or lease_namespace
        if ledger == "memory":
            self.binder_elector = LeaderElector(kube.client, lease_namespace, binder_lease,
                                                identity or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}",
                                                lease_duration=lease_seconds, renew_deadline=lease_seconds * 2 / 3,
                                                retry_period=lease_seconds * 2 / 15)
        self.metrics.binder_active.set(1 if self.binding else 0)
        self.service: ControllerService | None = None
        if run_controller:
            self.service = ControllerService(kube, self.view, lease_namespace=lease_namespace, lease_name=lease_name,
                                             identity=identity, policy=policy, resync=resync,
                                             lease_seconds=lease_seconds, sweep_every=sweep_every,
                                             registry=self.metrics.registry, **controller)
        self.informers = make_informers(kube, self.view, self._on_node, self._on_pod, self._on_gpr, self._sync_gprs,
                                        watch_timeout, self.service.sync_nodes if self.service is not None else None
                                        ) + (self.service.informers if self.service is not None else [])
        self.extender = Extender(self.view, self.binder, self.metrics, require_gpr, ready=self.ready,
                                 registries=(REGISTRY,), body_timeout=body_timeout, fetch_gpr=kube.get_gpr,
                                 binding=lambda: self.binding)
        self.rest = RestAPI(kube, self.view, authorizer=Authorizer(kube) if rest_auth else None,
                            limiter=RateLimiter(waittime_qps, max(1, int(2 * waittime_qps))), body_timeout=body_timeout,
                            node_group_label=node_group_label)
        self.app = web.Application(client_max_size=max_body)
        verbs = self.extender.routes(prefix)
        health = verbs[len(VERBS):]  # /healthz, /readyz, /metrics: on both listeners
        # the verbs: on their own listener (only kube-scheduler's client certificate gets there), or beside the rest
        self.verbs_app: web.Application | None = None
        # the verbs' routes for a connection of either protocol on their listener (when it has TLS); HTTP/2 is
        # offered only with verbs_http2 (for a profile that names bindVerb: kube-scheduler then sends every bind on
        # one connection instead of a new TLS connection for each bind in flight beyond its two idle ones); each
        # connection is counted by protocol either way
        self.verbs_h2 = self.extender.h2_routes(prefix, frozenset(verbs_clients), max_body)
        self.verbs_http2 = verbs_http2
        if verbs_apart:
            self.verbs_app = web.Application(client_max_size=max_body,
                                             middlewares=[client_names(frozenset(verbs_clients))])
            self.verbs_app.add_routes(verbs)
            self.app.add_routes(health)
        else:
            self.app.add_routes(verbs)
        self.app.add_routes(self.rest.routes())
        if extra_routes is not None:
            extra_routes(self.app)
        self.stop_event = asyncio.Event()
        # more readers of the pod informer's events, after the view (the webhook's pods handed over to the binder)
        self.pod_listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._releases: set[asyncio.Task[None]] = set()
        self._runners: list[web.AppRunner] = []
        self.port = 0
        self.verbs_port = 0

    @property
    def controller(self) -> GPRController:
        if self.service is None:
            raise RuntimeError("this extender runs without the controller (run_controller=False)")
        return self.service.controller

    @property
    def elector(self) -> LeaderElector:
        if self.service is None:
            raise RuntimeError("this extender runs without the controller (run_controller=False)")
        return self.service.elector

    def ready(self) -> bool:
        return all(i.synced.is_set() and i.healthy for i in self.informers)

    def _on_node(self, kind: str, obj: dict[str, Any]) -> None:
        if self.service is not None:
            self.service.node_event(kind, obj)
        else:
            self.view.on_node(kind, obj)

    def _on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        self.view.on_gpr(kind, obj)
        if self.service is not None:
            self.service.on_gpr(kind, obj)

    async def _sync_gprs(self, items: Sequence[dict[str, Any]]) -> None:
        if self.service is None:
            await self.view.resync_gprs(items)  # decoded as the view reads them, in slices
            return
        objects = list(items)  # both keep them: decoded once (a Listed decodes at each read)
        await self.view.resync_gprs(objects)
        self.service.sync_gprs(objects)

    def _on_pod(self, kind: str, obj: dict[str, Any]) -> None:
        if self.service is not None:
            self.service.pod_event(kind, obj)
        else:
            self.view.on_pod(kind, obj)
        for listener in self.pod_listeners:
            listener(kind, obj)
        uid = (obj.get("metadata") or {}).get("uid", "")
        phase = (obj.get("status") or {}).get("phase")
        if kind == "DELETED" or phase in ("Succeeded", "Failed"):
            node = (obj.get("spec") or {}).get("nodeName") or ""
            view = self.view.nodes.get(node)
            if view is not None and uid in view.ledger:
                task = asyncio.create_task(self._release(node, uid))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

    async def _release(self, node: str, uid: str) -> None:
        """A pod that ended gives its devices back to the node's ledger."""
        try:
            await self.binder.release(node, [uid])
        except Exception as exc:
            log.warning("ledger release failed; the next sweep retries", extra={"node": node, "error": str(exc)[:200]})

    async def sweep(self, now: float | None = None, unbound_ttl: float = 120.0,
                    unseen_grace: float = 120.0) -> tuple[int, int]:
        """One ledger sweep over this process's view (the controller's leader runs it periodically)."""
        return await sweep_ledgers(self.view, self.binder, now, unbound_ttl, unseen_grace)

    async def start(self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None,
                    sync_timeout: float = 30.0, verbs_host: str = "127.0.0.1", verbs_port: int = 0,
                    verbs_ssl: ssl.SSLContext | None = None) -> None:
        self._tasks = [asyncio.create_task(i.run(self.stop_event), name=f"informer-{i.name}") for i in self.informers]
        try:
            await wait_synced(self.informers, sync_timeout)
        except RuntimeError:
            await self.stop()
            raise
        gc.freeze()  # the synced cluster view is long-lived: keep it out of the collector's full passes
        self._tasks.append(asyncio.create_task(watch_loop_lag(self.metrics.loop_lag, self.stop_event), name="loop-lag"))
        if self.service is not None:
            self.service.start(self.stop_event)
        if self.binder_elector is not None:
            elector = self.binder_elector
            self._tasks += [
                asyncio.create_task(supervise("binder-election", elector.run, self.stop_event), name="binder-election"),
                asyncio.create_task(while_leading(elector, self.stop_event, {"binder": self._binder_term}),
                                    name="binder-term")]
        runner, self.port = await serve_app(self.app, host, port, limits=self.limits, ssl_context=ssl_context,
                                        backlog=1024)
        self._runners.append(runner)
        if self.verbs_app is not None:
            runner, self.verbs_port = await serve_app(self.verbs_app, verbs_host, verbs_port, limits=self.limits,
                                                  ssl_context=verbs_ssl, backlog=1024, h2=self.verbs_h2,
                                                  http2=self.verbs_http2)
            self._runners.append(runner)
        log.info("extender serving", extra={
            "port": self.port, "tls": ssl_context is not None, "verbs_port": self.verbs_port or self.port,
            "verbs_client_auth": verbs_ssl is not None and verbs_ssl.verify_mode == ssl.CERT_REQUIRED,
            "verbs_http2": self.verbs_http2 and verbs_ssl is not None})

    async def _binder_term(self, term: asyncio.Event) -> None:
        """While this replica holds the binder Lease (ledger "memory"): wait ``handover_settle`` seconds, read every
        pod afresh (a list is a consistent read, and this replica's watch may lag), then answer the verbs, label
        this pod for the verbs Service, and sweep the ledger; at the end of the term (or a failure) stop at once.

        The wait is for the pods the last binder offered a node and claimed devices for: kube-scheduler binds
        them after that binder's filter, and their claims went with it, so this replica must see them bound
        before it offers their devices to other pods (a Binding takes milliseconds; the wait is seconds)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(term.wait(), self.handover_settle)
        if term.is_set():
            return
        listed = await self.kube.client.list_until(PODS, term, lambda exc: log.warning(
            "binder: cannot read the pods at the start of the term; retrying", extra={"error": str(exc)[:300]}))
        if listed is None:
            return
        items = listed[0]
        await self.view.resync_pods(items)
        self.binding = True
        self.metrics.binder_active.set(1)
        log.info("binder: this replica binds", extra={"pods": len(items), "pod": self.pod_name})
        try:
            await self._label(True)
            while not term.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(term.wait(), self.sweep_every)
                released, adopted = await self.sweep()
                if released or adopted:
                    log.info("ledger sweep", extra={"released": released, "adopted": adopted})
        finally:
            self.binding = False
            self.metrics.binder_active.set(0)
            log.info("binder: this replica no longer binds", extra={"pod": self.pod_name})
            task = asyncio.create_task(self._label(False))  # not awaited here: the term ends now
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _label(self, on: bool) -> None:
        """Label (or unlabel) this replica's pod ``accelstack.io/binder=true``: the verbs Service selects it."""
        if not self.pod_name:
            return
        try:
            await self.kube.client.patch(PODS, self.pod_name, {"metadata": {"labels": {BINDER_LABEL: "true" if on
                                                                                       else None}}},
                                         namespace=self.pod_namespace)
        except ApiError as exc:
            log.warning("binder: cannot label this pod for the verbs Service", extra={
                "pod": self.pod_name, "label": on, "error": str(exc)[:300]})

    async def stop(self) -> None:
        self.stop_event.set()
        if self.service is not None:
            await self.service.stop()
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for runner in self._runners:
            await runner.cleanup()
        self._runners = []
        elector = self.binder_elector
        if elector is not None and elector.leading.is_set():  # hand the binder Lease over now, not at its expiry
            elector.leading.clear()
            elector.following.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(elector.release(), 5)
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
