"""The GPR controller: drives the policy core from the API server and carries out its decisions.

While this replica leads (``LeaderElector``), each pass:

1. keeps the core's inventory equal to the nodes (allocatable managed devices, GPU model labels) and their
   health (``GPUUnhealthy``/``NR1Unhealthy`` conditions, the ``accelstack.io/unhealthy`` taint);
2. keeps the core's GPRs equal to the GPR objects: new ones are submitted, deleted ones cancelled, and on a
   fresh start (or a new leader) Admitted/Running ones are restored with their recorded reservation;
3. feeds pod facts in: all of an admitted GPR's pods running -> Running; any running -> activity (resets the
   idle clock: a GPR is idle while none of its pods runs); all ended -> Complete, or Failed if one failed;
4. ``tick``s the core and carries out what it decided: lifts the scheduling gate from the pods of admitted
   GPRs, evicts the pods of evicted, expired, idle-ended and cancelled GPRs through the Eviction API (a
   PodDisruptionBudget refusal is reported on the GPR as condition ``EvictionBlocked``, never bypassed),
   emits Kubernetes Events;
5. writes each GPR's status (phase, queue position, estimated start, reservation, conditions) with the
   object's resourceVersion (a conflict is retried on the next pass with the fresh object).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from scheduler_extender import gpr_resource as gr
from scheduler_extender.cluster import GPU, NR1, ClusterView
from scheduler_extender.core.gpr import GPR, Phase
from scheduler_extender.core.inventory import Inventory, NodeAssignment, NodeSpec, Placement
from scheduler_extender.core.placement import make_policy
from scheduler_extender.core.scheduler import Event, Scheduler, SchedulerConfig
from scheduler_extender.kube import Conflict, Kube, NotFound

log = logging.getLogger("accelstack.controller")
MODEL_LABEL = {GPU: "nvidia.com/gpu.product", NR1: "accelstack.io/nr1.product"}
MEMORY_LABEL = "nvidia.com/gpu.memory"
HOLDING = (Phase.ADMITTED, Phase.RUNNING)
STATUS_KEYS = ("phase", "reason", "queuePosition", "estimatedStart", "reservation", "failures", "evictions",
               "admittedAt", "startedAt", "finishedAt")


def node_specs(view: ClusterView) -> list[NodeSpec]:
    """The core's nodes: one per cluster node with managed devices (GPUs first when a node has both)."""
    specs = []
    for node in sorted(view.nodes.values(), key=lambda n: n.name):
        for resource in (GPU, NR1):
            count = node.allocatable.get(resource, 0)
            if count > 0:
                try:
                    memory = int(node.labels.get(MEMORY_LABEL, "0")) if resource == GPU else 0
                except ValueError:
                    memory = 0
                specs.append(NodeSpec(node.name, count, node.labels.get(MODEL_LABEL[resource], ""), resource,
                                      memory, labels=dict(node.labels)))
                break
    return specs


def live_cluster_limitation(g: GPR) -> str:
    """Why the live cluster cannot serve this GPR yet ('' when it can). The policy core and the simulator place
    fractions of a device, but on a cluster the kubelet hands out whole advertised devices: a fraction would be
    reserved as a whole device per GPR and its pods could never bind. Time-slicing replicas are the way to share a
    GPU on a cluster today (each replica is a whole advertised device)."""
    if g.milli_per_device < 1000:
        return ("spec.milliPerDevice: fractions of a device are not supported on a cluster yet (the simulator "
                "models them); share GPUs with time-slicing replicas and ask for whole replicas instead")
    return ""


def restore(sched: Scheduler, g: GPR, reservation: dict[str, int], now: float) -> bool:
    """Put an Admitted/Running GPR back into a fresh core with its recorded reservation (whole devices: the
    first free healthy ones of each node, the kubelet picks the physical ones); False if it no longer fits there
    (a node went away or shrank): the caller then queues it again."""
    inv = sched.inv
    assignments = []
    for node, count in sorted(reservation.items()):
        if node not in inv.index:
            return False
        n = inv.index[node]
        free = [d for d in range(inv.ndev[n]) if inv.free[n, d] == 1000 and inv.healthy[n, d]]
        if len(free) < count:
            return False
        assignments.append(NodeAssignment(n, tuple(free[:count]), 1000))
    return bool(assignments) and sched.adopt(g, Placement(tuple(assignments)), now)


def build_scheduler(view: ClusterView, objects: Iterable[dict[str, Any]], now: float, policy: str = "bestfit",
                    config: SchedulerConfig | None = None) -> tuple[Scheduler, dict[str, str]]:
    """A core built from the API server's state; returns it and the spec errors of objects it had to skip."""
    sched = Scheduler(Inventory(node_specs(view)), make_policy(policy), config or SchedulerConfig())
    errors: dict[str, str] = {}
    ordered = sorted(objects, key=lambda o: (o.get("metadata", {}).get("creationTimestamp") or "",
                                             o.get("metadata", {}).get("name", "")))
    for obj in ordered:
        key = gr.gpr_key(obj.get("metadata", {}).get("namespace") or "default", obj.get("metadata", {}).get("name", ""))
        if gr.is_terminal(obj) or obj.get("metadata", {}).get("deletionTimestamp"):
            continue
        try:
            g = gr.from_object(obj, now)
        except gr.SpecError as exc:
            errors[key] = str(exc)
            continue
        if live_cluster_limitation(g):
            errors[key] = live_cluster_limitation(g)
            continue
        if g.phase in HOLDING and restore(sched, g, gr.reservation_of(obj), now):
            continue
        phase_was = g.phase
        g.phase = Phase.QUEUED
        g.history = []
        sched.submit(g, now)
        if phase_was in (Phase.FAILED, Phase.EVICTED):
            g.reason = f"Requeued after {phase_was.value.lower()}"
    return sched, errors


class GPRController:
    def __init__(self, kube: Kube, view: ClusterView, policy: str = "bestfit", resync: float = 5.0,
                 config: SchedulerConfig | None = None, clock: Callable[[], float] = time.time,
                 namespace_events: bool = True) -> None:
        self.kube = kube
        self.view = view
        self.policy = policy
        self.resync = resync
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.emit_events = namespace_events
        self.objects: dict[str, dict[str, Any]] = {}
        self.sched: Scheduler | None = None
        self.signature: tuple[Any, ...] = ()
        self.unhealthy: set[str] = set()
        self.spec_errors: dict[str, str] = {}
        self.blocked: dict[str, str] = {}  # GPR -> eviction refusal message
        self.to_evict: dict[str, str] = {}  # GPR -> why its pods must go
        self.poke = asyncio.Event()
        self.passes = 0
        self.estimate_every = 30.0
        self._by_gpr: dict[str, list[Any]] = {}
        self._estimate_cache: dict[str, float] = {}
        self._estimate_names: frozenset[str] = frozenset()
        self._estimated_at = -math.inf

    # informer callbacks (the server fans events out to the view and here)
    def on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata", {})
        key = gr.gpr_key(meta.get("namespace") or "default", meta.get("name", ""))
        old = self.objects.get(key)
        if kind == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        if old is None or old.get("metadata", {}).get("generation") != meta.get("generation"):
            self.spec_errors.pop(key, None)  # a new spec gets judged again
        self.poke.set()

    def sync_gprs(self, items: list[dict[str, Any]]) -> None:
        self.objects = {}
        for obj in items:
            self.on_gpr("ADDED", obj)

    def changed(self, *_: Any) -> None:
        self.poke.set()

    # one pass
    def _inventory_signature(self) -> tuple[Any, ...]:
        return tuple((s.name, s.devices, s.model, s.resource) for s in node_specs(self.view))

    async def reconcile(self) -> list[Event]:
        now = self.clock()
        self.passes += 1
        signature = self._inventory_signature()
        if self.sched is None or signature != self.signature:
            self.sched, self.spec_errors = build_scheduler(self.view, self.objects.values(), now, self.policy,
                                                           self.config)
            self.signature, self.unhealthy = signature, set()
        sched = self.sched
        self._index_pods()
        events: list[Event] = []
        events += self._sync_gprs(sched, now)
        events += self._sync_health(sched, now)
        events += self._sync_pods(sched, now)
        events += sched.tick(now)
        await self._act(sched, events)
        await self._write_statuses(sched, now)
        return events

    def _sync_gprs(self, sched: Scheduler, now: float) -> list[Event]:
        events: list[Event] = []
        for key, obj in self.objects.items():
            if key in sched.gprs or key in self.spec_errors:
                continue
            if gr.is_terminal(obj):
                continue
            try:
                g = gr.from_object(obj, now)
            except gr.SpecError as exc:
                self.spec_errors[key] = str(exc)
                continue
            unsupported = live_cluster_limitation(g)
            if unsupported:
                self.spec_errors[key] = unsupported
                continue
            g.phase, g.history = Phase.QUEUED, []
            events += sched.submit(g, now)
        for key, g in list(sched.gprs.items()):
            current = self.objects.get(key)
            gone = current is None or bool(current.get("metadata", {}).get("deletionTimestamp"))
            if gone and g.phase not in (Phase.COMPLETE, Phase.CANCELLED):
                events += sched.cancel(key, now)
                self.to_evict[key] = "GPR deleted"
        return events

    def _sync_health(self, sched: Scheduler, now: float) -> list[Event]:
        events: list[Event] = []
        inv = sched.inv
        sick = {n.name for n in self.view.nodes.values() if n.name in inv.index
                and n.health_reason(inv.specs[inv.index[n.name]].resource)}
        for name in sick - self.unhealthy:
            events += sched.set_health(name, None, False, now)
        for name in self.unhealthy - sick:
            events += sched.set_health(name, None, True, now)
        self.unhealthy = sick
        return events

    def _pods_of(self, key: str) -> list[Any]:
        return self._by_gpr.get(key, [])

    def _index_pods(self) -> None:
        """GPR -> its pods, once per pass (the pass asks per GPR; scanning every pod each time is quadratic)."""
        self._by_gpr = {}
        for p in self.view.pods.values():
            if p.gpr:
                self._by_gpr.setdefault(p.gpr, []).append(p)

    def _sync_pods(self, sched: Scheduler, now: float) -> list[Event]:
        events: list[Event] = []
        for key, g in list(sched.holders.items()):
            pods = self._pods_of(key)
            if not pods:
                continue
            phases = [p.phase for p in pods]
            if all(ph in ("Succeeded", "Failed") for ph in phases):
                failed = "Failed" in phases
                events += sched.finish(key, now, ok=not failed, reason="PodFailed" if failed else "Succeeded")
                continue
            if g.phase is Phase.ADMITTED and all(ph == "Running" for ph in phases):
                events += sched.start(key, now)
            elif g.phase is Phase.RUNNING and any(ph == "Running" for ph in phases):
                sched.activity(key, now)
        return events

    async def _act(self, sched: Scheduler, events: list[Event]) -> None:
        for event in events:
            if event.kind in ("evicted", "expired", "cancelled") or (
                    event.kind == "completed" and event.detail == "IdleTimeout") or (
                    event.kind == "failed" and event.detail == "DeviceUnhealthy"):
                self.to_evict.setdefault(event.gpr, f"{event.kind}: {event.detail}".rstrip(": "))
            await self._event(event)
        for key, why in list(self.to_evict.items()):
            if await self._evict_pods(key, why):
                self.to_evict.pop(key, None)
        for key in list(sched.holders):
            await self._ungate(key)

    async def _evict_pods(self, key: str, why: str) -> bool:
        """Evict the GPR's pods that still run or wait; True when none is left to evict."""
        done = True
        refusals = []
        for pod in self._pods_of(key):
            if pod.phase in ("Succeeded", "Failed"):
                continue
            try:
                await self.kube.evict(pod.namespace, pod.name, why)
            except NotFound:
                continue
            except ApiException as exc:
                done = False
                refusals.append(f"{pod.key}: {exc.status} {exc.reason}")
        if refusals:
            self.blocked[key] = "; ".join(refusals)
        else:
            self.blocked.pop(key, None)
        return done

    async def _ungate(self, key: str) -> None:
        for pod in self._pods_of(key):
            if gr.SCHEDULING_GATE not in pod.gates:
                continue
            remaining = [{"name": g} for g in pod.gates if g != gr.SCHEDULING_GATE]
            patch = [{"op": "test", "path": "/spec/schedulingGates", "value": [{"name": g} for g in pod.gates]},
                     {"op": "replace", "path": "/spec/schedulingGates", "value": remaining}]
            try:
                await self.kube.patch_pod(pod.namespace, pod.name, patch)
            except (NotFound, Conflict):
                continue
            except ApiException as exc:
                log.warning("ungate failed", extra={"pod": pod.key, "status": exc.status})

    async def _event(self, event: Event) -> None:
        if not self.emit_events or "/" not in event.gpr:
            return
        namespace, name = event.gpr.split("/", 1)
        obj = self.objects.get(event.gpr)
        uid = obj.get("metadata", {}).get("uid", "") if obj else ""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(event.time))
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{name}.", "namespace": namespace},
                "involvedObject": {"apiVersion": gr.API_VERSION, "kind": gr.GPR_KIND, "name": name,
                                   "namespace": namespace, "uid": uid},
                "reason": event.kind.capitalize(), "message": event.detail or event.kind,
                "type": "Warning" if event.kind in ("evicted", "failed", "idle") else "Normal",
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
                "source": {"component": "accelstack-gpr-controller"}}
        await self.kube.create_event(namespace, body)

    async def _write_statuses(self, sched: Scheduler, now: float) -> None:
        queued = sched.queued()
        positions = {g.name: i + 1 for i, g in enumerate(queued)}
        estimates = self._estimates(sched, queued, now)
        for key, obj in list(self.objects.items()):
            g = sched.gprs.get(key)
            if key in self.spec_errors:
                body = {"status": {"phase": Phase.FAILED.value, "reason": "InvalidSpec",
                                   "message": self.spec_errors[key]}}
            elif g is None:
                continue
            else:
                reservation = [{"node": sched.inv.names[a.node], "devices": len(a.devices)}
                               for a in (g.placement.assignments if g.placement and g.holding else ())]
                conditions = []
                if key in self.blocked:
                    reason = "PodDisruptionBudget" if " 429 " in f" {self.blocked[key]} " else "EvictionRefused"
                    conditions.append({"type": "EvictionBlocked", "status": "True", "reason": reason,
                                       "message": self.blocked[key][:1000]})
                estimate = estimates.get(key)
                body = gr.status_body(g, queue_position=positions.get(key),
                                      estimated_start=estimate if estimate is not None and math.isfinite(estimate)
                                      else None, reservation=reservation, now=now,
                                      observed_generation=obj.get("metadata", {}).get("generation"),
                                      conditions=conditions,
                                      previous_conditions=(obj.get("status") or {}).get("conditions"))
            if self._unchanged(obj.get("status") or {}, body["status"]):
                continue
            new = dict(obj)
            new["status"] = body["status"]
            meta = obj.get("metadata", {})
            try:
                written = await self.kube.replace_gpr_status(meta.get("namespace", ""), meta.get("name", ""), new)
            except (Conflict, NotFound):
                continue  # the informer brings the fresh object; the next pass writes again
            self.objects[key] = written

    def _estimates(self, sched: Scheduler, queued: list[GPR], now: float) -> dict[str, float]:
        """Estimated starts of the queued GPRs. They cost seconds for a queue of thousands (bench_core), so they
        are recomputed only when the queue's membership changed or ``estimate_every`` seconds passed."""
        names = frozenset(g.name for g in queued)
        if not names:
            return {}
        if names != self._estimate_names or now - self._estimated_at >= self.estimate_every:
            self._estimate_cache = sched.estimates(now)
            self._estimate_names, self._estimated_at = names, now
        return self._estimate_cache

    @staticmethod
    def _unchanged(current: dict[str, Any], new: dict[str, Any]) -> bool:
        def kinds(status: dict[str, Any]) -> set[tuple[str, str]]:
            return {(str(c.get("type")), str(c.get("status"))) for c in status.get("conditions") or []
                    if isinstance(c, dict)}

        return all(current.get(k) == new.get(k) for k in STATUS_KEYS) and kinds(current) == kinds(new)

    async def run(self, stop: asyncio.Event, leading: asyncio.Event) -> None:
        while not stop.is_set():
            if not leading.is_set():
                self.sched = None  # a new term starts from the API server's state
                waits = [asyncio.create_task(stop.wait()), asyncio.create_task(leading.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in waits:
                    task.cancel()
                continue
            self.poke.clear()
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile failed; retrying")
            wake = self.sched.next_wakeup() if self.sched else math.inf
            timeout = max(0.01, min(self.resync, wake - self.clock()))
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.poke.wait())]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), timeout)
            for task in waits:
                task.cancel()
