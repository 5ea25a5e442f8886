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

Level-triggered, as the hub: a pass on every change of either side and every ``resync`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubeapi import AlreadyExists, ApiError, KubeClient, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import run_passes
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

log = logging.getLogger("accelstack.member_agent")


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class DispatchFollower:
    def __init__(self, member: KubeClient, hub: KubeClient, hub_namespace: str, *, resync: float = 30.0,
                 wall: Callable[[], float] = time.time) -> None:
        self.member, self.hub, self.hub_namespace = member, hub, hub_namespace
        self.resync, self.wall = resync, wall
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
        key = _key(want)
        mine = self.mine.get(key)
        problem: tuple[str, str, str] | None = None
        if mine is not None and made_for(mine, dispatch):
            await self._mirror(dispatch, mine.get("status") or {}, now_text)
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
                await self._mirror(dispatch, there.get("status") or {}, now_text)
                return
            problem = ("NameTaken", "NameTaken", f"this member already has a GPR {key[0]}/{key[1]} that the hub did "
                       "not send (or sent for another GPR of that name): not touched")
        except NotFound:
            problem = ("NamespaceMissing", "NamespaceMissing", f"namespace {key[0]} does not exist on this member "
                       "(its workspace has not been created here)")
        else:
            self.mine[key] = created
            self.writes += 1
            log.info("GPR created from the hub", extra={"gpr": "/".join(key), "dispatch": key[1]})
            await self._mirror(dispatch, created.get("status") or {}, now_text)
            return
        await self._mirror(dispatch, {}, now_text, problem)

    async def _mirror(self, dispatch: dict[str, Any], member_status: Mapping[str, Any], now_text: str,
                      problem: tuple[str, str, str] | None = None) -> None:
        current = dispatch.get("status") or {}
        patch = mirror(member_status, current, now_text, problem)
        if not mirror_differs(current, patch):
            return
        name = _key(dispatch)[1]
        written = await self.hub.patch(GPRS, name, {"status": patch}, self.hub_namespace, subresource="status")
        self.dispatches[name] = written
        self.writes += 1

    async def _delete_orphans(self) -> None:
        for key, mine in list(self.mine.items()):
            meta = mine.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            dispatch = self.dispatches.get(str((meta.get("annotations") or {}).get(DISPATCH) or ""))
            if dispatch is not None and made_for(mine, dispatch):
                continue
            try:
                await self.member.delete(GPRS, key[1], key[0], uid=str(meta.get("uid") or "") or None)
            except NotFound:
                pass
            except ApiError as exc:
                log.warning("cannot delete a GPR whose hub dispatch is gone",
                            extra={"gpr": "/".join(key), "error": str(exc)[:200]})
                continue
            self.mine.pop(key, None)
            log.info("GPR deleted: its hub dispatch is gone", extra={"gpr": "/".join(key)})

    async def run(self, stop: asyncio.Event) -> None:
        """A pass on every change of either side and every ``resync`` seconds, once both informers have synced
        (:func:`kubeapi.passes.run_passes`)."""
        await run_passes(stop, self.changed, synced=lambda: all(i.synced.is_set() for i in self.informers),
                         reconcile=self.pass_once, resync=self.resync, min_interval=0.0, clock=self.wall, log=log,
                         what="dispatch follower")
