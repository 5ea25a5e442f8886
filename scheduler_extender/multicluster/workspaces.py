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
from kubeapi.passes import keep_newer, run_passes
from kubeapi.resources import CONFIGMAPS, WORKSPACES
from scheduler_extender.multicluster.clusters import MEMBER_NAMESPACE_PREFIX, member_namespace
from scheduler_extender.multicluster.kubeconfig import with_accounts
from scheduler_extender.multicluster.placement import FROM_HUB, ORIGIN
from scheduler_extender.multicluster.shares import MemberShare, plan_shares
from scheduler_extender.objects.selectors import selector_matches

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


def cluster_labels(cluster: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = (cluster.get("spec") or {}).get("labels")
    return labels if isinstance(labels, Mapping) else {}


def clusters_of(workspace: Mapping[str, Any], clusters: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """The members of a hub workspace: the names ``spec.clusters`` lists (in order, once each; anything not a
    non-empty string ignored), then the joined Clusters (``clusters``: name -> Cluster) whose ``spec.labels``
    match ``spec.clusterSelector``, by name."""
    spec = workspace.get("spec") or {}
    raw = spec.get("clusters")
    names = list(dict.fromkeys(c for c in raw if isinstance(c, str) and c)) if isinstance(raw, list) else []
    selector = spec.get("clusterSelector")
    if selector is not None and clusters:
        names += [c for c in sorted(clusters) if c not in names and selector_matches(selector, cluster_labels(
            clusters[c]))]
    return names


Shares = Mapping[tuple[str, str], int]  # (resource, model) -> the share of that policy.devices entry's max


def carried_spec(workspace: Mapping[str, Any], shares: Shares | None = None) -> str:
    """The spec a member gets, as stable JSON: ``clusters`` and ``clusterSelector`` are the hub's. With ``shares``
    (a workspace on more than one member) each ``policy.devices`` entry carries the member's share as ``max`` and
    the whole limit as ``sharedMax`` (the member's admission refuses only what the whole limit never allows)."""
    spec = {k: v for k, v in (workspace.get("spec") or {}).items() if k not in ("clusters", "clusterSelector")}
    if shares is not None and isinstance(spec.get("policy"), Mapping) and \
            isinstance(spec["policy"].get("devices"), list):
        devices = []
        for d in spec["policy"]["devices"]:
            key = _entry_key(d)
            if key is not None and key in shares:
                d = {**d, "max": shares[key], "sharedMax": d["max"]}
            devices.append(d)
        spec["policy"] = {**spec["policy"], "devices": devices}
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def _entry_key(entry: Any) -> tuple[str, str] | None:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("resource"), str) or \
            not isinstance(entry.get("max"), int) or isinstance(entry.get("max"), bool):
        return None
    return entry["resource"], str(entry.get("model") or "")


def limits_of(workspace: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    """``spec.policy.devices`` as (resource, model) -> max."""
    policy = (workspace.get("spec") or {}).get("policy")
    devices = policy.get("devices") if isinstance(policy, Mapping) else None
    return {k: int(d["max"]) for d in devices or () if (k := _entry_key(d)) is not None} \
        if isinstance(devices, list) else {}


def carried_shares(carrier: Mapping[str, Any] | None) -> dict[tuple[str, str], int]:
    """The share of each entry the carrier holds now (the whole ``max`` where the carrier holds no share)."""
    origin = carrier_origin(carrier) if carrier is not None else None
    return limits_of({"spec": origin[2]}) if origin is not None else {}


def reported_rows(carrier: Mapping[str, Any] | None) -> dict[tuple[str, str], Mapping[str, Any]]:
    """The member's usage rows from the carrier's status, by (resource, model)."""
    verdict = carrier_status(carrier) if carrier is not None else None
    rows = verdict.get("usage") if verdict is not None else None
    return {(str(r.get("resource") or ""), str(r.get("model") or "")): r for r in rows or ()
            if isinstance(r, Mapping)} if isinstance(rows, list) else {}


def _count(row: Mapping[str, Any] | None, *keys: str) -> int:
    return sum(v for k in keys if isinstance(v := (row or {}).get(k), int) and not isinstance(v, bool))


def member_shares(workspace: Mapping[str, Any], members: Sequence[str],
                  carriers: Mapping[str, Mapping[str, Any]], live: Callable[[str], bool]
                  ) -> dict[str, dict[tuple[str, str], int]]:
    """The share of each ``policy.devices`` entry to carry to each member now (:func:`.shares.plan_shares` per
    entry, from what each carrier holds and what each member reports); ``{}`` for a workspace on at most one
    member (it gets the whole limit, as on one cluster)."""
    if len(members) < 2:
        return {}
    out: dict[str, dict[tuple[str, str], int]] = {m: {} for m in members}
    have = {m: carried_shares(carriers.get(m)) for m in members}
    rows = {m: reported_rows(carriers.get(m)) for m in members}
    for key, limit in limits_of(workspace).items():
        views = {}
        for m in members:
            row = rows[m].get(key)
            reported = row.get("max") if row is not None and isinstance(row.get("max"), int) else None
            views[m] = MemberShare(carried=have[m].get(key), reported=reported, held=_count(row, "inUse", "reserved"),
                                   queued=_count(row, "queued"), live=live(m))
        for m, share in plan_shares(limit, views).items():
            out[m][key] = share
    return out


def carrier_object(workspace: Mapping[str, Any], cluster: str, shares: Shares | None = None) -> dict[str, Any]:
    name = _name(workspace)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": member_namespace(cluster),
                         "labels": {WORKSPACE_DISPATCH: label_value(name),
                                    "app.kubernetes.io/managed-by": "accelstack-hub"}},
            "data": carrier_data(workspace, shares)}


def carrier_data(workspace: Mapping[str, Any], shares: Shares | None = None) -> dict[str, str]:
    """The hub's keys of a carrier (the agent's key, ``status``, is never among them)."""
    return {"workspace": _name(workspace), "uid": str(_meta(workspace).get("uid") or ""),
            "spec": carried_spec(workspace, shares)}


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
    """The Workspace the agent keeps in its member for ``carrier``: same name, the carried spec (plus a
    ServiceAccount per role for workspace kubeconfigs: :func:`.kubeconfig.with_accounts`), the origin."""
    origin = carrier_origin(carrier)
    if origin is None:
        return None
    name, uid, spec = origin
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
            "metadata": {"name": name, "labels": {FROM_HUB: "true"}, "annotations": {ORIGIN: f"hub/{name}/{uid}"}},
            "spec": with_accounts(spec)}


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
                        joined: Callable[[str], bool], members: Sequence[str] | None = None
                        ) -> list[dict[str, Any]]:
    """``status.clusters`` of a hub workspace: one row per member (``members``, by default those ``spec.clusters``
    lists), from its carrier (member name -> the carrier there); on a workspace of several members each has
    ``shares`` rows (resource, model, max: the share of that limit the hub carries it now)."""
    rows = []
    uid = str(_meta(workspace).get("uid") or "")
    listed = clusters_of(workspace) if members is None else list(members)
    for cluster in listed:
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
        shared = carried_shares(carrier) if carrier is not None and (carrier.get("data") or {}).get("uid") == uid \
            else {}
        if shared and len(listed) > 1:
            row["shares"] = [{"resource": r, "model": m, "max": v} for (r, m), v in sorted(shared.items())]
        rows.append({"name": cluster, **row})
    return rows


def hub_usage(workspace: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``status.usage`` of a hub workspace: per ``policy.devices`` entry, the whole limit and the sums of what
    the members report (held and queued)."""
    total: dict[tuple[str, str], dict[str, Any]] = {
        k: {"resource": k[0], "model": k[1], "max": v, "inUse": 0, "reserved": 0, "queued": 0}
             for k, v in sorted(limits_of(workspace).items())}
    for row in rows:
        for u in row.get("usage") or ():
            t = total.get((str(u.get("resource") or ""), str(u.get("model") or ""))) if isinstance(u, Mapping) \
                else None
            if t is not None:
                for col in ("inUse", "reserved", "queued"):
                    t[col] += _count(u, col)
    return list(total.values())


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

    def _wanted(self, clusters: Mapping[str, Mapping[str, Any]]) -> set[tuple[str, str]]:
        return {(c, name) for name, ws in self.workspaces.items() if not _meta(ws).get("deletionTimestamp")
                for c in clusters_of(ws, clusters)}

    @staticmethod
    def _live(cluster: Mapping[str, Any] | None) -> bool:
        """Not Lost: a Lost member's share is not moved (it keeps what it committed until it answers again)."""
        conditions = ((cluster or {}).get("status") or {}).get("conditions") or ()
        return not any(isinstance(c, Mapping) and c.get("type") == "Lost" and c.get("status") == "True"
                       for c in conditions)

    async def pass_once(self) -> None:
        clusters = dict(self.clusters())
        joined = set(clusters)
        for name, ws in list(self.workspaces.items()):
            if _meta(ws).get("deletionTimestamp"):
                continue
            members = clusters_of(ws, clusters)
            here = [c for c in members if c in joined]
            shares = member_shares(ws, here, {c: o for (c, n), o in self.carriers.items() if n == name},
                                   lambda c: self._live(clusters.get(c)))
            for cluster in here:
                try:
                    await self._carry(ws, cluster, shares.get(cluster))
                except ApiError as exc:
                    log.warning("cannot carry a workspace to a member; retrying at the next pass",
                                extra={"workspace": name, "cluster": cluster, "error": str(exc)[:300]})
            try:
                await self._status(ws, joined, members)
            except ApiError as exc:
                log.warning("cannot write a workspace's clusters status", extra={"workspace": name,
                                                                                 "error": str(exc)[:300]})
        await self._orphans(clusters)

    async def _carry(self, ws: Mapping[str, Any], cluster: str, shares: Shares | None = None) -> None:
        key = (cluster, _name(ws))
        have = self.carriers.get(key)
        if have is None:
            try:
                created = await self.client.create(CONFIGMAPS, carrier_object(ws, cluster, shares),
                                                   member_namespace(cluster))
            except AlreadyExists:
                return  # the informer brings it
            except NotFound:
                return  # the member left between the informer's view and now
            keep_newer(self.carriers, key, created, created=True)
            self.writes += 1
            log.info("workspace carried to a member", extra={"workspace": key[1], "cluster": cluster})
            return
        want = carrier_data(ws, shares)
        data = have.get("data") or {}
        if any(data.get(k) != v for k, v in want.items()):
            before = carried_shares(have)
            keep_newer(self.carriers, key, await self.client.patch(CONFIGMAPS, key[1], {"data": want},
                                                                   member_namespace(cluster)))
            self.writes += 1
            if shares is not None and any(before.get(k) != v for k, v in shares.items()):
                log.info("workspace share carried to a member", extra={
                    "workspace": key[1], "cluster": cluster,
                    "shares": {f"{r}/{m}" if m else r: v for (r, m), v in sorted(shares.items())}})

    async def _status(self, ws: Mapping[str, Any], joined: set[str], members: Sequence[str]) -> None:
        name = _name(ws)
        status = ws.get("status") or {}
        have = status.get("clusters")
        if not members and not have:
            return
        rows = hub_clusters_status(ws, {c: o for (c, n), o in self.carriers.items() if n == name},
                                   joined.__contains__, members)
        body: dict[str, Any] = {"clusters": rows}
        usage = hub_usage(ws, rows) if members else []
        if usage or status.get("usage"):
            body["usage"] = usage
        if all(status.get(k) == v for k, v in body.items()):
            return
        written = await self.client.patch(WORKSPACES, name, {"status": body}, subresource="status")
        keep_newer(self.workspaces, name, written)
        self.writes += 1

    async def _orphans(self, clusters: Mapping[str, Mapping[str, Any]]) -> None:
        """Delete each carrier whose workspace is gone (or is being deleted) or no longer has its member (not
        listed, not selected)."""
        wanted = self._wanted(clusters)
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
            keep_newer(self.mine, name, mine, created=True)  # made, or read: not in the store before
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
            keep_newer(self.mine, name, mine)
            self.writes += 1
            agent_log.info("workspace updated from the hub", extra={"workspace": name})
        await self._answer(carrier, member_verdict(mine.get("status") or {}))

    async def _answer(self, carrier: dict[str, Any], verdict: dict[str, Any]) -> None:
        if carrier_status(carrier) == verdict:
            return
        text = json.dumps(verdict, sort_keys=True, separators=(",", ":"))
        name = _name(carrier)
        keep_newer(self.carriers, name, await self.hub.patch(CONFIGMAPS, name, {"data": {"status": text}},
                                                             self.hub_namespace))
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
