"""The hub's half of GPRs across clusters (``accelstack-hub``, leader only): it places each origin GPR on a member
(``spec.clusterName``, or :func:`~.placement.pick`), writes the dispatch into that member's hub namespace, mirrors
the dispatch's status into the origin's, deletes the dispatch of a deleted origin, and takes a not-yet-started
GPR off a Lost member.

Level-triggered over two informers (every GPR on the hub, and the Clusters the :class:`~.hub.HubController`
already watches): each pass looks at every origin and every dispatch and does what their stored state asks, so
a restarted or newly elected hub continues where the last one stopped. The order of writes is what keeps one
origin on one member:

- the choice is recorded first (``status.cluster`` on the origin), then the dispatch is created. A pass that
  finds a recorded cluster never picks again; a crash between the two writes leaves a choice with no dispatch,
  which the next pass creates (with *create*: a dispatch already there answers 409).
- re-placement deletes the old dispatch first (with a UID precondition), then records the new cluster and the
  ``Replaced`` condition, then creates the new dispatch. A GPR that had started (``Running``) is never moved.
  A member that *left* may have taken the hub's rights in its namespace before the hub got there (``cluster
  leave`` deletes the Cluster, then those rights, then the namespace): a refused delete there does not hold the
  GPR back, as the namespace takes the dispatch with it and the member's agent is already gone.
- a dispatch whose origin is gone (or is a different origin of the same name, or was placed elsewhere) is
  deleted; the member's agent then deletes its copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubeapi import AlreadyExists, ApiError, Conflict, Forbidden, KubeClient, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import keep_newer, run_passes
from kubeapi.resources import GPRS
from scheduler_extender.multicluster.clusters import member_namespace, micro_time
from scheduler_extender.multicluster.placement import (
    Placed,
    Placer,
    demand_of,
    dispatch_name,
    dispatch_object,
    is_member_namespace,
    lost_of,
    mirror_differs,
    on_lost,
    origin_of,
    origin_status,
    waiting_status,
)

log = logging.getLogger("accelstack.hub")
FINAL = ("Complete", "Failed", "Evicted", "Cancelled")


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _gone_with_namespace(dispatch: str, origin: str) -> None:
    """A refused delete of a dispatch in the hub namespace of a member that left: not retried (see the module)."""
    log.info("a left member's dispatch goes with its namespace (the hub's rights there are gone)",
             extra={"dispatch": dispatch, "origin": origin})


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == kind), {})


class Dispatcher:
    def __init__(self, client: KubeClient, clusters: Callable[[], Mapping[str, dict[str, Any]]], *,
                 resync: float = 30.0, wall: Callable[[], float] = time.time) -> None:
        self.client = client
        self.clusters = clusters  # name -> Cluster object, the HubController's informer cache
        self.resync, self.wall = resync, wall
        self.origins: dict[tuple[str, str], dict[str, Any]] = {}
        self.dispatches: dict[tuple[str, str], dict[str, Any]] = {}  # (member namespace, name) -> dispatch
        self.changed = asyncio.Event()
        self.writes = 0
        # placed origins a pass found nothing to do for, with what that depended on (:meth:`_placed_state`): the
        # next pass skips them while it holds. Forgotten every ``resync`` seconds, so each is looked at again then
        self._idle: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._idle_since = -float("inf")
        self.informer = Informer(client, GPRS, self._on_gpr, self._sync, name="gprs")

    # ---- the hub's GPRs, origins and dispatches ------------------------------------------------------------
    def _table(self, obj: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]] | None:
        ns = _key(obj)[0]
        if not is_member_namespace(ns):
            return self.origins
        return self.dispatches if origin_of(obj) is not None else None

    def _on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        table = self._table(obj)
        if table is None:
            return
        if kind == "DELETED":
            table.pop(_key(obj), None)
        else:
            table[_key(obj)] = obj
        self.changed.set()

    def _sync(self, items: Sequence[dict[str, Any]]) -> None:
        self.origins, self.dispatches = {}, {}
        for obj in items:
            table = self._table(obj)
            if table is not None:
                table[_key(obj)] = obj
        self.changed.set()

    def dispatch_of(self, origin: Mapping[str, Any], cluster: str) -> dict[str, Any] | None:
        ns, name = _key(origin)
        found = self.dispatches.get((member_namespace(cluster), dispatch_name(ns, name)))
        uid = (origin.get("metadata") or {}).get("uid")
        return found if found is not None and (origin_of(found) or ("", "", ""))[2] == uid else None

    # ---- one pass ---------------------------------------------------------------------------------------------
    def _placed_state(self, origin: Mapping[str, Any], lost: Mapping[str, bool]) -> tuple[Any, ...] | None:
        """What a placed origin's pass depends on: its version, its dispatch's, whether its member is there and
        Lost. None for an unplaced one (the choice reads every member: looked at every pass)."""
        cluster = str((origin.get("status") or {}).get("cluster") or "")
        if not cluster:
            return None
        dispatch = self.dispatch_of(origin, cluster)
        return ((origin.get("metadata") or {}).get("resourceVersion"),
                None if dispatch is None else (dispatch.get("metadata") or {}).get("resourceVersion"),
                lost.get(cluster))  # None: left

    async def pass_once(self) -> None:
        clusters = dict(self.clusters())
        placer = Placer(clusters)  # one pass's picks: members read once per demand, what it sent counted
        now = self.wall()
        now_text = micro_time(now).split(".")[0] + "Z"
        if now - self._idle_since >= self.resync:
            self._idle, self._idle_since = {}, now
        # a pass comes on every event (each member's heartbeat, each GPR write): walking 10,000 placed origins
        # that nothing changed for cost 0.4-2 s a pass on 2 busy cores, and a new GPR waited behind it
        idle = {}
        lost = {name: lost_of(c) for name, c in clusters.items()}
        for origin in list(self.origins.values()):
            if (origin.get("metadata") or {}).get("deletionTimestamp"):
                continue
            key, state = _key(origin), self._placed_state(origin, lost)
            if state is not None and self._idle.get(key) == state:
                idle[key] = state
                continue
            writes = self.writes
            try:
                await self._one(origin, clusters, placer, now_text)
            except Conflict:
                continue  # decided on an old copy: the informer's event for the new one brings another pass
            except ApiError as exc:
                log.warning("cannot place or mirror a hub GPR; retrying at the next pass",
                            extra={"gpr": "/".join(_key(origin)), "error": str(exc)[:300]})
                continue
            if state is not None and state[2] is False and self.writes == writes:  # a Lost member's: every pass
                idle[key] = state
        self._idle = idle
        await self._orphans({member_namespace(name) for name in clusters})

    async def _one(self, origin: dict[str, Any], clusters: Mapping[str, dict[str, Any]], placer: Placer,
                   now_text: str) -> None:
        status = origin.get("status") or {}
        spec = origin.get("spec") or {}
        pinned = str(spec.get("clusterName") or "")
        cluster = str(status.get("cluster") or "")
        if not cluster:
            await self._place(origin, pinned, clusters, placer, now_text)
            return
        placed_cond = _condition(status, "Placed")
        placed = Placed(cluster, str(placed_cond.get("reason") or ("Pinned" if pinned else "EarliestStart")),
                        str(placed_cond.get("message") or ""))
        dispatch = self.dispatch_of(origin, cluster)
        lost = ""
        # a member that left (its Cluster deleted: `cluster leave`) is as good as Lost for what ran there, at once:
        # its agent is gone, so nothing it held can be mirrored, and a GPR that had not started is placed elsewhere
        left = cluster not in clusters
        gone = "has left the hub (its Cluster is gone)" if left else "is Lost (no heartbeat)"
        if (left or lost_of(clusters.get(cluster))) and str(status.get("phase") or "") not in FINAL:
            action = on_lost(str(status.get("phase") or ""), bool(pinned))
            if action == "replace":
                if await self._replace(origin, cluster, dispatch, placer, now_text, left=left):
                    return
                lost = f"{cluster} {gone}; the GPR had not started there, but no other member can take it now"
            elif action == "lost":
                phase = status.get("phase") or "Queued"
                lost = (f"{cluster} {gone}; the GPR was {phase} there and may still run: not placed "
                        "again" + (" (pinned by spec.clusterName)" if pinned else ""))
        if dispatch is None and not lost:
            await self._create_dispatch(origin, cluster)
        replaced = str(_condition(status, "Replaced").get("message") or "")
        patch = origin_status((dispatch or {}).get("status") if dispatch is not None else None, status, placed,
                              now_text, lost=lost, replaced=replaced)
        if dispatch is None and lost:  # nothing to mirror: keep what the origin last showed
            patch.update({k: status.get(k) for k in ("phase", "reservation", "reservedNodes", "queuePosition",
                                                     "estimatedStart", "estimatedStartRange", "admittedAt",
                                                     "startedAt", "finishedAt")})
        elif dispatch is not None and lost:
            patch["phase"] = status.get("phase") or patch.get("phase")
        await self._write(origin, patch)

    async def _place(self, origin: dict[str, Any], pinned: str, clusters: Mapping[str, dict[str, Any]],
                     placer: Placer, now_text: str) -> None:
        status = origin.get("status") or {}
        if pinned:
            if pinned not in clusters:
                await self._write(origin, waiting_status(
                    "ClusterNotFound", f"spec.clusterName: no member cluster {pinned!r} has joined the hub", status,
                    now_text))
                return
            placed = Placed(pinned, "Pinned", f"spec.clusterName: {pinned}")
        else:
            choice = placer.pick(demand_of(origin.get("spec") or {}))
            if not choice.cluster:
                if status.get("phase") == "Queued" and status.get("reason") == choice.reason:
                    # already waiting for this reason: not written again for the message's counts alone. The
                    # message names each member's usable devices, so any member's capacity or health change
                    # rewrote every waiting GPR, one after the other, in the pass that places new ones
                    # (bench_hub_latency: 225 writes and 4.4 s to reach a member at 2,000 queued, 10% too big)
                    return
                await self._write(origin, waiting_status(choice.reason, choice.message, status, now_text))
                return
            placed = Placed(choice.cluster, choice.reason, choice.message)
        # the choice first: a pass that finds it never picks again
        await self._write(origin, origin_status(None, status, placed, now_text), decide=True)
        log.info("hub GPR placed", extra={"gpr": "/".join(_key(origin)), "cluster": placed.cluster,
                                          "reason": placed.reason, "detail": placed.message})
        await self._create_dispatch(origin, placed.cluster)

    async def _replace(self, origin: dict[str, Any], old: str, dispatch: dict[str, Any] | None,
                       placer: Placer, now_text: str, left: bool = False) -> bool:
        """Take a never-started GPR off Lost (or ``left``) member ``old``: delete its dispatch there, record the
        new member, create the new dispatch. False (nothing done) when no other member can take it now."""
        choice = placer.pick(demand_of(origin.get("spec") or {}), exclude=[old])
        if not choice.cluster:
            return False
        if dispatch is not None:
            meta = dispatch.get("metadata") or {}
            try:
                await self.client.delete(GPRS, str(meta.get("name")), str(meta.get("namespace")),
                                         uid=str(meta.get("uid") or "") or None)
            except NotFound:
                pass
            except Forbidden:
                if not left:  # a Lost member's dispatch may still be acted on: not moved past it
                    raise
                _gone_with_namespace("/".join(_key(dispatch)), "/".join(_key(origin)))
            self.dispatches.pop(_key(dispatch), None)
        phase = str((origin.get("status") or {}).get("phase") or "Queued")
        why = (f"taken off {old} ({'left the hub' if left else 'Lost'}) where it was {phase} and had not started; "
               f"placed on {choice.cluster}")
        placed = Placed(choice.cluster, "Replaced", choice.message)
        status = {**(origin.get("status") or {}), "conditions": [
            c for c in (origin.get("status") or {}).get("conditions") or () if c.get("type") != "Replaced"]}
        await self._write(origin, origin_status(None, status, placed, now_text, replaced=why), decide=True)
        log.warning("hub GPR placed again: its member " + ("left" if left else "is Lost"), extra={
            "gpr": "/".join(_key(origin)), "from": old, "cluster": choice.cluster, "phase": phase})
        await self._create_dispatch(origin, choice.cluster)
        return True

    async def _create_dispatch(self, origin: dict[str, Any], cluster: str) -> None:
        body = dispatch_object(origin, cluster)
        try:
            created = await self.client.create(GPRS, body, member_namespace(cluster))
        except AlreadyExists:
            return  # there already: the informer brings it (or the orphan pass removes a stale one first)
        except NotFound:
            log.warning("the member's hub namespace is missing (left, or not joined)",
                        extra={"gpr": "/".join(_key(origin)), "cluster": cluster})
            return
        keep_newer(self.dispatches, _key(created), created, created=True)
        self.writes += 1

    async def _write(self, origin: dict[str, Any], patch: dict[str, Any], decide: bool = False) -> None:
        """Merge-patch the origin's status when it would change. ``decide``: a placement, written only over the
        very object the decision read (its resourceVersion as a precondition: 409 when the informer was behind)."""
        current = origin.get("status") or {}
        strip = {**patch, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                         for c in patch.get("conditions") or ()]}
        now = {**current, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                         for c in current.get("conditions") or ()]}
        if not mirror_differs(now, strip):
            return
        ns, name = _key(origin)
        body: dict[str, Any] = {"status": patch}
        if decide:
            body["metadata"] = {"resourceVersion": (origin.get("metadata") or {}).get("resourceVersion")}
        written = await self.client.patch(GPRS, name, body, ns, subresource="status")
        keep_newer(self.origins, (ns, name), written)
        self.writes += 1

    async def _orphans(self, joined: set[str]) -> None:
        """Delete each dispatch whose origin is gone, is a newer GPR of the same name, or sits elsewhere. One in
        the hub namespace of a member that left (not in ``joined``) whose delete is refused is dropped from the
        table: the namespace, being deleted, takes it (the informer brings it back only on a relist)."""
        for key, dispatch in list(self.dispatches.items()):
            origin_ns, origin_name, uid = origin_of(dispatch) or ("", "", "")
            origin = self.origins.get((origin_ns, origin_name))
            where = key[0]
            if origin is not None and (origin.get("metadata") or {}).get("uid") == uid and \
                    member_namespace(str((origin.get("status") or {}).get("cluster") or "")) == where:
                continue
            if origin is not None and (origin.get("metadata") or {}).get("uid") == uid and \
                    not (origin.get("status") or {}).get("cluster"):
                continue  # its choice is being written
            meta = dispatch.get("metadata") or {}
            try:
                await self.client.delete(GPRS, key[1], where, uid=str(meta.get("uid") or "") or None)
            except NotFound:
                pass
            except ApiError as exc:
                if isinstance(exc, Forbidden) and where not in joined:
                    self.dispatches.pop(key, None)
                    _gone_with_namespace(f"{where}/{key[1]}", f"{origin_ns}/{origin_name}")
                    continue
                log.warning("cannot delete a dispatch whose origin is gone", extra={
                    "dispatch": f"{where}/{key[1]}", "error": str(exc)[:200]})
                continue
            self.dispatches.pop(key, None)
            log.info("dispatch deleted: its origin is gone or placed elsewhere",
                     extra={"dispatch": f"{where}/{key[1]}", "origin": f"{origin_ns}/{origin_name}"})

    async def run(self, stop: asyncio.Event) -> None:
        """Leader-only: a pass on every change of a GPR or a Cluster, and every ``resync`` seconds
        (:func:`kubeapi.passes.run_passes`)."""
        await run_passes(stop, self.changed, synced=self.informer.synced.is_set, reconcile=self.pass_once,
                         resync=self.resync, min_interval=0.0, clock=self.wall, log=log, what="dispatch")
