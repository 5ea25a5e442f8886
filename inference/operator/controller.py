"""The CG operator's I/O shell: informers feed stores, a work queue of endpoint keys, and for each key the pure
:func:`decide.plan` carried out with ``kubeapi``.

Carrying out a plan: an object that is missing is created; one that exists and is owned by the endpoint is
replaced (PUT with its resourceVersion, so a stale read retries) only when the desired fields are not already
there; an object of the same name that the endpoint does not own is left alone and reported; objects the
endpoint owns but no longer wants are deleted (with a UID precondition); replicas on unhealthy nodes are
deleted; the status subresource is written when it changed; events go to the endpoint. Any change to an
endpoint, its objects, its pods, a node or a GPR template requeues the endpoints concerned; a periodic resync
requeues all (level-triggered: a missed event costs at most one resync).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from inference.names import LABEL_ENDPOINT, LABEL_POOL, POOL_BURST, POOL_PRIMARY
from inference.operator import objects as o
from inference.operator.decide import Observed, Plan, plan, primary_replicas, refused
from inference.resources import DEPLOYMENTS, HPAS, INFERENCE_ENDPOINTS, NETWORK_POLICIES, PDBS
from kubeapi.client import KubeClient, backoff_delay
from kubeapi.errors import AlreadyExists, ApiError, Conflict, NotFound
from kubeapi.informer import Informer
from kubeapi.resources import EVENTS, GPR_TEMPLATES, GPRS, NODES, PODS, SERVICES, WORKSPACES, Resource

log = logging.getLogger("accelstack.inference.operator")
FIELD_MANAGER = o.MANAGED_BY
ASSIGNED_FOR = 30.0  # seconds an assignment this process made is assumed while the pod informer has not shown it
OWNED: dict[str, Resource] = {"Deployment": DEPLOYMENTS, "Service": SERVICES, "GPUProvisioningRequest": GPRS,
                              "PodDisruptionBudget": PDBS, "NetworkPolicy": NETWORK_POLICIES,
                              "HorizontalPodAutoscaler": HPAS}
# fields the API server allocates on a Service and refuses to see unset on update
_SERVICE_ALLOCATED = ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy", "internalTrafficPolicy")
Key = tuple[str, str]  # namespace, name


def _key(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def contains(existing: Any, desired: Any) -> bool:
    """Whether ``existing`` already holds every field of ``desired`` (server defaults may add more)."""
    if isinstance(desired, dict):
        return isinstance(existing, dict) and all(k in existing and contains(existing[k], v)
                                                  for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(existing, list) and len(existing) == len(desired) and all(
            contains(e, d) for e, d in zip(existing, desired, strict=True))
    numbers = (int, float)
    if isinstance(desired, bool) or isinstance(existing, bool):
        return bool(existing == desired)
    if (isinstance(desired, numbers) and isinstance(existing, str)) or (
            isinstance(existing, numbers) and isinstance(desired, str)):
        return str(existing) == str(desired)  # a quantity the server wrote back as a string, or the reverse
    return bool(existing == desired)


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in
               (obj.get("metadata") or {}).get("ownerReferences") or [])


def now_iso(wall: Callable[[], float] = time.time) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall()))


class Store:
    def __init__(self, on_change: Callable[[dict[str, Any]], None]) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.on_change = on_change

    def sync(self, items: list[dict[str, Any]]) -> None:
        gone = [obj for key, obj in self.objects.items() if key not in {_key(i) for i in items}]
        self.objects = {_key(i): i for i in items}
        for obj in [*items, *gone]:
            self.on_change(obj)

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.objects.pop(_key(obj), None)
        else:
            self.objects[_key(obj)] = obj
        self.on_change(obj)

    def record_write(self, based_on: dict[str, Any] | None, written: dict[str, Any]) -> None:
        """Our own write, so the next pass sees it before the watch brings it — but only when the store still
        holds the version the write was based on (the watch may already have brought something newer, which
        must not be replaced by this older answer)."""
        key = _key(written)
        current = self.objects.get(key)
        if based_on is None:
            if current is None:
                self.objects[key] = written
            return
        if current is not None and _rv(current) == _rv(based_on):
            self.objects[key] = written


def _rv(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class Operator:
    def __init__(self, kube: KubeClient, settings: o.OperatorSettings | None = None, *, resync: float = 30.0,
                 registry: CollectorRegistry | None = None, identity: str = "",
                 wall: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.settings = settings or o.OperatorSettings()
        self.resync = resync
        self.identity = identity or f"{FIELD_MANAGER}-{uuid.uuid4().hex[:6]}"
        self.wall = wall
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter("accelstack_inference_operator_reconciles_total", "Endpoint reconciles by result",
                                  ["result"], registry=self.registry)
        self.reconcile_seconds = Histogram("accelstack_inference_operator_reconcile_seconds",
                                           "Time to reconcile one endpoint", registry=self.registry)
        self.endpoints = Store(self._endpoint_changed)
        self.owned = {kind: Store(self._child_changed) for kind in OWNED}
        self.pods = Store(self._child_changed)
        self.nodes = Store(self._node_changed)
        self.templates = Store(self._template_changed)
        self.workspaces = Store(self._workspace_changed)
        managed = f"app.kubernetes.io/managed-by={o.MANAGED_BY}"
        self.informers = [Informer(kube, INFERENCE_ENDPOINTS, self.endpoints.event, self.endpoints.sync,
                                   name="ie-endpoints"),
                          Informer(kube, PODS, self.pods.event, self.pods.sync, name="ie-pods",
                                   label_selector=LABEL_ENDPOINT),
                          Informer(kube, NODES, self.nodes.event, self.nodes.sync, name="ie-nodes"),
                          Informer(kube, GPR_TEMPLATES, self.templates.event, self.templates.sync,
                                   name="ie-gprtemplates"),
                          Informer(kube, WORKSPACES, self.workspaces.event, self.workspaces.sync,
                                   name="ie-workspaces")]
        for kind, resource in OWNED.items():
            store = self.owned[kind]
            self.informers.append(Informer(kube, resource, store.event, store.sync, name=f"ie-{resource.plural}",
                                           label_selector=managed))
        self._queue: dict[Key, None] = {}
        self._wake = asyncio.Event()
        self._failures: dict[Key, int] = {}
        self._rng = random.Random()
        self._reported: set[tuple[str, str, str]] = set()
        # pods this process pointed at a replica slot's GPR, until the pod informer shows it (or ASSIGNED_FOR
        # seconds pass): a pass planned from a pod view that does not show the patch yet would give the same slot to
        # a second pod
        self._assigned: dict[Key, tuple[str, float]] = {}

    # ---- what to requeue ---------------------------------------------------------------------------------
    def enqueue(self, key: Key) -> None:
        self._queue[key] = None
        self._wake.set()

    def _endpoint_changed(self, obj: dict[str, Any]) -> None:
        self.enqueue(_key(obj))

    def _child_changed(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = (meta.get("labels") or {}).get(LABEL_ENDPOINT)
        if name:
            self.enqueue((meta.get("namespace") or "", name))

    def _node_changed(self, obj: dict[str, Any]) -> None:
        node = (obj.get("metadata") or {}).get("name")
        for pod in list(self.pods.objects.values()):
            if (pod.get("spec") or {}).get("nodeName") == node:
                self._child_changed(pod)

    def _template_changed(self, obj: dict[str, Any]) -> None:
        namespace, name = _key(obj)
        for key, endpoint in list(self.endpoints.objects.items()):
            if key[0] == namespace and ((endpoint.get("spec") or {}).get("gpr") or {}).get("template") == name:
                self.enqueue(key)

    def _workspace_changed(self, obj: dict[str, Any]) -> None:
        namespaces = set(((obj.get("spec") or {}).get("namespaces")) or [])
        for key in list(self.endpoints.objects):
            if key[0] in namespaces:
                self.enqueue(key)

    def max_exit(self, namespace: str) -> str | None:
        """The ``spec.policy.maxExitDuration`` of the workspace that lists ``namespace`` (as the GPR webhook holds
        a GPR there to it), as written; None when no workspace lists it or the policy sets none."""
        for ws in self.workspaces.objects.values():
            spec = ws.get("spec") or {}
            if namespace in (spec.get("namespaces") or []):
                value = (spec.get("policy") or {}).get("maxExitDuration")
                return str(value) if value else None
        return None

    # ---- observing --------------------------------------------------------------------------------------------
    def observe(self, endpoint: dict[str, Any]) -> Observed:
        namespace, name = _key(endpoint)
        uid = endpoint["metadata"].get("uid", "")

        def mine(kind: str, child: str) -> dict[str, Any] | None:
            obj = self.owned[kind].objects.get((namespace, child))
            return obj if obj is not None and owned_by(obj, uid) else None

        pools = (POOL_PRIMARY, POOL_BURST)
        deployments = {p: d for p in pools if (d := mine("Deployment", f"{name}-{p}")) is not None}
        gprs = {p: g for p in pools if (g := mine("GPUProvisioningRequest", f"{name}-{p}")) is not None}
        growth = {k: g for (ns, child), g in self.owned["GPUProvisioningRequest"].objects.items()
                  if ns == namespace and (k := o.growth_index(endpoint, child)) is not None and owned_by(g, uid)}
        template_name = ((endpoint.get("spec") or {}).get("gpr") or {}).get("template")
        owned = sorted((kind, key[1]) for kind, store in self.owned.items() for key, obj in store.objects.items()
                       if key[0] == namespace and owned_by(obj, uid))
        pods = [self._as_assigned(p) for (ns, _), p in self.pods.objects.items()
                if ns == namespace and ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_ENDPOINT) == name]
        nodes = {n: self.nodes.objects[("", n)] for n in {(p.get("spec") or {}).get("nodeName") for p in pods}
                 if n and ("", n) in self.nodes.objects}
        return Observed(deployments=deployments, gprs=gprs, hpa=mine("HorizontalPodAutoscaler", name), pods=pods,
                        nodes=nodes, owned=owned, max_exit=self.max_exit(namespace), growth=growth,
                        gpr_template=self.templates.objects.get((namespace, template_name)) if template_name else None)

    def _as_assigned(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The pod as this process last wrote it: with the GPR label of its assignment until the informer shows it."""
        key = _key(pod)
        memo = self._assigned.get(key)
        if memo is None:
            return pod
        gpr, until = memo
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(o.GPR_LABEL) == gpr or time.monotonic() > until:
            del self._assigned[key]
            return pod
        return {**pod, "metadata": {**pod["metadata"], "labels": {**labels, o.GPR_LABEL: gpr}}}

    # ---- acting -----------------------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> Plan | None:
        endpoint = self.endpoints.objects.get(key)
        if endpoint is None or (endpoint.get("metadata") or {}).get("deletionTimestamp"):
            return None  # the garbage collector removes what it owned
        endpoint = copy.deepcopy(endpoint)
        result = plan(endpoint, self.observe(endpoint), self.settings, now_iso(self.wall))
        namespace, name = key
        refusal = ""
        growth_refused = False
        for obj in result.apply:
            refusal = await self._apply(endpoint, obj)
            if refusal:  # what comes after it (a Deployment gated on a refused GPR) would only wait for nothing
                growth_refused = obj["kind"] == "GPUProvisioningRequest" and \
                    o.growth_index(endpoint, obj["metadata"]["name"]) is not None
                break
        if refusal:
            # a replica's GPR refused (a GPR count limit, a quota) limits scaling; the endpoint still serves
            result.status, news = refused(endpoint, result.status, refusal, now_iso(self.wall),
                                          condition="ScalingLimited" if growth_refused else "Ready")
            if news:
                result.events.append(("Warning", "Refused", refusal))
        for pod, before, gpr, gates, cost in result.assign:
            await self._assign(endpoint, pod, before, gpr, gates, cost)
        for kind, child in result.delete:
            try:
                await self.kube.delete(OWNED[kind], child, namespace, uid=self._uid(kind, namespace, child))
                log.info("deleted", extra={"endpoint": f"{namespace}/{name}", "kind": kind, "object": child})
            except (NotFound, Conflict):
                pass
        for pod, why in result.replace_pods:
            try:
                await self.kube.delete(PODS, pod, namespace)
                log.warning("replica replaced", extra={"endpoint": f"{namespace}/{name}", "pod": pod, "why": why})
            except NotFound:
                pass
        if result.status != endpoint.get("status"):
            body = {**endpoint, "status": result.status}
            try:
                stored = await self.kube.replace(INFERENCE_ENDPOINTS, name, body, namespace, subresource="status")
                self.endpoints.record_write(endpoint, stored)
            except Conflict:
                self.enqueue(key)
            except NotFound:  # deleted while this reconcile ran: the garbage collector removes what it owned
                return result
        for type_, reason, message in result.events:
            await self._event(endpoint, type_, reason, message)
        return result

    async def _assign(self, endpoint: dict[str, Any], pod: str, before: str, gpr: str, gates: list[str],
                      cost: str) -> None:
        """Point a pod still at the scheduling gate at the GPR of a free replica slot (and set its deletion cost, so
        the ReplicaSet removes the replicas of the last GPRs first). The patch tests that the pod still has the
        gates and the GPR label this pass saw: the GPR controller lifts the gate of an admitted GPR's pods, and a
        pod past the gate is never moved (its node affinity is narrowed to its GPR's nodes)."""
        namespace, name = _key(endpoint)
        label = "/metadata/labels/" + o.GPR_LABEL.replace("~", "~0").replace("/", "~1")
        current = self.pods.objects.get((namespace, pod)) or {}
        annotations = (current.get("metadata") or {}).get("annotations")
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/spec/schedulingGates", "value": [{"name": g} for g in gates]},
            {"op": "test", "path": label, "value": before}, {"op": "replace", "path": label, "value": gpr}]
        if isinstance(annotations, dict):
            ops.append({"op": "add", "path": "/metadata/annotations/" + o.DELETION_COST.replace("/", "~1"),
                        "value": cost})
        else:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {o.DELETION_COST: cost}})
        try:
            await self.kube.patch(PODS, pod, ops, namespace, patch_type="json")
            now = time.monotonic()
            self._assigned = {k: v for k, v in self._assigned.items() if v[1] > now}  # pods deleted meanwhile
            self._assigned[(namespace, pod)] = (gpr, now + ASSIGNED_FOR)
            log.info("replica assigned", extra={"endpoint": f"{namespace}/{name}", "pod": pod, "from": before,
                                                "gpr": gpr})
        except (NotFound, Conflict):
            self.enqueue((namespace, name))
        except ApiError as exc:
            if exc.transient:
                raise
            # 422: a test failed, the pod moved on (its gate lifted, or relabelled) since the pass read it
            log.info("replica not assigned; the pod changed", extra={
                "endpoint": f"{namespace}/{name}", "pod": pod, "gpr": gpr, "status": exc.status,
                "error": str(exc)[:200]})
            self.enqueue((namespace, name))

    def _uid(self, kind: str, namespace: str, name: str) -> str | None:
        obj = self.owned[kind].objects.get((namespace, name))
        return (obj or {}).get("metadata", {}).get("uid") or None

    async def _apply(self, endpoint: dict[str, Any], desired: dict[str, Any]) -> str:
        """Create or update one child; '' when done (or left to a later pass), else why the API server refused it
        (an admission webhook, a quota, a schema: an answer that retrying the same object will not change)."""
        try:
            await self._write(endpoint, desired)
        except (Conflict, NotFound):
            self.enqueue(_key(endpoint))
        except ApiError as exc:
            if exc.transient:
                raise
            why = f"{desired['kind']} {'/'.join(_key(desired))} refused: {exc.message or exc}"[:1000]
            log.warning("child refused", extra={"endpoint": "/".join(_key(endpoint)), "kind": desired["kind"],
                                                "object": desired["metadata"]["name"], "status": exc.status,
                                                "error": why})
            return why
        return ""

    async def _write(self, endpoint: dict[str, Any], desired: dict[str, Any]) -> None:
        kind = desired["kind"]
        resource = OWNED[kind]
        namespace, name = _key(desired)
        existing = self.owned[kind].objects.get((namespace, name))
        if existing is None:
            try:
                created = await self.kube.create(resource, desired, namespace)
                self.owned[kind].record_write(None, created)
                log.info("created", extra={"endpoint": "/".join(_key(endpoint)), "kind": kind, "object": name})
            except AlreadyExists:
                self.enqueue(_key(endpoint))  # made by someone else meanwhile; the informer brings it
            return
        if not owned_by(existing, endpoint["metadata"].get("uid", "")):
            clash = (endpoint["metadata"].get("uid", ""), kind, name)
            if clash not in self._reported:  # once per process, not once per resync
                self._reported.add(clash)
                await self._event(endpoint, "Warning", "ObjectNotOwned",
                                  f"{kind} {namespace}/{name} exists and is not owned by this endpoint; left alone")
            return
        if kind == "Deployment" and desired["metadata"]["labels"].get(LABEL_POOL) == POOL_PRIMARY \
                and o.hpa(endpoint) is not None:
            # the autoscaler owns the count: take it from the object as it is now, not as the plan saw it, so a
            # scale that landed meanwhile is never undone
            desired = copy.deepcopy(desired)
            desired["spec"]["replicas"] = primary_replicas(endpoint, Observed(deployments={POOL_PRIMARY: existing}))
        if contains(existing.get("spec"), desired.get("spec")) and \
                contains(existing.get("metadata"), {"labels": desired["metadata"]["labels"]}):
            return
        body = copy.deepcopy(existing)
        body["metadata"]["labels"] = {**(existing["metadata"].get("labels") or {}), **desired["metadata"]["labels"]}
        body["metadata"]["ownerReferences"] = desired["metadata"]["ownerReferences"]
        spec = copy.deepcopy(desired["spec"])
        if kind == "Service":
            for field in _SERVICE_ALLOCATED:
                if field in (existing.get("spec") or {}):
                    spec.setdefault(field, existing["spec"][field])
        body["spec"] = spec
        try:
            stored = await self.kube.replace(resource, name, body, namespace)
            self.owned[kind].record_write(existing, stored)
            log.info("updated", extra={"endpoint": "/".join(_key(endpoint)), "kind": kind, "object": name})
        except Conflict:
            self.enqueue(_key(endpoint))

    async def _event(self, endpoint: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = endpoint["metadata"]
        stamp = now_iso(self.wall)
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                 "involvedObject": {"apiVersion": endpoint.get("apiVersion", ""), "kind": endpoint.get("kind", ""),
                                    "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid", ""),
                                    "resourceVersion": meta.get("resourceVersion", "")},
                 "reason": reason, "message": message[:1024], "type": type_, "count": 1,
                 "firstTimestamp": stamp, "lastTimestamp": stamp,
                 "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
                 "reportingInstance": self.identity}
        try:
            await self.kube.create(EVENTS, event, meta["namespace"])
        except ApiError as exc:  # an event is best effort
            log.warning("event not recorded", extra={"reason": reason, "error": str(exc)[:200]})

    # ---- running ------------------------------------------------------------------------------------------------
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers)

    def healthy(self) -> bool:
        return all(i.synced.is_set() and i.healthy for i in self.informers)

    async def run_informers(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(i.run(stop) for i in self.informers))

    async def run_workers(self, stop: asyncio.Event) -> None:
        """Reconcile queued endpoints until ``stop``; every ``resync`` seconds requeue all of them."""
        await asyncio.gather(*(i.synced.wait() for i in self.informers))
        for key in self.endpoints.objects:
            self.enqueue(key)
        loop = asyncio.get_running_loop()
        next_resync = loop.time() + self.resync
        while not stop.is_set():
            timeout = max(0.0, next_resync - loop.time())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                for key in self.endpoints.objects:
                    self.enqueue(key)
                next_resync = loop.time() + self.resync
            self._wake.clear()
            while self._queue and not stop.is_set():
                key = next(iter(self._queue))
                del self._queue[key]
                started = time.perf_counter()
                try:
                    await self.reconcile(key)
                    self.reconciles.labels("ok").inc()
                    self._failures.pop(key, None)
                except Exception as exc:  # an API error, or a bug: this endpoint is retried, the others go on
                    self.reconciles.labels("error").inc()
                    failures = self._failures[key] = self._failures.get(key, 0) + 1
                    delay = backoff_delay(failures, 0.5, 30.0, self._rng)
                    extra = {"endpoint": f"{key[0]}/{key[1]}", "error": f"{type(exc).__name__}: {exc}"[:300],
                             "retry_in": round(delay, 1)}
                    if isinstance(exc, ApiError):
                        log.warning("reconcile failed; retrying", extra=extra)
                    else:
                        log.exception("reconcile crashed; retrying", extra=extra)
                    loop.call_later(delay, self.enqueue, key)
                finally:
                    self.reconcile_seconds.observe(time.perf_counter() - started)
