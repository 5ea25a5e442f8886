"""Workspace kubeconfigs on the shared three-server world (``mc_world``; issue 40.2, last part): a hub Workspace
on member-a whose access rules list alice (a hub ServiceAccount: a real hub token, reviewed by the hub's API
server), the real REST route on a second ``accelstack-hub`` replica with ``--api-listen`` (the shipped hub
ServiceAccount), member-a's real agent and workspace controller.

Alice gets a kubeconfig for member-a through ``kubectl accelstack workspace kubeconfig`` (written 0600); with it,
``kubectl auth can-i`` on member-a says the member role's rights in the workspace's namespace and nothing outside
it. Bob (not in the access rules) gets 403, member-b (not a member of the workspace) 404, a bad expiry 400, each
one line. The rights of the flow are proved with ``kubectl auth can-i`` as the real identities: the agent's hub
token may create Secrets in its own hub namespace but read none; its member identity may mint tokens for the
workspace role accounts only (not ``default`` of the workspace's namespace, not any ``kube-system`` account); the
hub may get and delete Secrets in member namespaces only. No request or Secret is left, and no token is in the
hub's or the agent's log.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.realcluster.mc_world import SYSTEM, WORKSPACES, World, api_replica, call, cli, namespace
from tests.realcluster.objects import wait_for
from tests.realcluster.stack import Product

pytestmark = pytest.mark.realcluster
USERS = "kc-users"  # hub namespace of the test's users
WS, WS_NS = "kc-team", "kc-team-ns"
OWN = "accelstack-member-member-a"
ACCOUNT = "accelstack-workspace-member"


def post(base: str, path: str, token: str = "") -> tuple[int, Any]:
    return call(base, path, token, method="POST", timeout=60)


@pytest.fixture
def issuing(mc_world: World) -> Iterator[tuple[str, dict[str, str], Product]]:
    """(the replica's API base URL, user -> hub token, the replica); everything made here is deleted after."""
    hub = mc_world.hub
    namespace(hub, USERS)
    for sa in ("kc-alice", "kc-bob"):
        if hub.get(f"api/v1/namespaces/{USERS}/serviceaccounts/{sa}") is None:
            hub.create(f"api/v1/namespaces/{USERS}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                                       "metadata": {"name": sa}})
    hub.create(WORKSPACES, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": WS},
                            "spec": {"clusters": ["member-a"], "namespaces": [WS_NS],
                                     "access": [{"kind": "ServiceAccount", "name": "kc-alice", "namespace": USERS,
                                                 "role": "member"}]}})
    tokens = {"alice": hub.token(USERS, "kc-alice"), "bob": hub.token(USERS, "kc-bob")}
    replica, base = api_replica(hub, "hub-kubeconfig")
    try:
        yield base, tokens, replica
    finally:
        replica.stop()
        hub.delete(f"{WORKSPACES}/{WS}")
        a = mc_world.members["member-a"]
        wait_for("member-a's copy of the workspace gone", lambda: a.cp.get(f"{WORKSPACES}/{WS}") is None, timeout=60)
        for sa in ("kc-alice", "kc-bob"):
            hub.delete(f"api/v1/namespaces/{USERS}/serviceaccounts/{sa}")


def test_a_listed_user_gets_a_member_kubeconfig_with_its_roles_rights_only(
        mc_world: World, issuing: tuple[str, dict[str, str], Product], tmp_path: Any) -> None:
    base, tokens, replica = issuing
    hub, a = mc_world.hub, mc_world.members["member-a"]
    cluster = hub.get("apis/accelstack.io/v1alpha1/clusters/member-a") or {}
    assert cluster["spec"]["apiServer"]["url"] == a.cp.url and cluster["spec"]["apiServer"]["caBundle"]

    # ---- the member's own controller makes the role account (the agent added its rule to the copy) -------------
    wait_for(f"{ACCOUNT} in {WS_NS} on member-a", lambda: a.cp.get(
        f"api/v1/namespaces/{WS_NS}/serviceaccounts/{ACCOUNT}"), timeout=60)

    # ---- alice: the real route through the plugin, written 0600 ---------------------------------------------------
    path = tmp_path / "alice.kubeconfig"

    def issued() -> bool:
        out = cli("--server", base, "--token", tokens["alice"], "workspace", "kubeconfig", WS, "--cluster",
                  "member-a", "--expiry", "15m", "-o", str(path))
        assert out.returncode == 0 or "NotReady" in out.stderr, out.stderr  # the copy may still be reconciling
        return out.returncode == 0

    wait_for("alice's kubeconfig for member-a", issued, timeout=60)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    config = yaml.safe_load(path.read_text())
    assert config["contexts"][0]["context"]["namespace"] == WS_NS
    assert config["clusters"][0]["cluster"]["server"] == a.cp.url
    member_token = config["users"][0]["user"]["token"]
    # the member role's rights in the workspace's namespace, and nothing outside it
    for verb, res in (("create", "gpuprovisioningrequests.accelstack.io"), ("get", "pods"), ("list", "events")):
        assert a.cp.can_i(path, verb, res, namespace=WS_NS), (verb, res)
    for verb, res, ns in (("create", "rolebindings.rbac.authorization.k8s.io", WS_NS), ("get", "secrets", WS_NS),
                          ("create", "pods", WS_NS), ("get", "pods", "default"),
                          ("create", "gpuprovisioningrequests.accelstack.io", "default"), ("get", "pods", "kube-system"),
                          ("list", "nodes", None)):
        assert not a.cp.can_i(path, verb, res, namespace=ns), (verb, res, ns)
    # a member token, for member-a only: the hub does not know it
    status, _ = post(base, f"/api/v1/workspaces/{WS}/kubeconfig?cluster=member-a", member_token)
    assert status == 401
    # nothing left behind in member-a's hub namespace
    for kind in ("configmaps", "secrets"):
        items = hub.api("GET", f"api/v1/namespaces/{OWN}/{kind}?labelSelector=accelstack.io/kubeconfig-request")
        assert items.get("items") == [], kind

    # ---- refusals, one line each ------------------------------------------------------------------------------------
    out = cli("--server", base, "--token", tokens["bob"], "workspace", "kubeconfig", WS, "--cluster", "member-a")
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0 and \
        f"403 system:serviceaccount:{USERS}:kc-bob is not in the access rules of workspace {WS}" in out.stderr
    status, body = post(base, f"/api/v1/workspaces/{WS}/kubeconfig?cluster=member-b", tokens["alice"])
    assert (status, body) == (404, {"error": f"workspace {WS} is not on cluster member-b"})
    status, body = post(base, f"/api/v1/workspaces/{WS}/kubeconfig?cluster=member-a&expiry=5m", tokens["alice"])
    assert (status, body) == (400, {"error": "expiry: between 10m and 24h, got '5m'"})
    status, _ = post(base, f"/api/v1/workspaces/{WS}/kubeconfig?cluster=member-a")
    assert status == 401

    # ---- the rights of the flow, as the real identities ---------------------------------------------------------------
    agent_hub = a.hub_kubeconfig()  # the agent's hub token, as join stored it
    assert hub.can_i(agent_hub, "create", "secrets", namespace=OWN)
    for verb in ("get", "list", "watch", "delete"):
        assert not hub.can_i(agent_hub, verb, "secrets", namespace=OWN), verb  # it cannot read a token back
    assert not hub.can_i(agent_hub, "create", "secrets", namespace="accelstack-member-member-b")
    agent_member = a.cp.sa_kubeconfig(SYSTEM, "accelstack-member-agent")
    assert a.cp.can_i(agent_member, "create", f"serviceaccounts/{ACCOUNT}", namespace=WS_NS, subresource="token")
    assert not a.cp.can_i(agent_member, "create", "serviceaccounts/default", namespace=WS_NS, subresource="token")
    for sa in ("default", "namespace-controller", "generic-garbage-collector"):
        assert not a.cp.can_i(agent_member, "create", f"serviceaccounts/{sa}", namespace="kube-system",
                              subresource="token"), sa
    assert not a.cp.can_i(agent_member, "get", "serviceaccounts", namespace=WS_NS)
    hub_sa = hub.sa_kubeconfig(SYSTEM, "accelstack-hub")
    assert hub.can_i(hub_sa, "get", "secrets", namespace=OWN) and hub.can_i(hub_sa, "delete", "secrets", namespace=OWN)
    assert not hub.can_i(hub_sa, "list", "secrets", namespace=OWN)
    for ns in (SYSTEM, "kube-system", USERS):
        assert not hub.can_i(hub_sa, "get", "secrets", namespace=ns), ns

    # ---- no token in either log -------------------------------------------------------------------------------------
    assert a.agent is not None
    agent_log, hub_log = a.agent.log.read_text(errors="replace"), replica.log.read_text(errors="replace")
    assert "workspace kubeconfig token made" in agent_log and "workspace kubeconfig issued" in hub_log
    for token in (member_token, tokens["alice"], tokens["bob"]):
        assert token not in agent_log and token not in hub_log
