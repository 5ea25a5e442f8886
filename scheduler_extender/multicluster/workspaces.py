"""Workspaces across clusters (issue 40.2, first slice): a ``Workspace`` on the hub with ``spec.clusters`` (member
names) is carried to each listed member, whose own workspace controller makes its namespaces and RBAC there.

- **The carrier.** ``Workspace`` is cluster-scoped, and an agent's hub rights are its own hub namespace
  ``accelstack-member-NAME``, so the hub (:class:`WorkspaceDispatcher`, leader only) writes a ConfigMap there, named
  as the workspace, labelled :data:`WORKSPACE_DISPATCH` and holding the origin's name, UID and spec
  (``clusters`` removed) as JSON in ``data.spec``. The agent writes the member's verdict back into the same
  ConfigMap's ``data.status`` (JSON: ready, namespaces, usage, message): the hub writes only ``workspace``,
  ``uid`` and ``spec``, the agent only ``status``, each with a merge patch of its own keys.
- **The member's copy** (:class:`WorkspaceFollower`, in the agent): a Workspace of the same name, the carried spec,
  labelled ``accelstack.io/from-hub=true`` and annotated ``accelstack.io/origin: hub/NAME/UID``. The member's
  workspace controller treats it as any Workspace: it creates or adopts the namespaces, never deletes one, and
  deletes only the RBAC objects it made when the Workspace goes. A Workspace of that name the agent did not make
  is never touched (``NameTaken``); the agent deletes only its own copies, and only while its view of the hub is
  fresh (informer synced and healthy), so a hub it cannot reach never makes a member drop a workspace.
- **Status.** The hub writes ``status.clusters[]`` (name, ready, namespaces, usage, message) on the hub Workspace
  from the carriers, only when it changes; a member listed but not joined says so.
- **Removal.** A carrier whose workspace is gone, or whose member is no longer in ``spec.clusters``, is deleted
  (UID precondition); the agent then deletes its copy.

Level-triggered on both sides, as the GPR dispatch (:mod:`.dispatch`, :mod:`.follow`): each pass does what the
stored objects ask, so a restart continues where the last one stopped. Not built here: a label selector in
``spec.clusters``, quotas that hold across clusters, per-member workspace kubeconfigs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubeapi import AlreadyExists, ApiError, KubeClient, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import run_passes
from kubeapi.resources import CONFIGMAPS, WORKSPACES
from scheduler_extender.multicluster.clusters import MEMBER_NAMESPACE_PREFIX, member_namespace
from scheduler_extender.multicluster.placement import FROM_HUB, ORIGIN

log = logging.getLogger("accelstack.hub")
agent_log = logging.getLogger("accelstack.member_agent")
WORKSPACE_DISPATCH = "accelstack.io/workspace-dispatch"  # label on a carrier ConfigMap (hub): the workspace


# ---- pure parts -------------------------------------------------------------------------------------------------
def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _name(obj: Mapping[str, Any]) -> str:
    return str(_meta(obj).get("name") or "")


def label_value(name: str) -> str:
    """A workspace name as a label value (names may be 253 long, label values 63): cut and hashed when longer."""
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[:52].rstrip('-.')}-{digest}"


def clusters_of(workspace: Mapping[str, Any]) -> list[str]:
    """The member names ``spec.clusters`` lists (in order, once each; anything not a non-empty string ignored)."""
    raw = (workspace.get("spec") or {}).get("clusters")
    return list(dict.fromkeys(c for c in raw if isinstance(c, str) and c)) if isinstance(raw, list) else []


def carried_spec(workspace: Mapping[str, Any]) -> str:
    """The spec a member gets, as stable JSON: ``clusters`` is the hub's."""
    spec = {k: v for k, v in (workspace.get("spec") or {}).items() if k != "clusters"}
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def carrier_object(workspace: Mapping[str, Any], cluster: str) -> dict[str, Any]:
    name = _name(workspace)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": member_namespace(cluster),
                         "labels": {WORKSPACE_DISPATCH: label_value(name),
                                    "app.kubernetes.io/managed-by": "accelstack-hub"}},
            "data": carrier_data(workspace)}


def carrier_data(workspace: Mapping[str, Any]) -> dict[str, str]:
    """The hub's keys of a carrier (the agent's key, ``status``, is never among them)."""
    return {"workspace": _name(workspace), "uid": str(_meta(workspace).get("uid") or ""),
            "spec": carried_spec(workspace)}


def carrier_origin(carrier: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    """(workspace name, UID, spec) a carrier holds; None when it is not a usable carrier."""
    data = carrier.get("data") or {}
    name, uid = str(data.get("workspace") or ""), str(data.get("uid") or "")
    try:
        spec = json.loads(str(data.get("spec") or ""))
    except ValueError:
        return None
    if not name or not uid or name != _name(carrier) or not isinstance(spec, dict):
        return None
    return name, uid, spec


def carrier_status(carrier: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the agent wrote back into ``data.status``; None before it did (or when it is not JSON)."""
    raw = (carrier.get("data") or {}).get("status")
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def member_workspace(carrier: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Workspace the agent keeps in its member for ``carrier``: same name, the carried spec, the origin."""
    origin = carrier_origin(carrier)
    if origin is None:
        return None
    name, uid, spec = origin
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
            "metadata": {"name": name, "labels": {FROM_HUB: "true"}, "annotations": {ORIGIN: f"hub/{name}/{uid}"}},
            "spec": spec}


def made_by_agent(workspace: Mapping[str, Any]) -> bool:
    """A member Workspace the agent made (for any hub workspace of that name): its label and origin annotation."""
    meta = _meta(workspace)
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    return labels.get(FROM_HUB) == "true" and str(notes.get(ORIGIN) or "").startswith(f"hub/{meta.get('name')}/")


def member_verdict(status: Mapping[str, Any]) -> dict[str, Any]:
    """The member Workspace's status as it goes back to the hub: Ready, the namespaces there (those the member's
    controller reports ready), usage rows, and the Ready condition's message."""
    ready = next((c for c in status.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == "Ready"),
                 {})
    rows = [n for n in status.get("namespaces") or () if isinstance(n, Mapping)]
    return {"ready": ready.get("status") == "True",
            "namespaces": sorted(str(n.get("name")) for n in rows if n.get("ready") and n.get("name")),
            "usage": list(status.get("usage") or []),
            "message": str(ready.get("message") or ("waiting for the member's workspace controller"
                                                    if not ready else ""))}


def problem_verdict(reason: str, message: str) -> dict[str, Any]:
    return {"ready": False, "namespaces": [], "usage": [], "message": f"{reason}: {message}"}


def hub_clusters_status(workspace: Mapping[str, Any], carriers: Mapping[str, Mapping[str, Any]],
                        joined: Callable[[str], bool]) -> list[dict[str, Any]]:
    """``status.clusters`` of a hub workspace: one row per listed member, from its carrier (member name -> the
    carrier there)."""
    rows = []
    uid = str(_meta(workspace).get("uid") or "")
    for cluster in clusters_of(workspace):
        carrier = carriers.get(cluster)
        verdict = carrier_status(carrier) if carrier is not None else None
        if not joined(cluster):
            row = problem_verdict("ClusterNotFound", f"no member cluster {cluster!r} has joined the hub")
        elif carrier is None or (carrier.get("data") or {}).get("uid") != uid:
            row = {"ready": False, "namespaces": [], "usage": [], "message": "sending to the member"}
        elif verdict is None:
            row = {"ready": False, "namespaces": [], "usage": [], "message": "the member's agent has not answered yet"}
        else:
            row = {k: verdict.get(k) for k in ("ready", "namespaces", "usage", "message")}
        rows.append({"name": cluster, **row})
    return rows


# ---- the hub ----------------------------------------------------------------------------------------------------
class WorkspaceDispatcher:
    """The hub's half (leader only): carriers into the listed members' hub namespaces, ``status.clusters`` back."""

    def __init__(self, client: KubeClient, clusters: Callable[[], Mapping[str, Any]], *, resync: float = 30.0
                 ) -> None:
        self.client, self.clusters, self.resync = client, clusters, resync
        self.workspaces: dict[str, dict[str, Any]] = {}
        self.carriers: dict[tuple[str, str], dict[str, Any]] = {}  # (member, workspace name) -> carrier
        self.changed = asyncio.Event()
        self.writes = 0
        self.informers = [
            Informer(client, WORKSPACES, self._on_workspace, self._sync_workspaces, name="workspaces"),
            Informer(client, CONFIGMAPS, self._on_carrier, self._sync_carriers, name="workspace-carriers",
                     label_selector=WORKSPACE_DISPATCH)]

    @staticmethod
    def _carrier_key(obj: Mapping[str, Any]) -> tuple[str, str] | None:
        ns = str(_meta(obj).get("namespace") or "")
        return (ns[len(MEMBER_NAMESPACE_PREFIX):], _name(obj)) if ns.startswith(MEMBER_NAMESPACE_PREFIX) else None

    def _on_workspace(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.workspaces.pop(_name(obj), None)
        else:
            self.workspaces[_name(obj)] = obj
        self.changed.set()

    def _sync_workspaces(self, items: Sequence[dict[str, Any]]) -> None:
        self.workspaces = {_name(o): o for o in items}
        self.changed.set()

    def _on_carrier(self, kind: str, obj: dict[str, Any]) -> None:
        key = self._carrier_key(obj)
        if key is None:
            return
        if kind == "DELETED":
            self.carriers.pop(key, None)
        else:
            self.carriers[key] = obj
        self.changed.set()

    def _sync_carriers(self, items: Sequence[dict[str, Any]]) -> None:
        self.carriers = {k: o for o in items if (k := self._carrier_key(o)) is not None}
        self.changed.set()

    def _wanted(self) -> set[tuple[str, str]]:
        return {(c, name) for name, ws in self.workspaces.items() if not _meta(ws).get("deletionTimestamp")
                for c in clusters_of(ws)}

    async def pass_once(self) -> None:
        joined = set(self.clusters())
        for name, ws in list(self.workspaces.items()):
            if _meta(ws).get("deletionTimestamp"):
                continue
            for cluster in clusters_of(ws):
                if cluster in joined:
                    try:
                        await self._carry(ws, cluster)
                    except ApiError as exc:
                        log.warning("cannot carry a workspace to a member; retrying at the next pass",
                                    extra={"workspace": name, "cluster": cluster, "error": str(exc)[:300]})
            try:
                await self._status(ws, joined)
            except ApiError as exc:
                log.warning("cannot write a workspace's clusters status", extra={"workspace": name,
                                                                                 "error": str(exc)[:300]})
        await self._orphans()

    async def _carry(self, ws: Mapping[str, Any], cluster: str) -> None:
        key = (cluster, _name(ws))
        have = self.carriers.get(key)
        if have is None:
            try:
                created = await self.client.create(CONFIGMAPS, carrier_object(ws, cluster), member_namespace(cluster))
            except AlreadyExists:
                return  # the informer brings it
            except NotFound:
                return  # the member left between the informer's view and now
            self.carriers[key] = created
            self.writes += 1
            log.info("workspace carried to a member", extra={"workspace": key[1], "cluster": cluster})
            return
        want = carrier_data(ws)
        data = have.get("data") or {}
        if any(data.get(k) != v for k, v in want.items()):
            self.carriers[key] = await self.client.patch(CONFIGMAPS, key[1], {"data": want}, member_namespace(cluster))
            self.writes += 1

    async def _status(self, ws: Mapping[str, Any], joined: set[str]) -> None:
        name = _name(ws)
        have = (ws.get("status") or {}).get("clusters")
        if not clusters_of(ws) and not have:
            return
        rows = hub_clusters_status(ws, {c: o for (c, n), o in self.carriers.items() if n == name},
                                   joined.__contains__)
        if rows == (have or []):
            return
        written = await self.client.patch(WORKSPACES, name, {"status": {"clusters": rows}}, subresource="status")
        self.workspaces[name] = written
        self.writes += 1

    async def _orphans(self) -> None:
        """Delete each carrier whose workspace is gone (or is being deleted) or no longer lists its member."""
        wanted = self._wanted()
        for key, carrier in list(self.carriers.items()):
            if key in wanted:
                continue
            try:
                await self.client.delete(CONFIGMAPS, key[1], member_namespace(key[0]),
                                         uid=str(_meta(carrier).get("uid") or "") or None)
            except NotFound:
                pass
            except ApiError as exc:
                log.warning("cannot delete a workspace carrier", extra={"workspace": key[1], "cluster": key[0],
                                                                        "error": str(exc)[:200]})
                continue
            self.carriers.pop(key, None)
            self.writes += 1
            log.info("workspace carrier deleted: the workspace is gone or no longer lists the member",
                     extra={"workspace": key[1], "cluster": key[0]})

    async def run(self, stop: asyncio.Event) -> None:
        await run_passes(stop, self.changed, synced=lambda: all(i.synced.is_set() for i in self.informers),
                         reconcile=self.pass_once, resync=self.resync, min_interval=0.0, clock=time.time, log=log,
                         what="workspace dispatch")


# ---- the member's agent -----------------------------------------------------------------------------------------
class WorkspaceFollower:
    """The agent's half: one member Workspace per carrier in its hub namespace, its verdict back into the carrier."""

    def __init__(self, member: KubeClient, hub: KubeClient, hub_namespace: str, *, resync: float = 30.0) -> None:
        self.member, self.hub, self.hub_namespace, self.resync = member, hub, hub_namespace, resync
        self.carriers: dict[str, dict[str, Any]] = {}
        self.mine: dict[str, dict[str, Any]] = {}  # member Workspaces the agent made
        self.changed = asyncio.Event()
        self.writes = 0
        self.hub_informer = Informer(hub, CONFIGMAPS, self._on_carrier, self._sync_carriers,
                                     name="hub-workspace-carriers", namespace=hub_namespace,
                                     label_selector=WORKSPACE_DISPATCH)
        self.member_informer = Informer(member, WORKSPACES, self._on_mine, self._sync_mine,
                                        name="member-workspaces-from-hub", label_selector=f"{FROM_HUB}=true")
        self.informers = [self.hub_informer, self.member_informer]

    def _on_carrier(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.carriers.pop(_name(obj), None)
        else:
            self.carriers[_name(obj)] = obj
        self.changed.set()

    def _sync_carriers(self, items: Sequence[dict[str, Any]]) -> None:
        self.carriers = {_name(o): o for o in items}
        self.changed.set()

    def _on_mine(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED" or not made_by_agent(obj):
            self.mine.pop(_name(obj), None)
        else:
            self.mine[_name(obj)] = obj
        self.changed.set()

    def _sync_mine(self, items: Sequence[dict[str, Any]]) -> None:
        self.mine = {_name(o): o for o in items if made_by_agent(o)}
        self.changed.set()

    async def pass_once(self) -> None:
        for name, carrier in list(self.carriers.items()):
            try:
                await self._follow(carrier)
            except ApiError as exc:
                agent_log.warning("cannot follow a workspace from the hub; retrying at the next pass",
                                  extra={"workspace": name, "error": str(exc)[:300]})
        if self.hub_informer.synced.is_set() and self.hub_informer.healthy:
            await self._delete_orphans()

    async def _follow(self, carrier: dict[str, Any]) -> None:
        want = member_workspace(carrier)
        if want is None:
            return
        name = _name(want)
        mine = self.mine.get(name)
        if mine is None:
            try:
                mine = await self.member.create(WORKSPACES, want)
                agent_log.info("workspace created from the hub", extra={"workspace": name})
            except AlreadyExists:
                there = await self.member.get(WORKSPACES, name)
                if not made_by_agent(there):
                    await self._answer(carrier, problem_verdict(
                        "NameTaken", f"this member already has a Workspace {name} that the hub did not send: "
                        "not touched"))
                    return
                mine = there
            except ApiError as exc:  # refused by the member's admission (a namespace another workspace holds, ...)
                await self._answer(carrier, problem_verdict("Refused", str(exc).splitlines()[0][:300]))
                return
            self.mine[name] = mine
            self.writes += 1
        elif mine.get("spec") != want["spec"] or \
                (_meta(mine).get("annotations") or {}).get(ORIGIN) != want["metadata"]["annotations"][ORIGIN]:
            meta = dict(_meta(mine))
            meta["annotations"] = {**(meta.get("annotations") or {}), **want["metadata"]["annotations"]}
            try:
                mine = await self.member.replace(WORKSPACES, name, {**mine, "metadata": meta, "spec": want["spec"]})
            except ApiError as exc:
                await self._answer(carrier, problem_verdict("Refused", str(exc).splitlines()[0][:300]))
                return
            self.mine[name] = mine
            self.writes += 1
            agent_log.info("workspace updated from the hub", extra={"workspace": name})
        await self._answer(carrier, member_verdict(mine.get("status") or {}))

    async def _answer(self, carrier: dict[str, Any], verdict: dict[str, Any]) -> None:
        if carrier_status(carrier) == verdict:
            return
        text = json.dumps(verdict, sort_keys=True, separators=(",", ":"))
        name = _name(carrier)
        self.carriers[name] = await self.hub.patch(CONFIGMAPS, name, {"data": {"status": text}}, self.hub_namespace)
        self.writes += 1

    async def _delete_orphans(self) -> None:
        for name, mine in list(self.mine.items()):
            if _meta(mine).get("deletionTimestamp") or member_workspace(self.carriers.get(name) or {}) is not None:
                continue
            try:
                await self.member.delete(WORKSPACES, name, uid=str(_meta(mine).get("uid") or "") or None)
            except NotFound:
                pass
            except ApiError as exc:
                agent_log.warning("cannot delete a workspace whose hub carrier is gone",
                                  extra={"workspace": name, "error": str(exc)[:200]})
                continue
            self.mine.pop(name, None)
            self.writes += 1
            agent_log.info("workspace deleted: its hub carrier is gone", extra={"workspace": name})

    async def run(self, stop: asyncio.Event) -> None:
        await run_passes(stop, self.changed, synced=lambda: all(i.synced.is_set() for i in self.informers),
                         reconcile=self.pass_once, resync=self.resync, min_interval=0.0, clock=time.time, log=agent_log,
                         what="workspace follower")
