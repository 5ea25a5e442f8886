"""The GPR controller: runs :func:`reconcile.plan_pass` over the informers' state and carries out the plan.

While this replica leads, a pass is triggered by an event that matters (a GPR, a pod that asks for a managed
resource or names a GPR, a node whose capacity, health or ledger changed; not a pod bound where its GPR's
reservation holds devices, nor the binder's ledger entry for it), coalesced (events arriving while a
pass runs make one more pass, not one each), or by a timer (backoff ends, exitDuration, idle timeouts, resync).
The pass itself is pure and CPU-bound, so it runs in a worker thread on a snapshot: the event loop keeps
serving informers, the Lease and HTTP meanwhile. Then, concurrently and bounded:

1. status writes (PUT ``status`` with the object's resourceVersion; a conflict is left to the next pass, which
   sees the fresh object). Writes that only move a queued GPR's position or wait estimate are news, not
   decisions: they are paced by a token bucket (``refresh_qps`` / ``refresh_burst``), those nearest the head of
   the queue first, and one left out is planned again at the next refresh (the stored status still differs);
   estimates drifting together (every queued GPR's, after a restart) never turn into a burst of thousands of
   writes at the API server;
2. for GPRs whose *stored* status says Admitted/Running: each gated pod's node affinity is narrowed to the
   reserved nodes and the gate lifted, in one patch, right after that GPR's own status write when the pass made
   one (so kube-scheduler's own filters and node sampling work for
   the reservation, and the extender only sees feasible nodes);
3. evictions through the Eviction API (PodDisruptionBudgets respected; a refusal shows on the GPR as condition
   ``EvictionBlocked``), at most once per ``evict_every`` per pod;
4. Events for transitions whose status was written; deletion of auto-created GPRs no pod ever used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kubeapi import ApiError, Conflict, NotFound, TooManyRequests
from kubeapi.errors import log_failure
from kubeapi.passes import keep_newer
from kubeapi.resources import GPRS
from scheduler_extender.controller.gpr_pass import run_pass
from scheduler_extender.controller.pass_cache import AUTO_LABEL, PassCache
from scheduler_extender.controller.pass_types import PassConfig, Plan, Snapshot, StatusWrite
from scheduler_extender.controller.predictor_store import PredictorStore
from scheduler_extender.core.scheduler import Event, SchedulerConfig
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import ClusterView
from scheduler_extender.objects.kube import Kube
from scheduler_extender.objects.narrowing import ungate_patch
from scheduler_extender.objects.podfit import HOSTNAME_LABEL
from scheduler_extender.objects.workspaces import WorkspaceIndex

log = logging.getLogger("accelstack.controller")
WARNING_EVENTS = ("evicted", "failed", "idle", "unschedulable")
# Event reasons are CamelCase (kubectl and the portal show them as written): the core's kinds that are two words
EVENT_REASONS = {"modelquota": "ModelQuota", "workspacequota": "WorkspaceQuota",
                 "insufficientcapacity": "InsufficientCapacity", "behindhigherpriority": "BehindHigherPriority",
                 "behindblockedgprs": "BehindBlockedGPRs"}


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        p = "accelstack_controller_"
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
        self.pass_seconds = Histogram(p + "pass_seconds", "Time to plan one pass (off the event loop)",
                                      buckets=buckets, registry=self.registry)
        self.estimate_seconds = Histogram(p + "estimate_seconds", "Time to estimate the queue's start times",
                                          buckets=buckets, registry=self.registry)
        self.act_seconds = Histogram(p + "act_seconds", "Time to carry out one pass (API writes)",
                                     buckets=buckets, registry=self.registry)
        self.passes = Counter(p + "passes_total", "Controller passes by result", ["result"], registry=self.registry)
        self.actions = Counter(p + "actions_total", "API actions by kind and result", ["action", "result"],
                               registry=self.registry)
        self.gpr_events = Counter(p + "gpr_events_total", "GPR transitions whose status was written, by kind "
                                  "(admitted, backfilled, requeued, evicted, failed, unschedulable, ...)", ["kind"],
                                  registry=self.registry)
        self.queued = Gauge(p + "queued_gprs", "GPRs waiting in the queue", registry=self.registry)
        self.holding = Gauge(p + "holding_gprs", "GPRs holding a reservation", registry=self.registry)


class GPRController:
    def __init__(self, kube: Kube, view: ClusterView, policy: str = "bestfit", resync: float = 5.0,
                 config: SchedulerConfig | None = None, clock: Callable[[], float] = time.time,
                 namespace_events: bool = True, concurrency: int = 16, estimate_every: float = 30.0,
                 evict_every: float = 10.0, orphan_grace: float = 120.0,
                 registry: CollectorRegistry | None = None, history: PredictorStore | None = None,
                 history_namespace: str | None = None, history_every: float = 60.0,
                 refresh_qps: float = 20.0, refresh_burst: int = 100, min_gap: float = 0.25) -> None:
        self.kube = kube
        # the least time between the end of a pass and the start of one an event asked for: a burst of events
        # (2,000 pods created and bound in a minute) makes passes of many changes each, not one per event back to
        # back, so the controller's CPU in a burst is bounded (~20% duty at 60 ms passes) while a decision waits
        # at most this long more
        self.min_gap = min_gap
        self.view = view
        self.policy = policy
        self.resync = resync
        self.config = config or SchedulerConfig()
        self.config.instant_eviction = False
        self.config.learn = False  # the history below learns from finished GPR objects, once each
        # how long work runs (wait estimates), kept in a ConfigMap of history_namespace across restarts
        self.history = history or PredictorStore()
        self.history_namespace = history_namespace
        self.history_every = history_every
        self._history_saved = -math.inf
        self.clock = clock
        self.emit_events = namespace_events
        self.concurrency = concurrency
        self.refresh_qps, self.refresh_burst = refresh_qps, refresh_burst
        self._refresh_tokens, self._refresh_at = float(refresh_burst), -math.inf  # the token bucket of news writes
        self.estimate_every = estimate_every
        self.evict_every = evict_every
        self.orphan_grace = orphan_grace
        self.metrics = ControllerMetrics(registry)
        self.objects: dict[str, dict[str, Any]] = {}  # GPR objects by UID
        self._uids: dict[str, str] = {}  # namespace/name -> UID of the object that has that name now
        self.cache = PassCache()
        self.poke = asyncio.Event()
        self.passes = 0
        self.last_plan: Plan | None = None
        self.refusals: dict[str, str] = {}  # GPR UID -> eviction refusals seen at the last attempt
        self._evicted_at: dict[str, float] = {}  # pod UID -> last eviction request
        self._queue_at = -math.inf
        self._queue: tuple[str, ...] | None = None  # the queue, in order, at the last refresh of positions
        self.min_refresh = min(2.0, estimate_every)  # a changed queue is re-estimated at most this often
        # namespace -> workspace and the workspaces' quotas (the workspace controller's); None: namespace = workspace
        self.workspaces: Callable[[], WorkspaceIndex] | None = None

    # ------------------------------------------------------------------------------- informer callbacks
    def on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        key = gr.gpr_key(str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if kind == "DELETED":
            self.objects.pop(uid, None)
            if self._uids.get(key) == uid:
                del self._uids[key]
        elif not _older(obj, self.objects.get(uid)):
            old = self._uids.get(key)
            if old is not None and old != uid:  # the name now belongs to a new object: the old one is gone
                self.objects.pop(old, None)
            self._uids[key] = uid
            self.objects[uid] = obj
        self.poke.set()

    def sync_gprs(self, items: Iterable[dict[str, Any]]) -> None:
        """A relist: the listed objects replace the view, except that a version this controller already holds
        that is newer than the listed one is kept. A list that was being served while this controller wrote a
        status (an admission) may carry the object as it was before; taking it would make the next pass see the
        GPR's nodes as free and give them to another GPR. Objects the list lacks are gone (a deleted object;
        one created after the list began comes with the watch that follows)."""
        held = self.objects
        self.objects, self._uids = {}, {}
        for obj in items:
            uid = str((obj.get("metadata") or {}).get("uid") or "")
            current = held.get(uid)
            self.on_gpr("ADDED", current if current is not None and _older(obj, current) else obj)

    def changed(self, *_: Any) -> None:
        self.poke.set()

    async def catch_up(self, stop: asyncio.Event) -> bool:
        """At the start of a leader term, before the first pass: read every GPR afresh (a list is a consistent
        read) and take each version newer than the view holds. The last leader stopped writing by its renew
        deadline, but this replica's watch may lag behind its last writes (a watch broken and relisting with
        backoff while the API server is in trouble); a pass on that view would see GPRs the last leader admitted
        as queued and give their nodes to others. Retried with backoff until it succeeds; False when the term
        ended first."""
        listed_now = await self.kube.client.list_until(GPRS, stop, lambda exc: log.warning(
            "cannot read the GPRs at the start of the term; retrying", extra={"error": str(exc)[:300]}))
        if listed_now is None:
            return False
        items, version = listed_now
        before = dict(self.objects)
        listed = set()
        for obj in items:
            listed.add(str((obj.get("metadata") or {}).get("uid") or ""))
            self.on_gpr("MODIFIED", obj)  # a version older than the view's is ignored
        for uid, obj in before.items():  # not listed, and not newer than the list: deleted meanwhile
            if uid not in listed and not _older({"metadata": {"resourceVersion": version}}, obj):
                self.on_gpr("DELETED", obj)
        newer = sum(1 for uid, obj in self.objects.items() if before.get(uid) is not obj)
        log.info("leader term: GPRs read afresh", extra={"gprs": len(items), "newer_than_view": newer})
        return True

    # ----------------------------------------------------------------------------------------- a pass
    def snapshot(self) -> Snapshot:
        return Snapshot(self.clock(), dict(self.view.nodes), dict(self.view.pods), dict(self.objects),
                        dict(self.refusals), dict(self.view.host_used))

    async def reconcile(self) -> Plan:
        snap = self.snapshot()
        due = snap.now - self._queue_at >= self.estimate_every
        index = self.workspaces() if self.workspaces is not None else None
        core = self.config
        if index is not None and (index.quotas or index.model_caps):
            core = dataclasses.replace(core, quotas={**(core.quotas or {}), **index.quotas}, model_caps={
                **(core.model_caps or {}), **{k: dict(v) for k, v in index.model_caps.items()}})
        # before the pass, which only reads the predictor and the calibration
        self.history.learn(snap.gprs, index.key if index is not None else None)
        cfg = PassConfig(self.policy, core, workspaces=index, refresh_queue=due, orphan_grace=self.orphan_grace,
                         last_queue=self._queue, refresh_on_change=snap.now - self._queue_at >= self.min_refresh,
                         predictor=self.history.predictor, calibrator=self.history.calibrator,
                         noted=frozenset(self.history.first))
        plan = await asyncio.to_thread(run_pass, snap, cfg, self.cache)
        if plan.refreshed:
            self._queue_at, self._queue = snap.now, plan.queue
            self.history.note_projections(plan.projections, snap.now)
            self.metrics.estimate_seconds.observe(plan.estimate_seconds)
        self.metrics.pass_seconds.observe(plan.seconds)
        self.metrics.queued.set(plan.queued)
        self.metrics.holding.set(plan.holding)
        started = time.perf_counter()
        await self._act(plan, snap)
        self.metrics.act_seconds.observe(time.perf_counter() - started)
        self.passes += 1
        self.last_plan = plan
        return plan

    async def _bounded(self, jobs: Iterable[Callable[[], Awaitable[Any]]],
                       gate: asyncio.Semaphore | None = None) -> list[Any]:
        """Each job's result, in order, at most ``concurrency`` running at once (or as many as a ``gate`` shared
        with other batches lets through). A job is started (its coroutine made) only at its turn, so a batch
        cancelled midway (leadership lost, shutdown) leaves none unawaited."""
        gate = gate or asyncio.Semaphore(self.concurrency)

        async def one(job: Callable[[], Awaitable[Any]]) -> Any:
            async with gate:
                return await job()

        return await asyncio.gather(*(one(j) for j in jobs))

    def paced(self, writes: list[StatusWrite]) -> list[StatusWrite]:
        """The status writes to make now: every decision, and as many position/estimate-only writes as the token
        bucket holds, those nearest the head of the queue first (the rest wait for a later refresh)."""
        news = [w for w in writes if w.queue_only]
        if not news:
            return writes
        now = self.clock()
        tokens = min(float(self.refresh_burst), self._refresh_tokens + max(0.0, now - self._refresh_at) * self.refresh_qps)
        take = min(len(news), int(tokens + 1e-9))  # 0.3 s at 10/s is three tokens, not 2.999...
        self._refresh_tokens, self._refresh_at = tokens - take, now
        if take < len(news):
            self.metrics.actions.labels("status", "deferred").inc(len(news) - take)
            news.sort(key=lambda w: _position(w.status))
        return [w for w in writes if not w.queue_only] + news[:take]

    def _reserves(self, write: StatusWrite) -> tuple[set[str], set[str]]:
        """(the nodes the write gives the GPR beyond what its stored status holds, the nodes whose devices it takes
        back from the stored status)."""
        obj = self.objects.get(write.uid)
        stored = gr.reservation_of(obj) if obj is not None and gr.phase_of(obj) in gr.ALLOCATED_PHASES else {}
        new: dict[str, int] = {}
        if write.status.get("phase") in gr.ALLOCATED_PHASES:
            for r in write.status.get("reservation") or ():
                new[r["node"]] = new.get(r["node"], 0) + int(r.get("devices") or 0)
        takes = {node for node, count in new.items() if count > stored.get(node, 0)}
        frees = {node for node, count in stored.items() if count > new.get(node, 0)}
        return takes, frees

    async def _write_all(self, writes: list[StatusWrite],
                         then: Callable[[str], Awaitable[None]] | None = None) -> set[str]:
        """Store the pass's statuses; the UIDs written. A pass may free nodes (a GPR finished, failed, was
        requeued or moved) and give them to another GPR at once. Stored the other way round, or with the freeing
        write failing while the taking one lands, the API objects would say both hold the nodes, and the next pass
        (this replica's or a new leader's, both built from those objects) would have to judge one of them lost. So
        a write that gives a GPR a node waits until every write of the pass that frees that node is stored (a
        move, freeing some nodes and taking others, is both), and waits for the next pass if one of them failed;
        the rest (most of them: first statuses, queue positions) do not wait. Writes that wait only on each other
        (two GPRs swapping nodes) go one at a time: a failure among them leaves a conflict the next pass resolves
        (the later GPR requeued, see reconcile's NodeLost). ``then(uid)`` runs right after each write that was
        stored, in the same slot (the GPR's own follow-up, its pods' gates: they need not wait for the pass's other
        writes)."""
        kinds = {w.uid: self._reserves(w) for w in writes}  # judged against the stored statuses, before any write
        moving = [w for w in writes if kinds[w.uid][0] or kinds[w.uid][1]]
        plain = [w for w in writes if not (kinds[w.uid][0] or kinds[w.uid][1])]
        gate = asyncio.Semaphore(self.concurrency)  # one bound for both: the moves are not held behind the rest
        written: set[str] = set()

        async def write_then(w: StatusWrite) -> bool:
            ok = await self._write(w.uid, w.status)
            if ok and then is not None:
                await then(w.uid)
            return ok

        async def moves() -> None:
            pending, failed = list(moving), list[StatusWrite]()
            while pending:
                unfreed = {node for w in [*pending, *failed] for node in kinds[w.uid][1]}
                ready = [w for w in pending if not kinds[w.uid][0] & unfreed]  # a write never frees what it takes
                if not ready:
                    if any(kinds[w.uid][0] & {n for f in failed for n in kinds[f.uid][1]} for w in pending):
                        break  # they wait on a free that failed: the next pass plans them again
                    ready = pending[:1]  # only on each other (a swap): one at a time
                results = await self._bounded((functools.partial(write_then, w) for w in ready), gate)
                for w, ok in zip(ready, results, strict=True):
                    pending.remove(w)
                    if ok:
                        written.add(w.uid)
                    else:
                        failed.append(w)
            if pending:
                self.metrics.actions.labels("status", "deferred").inc(len(pending))

        async def rest() -> None:
            results = await self._bounded((functools.partial(write_then, w) for w in plain), gate)
            written.update(w.uid for w, ok in zip(plain, results, strict=True) if ok)

        await asyncio.gather(moves(), rest())
        return written

    def _gated(self, uid: str, nodes: list[str], by_gpr: dict[str, list[Any]]) -> list[Any]:
        """The gated pods of GPR ``uid`` whose gates may be lifted now: its *stored* status says Admitted or
        Running on exactly ``nodes`` (status first: a gate is never lifted before the status is stored)."""
        obj = self.objects.get(uid)
        if obj is None or gr.phase_of(obj) not in ("Admitted", "Running"):
            return []
        if sorted(gr.reservation_of(obj)) != sorted(nodes):
            return []
        meta = obj.get("metadata") or {}
        return by_gpr.get(gr.gpr_key(meta.get("namespace", ""), meta.get("name", "")), [])

    async def _act(self, plan: Plan, snap: Snapshot) -> None:
        by_gpr: dict[str, list[Any]] = {}
        for pod in snap.pods.values():
            if pod.gpr and gr.SCHEDULING_GATE in pod.gates:
                by_gpr.setdefault(pod.gpr, []).append(pod)
        hostnames = {n: node.labels.get(HOSTNAME_LABEL, "") for nodes in plan.ungate.values() for n in nodes
                     if (node := snap.nodes.get(n)) is not None}
        lifted: set[str] = set()

        async def ungate_now(uid: str) -> None:
            # an admission's gates go right after its status is stored, not after the whole pass's writes: with
            # 2,000 GPRs admitted in one pass the first pod is schedulable after one write, not 2,000
            nodes = plan.ungate.get(uid)
            if nodes is None:
                return
            lifted.add(uid)
            for pod in self._gated(uid, nodes, by_gpr):
                await self._ungate(pod, nodes, hostnames)

        # GPRs no pass had written a status for yet (for the Events below: read before the writes replace them)
        unstated = {uid for uid, e in plan.events if e.kind == "admitted" and self._auto(uid)
                    and not ((self.objects.get(uid) or {}).get("status") or {}).get("phase")}
        written = await self._write_all(self.paced(plan.writes), ungate_now)
        ungates = [(pod, nodes) for uid, nodes in plan.ungate.items() if uid not in lifted
                   for pod in self._gated(uid, nodes, by_gpr)]
        await self._bounded(functools.partial(self._ungate, pod, nodes, hostnames) for pod, nodes in ungates)
        now = self.clock()
        due = [e for e in plan.evictions if now - self._evicted_at.get(e.pod.uid, -math.inf) >= self.evict_every]
        outcomes = await self._bounded(functools.partial(self._evict, e.pod, e.why) for e in due)
        refusals: dict[str, list[str]] = {}
        for e, refusal in zip(due, outcomes, strict=True):
            self._evicted_at[e.pod.uid] = now
            if refusal:
                refusals.setdefault(e.gpr_uid, []).append(refusal)
        evicting = {e.gpr_uid for e in plan.evictions}
        self.refusals = {uid: msg for uid, msg in self.refusals.items() if uid in evicting}
        self.refusals.update({uid: "; ".join(msgs) for uid, msgs in refusals.items()})
        live = set(snap.pods)
        self._evicted_at = {uid: t for uid, t in self._evicted_at.items() if uid in live}
        landed = [(uid, event) for uid, event in plan.events if uid in written and event.kind != "submitted"]
        for _, event in landed:
            self.metrics.gpr_events.labels(event.kind).inc()
        if self.emit_events:
            # an auto-GPR admitted by the pass that first saw it never waited: its pod's own Scheduled Event
            # says all there is (an Admitted Event for each would be one more API write per pod at scale)
            await self._bounded(functools.partial(self._event, uid, e) for uid, e in landed
                                if not (e.kind == "admitted" and uid in unstated))
        await self._bounded(functools.partial(self._delete_orphan, *o) for o in plan.orphans)

    def _auto(self, uid: str) -> bool:
        labels = ((self.objects.get(uid) or {}).get("metadata") or {}).get("labels") or {}
        return labels.get(AUTO_LABEL) == "true"

    async def _write(self, uid: str, status: dict[str, Any]) -> bool:
        obj = self.objects.get(uid)
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        body = dict(obj)
        body["status"] = status
        try:
            written = await self.kube.replace_gpr_status(meta.get("namespace", ""), meta.get("name", ""), body)
        except NotFound:
            self.metrics.actions.labels("status", "conflict").inc()
            return False  # gone: the informer brings the deletion
        except Conflict:
            # stored since the version this write was made from (by another writer, or by this very write: the
            # client retries a PUT answered 5xx, its precondition then refuses the retry): read back at once
            self.metrics.actions.labels("status", "conflict").inc()
            await self._read_back(meta)
            return False
        except ApiError as exc:
            self.metrics.actions.labels("status", "error").inc()
            log.warning("status write failed", extra={"gpr": f"{meta.get('namespace')}/{meta.get('name')}",
                                                      "error": str(exc)[:200]})
            if exc.status == 0 or exc.status >= 500:
                await self._read_back(meta)
            return False
        self.metrics.actions.labels("status", "ok").inc()
        keep_newer(self.objects, uid, written)  # never a GPR deleted meanwhile back (its devices held for nothing)
        return True

    async def _read_back(self, meta: dict[str, Any]) -> None:
        """After a status write refused as a conflict, answered with a 5xx or not answered: the API server holds a
        newer version than the write was made from, or may have stored the write all the same.
        The GPR is read back at once, so that the next pass plans from what is stored, not from the version the
        write replaced (whose nodes it would otherwise give to another GPR before the watch brings the stored one:
        two stored reservations on one node). A write that lands only after this read (its request still in
        flight at the API server) is not covered; the next pass's NodeLost check resolves that one."""
        try:
            obj = await self.kube.get_gpr(str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        except ApiError:
            return  # not known either way: the watch brings what is stored
        self.on_gpr("MODIFIED", obj)

    async def _ungate(self, pod: Any, nodes: list[str], hostnames: dict[str, str]) -> None:
        patch = ungate_patch(pod, nodes, gr.SCHEDULING_GATE, hostnames)
        if patch is None:
            return
        try:
            await self.kube.patch_pod(pod.namespace, pod.name, patch)
            self.metrics.actions.labels("ungate", "ok").inc()
        except (NotFound, Conflict):
            self.metrics.actions.labels("ungate", "conflict").inc()
        except ApiError as exc:  # 422: a test op failed (the pod changed meanwhile); the next pass retries
            self.metrics.actions.labels("ungate", "error").inc()
            log.warning("ungate failed", extra={"pod": pod.key, "error": str(exc)[:200]})

    async def _evict(self, pod: Any, why: str) -> str:
        """'' when evicted (or already gone), else the refusal."""
        try:
            await self.kube.evict(pod.namespace, pod.name, why)
            self.metrics.actions.labels("evict", "ok").inc()
            log.info("evicted pod", extra={"pod": pod.key, "why": why})
            return ""
        except NotFound:
            return ""
        except TooManyRequests as exc:
            self.metrics.actions.labels("evict", "refused").inc()
            return f"{pod.key}: 429 {exc.message or 'refused by a PodDisruptionBudget'}"
        except ApiError as exc:
            self.metrics.actions.labels("evict", "error").inc()
            return f"{pod.key}: {exc.status} {exc.message or exc.reason}"

    async def _event(self, uid: str, event: Event) -> None:
        namespace, name = event.gpr.split("/", 1)
        stamp = gr.rfc3339(event.time)
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{name}.", "namespace": namespace},
                "involvedObject": {"apiVersion": gr.API_VERSION, "kind": gr.GPR_KIND, "name": name,
                                   "namespace": namespace, "uid": uid},
                "reason": EVENT_REASONS.get(event.kind) or event.kind.capitalize(), "message": event.detail or event.kind,
                "type": "Warning" if event.kind in WARNING_EVENTS else "Normal",
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
                "source": {"component": "accelstack-gpr-controller"}}
        await self.kube.create_event(namespace, body)

    async def _delete_orphan(self, namespace: str, name: str, uid: str) -> None:
        try:
            await self.kube.delete_gpr(namespace, name, uid=uid)
            log.info("deleted an auto-created GPR that no pod uses", extra={"gpr": f"{namespace}/{name}"})
            self.metrics.actions.labels("orphan", "ok").inc()
        except (NotFound, Conflict):
            pass
        except ApiError as exc:
            self.metrics.actions.labels("orphan", "error").inc()
            log.warning("could not delete an orphan GPR", extra={"gpr": f"{namespace}/{name}", "error": str(exc)[:200]})

    # ------------------------------------------------------------------------------------------ the loop
    async def run(self, stop: asyncio.Event) -> None:
        """Passes until ``stop`` (a leader term's end). Errors are logged and the pass retried with backoff.
        The duration history is read at the start of the term and written every ``history_every`` seconds
        when it changed, and at the end."""
        if self.history_namespace:
            await self.history.load(self.kube, self.history_namespace)
        if not await self.catch_up(stop):
            return
        try:
            await self._run(stop)
        finally:
            if self.history_namespace:
                await self.history.save(self.kube, self.history_namespace)

    async def _run(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            self.poke.clear()
            try:
                plan = await self.reconcile()
                if self.history_namespace and self.clock() - self._history_saved >= self.history_every:
                    self._history_saved = self.clock()
                    await self.history.save(self.kube, self.history_namespace)
                failures = 0
                self.metrics.passes.labels("ok").inc()
                wake = plan.wakeup
            except Exception as exc:
                failures += 1
                self.metrics.passes.labels("error").inc()
                log_failure(log, "controller pass failed; retrying", exc)  # an outage in one line
                wake = self.clock() + min(30.0, 0.5 * 2 ** failures)
            timeout = max(0.01, min(self.resync, wake - self.clock(), self._queue_at + self.estimate_every
                                    - self.clock() + 0.01))
            ended = time.monotonic()
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.poke.wait())]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), timeout)
            for task in waits:
                task.cancel()
            gap = self.min_gap - (time.monotonic() - ended)
            if gap > 0 and self.poke.is_set() and not stop.is_set():
                with contextlib.suppress(TimeoutError):  # events go on arriving meanwhile: one pass takes them all
                    await asyncio.wait_for(stop.wait(), gap)


def _older(new: dict[str, Any], current: dict[str, Any] | None) -> bool:
    """True when ``new`` is an older version than ``current`` (an event delayed behind our own write)."""
    if current is None:
        return False
    try:
        return int((new.get("metadata") or {}).get("resourceVersion") or 0) < int(
            (current.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return False


def _position(status: dict[str, Any]) -> float:
    position = status.get("queuePosition")
    return float(position) if isinstance(position, int) else math.inf
