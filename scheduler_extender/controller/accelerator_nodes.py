"""The accelerator-node controller's I/O: informers on Nodes and AcceleratorNodes, the pods of the cluster view,
and the API calls that carry out :func:`accelerator_nodes.plan`. It runs in the controller process under the GPR
controller's leader election (a term's task), beside the workspace controller.

Nodes come from an informer of its own and are reduced at once to what :func:`accelerator_nodes.detect` found
(a few hundred bytes per accelerator node, nothing for the others): the cluster view keeps neither a node's UID
(the owner reference needs it) nor its ``managedFields`` (who wrote the labels). Holders are read from the view's
pods (those asking for a managed resource) at each pass. A pass runs on a change that matters (a node's detection,
an AcceleratorNode, a holder's pod), at most once per ``min_interval``, and every ``resync`` seconds; it writes only
what differs, so a restarted or new leader writes nothing while the cluster is as it was. A pass on a change plans
only the nodes the change touched (each change marks its node), the nodes whose status waits on the clock
(onboarding, deboarding) and the writes the usage bucket held back; a pass at ``resync`` (and after a relist of
nodes, AcceleratorNodes or pods) plans every node. Per node the plan is the same either way (:func:`plan` decides
each node from that node's inputs alone): a bind on one of 5,000 nodes does not re-plan the other 4,999. It writes a Node only
to onboard it (the landing label, :meth:`AcceleratorNodeController._label`) or to carry out a deboard request
(:meth:`AcceleratorNodeController._deboard`).

A write that fails (403, 500, no answer) is logged and counted; the next pass (the next resync at the latest)
plans it again. What a write returned is kept at once (newer than the informer's copy), so the next pass does not
repeat it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kubeapi import AlreadyExists, ApiError, Conflict, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import keep_newer, resource_version, run_passes
from kubeapi.resources import GPRS, NODES, PODS, Resource
from scheduler_extender.objects import accelerator_nodes as an
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import GPR_LABEL, ClusterView, PodView
from scheduler_extender.objects.kube import Kube

log = logging.getLogger("accelstack.accelerator_nodes")
ACCELERATOR_NODES = Resource(an.GROUP, an.VERSION, an.PLURAL, an.KIND, namespaced=False)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


class AcceleratorNodeController:
    def __init__(self, kube: Kube, view: ClusterView, *, nr1_vendors: Iterable[str] = (), resync: float = 30.0,
                 min_interval: float = 1.0, registry: CollectorRegistry | None = None,
                 watch_timeout: tuple[int, int] = (300, 600), clock: Callable[[], float] = time.time,
                 onboard_selector: str = "", onboard_timeout: float = an.ONBOARD_TIMEOUT_S,
                 usage_qps: float = 5.0, usage_burst: int = 50) -> None:
        self.kube = kube
        self.view = view
        self.nr1_vendors = tuple(an.vendor_id(v) for v in nr1_vendors)
        self.selector = an.parse_selector(onboard_selector)
        self.onboard_timeout = onboard_timeout
        self.resync = resync
        self.min_interval = min(min_interval, resync)
        self.clock = clock
        # status writes that change only what pods hold on a node: a token bucket (0: no limit), so a burst of
        # binds over thousands of nodes does not add one AcceleratorNode write per node to the API server's load
        # while it binds; the rest are written by later passes (level-triggered: still differing, planned again)
        self.usage_qps, self.usage_burst = usage_qps, max(1, usage_burst)
        self._usage_tokens, self._usage_at = float(self.usage_burst), clock()
        self._usage_wake: asyncio.TimerHandle | None = None
        self.detected: dict[str, an.Detection] = {}  # accelerator nodes only
        self.objects: dict[str, dict[str, Any]] = {}  # AcceleratorNodes by name
        # every Node, reduced to what deboarding reads and patches (UID, resourceVersion, the deboarding taint and
        # the others it must keep, the DaemonSets' labels)
        self.nodes: dict[str, dict[str, Any]] = {}
        self.poke = asyncio.Event()
        # what the next pass plans: every node (``_full``), else the nodes a change touched (``_dirty``), those
        # whose status waits on the clock (``_timed``) and those the usage bucket held back (``_deferred``)
        self._full = True
        self._full_at = 0.0
        self._dirty: set[str] = set()
        self._timed: set[str] = set()
        self._deferred: set[str] = set()
        self._pods_seen: object = None  # the view's pod table at the last full pass (a relist replaces it)
        self._phase_of: dict[str, tuple[str, str]] = {}  # node -> (phase, managed-by), for the gauge
        self.passes = 0
        self.planned = 0  # nodes planned by the passes so far (a full pass plans every one)
        self.last_plan: an.Plan | None = None
        registry = registry or CollectorRegistry()
        p = "accelstack_accelerator_node_"
        self.passes_total = Counter(p + "passes_total", "Accelerator-node controller passes", registry=registry)
        self.writes = Counter(p + "writes_total", "AcceleratorNode writes by verb and result", ["verb", "result"],
                              registry=registry)
        self.phases = Gauge(p + "nodes", "Accelerator nodes by phase and managed-by", ["phase", "managed_by"],
                            registry=registry)
        # Nodes come from the process's one node informer, the cluster view's (its owner calls on_node and
        # sync_nodes): a second watch of every Node would double what the API server sends for each node change
        # (a bind's ledger patch, a kubelet's status) and what this process decodes
        self.nodes_synced = False
        self.informers = [
            Informer(kube.client, ACCELERATOR_NODES, self._on_object, self._sync_objects, name=an.PLURAL,
                     watch_timeout=watch_timeout),
        ]

    # ---- informer callbacks ------------------------------------------------------------------------------------
    def _keep_node(self, kind: str, obj: dict[str, Any]) -> bool:
        """Keep the Node's reduced copy; True when what deboarding reads of it changed."""
        name = _name(obj)
        if kind == "DELETED":
            return self.nodes.pop(name, None) is not None
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        labels = meta.get("labels") or {}
        small = {"metadata": {"name": name, "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion"),
                              "labels": {k: labels[k] for k in an.LANDING_LABELS if k in labels}},
                 "spec": {"taints": list(spec.get("taints") or ())}}
        old = self.nodes.get(name)
        self.nodes[name] = small
        return old is None or an.node_bits(old) != an.node_bits(small)

    def on_node(self, kind: str, obj: dict[str, Any]) -> None:
        """A node event of the view's informer."""
        name = _name(obj)
        if self._keep_node(kind, obj):
            self._touch(name)
        found = None if kind == "DELETED" else an.detect(obj, self.nr1_vendors, self.selector)
        old = self.detected.get(name)
        if found is None:
            self.detected.pop(name, None)
        else:
            self.detected[name] = found
        if found != old:
            self._touch(name)

    async def sync_nodes(self, items: Sequence[dict[str, Any]]) -> None:
        """A relist of the view's node informer."""
        detected = {}
        self.nodes = {}
        for i, obj in enumerate(items):  # a Listed: each node decoded as read, reduced, let go
            self._keep_node("ADDED", obj)
            found = an.detect(obj, self.nr1_vendors, self.selector)
            if found is not None:
                detected[found.node] = found
            if i % 64 == 63:
                await asyncio.sleep(0)
        self.detected = detected
        self.nodes_synced = True
        self._touch_all()

    def _on_object(self, kind: str, obj: dict[str, Any]) -> None:
        name = _name(obj)
        if kind == "DELETED":
            kept = self.objects.get(name)
            uid = (obj.get("metadata") or {}).get("uid")
            if kept is not None and (kept.get("metadata") or {}).get("uid") == uid:
                del self.objects[name]
        elif resource_version(obj) >= resource_version(self.objects.get(name)):
            self.objects[name] = obj
        self._touch(name)

    def _sync_objects(self, items: list[dict[str, Any]]) -> None:
        self.objects = {_name(o): o for o in items}
        self._touch_all()

    def _touch(self, name: str) -> None:
        """A change to what ``name`` is planned from: the next pass plans it."""
        self._dirty.add(name)
        self.poke.set()

    def _touch_all(self) -> None:
        self._full = True
        self.poke.set()

    def pod_changed(self, old: PodView | None, new: PodView | None) -> None:
        """A pod of the view changed: a pass if it holds or held devices on an accelerator node."""
        def holds(p: PodView | None) -> tuple[str, bool, tuple[tuple[str, int], ...], str] | None:
            if p is None or not p.node or p.node not in self.detected:
                return None
            return p.node, p.live, tuple(sorted(p.requests.items())), p.gpr  # the GPR: a holder's row shows it
        if holds(old) != holds(new):
            for pod in (old, new):
                if pod is not None and pod.node:
                    self._touch(pod.node)

    @property
    def synced(self) -> bool:
        return self.nodes_synced and all(i.synced.is_set() for i in self.informers)

    # ---- a pass ------------------------------------------------------------------------------------------------
    def holders(self, names: Collection[str] | None = None) -> dict[str, list[an.Holder]]:
        """Per accelerator node (of ``names``; None: every one), the live pods bound there that request devices."""
        out: dict[str, list[an.Holder]] = {}
        detected = self.detected
        for pod in self.view.pods.values():
            if not pod.node or pod.node not in detected or not pod.live or (names is not None and pod.node not in names):
                continue
            gpr = pod.gpr.partition("/")[2]
            for resource, count in pod.requests.items():
                if count > 0:
                    out.setdefault(pod.node, []).append(an.Holder(pod.namespace, pod.name, gpr, resource, count))
        return out

    def _scope(self) -> set[str] | None:
        """The nodes the pass about to run plans (None: every node); the marks it answers are taken."""
        now = self.clock()
        pods = self.view.pods
        if self._full or pods is not self._pods_seen or now - self._full_at >= self.resync:
            self._full, self._full_at, self._pods_seen, self._dirty = False, now, pods, set()
            return None
        names, self._dirty = self._dirty | self._timed | self._deferred, set()
        return names

    async def reconcile(self) -> an.Plan:
        names = self._scope()
        if names is None:
            detected, objects, nodes = self.detected, self.objects, self.nodes
        else:
            detected = {n: self.detected[n] for n in names if n in self.detected}
            objects = {n: self.objects[n] for n in names if n in self.objects}
            nodes = {n: self.nodes[n] for n in names if n in self.nodes}
        holders = self.holders(names)
        bits = {name: an.node_bits(n) for name, n in nodes.items()}
        plan = an.plan(dict(detected), holders, dict(objects), gr.rfc3339(self.clock()), bits, self.onboard_timeout)
        await self._deboard(nodes, holders, bits)
        for name, label in plan.label.items():
            await self._label(name, label)
        for name, pods in plan.adopt.items():
            for holder in pods:
                await self._adopt(name, holder)
        for name, uid in plan.delete:
            await self._delete(name, uid)
        for body in plan.create:
            await self._create(body)
        for name, status in self._paced(plan.statuses).items():
            await self._write_status(name, status)
        self.passes += 1
        self.passes_total.inc()
        self.planned += len(detected)
        self.last_plan = plan
        self._note(detected, names, plan)
        return plan

    def _note(self, detected: Mapping[str, an.Detection], names: set[str] | None, plan: an.Plan) -> None:
        """After a pass over ``names`` (None: every node): which nodes' status waits on the clock (onboarding, a
        deboard request: every pass plans them), and the phase gauge (the phase written or about to be, as
        kubectl shows it)."""
        if names is None:
            self._timed, self._phase_of = set(), {}
        else:
            self._timed -= names
            for name in names:
                self._phase_of.pop(name, None)
        for name, d in detected.items():
            st = plan.statuses.get(name) or (self.objects.get(name) or {}).get("status") or {}
            phase = str(st.get("phase") or d.phase)
            self._phase_of[name] = (phase, d.managed_by)
            if phase == "Onboarding":
                self._timed.add(name)
        # a deboarded node may show no evidence left; its request still waits on the clock
        for name in self.objects if names is None else names:
            obj = self.objects.get(name)
            if obj is not None and an.deboard_request(obj) is not None:
                self._timed.add(name)
        self.phases.clear()
        for (phase, by), n in collections.Counter(self._phase_of.values()).items():
            self.phases.labels(phase, by).set(n)

    def _paced(self, statuses: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The status writes to make now: every one that changes a phase, a condition or a deboard step, and as
        many that change only the holders as the ``usage_qps`` bucket holds (in name order); the others wait for
        a pass the controller asks for once the bucket has refilled."""
        self._deferred = set()  # the pass that calls this planned every node held back before
        if self.usage_qps <= 0:
            return dict(statuses)
        usage = [n for n, st in statuses.items()
                 if an.usage_only((self.objects.get(n) or {}).get("status") or {}, st)]
        if not usage:
            return dict(statuses)
        now = self.clock()
        tokens = min(float(self.usage_burst), self._usage_tokens + max(0.0, now - self._usage_at) * self.usage_qps)
        take = min(len(usage), int(tokens + 1e-9))
        self._usage_tokens, self._usage_at = tokens - take, now
        later = set(usage[take:])
        self._deferred = later
        if later:
            self.writes.labels("status", "deferred").inc(len(later))
            if self._usage_wake is None:
                wait = max(self.min_interval, min(len(later), self.usage_burst) / self.usage_qps)
                self._usage_wake = asyncio.get_running_loop().call_later(wait, self._usage_due)
        return {n: st for n, st in statuses.items() if n not in later}

    def _usage_due(self) -> None:
        self._usage_wake = None
        self.poke.set()

    async def _deboard(self, nodes: Mapping[str, dict[str, Any]], holders: Mapping[str, list[an.Holder]],
                       bits: Mapping[str, an.NodeBits]) -> None:
        """Make each Node carry what its AcceleratorNode's deboard request asks: the taint while it stands, the
        DaemonSets' labels removed once no pod holds devices there, the taint removed once the request is
        withdrawn (or its object is gone). A merge patch carrying the Node's resourceVersion: a Conflict (the
        Node changed meanwhile) waits for the informer's newer copy and the next pass."""
        for name, node in list(nodes.items()):
            obj = self.objects.get(name)
            want = an.deboard_request(obj) if obj is not None and an.owner_uid(obj) == bits[name].uid else None
            if want is None and bits[name].tainted is None:
                continue
            done = bits[name].tainted is not None and not holders.get(name)
            body = an.node_patch(node, want, done)
            if body is None:
                continue
            try:
                written = await self.kube.client.patch(NODES, name, body)
            except (Conflict, NotFound):
                self.writes.labels("node", "conflict").inc()
                self._touch(name)
                continue
            except ApiError as exc:
                self._failed("node", name, exc)
                continue
            self.writes.labels("node", "ok").inc()
            log.info("accelerator node deboarding: node patched",
                     extra={"node": name, "deboard": want is not None, "taint": "spec" in body,
                            "labels_removed": sorted((body.get("metadata") or {}).get("labels") or ())})
            self._keep_node("MODIFIED", written)

    async def _label(self, name: str, label: str) -> None:
        """Onboarding's first step: the landing label on the Node (a merge patch of that one label: nothing else of
        the Node is replaced), so the shipped DaemonSets land there."""
        try:
            written = await self.kube.client.patch(NODES, name, {"metadata": {"labels": {label: "true"}}})
        except NotFound:
            self.writes.labels("node", "conflict").inc()
            return
        except ApiError as exc:
            self._failed("node", name, exc)
            return
        self.writes.labels("node", "ok").inc()
        log.info("accelerator node onboarding: landing label put on", extra={"node": name, "label": label})
        self.on_node("MODIFIED", written)

    async def _adopt(self, node: str, h: an.Holder) -> None:
        """An automatic GPR for a pod that ran on ``node`` before it was onboarded: the GPR first (an automatic GPR
        waits for its pod and is placed nowhere meanwhile, as the webhook's), then the pod labelled for it (a label
        is all a running pod may change); the GPR pass places it where the pod runs. A GPR of that name that is not
        an adoption on this node is left alone and said (the pod keeps no GPR); a failed label is tried again the
        next pass (the GPR is found ours)."""
        name = an.adopted_name(h.name)
        try:
            try:
                await self.kube.client.create(GPRS, an.adopted_gpr(h, node), namespace=h.namespace)
            except AlreadyExists:
                have = await self.kube.client.get(GPRS, name, namespace=h.namespace)
                if ((have.get("metadata") or {}).get("labels") or {}).get(an.ADOPTED_LABEL) != node:
                    self.writes.labels("adopt", "exists").inc()
                    log.warning("accelerator node onboarding: a GPR of the adopted pod's name exists and is not an "
                                "adoption; the pod is left outside any GPR",
                                extra={"node": node, "pod": f"{h.namespace}/{h.name}", "gpr": name})
                    return
            await self.kube.client.patch(PODS, h.name, {"metadata": {"labels": {GPR_LABEL: name}}},
                                         namespace=h.namespace)
        except NotFound:  # the pod ended meanwhile (its automatic GPR is removed after the orphan grace)
            self.writes.labels("adopt", "conflict").inc()
            return
        except ApiError as exc:
            self._failed("adopt", node, exc)
            return
        self.writes.labels("adopt", "ok").inc()
        log.info("accelerator node onboarding: running pod adopted by an automatic GPR",
                 extra={"node": node, "pod": f"{h.namespace}/{h.name}", "gpr": name})

    async def _create(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        try:
            made = await self.kube.client.create(ACCELERATOR_NODES, body)
        except AlreadyExists:  # made by another leader a moment ago: the informer brings it
            self.writes.labels("create", "exists").inc()
            return
        except ApiError as exc:
            self._failed("create", name, exc)
            return
        self.writes.labels("create", "ok").inc()
        log.info("accelerator node detected", extra={"node": name})
        keep_newer(self.objects, name, made, created=True)

    async def _write_status(self, name: str, status: dict[str, Any]) -> None:
        obj = self.objects.get(name)
        if obj is None:  # the create failed or was answered AlreadyExists: the next pass writes it
            return
        try:
            written = await self.kube.client.replace(ACCELERATOR_NODES, name, {**obj, "status": status},
                                                     subresource="status")
        except (Conflict, NotFound):  # changed or gone meanwhile: the informer brings the news, the next pass decides
            self.writes.labels("status", "conflict").inc()
            self._touch(name)
            return
        except ApiError as exc:
            self._failed("status", name, exc)
            return
        self.writes.labels("status", "ok").inc()
        old = (obj.get("status") or {})
        if (old.get("phase"), old.get("managedBy")) != (status["phase"], status["managedBy"]):
            log.info("accelerator node state", extra={"node": name, "phase": status["phase"],
                                                      "managed_by": status["managedBy"], "reason": status["reason"]})
        keep_newer(self.objects, name, written)

    async def _delete(self, name: str, uid: str) -> None:
        try:
            await self.kube.client.delete(ACCELERATOR_NODES, name, uid=uid or None)
        except (NotFound, Conflict):
            self.writes.labels("delete", "conflict").inc()
        except ApiError as exc:
            self._failed("delete", name, exc)
            return
        else:
            self.writes.labels("delete", "ok").inc()
            log.info("accelerator node gone", extra={"node": name})
        kept = self.objects.get(name)
        if kept is not None and (not uid or (kept.get("metadata") or {}).get("uid") == uid):
            del self.objects[name]

    def _failed(self, verb: str, name: str, exc: ApiError) -> None:
        self.writes.labels(verb, "error").inc()
        self._dirty.add(name)  # planned again by the next pass, whatever asks for it (the resync at the latest)
        log.warning("accelerator node write failed; the next pass retries",
                    extra={"node": name, "verb": verb, "error": str(exc)[:300]})

    # ---- the loop ----------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Passes while this replica leads (until ``stop``): on a change (at most one per ``min_interval``) and
        every ``resync`` seconds (:func:`.passes.run_passes`). A term's first pass plans every node: the marks
        kept while another replica led say nothing of what it wrote meanwhile."""
        self._full = True
        await run_passes(stop, self.poke, synced=lambda: self.synced, reconcile=self.reconcile, resync=self.resync,
                         min_interval=self.min_interval, clock=self.clock, log=log, what="accelerator node")
