"""What ``kubectl accelstack cluster join`` creates and ``cluster leave`` deletes, as data, and its application.

Join runs on an admin's machine that holds both kubeconfigs; the hub never gets the member's credentials. On
the hub it makes the member's namespace ``accelstack-member-NAME`` with a ServiceAccount ``member-agent`` there,
a Role + RoleBinding there that lets that account ask for its own token (renewal), read the GPRs the hub
dispatched into that namespace and patch their status, read the Workspace carriers (ConfigMaps) there and patch
them (the member's verdict; nothing outside that namespace), create Secrets there (the answers to workspace
kubeconfig requests: it can read none back), a Role + RoleBinding ``accelstack-hub`` there for the hub's own
ServiceAccount: every write the hub makes in a member's namespace (create and delete the dispatched GPRs; create,
patch and delete the Workspace carriers and kubeconfig requests; get and delete those Secrets), so the hub's
ClusterRole only reads and writes statuses, never objects outside the member namespaces, a ClusterRole +
ClusterRoleBinding granting get/update/patch on ``clusters`` and ``clusters/status`` with ``resourceNames:
[NAME]`` only (OCM's klusterlet identity is scoped the same way), the ``Cluster`` itself (with the member's API
server URL and CA in ``spec.apiServer``, for workspace kubeconfigs: never a credential), and a token for the
ServiceAccount (TokenRequest, with an expiry). On the member it makes the Secret ``accelstack-hub-kubeconfig``
(a kubeconfig for the hub with that token, and the cluster's name) and the agent: its ServiceAccount, a
ClusterRole that reads nodes, acceleratornodes and gprs, may create and delete gprs (the hub's, in their
namespaces), read, create, update and delete workspaces (the hub's), impersonate the ServiceAccount
``accelstack-workload`` of any namespace (a hub GPR's workload is created as that account), create tokens for
the workspace kubeconfig ServiceAccounts (``accelstack-workspace-admin|member|viewer``, by ``resourceNames``)
and nothing else, a
Role that may update that one Secret (where the agent stores a renewed token), and its Deployment — the same objects as ``manifests/member/``
(a test keeps the two equal).

Every object carries ``app.kubernetes.io/managed-by: accelstack-cluster-join``: join refuses to take over an
object of the same name it did not make, and leave deletes only objects that carry it.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kubeapi import AlreadyExists, ApiError, KubeClient, NotFound
from kubeapi.resources import (
    DEPLOYMENTS,
    NAMESPACES,
    ROLE_BINDINGS,
    ROLES,
    SECRETS,
    SERVICE_ACCOUNTS,
    Resource,
)
from scheduler_extender.multicluster.agent import AGENT_SERVICE_ACCOUNT, HUB_SECRET
from scheduler_extender.multicluster.clusters import (
    CLUSTERS,
    check_name,
    cluster_object,
    member_namespace,
    micro_time,
)
from scheduler_extender.multicluster.kubeconfig import ACCOUNT_NAMES
from scheduler_extender.multicluster.workload import RUNNER as WORKLOAD_RUNNER

MANAGED_BY = {"app.kubernetes.io/managed-by": "accelstack-cluster-join"}
MEMBER_LABEL = "accelstack.io/member-cluster"
SYSTEM_NS = "accelstack-system"
AGENT = "accelstack-member-agent"
IMAGE = "ghcr.io/accelstack/accelstack:0.1.0"
CLUSTER_ROLES = Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False)
CLUSTER_ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding",
                                 namespaced=False)
TOKEN_MIN_S = 600  # the API server's floor for TokenRequest.spec.expirationSeconds
HUB_ACCOUNT = ("accelstack-system", "accelstack-hub")  # the hub controller's ServiceAccount (manifests/hub)
HUB_ROLE = "accelstack-hub"  # its Role in each member namespace: every write the hub makes there


class JoinError(RuntimeError):
    """One line for the admin: what went wrong and where."""


@dataclass(frozen=True)
class Item:
    side: str  # "hub" or "member"
    resource: Resource
    name: str
    namespace: str | None
    body: dict[str, Any] | None  # None: the hub token (issued by TokenRequest, never stored on the hub)

    def line(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.side}: {self.resource.kind} {self.name}{where}"


def _meta(name: str, namespace: str | None = None, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {**MANAGED_BY, **(labels or {})}}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _rbac(kind: str, name: str, namespace: str | None, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": _meta(name, namespace),
            "rules": rules}


def _binding(kind: str, name: str, namespace: str | None, role_kind: str, role: str, sa: str,
             sa_namespace: str) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": _meta(name, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_namespace}]}


def api_server_spec(url: str, ca_pem: bytes | None) -> dict[str, str]:
    """``Cluster.spec.apiServer``: the member's API server as its workspace kubeconfigs reach it."""
    return {"url": url, **({"caBundle": base64.b64encode(ca_pem).decode()} if ca_pem else {})}


def hub_items(name: str, labels: Mapping[str, str], api_server: Mapping[str, str] | None = None) -> list[Item]:
    """The hub's objects for member ``name``, in creation order (the token last); ``api_server``: the member's
    URL and CA (:func:`api_server_spec`) recorded in the Cluster."""
    check_name(name)
    ns = member_namespace(name)
    role = f"accelstack-member-{name}"
    return [
        Item("hub", NAMESPACES, ns, None, {"apiVersion": "v1", "kind": "Namespace",
                                           "metadata": _meta(ns, labels={MEMBER_LABEL: name})}),
        Item("hub", SERVICE_ACCOUNTS, AGENT_SERVICE_ACCOUNT, ns, {
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(AGENT_SERVICE_ACCOUNT, ns)}),
        Item("hub", ROLES, AGENT, ns, _rbac("Role", AGENT, ns, [
            {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"],
             "resourceNames": [AGENT_SERVICE_ACCOUNT]},
            # the GPRs the hub dispatched to this member (read), and their status (the member's verdict)
            {"apiGroups": [CLUSTERS.group], "resources": ["gpuprovisioningrequests"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": [CLUSTERS.group], "resources": ["gpuprovisioningrequests/status"],
             "verbs": ["patch"]},
            # the Workspaces the hub carried to this member (ConfigMaps): read, and patch (the member's verdict)
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "patch"]},
            # the answers to workspace kubeconfig requests (a token each): created, never read back
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}])),
        Item("hub", ROLE_BINDINGS, AGENT, ns, _binding("RoleBinding", AGENT, ns, "Role", AGENT,
                                                       AGENT_SERVICE_ACCOUNT, ns)),
        # the hub's writes, here only (its ClusterRole reads; it writes nothing outside the member namespaces):
        # the dispatches (GPRs), the Workspace carriers and kubeconfig requests (ConfigMaps), and the answers to
        # those requests, read once and deleted (and nothing else of Secrets, here or anywhere)
        Item("hub", ROLES, HUB_ROLE, ns, _rbac("Role", HUB_ROLE, ns, [
            {"apiGroups": [CLUSTERS.group], "resources": ["gpuprovisioningrequests"], "verbs": ["create", "delete"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "patch", "delete"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "delete"]}])),
        Item("hub", ROLE_BINDINGS, HUB_ROLE, ns, _binding("RoleBinding", HUB_ROLE, ns, "Role",
                                                          HUB_ROLE, HUB_ACCOUNT[1], HUB_ACCOUNT[0])),
        Item("hub", CLUSTER_ROLES, role, None, _rbac("ClusterRole", role, None, [
            {"apiGroups": [CLUSTERS.group], "resources": ["clusters", "clusters/status"],
             "verbs": ["get", "update", "patch"], "resourceNames": [name]}])),
        Item("hub", CLUSTER_ROLE_BINDINGS, role, None, _binding("ClusterRoleBinding", role, None, "ClusterRole",
                                                                role, AGENT_SERVICE_ACCOUNT, ns)),
        Item("hub", CLUSTERS, name, None, _cluster(name, labels, api_server)),
        Item("hub", SERVICE_ACCOUNTS, f"{AGENT_SERVICE_ACCOUNT}/token", ns, None),
    ]


def _cluster(name: str, labels: Mapping[str, str], api_server: Mapping[str, str] | None) -> dict[str, Any]:
    body = {**cluster_object(name, labels), "metadata": _meta(name)}
    if api_server:
        body["spec"] = {**body["spec"], "apiServer": dict(api_server)}
    return body


def member_objects() -> list[dict[str, Any]]:
    """The agent's objects on a member, the same for every member (``manifests/member/`` holds them): the name of
    the member and the hub's address come from the Secret join writes."""
    ns = SYSTEM_NS
    labels = {"app.kubernetes.io/name": AGENT, "app.kubernetes.io/part-of": "accelstack"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(AGENT, ns, labels),
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": AGENT}},
                 "strategy": {"type": "Recreate"},
                 "template": {
                     "metadata": {"labels": labels},
                     "spec": {
                         "serviceAccountName": AGENT,
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                             "seccompProfile": {"type": "RuntimeDefault"}},
                         "containers": [{
                             "name": "agent", "image": IMAGE, "command": [AGENT], "args": ["--listen=:8082"],
                             "env": [
                                 {"name": "ACCELSTACK_AGENT_CLUSTER",
                                  "valueFrom": {"secretKeyRef": {"name": HUB_SECRET, "key": "cluster"}}},
                                 {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
                             "ports": [{"name": "http", "containerPort": 8082, "protocol": "TCP"}],
                             "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
                             "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 20},
                             "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                           "limits": {"memory": "512Mi"}},
                             "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                 "capabilities": {"drop": ["ALL"]}},
                             "volumeMounts": [{"name": "hub", "mountPath": "/etc/accelstack/hub", "readOnly": True}]}],
                         "volumes": [{"name": "hub", "secret": {"secretName": HUB_SECRET,
                                                                "items": [{"key": "kubeconfig",
                                                                           "path": "kubeconfig"}]}}]}}}}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(AGENT, ns)},
        _rbac("ClusterRole", AGENT, None, [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [CLUSTERS.group], "resources": ["acceleratornodes", "gpuprovisioningrequests"],
             "verbs": ["get", "list", "watch"]},
            # the GPRs the hub sent: created in their namespace, deleted with their dispatch (never a status)
            {"apiGroups": [CLUSTERS.group], "resources": ["gpuprovisioningrequests"], "verbs": ["create", "delete"]},
            # the hub's Workspaces: created, updated, deleted only when it made them (label and origin annotation)
            {"apiGroups": [CLUSTERS.group], "resources": ["workspaces"],
             "verbs": ["get", "list", "watch", "create", "update", "delete"]},
            # a hub GPR's workload: created as the workload account of the GPR's namespace, never as the agent
            # (it may create none of those kinds itself: the member's RBAC for that account decides)
            {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["impersonate"],
             "resourceNames": [WORKLOAD_RUNNER]},
            # workspace kubeconfigs: a token for the role's ServiceAccount the workspace controller made, no other
            {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"],
             "resourceNames": list(ACCOUNT_NAMES)}]),
        _binding("ClusterRoleBinding", AGENT, None, "ClusterRole", AGENT, AGENT, ns),
        _rbac("Role", AGENT, ns, [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "update"],
                                   "resourceNames": [HUB_SECRET]}]),
        _binding("RoleBinding", AGENT, ns, "Role", AGENT, AGENT, ns),
        deployment,
    ]


_MEMBER_RESOURCES = {"ServiceAccount": SERVICE_ACCOUNTS, "ClusterRole": CLUSTER_ROLES,
                     "ClusterRoleBinding": CLUSTER_ROLE_BINDINGS, "Role": ROLES, "RoleBinding": ROLE_BINDINGS,
                     "Deployment": DEPLOYMENTS}


def member_items() -> list[Item]:
    """The member's objects in creation order: the Secret first (the Deployment mounts it)."""
    items = [Item("member", SECRETS, HUB_SECRET, SYSTEM_NS, None)]
    for obj in member_objects():
        meta = obj["metadata"]
        items.append(Item("member", _MEMBER_RESOURCES[obj["kind"]], meta["name"], meta.get("namespace"), obj))
    return items


def hub_kubeconfig(server: str, ca_pem: bytes | None, token: str, cluster: str, insecure: bool = False) -> str:
    """The kubeconfig the member's agent uses for the hub: the server, its CA and the ServiceAccount token."""
    entry: dict[str, Any] = {"server": server}
    if ca_pem:
        entry["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    if insecure:
        entry["insecure-skip-tls-verify"] = True
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [{"name": "hub", "cluster": entry}],
        "users": [{"name": f"accelstack-member-{cluster}", "user": {"token": token}}],
        "contexts": [{"name": "hub", "context": {"cluster": "hub", "user": f"accelstack-member-{cluster}"}}],
        "current-context": "hub"}, sort_keys=False)


def secret_body(cluster: str, kubeconfig: str, expiry: float) -> dict[str, Any]:
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _meta(HUB_SECRET, SYSTEM_NS),
            "data": {"kubeconfig": b64(kubeconfig), "cluster": b64(cluster), "expiry": b64(micro_time(expiry))}}


# ---- application ----------------------------------------------------------------------------------------------
Say = Callable[[str], None]


def _ours(obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in MANAGED_BY.items())


def _contains(current: Any, want: Any) -> bool:
    """``want`` holds in ``current``: the API server adds defaults (a Deployment's template gets a dozen) but
    never drops what was sent, so what join sends is compared as a part of what is stored."""
    if isinstance(want, Mapping):
        return isinstance(current, Mapping) and all(_contains(current.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(current, list) and len(current) == len(want) and all(
            _contains(c, w) for c, w in zip(current, want, strict=True))
    return bool(current == want)


def _same(current: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    body = {k: v for k, v in want.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    labels = (want.get("metadata") or {}).get("labels") or {}
    return _contains(current, body) and _contains((current.get("metadata") or {}).get("labels") or {}, labels)


async def ensure(client: KubeClient, item: Item, body: dict[str, Any]) -> str:
    """Create ``body``, or bring an object join made before in line with it: created, updated or unchanged.
    An object of that name that join did not make is left alone and is an error."""
    try:
        await client.create(item.resource, body, item.namespace)
        return "created"
    except AlreadyExists:
        pass
    current = await client.get(item.resource, item.name, item.namespace)
    if not _ours(current):
        raise JoinError(f"{item.line()} exists and was not made by cluster join (no label "
                        "app.kubernetes.io/managed-by=accelstack-cluster-join): not taking it over")
    if _same(current, body):
        return "unchanged"
    updated = copy.deepcopy(body)
    updated["metadata"] = {**current["metadata"], "labels": {**(current["metadata"].get("labels") or {}),
                                                             **body["metadata"]["labels"]}}
    if item.resource is CLUSTERS:  # the status is the agent's and the hub's
        updated.pop("status", None)
    await client.replace(item.resource, item.name, updated, item.namespace)
    return "updated"


async def issue_token(hub: KubeClient, name: str, seconds: int) -> tuple[str, float]:
    """A token for the member's ServiceAccount on the hub: (token, expiry as epoch seconds)."""
    from scheduler_extender.objects.gpr_codec import parse_time

    answer = await hub.create(SERVICE_ACCOUNTS, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                                 "spec": {"expirationSeconds": seconds}},
                              member_namespace(name), subresource="token", name=AGENT_SERVICE_ACCOUNT)
    status = answer.get("status") or {}
    expiry = parse_time(status.get("expirationTimestamp"))
    if not status.get("token") or expiry is None:
        raise JoinError("hub: the TokenRequest answered no token")
    return str(status["token"]), expiry


async def join(hub: KubeClient, member: KubeClient, name: str, labels: Mapping[str, str], *, hub_server: str,
               ca_pem: bytes | None, insecure: bool, token_seconds: int, say: Say,
               member_server: str = "", member_ca: bytes | None = None) -> None:
    """Create (or bring in line) every object of :func:`hub_items` and :func:`member_items`, saying each.
    ``member_server``/``member_ca``: the member's API server as workspace kubeconfigs reach it (default: the
    server of the member client and no CA)."""
    await reach(hub, "hub")
    await reach(member, "member")
    try:
        await member.get(NAMESPACES, SYSTEM_NS)
    except NotFound:
        raise JoinError(f"member: no namespace {SYSTEM_NS}: install accelstack on the member first "
                        "(kubectl apply -k manifests/base)") from None
    token, expiry = "", 0.0
    for item in hub_items(name, labels, api_server_spec(member_server or member.host, member_ca)):
        if item.body is None:
            token, expiry = await issue_token(hub, name, token_seconds)
            say(f"{item.line()}: issued, expires {micro_time(expiry).split('.')[0]}Z")
        else:
            say(f"{item.line()}: {await ensure(hub, item, item.body)}")
    for item in member_items():
        body = item.body or secret_body(name, hub_kubeconfig(hub_server, ca_pem, token, name, insecure), expiry)
        say(f"{item.line()}: {await ensure(member, item, body)}")


async def reach(client: KubeClient, side: str) -> None:
    """One cheap call first, so that an unreachable or refusing API server is one line naming the side."""
    try:
        await client.request("GET", "/version", resource="version")
    except ApiError as exc:
        what = "cannot reach" if exc.status == 0 else "refused by"
        raise JoinError(f"{side}: {what} the API server {client.host}: {exc}"[:400]) from None


async def leave(hub: KubeClient, member: KubeClient, name: str, *, say: Say) -> None:
    """Delete, in reverse order, each object join makes that carries join's label; say what happened to each."""
    await reach(hub, "hub")
    await reach(member, "member")
    for item in [*reversed(member_items()), *reversed(hub_items(name, {}))]:
        if item.body is None and item.side == "hub":
            continue  # the token dies with its ServiceAccount
        client = hub if item.side == "hub" else member
        try:
            current = await client.get(item.resource, item.name, item.namespace)
        except NotFound:
            say(f"{item.line()}: absent")
            continue
        if not _ours(current):
            say(f"{item.line()}: not made by cluster join, left")
            continue
        if (current.get("metadata") or {}).get("deletionTimestamp"):
            say(f"{item.line()}: being deleted")  # a namespace until its contents are gone
            continue
        try:
            await client.delete(item.resource, item.name, item.namespace,
                                uid=(current.get("metadata") or {}).get("uid"))
        except NotFound:
            say(f"{item.line()}: absent")
            continue
        say(f"{item.line()}: deleted")


def plan_lines(name: str, labels: Mapping[str, str]) -> list[str]:
    """What join would create, one line each (``--dry-run``)."""
    return [item.line() for item in [*hub_items(name, labels), *member_items()]]


__all__ = ["ApiError", "Item", "JoinError", "hub_items", "join", "leave", "member_items", "member_objects",
           "plan_lines"]
