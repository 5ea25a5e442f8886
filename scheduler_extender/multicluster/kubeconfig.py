"""Workspace kubeconfigs (issue 40.2, last part): a user listed in a hub Workspace's ``spec.access`` gets a
kubeconfig for one member cluster of that workspace, with a short-lived token that the member made, for the
member only. The hub never holds a member credential at rest and never calls a member.

The way it goes (docs/multicluster.md, "Workspace kubeconfigs"):

1. The user asks the hub's REST API (``POST /api/v1/workspaces/{ws}/kubeconfig?cluster=NAME&expiry=1h``, the
   route is :mod:`scheduler_extender.api.kubeconfig`). After the TokenReview, :class:`KubeconfigIssuer` reads the
   hub Workspace: the caller (or one of its groups, or the ServiceAccount it is) must be in ``spec.access``; the
   highest role listed for it decides which ServiceAccount's token it gets (:func:`account_name`).
2. The issuer writes a request ConfigMap into the member's hub namespace ``accelstack-member-NAME`` (label
   :data:`REQUEST_LABEL`; data: workspace, role, namespace, expirySeconds, requester (for the member's audit
   log), a random id as its name).
3. The member's agent (:class:`KubeconfigMinter`: it may read ConfigMaps of its hub namespace, create Secrets there
   and read none) checks that the member has that workspace (its own copy, from the hub) and that it is Ready, asks
   its member for a token of the role's ServiceAccount (TokenRequest, the expiry asked: 10 min to 24 h) and
   creates a Secret of the request's name in its hub namespace holding it (owned by the request, so the hub's
   garbage collector removes it with the request). What it cannot serve it says in one line in the ConfigMap's
   ``refusal`` key (``NotFound: ...``, ``NotReady: ...``, ``Refused: ...``).
4. The issuer polls for the Secret (or the refusal) for at most ``wait`` seconds, builds the kubeconfig from the
   member's ``Cluster.spec.apiServer`` (url and CA, recorded by ``cluster join``), the token and the workspace's
   first namespace, deletes the Secret and the ConfigMap, and answers. The token is in that answer only: never in
   a log, never kept.

The ServiceAccounts: the member's workspace controller makes them, as for any ServiceAccount access rule. The
agent adds to each member copy of a hub workspace one rule per role that ``spec.access`` uses
(:func:`with_accounts`): ``{kind: ServiceAccount, name: accelstack-workspace-<role>, namespace: <first
namespace>, role}``, so the account lives in the first namespace and is bound to that role in every namespace of
the workspace. Those three names are all the agent may mint tokens for (RBAC ``resourceNames`` on
``serviceaccounts/token`` in the member ClusterRole), so it can mint none for ``default`` or any ``kube-system``
account.

Stale requests: each call of the issuer first deletes, in that member's hub namespace, requests (and their
Secrets) older than :data:`STALE_S` (a call that died half-way leaves them; nothing else makes them).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from kubeapi import AlreadyExists, ApiError, KubeClient, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import run_passes
from kubeapi.resources import CONFIGMAPS, SECRETS, SERVICE_ACCOUNTS, WORKSPACES
from scheduler_extender.multicluster.clusters import member_namespace, ready_of
from scheduler_extender.objects.gpr_codec import parse_time

log = logging.getLogger("accelstack.hub")
agent_log = logging.getLogger("accelstack.member_agent")

REQUEST_LABEL = "accelstack.io/kubeconfig-request"  # on a request ConfigMap (hub) and the agent's Secret
ACCOUNT_PREFIX = "accelstack-workspace-"
ROLES = ("viewer", "member", "admin")  # lowest first: the highest listed for a caller wins
ACCOUNT_NAMES = tuple(f"{ACCOUNT_PREFIX}{r}" for r in ("admin", "member", "viewer"))
EXPIRY_MIN_S, EXPIRY_MAX_S, EXPIRY_DEFAULT_S = 600, 86_400, 3_600  # TokenRequest's floor is 10 min
STALE_S = 60.0
WAIT_S = 10.0
TOKEN_KEY = "token"


class KubeconfigError(Exception):
    """A refusal with its HTTP status and one line (never a token)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# ---- pure parts -------------------------------------------------------------------------------------------------
def account_name(role: str) -> str:
    """The member ServiceAccount whose token a caller of ``role`` gets."""
    return f"{ACCOUNT_PREFIX}{role}"


_EXPIRY = re.compile(r"^(\d{1,6})([smh]?)$")


def parse_expiry(text: str | None) -> int:
    """``expiry`` as seconds: ``600``, ``90s``, ``30m``, ``1h``, ``24h``; empty: 1 h. Outside 10 min..24 h, or
    not such a number: ValueError with one line."""
    if not text:
        return EXPIRY_DEFAULT_S
    m = _EXPIRY.match(text.strip())
    if not m:
        raise ValueError(f"expiry: want a duration like 10m, 1h or 24h, got {text[:40]!r}")
    seconds = int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if not EXPIRY_MIN_S <= seconds <= EXPIRY_MAX_S:
        raise ValueError(f"expiry: between 10m and 24h, got {text[:40]!r}")
    return seconds


def _namespaces(spec: Mapping[str, Any]) -> list[str]:
    raw = spec.get("namespaces")
    return list(dict.fromkeys(n for n in raw if isinstance(n, str) and n)) if isinstance(raw, list) else []


def role_for(workspace: Mapping[str, Any], user: str, groups: Sequence[str]) -> str | None:
    """The highest role ``spec.access`` gives ``user`` (directly, through one of ``groups``, or as the hub
    ServiceAccount it is: a rule without a namespace matches the account in any of the workspace's namespaces);
    None when it is not listed."""
    spec = workspace.get("spec") or {}
    namespaces = _namespaces(spec)
    best = -1
    for rule in spec.get("access") or ():
        if not isinstance(rule, Mapping) or rule.get("role") not in ROLES:
            continue
        kind, name = rule.get("kind"), rule.get("name")
        if kind == "User":
            hit = name == user
        elif kind == "Group":
            hit = name in groups
        elif kind == "ServiceAccount":
            where = [rule["namespace"]] if rule.get("namespace") else namespaces
            hit = user in {f"system:serviceaccount:{ns}:{name}" for ns in where}
        else:
            hit = False
        if hit:
            best = max(best, ROLES.index(rule["role"]))
    return ROLES[best] if best >= 0 else None


def with_accounts(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A member copy's spec with the kubeconfig ServiceAccounts: per role ``spec.access`` uses, a ServiceAccount
    rule ``accelstack-workspace-<role>`` in the first namespace (bound there and in every other namespace of the
    workspace). Rules already there (a spec given twice) are not added again; no namespaces, no accounts."""
    out = dict(spec)
    namespaces = _namespaces(spec)
    access = [r for r in spec.get("access") or () if isinstance(r, Mapping)]
    if not namespaces or not access:
        return out
    roles = [r for r in ROLES if any(a.get("role") == r for a in access)]
    extra = [{"kind": "ServiceAccount", "name": account_name(r), "namespace": namespaces[0], "role": r}
             for r in reversed(roles)]
    out["access"] = [*access, *(e for e in extra if e not in access)]
    return out


def request_object(cluster: str, workspace: str, role: str, namespace: str, expiry: int, requester: str,
                   request_id: str) -> dict[str, Any]:
    """The request ConfigMap the hub writes into the member's hub namespace (no credential in it)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": request_id, "namespace": member_namespace(cluster),
                         "labels": {REQUEST_LABEL: "true", "app.kubernetes.io/managed-by": "accelstack-hub"}},
            "data": {"workspace": workspace, "role": role, "namespace": namespace, "expirySeconds": str(expiry),
                     "requester": requester[:253]}}


@dataclass(frozen=True)
class Request:
    name: str
    uid: str
    workspace: str
    role: str
    namespace: str
    expiry: int
    requester: str


def parse_request(cm: Mapping[str, Any]) -> Request | str:
    """A request ConfigMap as the agent reads it, or why it cannot be served (one line)."""
    meta, data = cm.get("metadata") or {}, cm.get("data") or {}
    role = str(data.get("role") or "")
    if role not in ROLES:
        return f"Refused: role {role[:20]!r} is not admin, member or viewer"
    try:
        expiry = parse_expiry(str(data.get("expirySeconds") or ""))
    except ValueError as exc:
        return f"Refused: {exc}"
    if not data.get("workspace") or not data.get("namespace"):
        return "Refused: the request names no workspace or namespace"
    return Request(str(meta.get("name") or ""), str(meta.get("uid") or ""), str(data["workspace"]), role,
                   str(data["namespace"]), expiry, str(data.get("requester") or ""))


def member_check(workspace: Mapping[str, Any] | None, request: Request) -> str:
    """Why the member cannot serve ``request`` with its copy of the workspace (``workspace``: the member's
    Workspace of that name, None when it has none); "" when it can."""
    from scheduler_extender.multicluster.placement import FROM_HUB

    if workspace is None:
        return f"NotFound: this member has no workspace {request.workspace}"
    if ((workspace.get("metadata") or {}).get("labels") or {}).get(FROM_HUB) != "true":
        return f"NotFound: workspace {request.workspace} on this member was not sent by the hub"
    spec = workspace.get("spec") or {}
    namespaces = _namespaces(spec)
    if not namespaces or namespaces[0] != request.namespace:
        return f"NotFound: workspace {request.workspace} has no namespace {request.namespace} first on this member"
    want = {"kind": "ServiceAccount", "name": account_name(request.role), "namespace": request.namespace,
            "role": request.role}
    if want not in (spec.get("access") or []):
        return f"NotFound: workspace {request.workspace} has no {request.role} ServiceAccount on this member yet"
    status = workspace.get("status") or {}
    ready = next((c for c in status.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == "Ready"),
                 None)
    if ready is None or ready.get("status") != "True":
        why = str((ready or {}).get("message") or "not reconciled yet")[:200]
        return f"NotReady: workspace {request.workspace} is not Ready on this member: {why}"
    ns_ready = {str(n.get("name")) for n in status.get("namespaces") or () if isinstance(n, Mapping) and n.get("ready")}
    if request.namespace not in ns_ready:
        return f"NotReady: namespace {request.namespace} of workspace {request.workspace} is not ready on this member"
    return ""


def refusal_status(refusal: str) -> int:
    """The HTTP status of an agent's refusal: NotFound 404, the rest (NotReady, Refused, a failed TokenRequest) 409."""
    return 404 if refusal.startswith("NotFound:") else 409


def api_server(cluster: Mapping[str, Any]) -> tuple[str, str]:
    """(url, caBundle as base64 PEM, "" when none) join recorded in ``Cluster.spec.apiServer``."""
    entry = (cluster.get("spec") or {}).get("apiServer")
    if not isinstance(entry, Mapping) or not isinstance(entry.get("url"), str) or not entry["url"]:
        return "", ""
    return entry["url"], str(entry.get("caBundle") or "")


def kubeconfig_text(cluster: str, workspace: str, server: str, ca_bundle: str, token: str, namespace: str,
                    account: str) -> str:
    """A kubeconfig for one member: its API server and CA (from the hub's Cluster), the token, the namespace."""
    entry: dict[str, Any] = {"server": server}
    if ca_bundle:
        entry["certificate-authority-data"] = ca_bundle
    user = f"{workspace}-{account}@{cluster}"
    context = f"{workspace}@{cluster}"
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [{"name": cluster, "cluster": entry}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": cluster, "user": user, "namespace": namespace}}],
        "current-context": context}, sort_keys=False)


def stale(obj: Mapping[str, Any], now: float, after: float = STALE_S) -> bool:
    made = parse_time((obj.get("metadata") or {}).get("creationTimestamp"))
    return made is not None and now - made > after


# ---- the hub ----------------------------------------------------------------------------------------------------
Clusters = Callable[[], Mapping[str, Mapping[str, Any]]]


class KubeconfigIssuer:
    """The hub's half: authorises by the hub Workspace's ``spec.access``, asks the member's agent through a
    request ConfigMap, waits for its Secret, answers the kubeconfig and deletes both."""

    def __init__(self, client: KubeClient, clusters: Clusters, *, wait: float = WAIT_S, poll: float = 0.2,
                 clock: Callable[[], float] = time.time) -> None:
        self.client, self.clusters, self.wait, self.poll, self.clock = client, clusters, wait, poll, clock

    async def issue(self, workspace: str, cluster: str, user: str, groups: Sequence[str], expiry: int
                    ) -> dict[str, Any]:
        """The kubeconfig and what it is for; :class:`KubeconfigError` (status, one line) otherwise."""
        from scheduler_extender.multicluster.workspaces import clusters_of

        try:
            ws = await self.client.get(WORKSPACES, workspace)
        except NotFound:
            ws = None
        role = role_for(ws, user, groups) if ws is not None else None
        if ws is None or role is None:  # the same answer: a name nobody lets the caller into is not confirmed
            raise KubeconfigError(403, f"{user} is not in the access rules of workspace {workspace}")
        joined = self.clusters()
        if cluster not in clusters_of(ws, joined):
            raise KubeconfigError(404, f"workspace {workspace} is not on cluster {cluster}")
        member = joined.get(cluster)
        if member is None:
            raise KubeconfigError(404, f"no member cluster {cluster!r} has joined the hub")
        if ready_of(member.get("status") or {}) is False:
            raise KubeconfigError(409, f"cluster {cluster} is not Ready: its agent cannot answer now")
        server, ca = api_server(member)
        if not server:
            raise KubeconfigError(409, f"cluster {cluster} has no spec.apiServer (run cluster join again)")
        namespaces = _namespaces(ws.get("spec") or {})
        if not namespaces:
            raise KubeconfigError(409, f"workspace {workspace} has no namespaces")
        ns = member_namespace(cluster)
        await self.sweep(ns)
        request_id = f"kubeconfig-{secrets.token_hex(8)}"
        await self.client.create(CONFIGMAPS, request_object(cluster, workspace, role, namespaces[0], expiry, user,
                                                            request_id), ns)
        log.info("workspace kubeconfig asked of a member", extra={
            "workspace": workspace, "cluster": cluster, "role": role, "user": user, "request": request_id,
            "expiry_s": expiry})
        try:
            token = await self._answer(ns, request_id, cluster)
        finally:
            await self._delete(ns, request_id)
        account = account_name(role)
        log.info("workspace kubeconfig issued", extra={"workspace": workspace, "cluster": cluster, "role": role,
                                                       "user": user, "request": request_id})
        return {"workspace": workspace, "cluster": cluster, "namespace": namespaces[0], "role": role,
                "serviceAccount": account, "expirySeconds": expiry,
                "kubeconfig": kubeconfig_text(cluster, workspace, server, ca, token, namespaces[0], account)}

    async def _answer(self, ns: str, request_id: str, cluster: str) -> str:
        deadline = self.clock() + self.wait
        while True:
            try:
                secret = await self.client.get(SECRETS, request_id, ns)
                raw = (secret.get("data") or {}).get(TOKEN_KEY) or ""
                token = base64.b64decode(raw).decode() if raw else ""
                if token:
                    return token
            except NotFound:
                pass
            try:
                cm = await self.client.get(CONFIGMAPS, request_id, ns)
            except NotFound:
                raise KubeconfigError(409, "the request was deleted before the member answered") from None
            refusal = str((cm.get("data") or {}).get("refusal") or "")
            if refusal:
                raise KubeconfigError(refusal_status(refusal), f"cluster {cluster}: {refusal[:300]}")
            if self.clock() >= deadline:
                raise KubeconfigError(504, f"cluster {cluster}'s agent did not answer within {self.wait:g}s")
            await asyncio.sleep(self.poll)

    async def _delete(self, ns: str, name: str) -> None:
        for res in (SECRETS, CONFIGMAPS):  # the Secret first: a request left alone is swept with its Secret
            try:
                await self.client.delete(res, name, ns)
            except NotFound:
                pass
            except ApiError as exc:
                log.warning("cannot delete a kubeconfig request; the next request sweeps it",
                            extra={"object": f"{res.kind} {ns}/{name}", "error": str(exc)[:200]})

    async def sweep(self, ns: str) -> int:
        """Delete requests (and their Secrets) older than :data:`STALE_S` in one member's hub namespace."""
        try:
            items, _ = await self.client.list(CONFIGMAPS, ns, label_selector=REQUEST_LABEL)
        except ApiError as exc:
            log.warning("cannot list kubeconfig requests to sweep", extra={"namespace": ns, "error": str(exc)[:200]})
            return 0
        now, swept = self.clock(), 0
        for cm in items:
            if stale(cm, now):
                await self._delete(ns, str((cm.get("metadata") or {}).get("name") or ""))
                swept += 1
        return swept


# ---- the member's agent -------------------------------------------------------------------------------------------
class KubeconfigMinter:
    """The agent's half: a token of the role's ServiceAccount on its member for each request in its hub
    namespace, as a Secret of the request's name there (it may create Secrets there, and read none)."""

    def __init__(self, member: KubeClient, hub: KubeClient, hub_namespace: str, *, resync: float = 30.0) -> None:
        self.member, self.hub, self.hub_namespace, self.resync = member, hub, hub_namespace, resync
        self.requests: dict[str, dict[str, Any]] = {}
        self.done: set[str] = set()  # request UIDs answered (a Secret made or a refusal written)
        self.changed = asyncio.Event()
        self.minted = 0
        self.informer = Informer(hub, CONFIGMAPS, self._on_request, self._sync, name="hub-kubeconfig-requests",
                                 namespace=hub_namespace, label_selector=REQUEST_LABEL)
        self.informers = [self.informer]

    def _on_request(self, kind: str, obj: dict[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        if kind == "DELETED":
            self.requests.pop(name, None)
            self.done.discard(str((obj.get("metadata") or {}).get("uid") or ""))
        else:
            self.requests[name] = obj
        self.changed.set()

    def _sync(self, items: Sequence[dict[str, Any]]) -> None:
        self.requests = {str((o.get("metadata") or {}).get("name") or ""): o for o in items}
        uids = {str((o.get("metadata") or {}).get("uid") or "") for o in items}
        self.done &= uids
        self.changed.set()

    async def pass_once(self) -> None:
        for cm in list(self.requests.values()):
            meta = cm.get("metadata") or {}
            if str(meta.get("uid") or "") in self.done or (cm.get("data") or {}).get("refusal"):
                continue
            try:
                await self.serve(cm)
            except ApiError as exc:
                agent_log.warning("cannot answer a workspace kubeconfig request; retrying at the next pass",
                                  extra={"request": meta.get("name"), "error": str(exc)[:200]})

    async def serve(self, cm: Mapping[str, Any]) -> None:
        request = parse_request(cm)
        if isinstance(request, str):
            await self._refuse(cm, request)
            return
        try:
            workspace: dict[str, Any] | None = await self.member.get(WORKSPACES, request.workspace)
        except NotFound:
            workspace = None
        why = member_check(workspace, request)
        if why:
            await self._refuse(cm, why)
            return
        account = account_name(request.role)
        if not await self._still_asked(request):  # the hub gave up (504) or swept it: mint nothing for it
            self.done.add(request.uid)
            return
        try:
            answer = await self.member.create(SERVICE_ACCOUNTS, {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": request.expiry}}, request.namespace, subresource="token", name=account)
        except NotFound:
            await self._refuse(cm, f"NotFound: no ServiceAccount {account} in {request.namespace} on this member yet")
            return
        except ApiError as exc:
            await self._refuse(cm, f"Refused: the member refused the token: {str(exc).splitlines()[0][:200]}")
            return
        token = str((answer.get("status") or {}).get("token") or "")
        if not token:
            await self._refuse(cm, "Refused: the member's TokenRequest answered no token")
            return
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": request.name, "labels": {REQUEST_LABEL: "true"},
                               "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": request.name,
                                                    "uid": request.uid}]},
                  "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()}}
        try:
            await self.hub.create(SECRETS, secret, self.hub_namespace)
        except AlreadyExists:
            pass  # answered before a restart
        self.done.add(request.uid)
        self.minted += 1
        agent_log.info("workspace kubeconfig token made", extra={
            "request": request.name, "workspace": request.workspace, "namespace": request.namespace,
            "service_account": account, "requester": request.requester, "expiry_s": request.expiry})

    async def _still_asked(self, request: Request) -> bool:
        """The request is still on the hub (read now, not from the informer): a token is minted only for a request
        the hub still waits for. A Secret made in the moment between is owned by the deleted request, so the
        hub's garbage collector removes it; its token expires anyway."""
        try:
            cm = await self.hub.get(CONFIGMAPS, request.name, self.hub_namespace)
        except NotFound:
            return False
        return str((cm.get("metadata") or {}).get("uid") or "") == request.uid

    async def _refuse(self, cm: Mapping[str, Any], why: str) -> None:
        meta = cm.get("metadata") or {}
        await self.hub.patch(CONFIGMAPS, str(meta.get("name") or ""), {"data": {"refusal": why[:400]}},
                             self.hub_namespace)
        self.done.add(str(meta.get("uid") or ""))
        agent_log.info("workspace kubeconfig request refused", extra={
            "request": meta.get("name"), "requester": (cm.get("data") or {}).get("requester"), "reason": why})

    async def run(self, stop: asyncio.Event) -> None:
        await run_passes(stop, self.changed, synced=lambda: self.informer.synced.is_set(),
                         reconcile=self.pass_once, resync=self.resync, min_interval=0.0, clock=time.time,
                         log=agent_log, what="kubeconfig minter")
