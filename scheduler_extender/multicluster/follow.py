"""The member agent's half of GPRs across clusters: it follows the dispatches the hub wrote into its hub namespace
``accelstack-member-NAME`` (the only GPRs its hub token may read), keeps one GPR in its own cluster for each, and
mirrors that GPR's status back into the dispatch's.

- **Create**: in the origin's namespace, under the origin's name, ``clusterName`` removed and the origin in an
  annotation (:func:`~.placement.member_object`). The member's own controller and webhook treat it as any GPR:
  the member stays the only authority over its nodes. The namespace must exist (the workspace step makes it):
  otherwise the dispatch says ``NamespaceMissing``. A GPR of that name that the agent did not make for this
  origin is never touched: the dispatch says ``NameTaken``.
- **Mirror**: phase, reason, message, reservation, queue position, estimate, conditions (:func:`~.placement.mirror`),
  written to the dispatch's status subresource only when they changed.
- **Delete**: a member GPR the agent made (label ``accelstack.io/from-hub``) whose dispatch is gone, or is now
  the dispatch of another origin, is deleted (with a UID precondition); only while the hub's list is fresh (its
  informer synced and healthy), so a hub that cannot be reached never makes a member drop its GPRs.
- **Workload** (``spec.workload``, :mod:`.workload`): once the member GPR is Admitted or Running, its objects
  are created in its namespace as the ServiceAccount ``accelstack-workload`` there (impersonated: the member's
  RBAC decides), labelled and owned by the member GPR; the outcome is the dispatch's condition
  ``WorkloadCreated``. Looked at again when the member GPR changes and every ``resync`` seconds (one GET per
  object, as that account), so a deleted object is made again. Deleted with the member GPR (before it, as the
  same account; the owner reference lets the member's garbage collector do it too).

Level-triggered, as the hub: a pass on every change of either side and every ``resync`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubeapi import AlreadyExists, ApiError, Forbidden, KubeClient, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import keep_newer, run_passes
from kubeapi.resources import GPRS
from scheduler_extender.multicluster.clusters import micro_time
from scheduler_extender.multicluster.placement import (
    DISPATCH,
    FROM_HUB,
    made_for,
    member_object,
    mirror,
    mirror_differs,
    origin_of,
)
from scheduler_extender.multicluster.workload import (
    OBJECTS,
    Ref,
    ref_of,
    refs_annotation,
    refs_of,
    resource_of,
    runner,
    step,
    to_delete,
    with_condition,
)
from scheduler_extender.multicluster.workload import refused as refused_condition

log = logging.getLogger("accelstack.member_agent")


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class DispatchFollower:
    def __init__(self, member: KubeClient, hub: KubeClient, hub_namespace: str, *, resync: float = 30.0,
                 wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.member, self.hub, self.hub_namespace = member, hub, hub_namespace
        self.resync, self.wall, self.monotonic = resync, wall, monotonic
        # member GPR uid -> (its resourceVersion, when, the condition shown): a workload looked at again when the
        # GPR changed or every resync seconds, not on every pass of any GPR
        self.workloads: dict[str, tuple[str, float, tuple[str, str, str] | None]] = {}
        self.dispatches: dict[str, dict[str, Any]] = {}  # dispatch name -> dispatch (hub)
        self.mine: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> member GPR the agent made
        self.changed = asyncio.Event()
        self.writes = 0
        self.hub_informer = Informer(hub, GPRS, self._on_dispatch, self._sync_dispatches, name="hub-gprs",
                                     namespace=hub_namespace)
        self.member_informer = Informer(member, GPRS, self._on_mine, self._sync_mine, name="member-gprs-from-hub",
                                        label_selector=f"{FROM_HUB}=true")
        self.informers = [self.hub_informer, self.member_informer]

    def _on_dispatch(self, kind: str, obj: dict[str, Any]) -> None:
        name = _key(obj)[1]
        if kind == "DELETED" or origin_of(obj) is None:
            self.dispatches.pop(name, None)
        else:
            self.dispatches[name] = obj
        self.changed.set()

    def _sync_dispatches(self, items: Sequence[dict[str, Any]]) -> None:
        self.dispatches = {_key(o)[1]: o for o in items if origin_of(o) is not None}
        self.changed.set()

    def _on_mine(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.mine.pop(_key(obj), None)
        else:
            self.mine[_key(obj)] = obj
        self.changed.set()

    def _sync_mine(self, items: Sequence[dict[str, Any]]) -> None:
        self.mine = {_key(o): o for o in items}
        self.changed.set()

    # ---- one pass -----------------------------------------------------------------------------------------------
    async def pass_once(self) -> None:
        now_text = micro_time(self.wall()).split(".")[0] + "Z"
        for dispatch in list(self.dispatches.values()):
            if (dispatch.get("metadata") or {}).get("deletionTimestamp"):
                continue
            try:
                await self._follow(dispatch, now_text)
            except ApiError as exc:
                log.warning("cannot follow a dispatch from the hub; retrying at the next pass",
                            extra={"dispatch": _key(dispatch)[1], "error": str(exc)[:300]})
        if self.hub_informer.synced.is_set() and self.hub_informer.healthy:
            await self._delete_orphans()

    async def _follow(self, dispatch: dict[str, Any], now_text: str) -> None:
        want = member_object(dispatch)
        if want is None:
            return
        workload = want["spec"].pop("workload", None)  # the hub's: the member's webhook refuses the field
        if workload is not None:
            want["metadata"]["annotations"][OBJECTS] = refs_annotation(workload)
        key = _key(want)
        mine = self.mine.get(key)
        problem: tuple[str, str, str] | None = None
        if mine is not None and made_for(mine, dispatch):
            await self._mirror(dispatch, mine.get("status") or {}, now_text, workload=await self._workload(
                dispatch, mine))
            return
        if mine is not None:
            return  # the copy of an earlier origin of that name: deleted first (below), then made again
        try:
            created = await self.member.create(GPRS, want, key[0])
        except AlreadyExists:
            try:
                there = await self.member.get(GPRS, key[1], key[0])
            except NotFound:
                return  # deleted meanwhile: the next pass creates it
            if made_for(there, dispatch):
                self.mine[key] = there
                await self._mirror(dispatch, there.get("status") or {}, now_text,
                                   workload=await self._workload(dispatch, there))
                return
            problem = ("NameTaken", "NameTaken", f"this member already has a GPR {key[0]}/{key[1]} that the hub did "
                       "not send (or sent for another GPR of that name): not touched")
        except NotFound:
            problem = ("NamespaceMissing", "NamespaceMissing", f"namespace {key[0]} does not exist on this member "
                       "(its workspace has not been created here)")
        else:
            keep_newer(self.mine, key, created, created=True)
            self.writes += 1
            log.info("GPR created from the hub", extra={"gpr": "/".join(key), "dispatch": key[1]})
            await self._mirror(dispatch, created.get("status") or {}, now_text,
                               workload=await self._workload(dispatch, created))
            return
        await self._mirror(dispatch, {}, now_text, problem)

    async def _mirror(self, dispatch: dict[str, Any], member_status: Mapping[str, Any], now_text: str,
                      problem: tuple[str, str, str] | None = None,
                      workload: tuple[str, str, str] | None = None) -> None:
        current = dispatch.get("status") or {}
        patch = mirror(member_status, current, now_text, problem)
        if (dispatch.get("spec") or {}).get("workload") is not None:
            patch = with_condition(patch, current, workload, now_text)
        if not mirror_differs(current, patch):
            return
        name = _key(dispatch)[1]
        written = await self.hub.patch(GPRS, name, {"status": patch}, self.hub_namespace, subresource="status")
        keep_newer(self.dispatches, name, written)
        self.writes += 1

    async def _delete_orphans(self) -> None:
        for key, mine in list(self.mine.items()):
            meta = mine.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            dispatch = self.dispatches.get(str((meta.get("annotations") or {}).get(DISPATCH) or ""))
            if dispatch is not None and made_for(mine, dispatch):
                continue
            await self._delete_workload(mine)
            try:
                await self.member.delete(GPRS, key[1], key[0], uid=str(meta.get("uid") or "") or None)
            except NotFound:
                pass
            except ApiError as exc:
                log.warning("cannot delete a GPR whose hub dispatch is gone",
                            extra={"gpr": "/".join(key), "error": str(exc)[:200]})
                continue
            self.mine.pop(key, None)
            self.workloads.pop(str(meta.get("uid") or ""), None)
            log.info("GPR deleted: its hub dispatch is gone", extra={"gpr": "/".join(key)})

    # ---- the workload ----------------------------------------------------------------------------------------
    async def _workload(self, dispatch: Mapping[str, Any], mine: Mapping[str, Any]) -> tuple[str, str, str] | None:
        """Create what is missing of the dispatch's workload for the member GPR ``mine`` (:func:`.workload.step`),
        as the namespace's workload account; the condition to show (None: keep what the dispatch shows)."""
        workload = (dispatch.get("spec") or {}).get("workload")
        if workload is None:
            return None
        meta = mine.get("metadata") or {}
        uid, version, ns = str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""), str(
            meta.get("namespace") or "")
        seen = self.workloads.get(uid)
        if seen is not None and seen[0] == version and self.monotonic() - seen[1] < self.resync:
            return seen[2]
        first = step(mine, workload, {})
        if not first.create:  # waiting, finished or invalid: nothing to look up
            shown = (first.status, first.reason, first.message) if first.status else None
            self.workloads[uid] = (version, self.monotonic(), shown)
            return shown
        try:
            shown = await self._create_workload(mine, workload, first.create, ns)
        except ApiError as exc:  # not a verdict (the member's API server busy or away): the next pass tries again
            log.warning("cannot create a GPR's workload now; trying again at the next pass", extra={
                "gpr": f"{ns}/{meta.get('name')}", "error": str(exc)[:300]})
            return None
        self.workloads[uid] = (version, self.monotonic(), shown)
        return shown

    async def _create_workload(self, mine: Mapping[str, Any], workload: Any, wanted: list[dict[str, Any]],
                               ns: str) -> tuple[str, str, str] | None:
        as_runner = self.member.impersonating(runner(ns))
        name = f"{ns}/{(mine.get('metadata') or {}).get('name')}"
        found: dict[Ref, Mapping[str, Any] | None] = {}
        ref: Ref = ("", "", "")
        done = 0
        try:
            for obj in wanted:
                ref = ref_of(obj)
                try:
                    found[ref] = await as_runner.get(resource_of(ref), ref[2], ns)
                except NotFound:
                    found[ref] = None
            plan = step(mine, workload, found)
            done = len(wanted) - len(plan.create)
            for obj in plan.create:
                ref = ref_of(obj)
                try:
                    await as_runner.create(resource_of(ref), obj, ns)
                except AlreadyExists:
                    pass  # made meanwhile: looked at again at the next pass
                done += 1
                self.writes += 1
                log.info("workload object created", extra={"gpr": name, "object": f"{ref[1]}/{ref[2]}",
                                                             "as": runner(ns)})
        except ApiError as exc:
            if not isinstance(exc, Forbidden) and exc.status not in (400, 422):
                raise
            log.warning("workload refused by the member's API server", extra={
                "gpr": name, "object": f"{ref[1]}/{ref[2]}", "as": runner(ns), "error": str(exc)[:300]})
            return refused_condition(ref, exc.message or str(exc), done, len(wanted), ns,
                                     "WorkloadRefused" if isinstance(exc, Forbidden) else "WorkloadInvalid")
        return (plan.status, plan.reason, plan.message) if plan.status else None

    async def _delete_workload(self, mine: Mapping[str, Any]) -> None:
        """Delete the objects the member GPR's annotation names that are still its own (label and owner), as the
        namespace's workload account, before the GPR itself; a failure is logged (the owner reference still lets
        the member's garbage collector delete them)."""
        meta = mine.get("metadata") or {}
        ns = str(meta.get("namespace") or "")
        as_runner = self.member.impersonating(runner(ns))
        found: dict[Ref, Mapping[str, Any] | None] = {}
        try:
            for ref in refs_of(mine):
                try:
                    found[ref] = await as_runner.get(resource_of(ref), ref[2], ns)
                except NotFound:
                    found[ref] = None
            for ref, uid in to_delete(mine, found):
                try:
                    # Background: a Job's default is to orphan its pods, which needs a garbage collector to finish
                    res = resource_of(ref)
                    await as_runner.request("DELETE", res.path(ns, ref[2]), body={
                        "apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background",
                        **({"preconditions": {"uid": uid}} if uid else {})}, retry=True, resource=res.plural)
                except NotFound:
                    continue
                self.writes += 1
                log.info("workload object deleted with its GPR", extra={
                    "gpr": f"{ns}/{meta.get('name')}", "object": ref[1:]})
        except ApiError as exc:
            log.warning("cannot delete a workload with its GPR (the member's garbage collector may: owner "
                        "reference)", extra={"gpr": f"{ns}/{meta.get('name')}", "error": str(exc)[:300]})

    async def run(self, stop: asyncio.Event) -> None:
        """A pass on every change of either side and every ``resync`` seconds, once both informers have synced
        (:func:`kubeapi.passes.run_passes`)."""
        await run_passes(stop, self.changed, synced=lambda: all(i.synced.is_set() for i in self.informers),
                         reconcile=self.pass_once, resync=self.resync, min_interval=0.0, clock=self.wall, log=log,
                         what="dispatch follower")
