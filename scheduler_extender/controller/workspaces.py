"""The workspace controller's I/O: informers for what :func:`workspaces.plan` reads, and the API calls that carry
out its plan. It runs in the controller process, under the GPR controller's leader election (a term's task).

A pass: every Workspace, every Namespace, the Roles, RoleBindings and ServiceAccounts carrying
``app.kubernetes.io/managed-by=accelstack-workspace-controller``, the role templates ConfigMap (read each pass: it
changes rarely: read again every ``resync`` seconds), the GPR objects of the GPR controller and the nodes' device models go in;
creates, updates, deletes, namespace label patches and status writes come out. An API error on one write (403,
500, no answer) is logged, shown on that workspace's Ready condition and retried with a backoff of its own
(1 s, doubling to 30 s: however often passes run, a refused write is not hammered); the other writes go
ahead. What each write returned is kept at once (newer than the informer's copy), so the next pass does not try
the same create again. An object of a wanted name that exists without the managed-by label (a create answered
AlreadyExists) is someone else's and left alone; the informers do not see such objects, so each is read again
every ``5 * resync`` seconds and, once it is gone, the name is the controller's again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kubeapi import AlreadyExists, ApiError, Conflict, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import keep_newer, resource_version, run_passes
from kubeapi.resources import (
    NAMESPACES,
    ROLE_BINDINGS,
    ROLES,
    SERVICE_ACCOUNTS,
    WORKSPACES,
    Resource,
)
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects import workspaces as wsp
from scheduler_extender.objects.cluster import MODEL_LABEL, ClusterView
from scheduler_extender.objects.kube import Kube

log = logging.getLogger("accelstack.workspaces")
KINDS: dict[str, Resource] = {"Role": ROLES, "RoleBinding": ROLE_BINDINGS, "ServiceAccount": SERVICE_ACCOUNTS,
                              "Namespace": NAMESPACES}


def _name(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class WorkspaceController:
    def __init__(self, kube: Kube, view: ClusterView, gprs: Callable[[], Iterable[Mapping[str, Any]]], *,
                 namespace: str = "accelstack-system", resync: float = 5.0, min_interval: float = 1.0,
                 concurrency: int = 16, registry: CollectorRegistry | None = None,
                 on_index: Callable[[], None] | None = None, watch_timeout: tuple[int, int] = (300, 600),
                 clock: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.view = view
        self.gprs = gprs
        self.namespace = namespace  # where the role templates ConfigMap lives
        self.resync = resync
        self.min_interval = min(min_interval, resync)  # between passes: a burst of GPR changes makes one
        self.concurrency = concurrency
        self.on_index = on_index  # the namespace -> workspace map or the quotas may have changed
        self.clock = clock
        self.workspaces: dict[str, dict[str, Any]] = {}
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.managed: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.errors: dict[str, str] = {}  # workspace -> what the API answered to the last pass's failed writes
        # (kind, namespace, name) of objects that exist without the managed-by label -> when last seen there
        self.foreign: dict[tuple[str, str, str], float] = {}
        self.recheck = 5 * resync
        # (verb, object) of writes that failed -> (tries, retry after, what the API answered)
        self._failed: dict[tuple[str, str], tuple[int, float, str]] = {}
        self.poke = asyncio.Event()
        self.passes = 0
        self.last_plan: wsp.Plan | None = None
        self._index: wsp.WorkspaceIndex | None = None
        self._template_cm: dict[str, Any] | None = None
        self._templates_at = -math.inf
        registry = registry or CollectorRegistry()
        p = "accelstack_workspace_"
        self.pass_seconds = Histogram(p + "pass_seconds", "Time of one workspace pass (plan and writes)",
                                      registry=registry)
        self.actions = Counter(p + "actions_total", "Workspace controller API writes by verb, kind and result",
                               ["verb", "kind", "result"], registry=registry)
        selector = wsp.MANAGED_SELECTOR
        self.informers = [
            Informer(kube.client, WORKSPACES, self._on_workspace, self._sync_workspaces, name="workspaces",
                     watch_timeout=watch_timeout),
            Informer(kube.client, NAMESPACES, self._on_namespace, self._sync_namespaces, name="namespaces",
                     watch_timeout=watch_timeout),
            *[Informer(kube.client, res, self._managed_handler(kind), self._managed_sync(kind), name=res.plural,
                       label_selector=selector, watch_timeout=watch_timeout)
              for kind, res in KINDS.items() if kind != "Namespace"],
        ]

    # ---- informer callbacks ----------------------------------------------------------------------------------
    def _changed(self, index_too: bool) -> None:
        if index_too:
            self._index = None
            if self.on_index is not None:
                self.on_index()
        self.poke.set()

    def _on_workspace(self, kind: str, obj: dict[str, Any]) -> None:
        name = _name(obj)[1]
        old = self.workspaces.get(name)
        if kind == "DELETED":
            self.workspaces.pop(name, None)
        elif resource_version(obj) >= resource_version(old):
            self.workspaces[name] = obj
        else:
            return
        if kind == "DELETED" or old is None or old.get("spec") != obj.get("spec"):
            self._changed(True)  # a status write (ours, mostly) changes neither the plan's input nor the quotas

    def _sync_workspaces(self, items: list[dict[str, Any]]) -> None:
        self.workspaces = {_name(o)[1]: o for o in items}
        self._changed(True)

    def _on_namespace(self, kind: str, obj: dict[str, Any]) -> None:
        name = _name(obj)[1]
        old = self.namespaces.get(name)
        if kind == "DELETED":
            self.namespaces.pop(name, None)
        elif resource_version(obj) >= resource_version(old):
            self.namespaces[name] = obj
        labels = lambda o: ((o or {}).get("metadata") or {}).get("labels") or {}  # noqa: E731
        self._changed(kind == "DELETED" or old is None
                      or labels(old).get(wsp.WORKSPACE_LABEL) != labels(obj).get(wsp.WORKSPACE_LABEL))

    def _sync_namespaces(self, items: list[dict[str, Any]]) -> None:
        self.namespaces = {_name(o)[1]: o for o in items}
        self._changed(True)

    def _managed_handler(self, kind_name: str) -> Callable[[str, dict[str, Any]], None]:
        def handle(kind: str, obj: dict[str, Any]) -> None:
            key = (kind_name, *_name(obj))
            if kind == "DELETED":
                self.managed.pop(key, None)
            else:
                self._keep(key, obj, created=True)  # the watch's own copy: new objects come this way
            self.poke.set()
        return handle

    def _managed_sync(self, kind_name: str) -> Callable[[list[dict[str, Any]]], None]:
        def sync(items: list[dict[str, Any]]) -> None:
            for key in [k for k in self.managed if k[0] == kind_name]:
                del self.managed[key]
            for obj in items:
                self.managed[(kind_name, *_name(obj))] = obj
            self.poke.set()
        return sync

    def _keep(self, key: tuple[str, str, str], obj: dict[str, Any], created: bool = False) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(wsp.MANAGED_LABEL) != wsp.MANAGED_BY:
            self.managed.pop(key, None)
        else:
            keep_newer(self.managed, key, obj, created=created)

    def changed(self, *_: Any) -> None:
        """A GPR changed: the usage in some workspace's status may have."""
        self.poke.set()

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers)

    def index(self) -> wsp.WorkspaceIndex:
        """The namespace -> workspace map and the core's quotas, for the GPR controller's pass."""
        if self._index is None:
            labels = {n: ((o.get("metadata") or {}).get("labels") or {}) for n, o in self.namespaces.items()}
            self._index = wsp.index((wsp.parse_workspace(o) for o in self.workspaces.values()), labels)
        return self._index

    # ---- a pass ----------------------------------------------------------------------------------------------
    async def _templates(self) -> dict[str, Any] | None:
        """The role templates ConfigMap, read again once ``resync`` seconds have passed (passes triggered by
        GPR changes come often; the templates change rarely). A read that fails keeps the last one."""
        now = self.clock()
        if now - self._templates_at < self.resync:
            return self._template_cm
        try:
            self._template_cm = await self.kube.get_configmap(self.namespace, wsp.ROLE_TEMPLATES)
        except NotFound:
            self._template_cm = None
        self._templates_at = now
        return self._template_cm

    def _models(self) -> dict[str, str]:
        out = {}
        for name, node in self.view.nodes.items():
            for resource, label in MODEL_LABEL.items():
                if node.allocatable.get(resource):
                    out[name] = node.labels.get(label, "")
                    break
        return out

    async def reconcile(self) -> wsp.Plan:
        started = time.perf_counter()
        templates = await self._templates()  # before the snapshot: the pass sees what is current after it
        await self._recheck_foreign()
        obs = wsp.Observed(list(self.workspaces.values()), dict(self.namespaces), dict(self.managed), templates,
                           list(self.gprs()), self._models(), dict(self.errors), frozenset(self.foreign),
                           gr.rfc3339(self.clock()))
        plan = await asyncio.to_thread(wsp.plan, obs)  # O(GPRs) for the usage: off the event loop
        self.foreign = {k: v for k, v in self.foreign.items() if k in plan.wanted}
        errors: dict[str, list[str]] = {}
        now = self.clock()
        # a write that failed is retried with its own backoff; one a pass no longer plans is forgotten
        self._failed = {k: v for k, v in self._failed.items() if k in {(a.verb, a.key) for a in plan.actions}}
        due = []
        for a in plan.actions:
            failed = self._failed.get((a.verb, a.key))
            if failed is not None and failed[1] > now:
                errors.setdefault(a.workspace, []).append(failed[2])
            else:
                due.append(a)
        gate = asyncio.Semaphore(self.concurrency)

        async def one(action: wsp.Action) -> None:
            async with gate:
                problem = await self._do(action)
            key = (action.verb, action.key)
            if problem:
                errors.setdefault(action.workspace, []).append(problem)
                tries = self._failed[key][0] + 1 if key in self._failed else 1
                self._failed[key] = (tries, self.clock() + min(30.0, 0.5 * 2 ** tries), problem)
            else:
                self._failed.pop(key, None)

        # namespaces first: the objects in a new namespace wait for the next pass (the informer sees it first);
        # then Roles and ServiceAccounts, then RoleBindings: a binding is written once its Role is in place, and
        # not at all when creating the Role found one of that name that is not the controller's (binding to it
        # would grant what that Role grants)
        await asyncio.gather(*(one(a) for a in due if a.kind == "Namespace"))
        await asyncio.gather(*(one(a) for a in due if a.kind not in ("Namespace", "RoleBinding")))
        await asyncio.gather(*(one(a) for a in due if a.kind == "RoleBinding"
                               and not (a.verb in ("create", "update") and self._role_taken(a))))
        await asyncio.gather(*(self._write_status(name, body) for name, body in plan.statuses.items()))
        self.errors = {ws: "; ".join(msgs)[:800] for ws, msgs in errors.items()}
        self.passes += 1
        self.last_plan = plan
        self.pass_seconds.observe(time.perf_counter() - started)
        return plan

    async def _do(self, a: wsp.Action) -> str:
        """Carry out one action; '' or what went wrong (for the workspace's status)."""
        res = KINDS[a.kind]
        client = self.kube.client
        try:
            if a.verb in ("create", "create-namespace"):
                try:
                    made = await client.create(res, a.body, a.namespace or None)
                except AlreadyExists:
                    if a.kind != "Namespace":
                        self.foreign[a.kind, a.namespace, a.name] = self.clock()
                    self.actions.labels(a.verb, a.kind, "exists").inc()
                    return ""
                self._remember(a, made)
            elif a.verb == "update":
                self._remember(a, await client.replace(res, a.name, a.body, a.namespace or None))
            elif a.verb in ("label", "unlabel"):
                self._remember(a, await client.patch(res, a.name, a.body, None, patch_type="merge"))
            elif a.verb == "delete":
                await client.delete(res, a.name, a.namespace or None, uid=a.uid or None)
                self._forget(a)
        except (NotFound, Conflict):  # gone meanwhile, or changed: the informer brings the news, the next pass decides
            self.actions.labels(a.verb, a.kind, "conflict").inc()
            if a.verb == "delete":
                self._forget(a)
            return ""
        except ApiError as exc:
            self.actions.labels(a.verb, a.kind, "error").inc()
            log.warning("workspace write failed; the next pass retries",
                        extra={"workspace": a.workspace, "action": f"{a.verb} {a.key}", "error": str(exc)[:300]})
            return f"{a.verb} {a.key}: {exc.status or ''} {exc.message or exc.reason or exc}".replace("  ", " ")
        self.actions.labels(a.verb, a.kind, "ok").inc()
        log.info("workspace object written", extra={"workspace": a.workspace, "action": f"{a.verb} {a.key}"})
        return ""

    async def _recheck_foreign(self) -> None:
        """Read again the objects of others that hold a wanted name, once ``recheck`` seconds have passed since
        each was last seen: one that is gone is forgotten, so that this pass creates the controller's own (a
        level-triggered controller must not remember an owner that no longer exists)."""
        now = self.clock()
        due = [k for k, seen in self.foreign.items() if now - seen >= self.recheck]

        async def one(key: tuple[str, str, str]) -> None:
            kind, namespace, name = key
            try:
                await self.kube.client.get(KINDS[kind], name, namespace or None)
            except NotFound:
                self.foreign.pop(key, None)
                return
            except ApiError:  # unknown: keep it as it was, read it again next time
                pass
            if key in self.foreign:
                self.foreign[key] = now
        await asyncio.gather(*(one(k) for k in due))

    def _role_taken(self, a: wsp.Action) -> bool:
        """The Role a RoleBinding action would bind to exists and is not the controller's (a create answered
        AlreadyExists this pass or earlier)."""
        role = ("Role", a.namespace, a.name)
        return role in self.foreign and role not in self.managed

    def _forget(self, a: wsp.Action) -> None:
        """The object a delete named is gone (deleted, or a 404 or a 409 said so): forget it, but only it. The
        informer may meanwhile have brought a new object of that name (re-created: another UID); forgetting that
        one would leave it unknown, never deleted, until the next relist."""
        key = (a.kind, a.namespace, a.name)
        kept = self.managed.get(key)
        if kept is not None and (not a.uid or ((kept.get("metadata") or {}).get("uid") or "") == a.uid):
            del self.managed[key]

    def _remember(self, a: wsp.Action, obj: dict[str, Any]) -> None:
        if a.kind == "Namespace":
            if resource_version(obj) >= resource_version(self.namespaces.get(a.name)):
                self.namespaces[a.name] = obj
                self._changed(True)
        else:
            self._keep((a.kind, a.namespace, a.name), obj, created=a.verb in ("create", "create-namespace"))

    async def _write_status(self, name: str, status: dict[str, Any]) -> None:
        obj = self.workspaces.get(name)
        if obj is None:
            return
        body = {**obj, "status": status}
        try:
            written = await self.kube.client.replace(WORKSPACES, name, body, subresource="status")
        except (Conflict, NotFound):
            self.actions.labels("status", "Workspace", "conflict").inc()
            return
        except ApiError as exc:
            self.actions.labels("status", "Workspace", "error").inc()
            log.warning("workspace status write failed", extra={"workspace": name, "error": str(exc)[:300]})
            return
        self.actions.labels("status", "Workspace", "ok").inc()
        keep_newer(self.workspaces, name, written)

    # ---- the loop --------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Passes while this replica leads (until ``stop``): on a change (coalesced, at most one per
        ``min_interval``), every ``resync`` seconds, and when a failed write's backoff (1 s doubling to 30 s, per
        write) ends (:func:`.passes.run_passes`)."""
        await run_passes(stop, self.poke, synced=lambda: self.synced, reconcile=self.reconcile, resync=self.resync,
                         min_interval=self.min_interval, clock=self.clock, log=log, what="workspace",
                         retry_at=lambda: min((f[1] for f in self._failed.values()), default=None))
