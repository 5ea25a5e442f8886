"""The hub controller's I/O (``accelstack-hub``, leader-elected on the hub): judges every ``Cluster`` Ready or
Lost from the heartbeats its agent writes, and exports per-cluster metrics.

Level-triggered: each pass reads the Clusters from its informer, computes the hub's part of each status with
:func:`~.clusters.judge` at the hub's time, and merge-patches only the Clusters whose hub part would change. It
keeps no memory between passes (what it needs, the heartbeat value it last saw and when, is in the status), so a
restarted or newly elected hub reaches the same verdicts and writes nothing while nothing changed. A pass runs
when a Cluster changes (a heartbeat) and at the earliest time a verdict would flip without one (Ready → Lost).

The hub vouches for a member's silence only over time it could hear it: while its own API server does not answer
(its informer unhealthy, or a write refused for want of an answer) nothing is judged Lost, and once it answers
again, or when this replica starts leading, a Ready member keeps ``lost_after`` of grace from then. Without it a
hub down for longer than ``--lost-after`` judged every member Lost from its stale view on its first pass back, and
the dispatcher moved their unstarted GPRs (issue 40.5: the hub down is the hub's fault, not the members').
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from kubeapi import ApiError, Conflict, KubeClient, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import keep_newer, run_passes
from scheduler_extender.multicluster.clusters import (
    CLUSTERS,
    LOST_AFTER_S,
    hub_part_differs,
    hub_status,
    judge,
    micro_time,
    parse_time,
)

log = logging.getLogger("accelstack.hub")
DEVICE_KINDS = ("capacity", "allocatable", "allocated", "reserved", "unhealthy", "queued")


class HubMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ready = Gauge("accelstack_hub_cluster_ready", "1 while the member cluster is Ready (heartbeats seen "
                           "within --lost-after on the hub's clock), 0 when Lost or not reporting",
                           ["cluster"], registry=registry)
        self.devices = Gauge("accelstack_hub_cluster_devices", "A member's devices as its agent last reported them, "
                             "by resource and kind (capacity, allocatable, allocated, reserved, unhealthy, queued)",
                             ["cluster", "resource", "kind"], registry=registry)
        self.writes = Gauge("accelstack_hub_status_writes", "Cluster status writes this replica made",
                            registry=registry)
        self._seen: set[tuple[str, ...]] = set()

    def show(self, clusters: dict[str, dict[str, Any]], ready: dict[str, bool]) -> None:
        labels: set[tuple[str, ...]] = set()
        for name, obj in clusters.items():
            self.ready.labels(name).set(1 if ready.get(name) else 0)
            labels.add((name,))
            totals: dict[tuple[str, str], int] = {}
            for item in (obj.get("status") or {}).get("inventory") or []:
                for kind in DEVICE_KINDS:
                    key = (str(item.get("resource", "")), kind)
                    totals[key] = totals.get(key, 0) + int(item.get(kind) or 0)
            for (resource, kind), value in totals.items():
                self.devices.labels(name, resource, kind).set(value)
                labels.add((name, resource, kind))
        for gone in self._seen - labels:  # a cluster that left, or a resource it no longer reports
            with contextlib.suppress(KeyError):
                (self.ready if len(gone) == 1 else self.devices).remove(*gone)
        self._seen = labels


class HubController:
    def __init__(self, client: KubeClient, *, lost_after: float = LOST_AFTER_S, resync: float = 30.0,
                 registry: CollectorRegistry | None = None, wall: Callable[[], float] = time.time) -> None:
        self.client = client
        self.lost_after, self.resync = lost_after, resync
        self.wall = wall
        self.clusters: dict[str, dict[str, Any]] = {}
        self.changed = asyncio.Event()
        self.listeners: list[asyncio.Event] = []  # set with ``changed``: the dispatcher places by the Clusters
        self.metrics = HubMetrics(registry or CollectorRegistry())
        self.writes = 0
        self.heard_since: float | None = None  # since when (hub clock) the hub's view is live; None: it is not
        self.informer = Informer(client, CLUSTERS, self._on_cluster, self._sync, name="clusters")

    def _on_cluster(self, kind: str, obj: dict[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        if kind == "DELETED":
            self.clusters.pop(name, None)
        else:
            self.clusters[name] = obj
        self._notify()

    def _sync(self, items: Sequence[dict[str, Any]]) -> None:
        self.clusters = {str((o.get("metadata") or {}).get("name") or ""): o for o in items}
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        for event in self.listeners:
            event.set()

    def plan(self, now: float) -> tuple[dict[str, dict[str, Any]], dict[str, bool], float | None]:
        """(cluster -> the hub part to write, for those that change; cluster -> Ready; the next time a verdict
        flips without an event). Pure over the informer's objects."""
        writes, ready, wake = {}, {}, None
        for name, obj in self.clusters.items():
            status = obj.get("status") or {}
            verdict = judge(self._vouched(status, now), now, self.lost_after)
            ready[name] = verdict.ready
            new = hub_status(status, verdict, now)
            if hub_part_differs(status, new):
                writes[name] = new
            if verdict.next_check is not None:
                wake = verdict.next_check if wake is None else min(wake, verdict.next_check)
        return writes, ready, wake

    def _vouched(self, status: dict[str, Any], now: float) -> dict[str, Any]:
        """The status as judged: a Ready member's last heartbeat counts as seen no earlier than when the hub's view
        became live (``now`` while it is not), so the hub's own outage never reads as the member's silence. A
        member already Lost stays Lost; only the judging changes, never the written observedHeartbeatTime."""
        since = now if self.heard_since is None else self.heard_since
        seen_at = parse_time(status.get("observedHeartbeatTime"))
        lost = any(c.get("type") == "Lost" and c.get("status") == "True" for c in status.get("conditions") or ()
                   if isinstance(c, dict))
        if lost or seen_at is None or seen_at >= since or status.get("observedHeartbeat") != status.get(
                "lastHeartbeatTime"):
            return status
        return {**status, "observedHeartbeatTime": micro_time(since)}

    async def pass_once(self) -> float | None:
        now = self.wall()
        if not self.informer.healthy:
            self.heard_since = None
        elif self.heard_since is None:
            self.heard_since = now
        writes, ready, wake = self.plan(now)
        for name, part in writes.items():
            judged = self.clusters.get(name) or {}
            before = judged.get("status") or {}  # before: the watch may bring our write
            body: dict[str, Any] = {"status": part}
            rv = (judged.get("metadata") or {}).get("resourceVersion")
            if rv:  # written only over the object judged: a heartbeat that landed since makes it a 409
                body["metadata"] = {"resourceVersion": rv}
            try:
                written = await self.client.patch(CLUSTERS, name, body, subresource="status")
            except NotFound:  # left: gone from the API server, so from the view too, whatever the watch has
                # delivered (a stale entry would stay Ready, never judged again, its GPRs placed on it for good)
                if self.clusters.get(name) is judged:
                    self.clusters.pop(name, None)
                    self._notify()
                continue
            except Conflict:
                # judged from a copy the watch had not brought up to date (right after the hub's own API server
                # came back, its events can come seconds late): that copy's silence is no verdict. The fresh
                # object's event brings the next pass
                continue
            except ApiError as exc:
                log.warning("cannot write a Cluster's status", extra={"cluster": name, "error": str(exc)[:200]})
                if exc.status == 0 or exc.status >= 500:  # no answer: the view is not live until it answers again
                    self.heard_since = None
                continue
            keep_newer(self.clusters, name, written)
            self.writes += 1
            self.metrics.writes.set(self.writes)
            was = next((c.get("status") for c in before.get("conditions") or [] if c.get("type") == "Ready"), None)
            if was != ("True" if ready[name] else "False"):
                ready_cond = part["conditions"][0]
                log.info("cluster Ready changed", extra={"cluster": name, "ready": ready_cond["status"],
                                                         "reason": ready_cond["reason"],
                                                         "detail": ready_cond["message"]})
        self.metrics.show(self.clusters, ready)
        return wake

    async def run(self, stop: asyncio.Event) -> None:
        """Leader-only: a pass on every change, at the next verdict flip, and every ``resync`` seconds
        (:func:`kubeapi.passes.run_passes`: a pass that fails is retried with a backoff)."""
        wake: list[float | None] = [None]

        async def reconcile() -> None:
            wake[0] = await self.pass_once()

        await run_passes(stop, self.changed, synced=self.informer.synced.is_set, reconcile=reconcile,
                         resync=self.resync, min_interval=0.05, clock=self.wall, log=log, what="hub",
                         retry_at=lambda: None if wake[0] is None else wake[0] + 0.01)
