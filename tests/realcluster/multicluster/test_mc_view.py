"""One view over every member (issue 40.4) on the shared three-server world (``mc_world``): the hub's REST API
with real tokens reviewed by the hub's real API server.

A second ``accelstack-hub`` replica (the world's hub leads; this one does not, and serves the views from its own
informers, as every replica does) runs with ``--api-listen``, under the shipped ``accelstack-hub`` ServiceAccount,
whose RBAC (manifests/hub) lets it create TokenReviews and SubjectAccessReviews and still read no Secret. A user
with ``list`` on clusters, GPRs and workspaces sees both members' GPUs, ``cluster=member-a`` only member-a's rows,
a hub GPR pinned to member-b in the queue with its cluster (the REST API and ``kubectl accelstack queue
--cluster``); a token without those rights gets 403, no token 401, an unknown cluster 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.realcluster.mc_world import HUB_NS, SYSTEM, World, api_replica, call, cli, hub_status, namespace
from tests.realcluster.objects import gpr, wait_for

pytestmark = pytest.mark.realcluster
NS = "view-team"
READER, NOBODY = "view-reader", "view-nobody"
RBAC = "apis/rbac.authorization.k8s.io/v1"


def get(base: str, path: str, token: str = "") -> tuple[int, Any]:
    return call(base, path, token, method="GET", timeout=30)


@pytest.fixture
def view(mc_world: World) -> Iterator[tuple[str, dict[str, str]]]:
    """(the view replica's API base URL, user -> token); everything made here is deleted afterwards."""
    hub = mc_world.hub
    for cp in (hub, mc_world.members["member-b"].cp):
        namespace(cp, NS)
    for sa in (READER, NOBODY):
        if hub.get(f"api/v1/namespaces/{NS}/serviceaccounts/{sa}") is None:
            hub.create(f"api/v1/namespaces/{NS}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                                    "metadata": {"name": sa}})
    hub.apply([{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": READER},
                "rules": [{"apiGroups": ["accelstack.io"],
                           "resources": ["clusters", "gpuprovisioningrequests", "workspaces"],
                           "verbs": ["list"]}]},
               {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": READER},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": READER},
                "subjects": [{"kind": "ServiceAccount", "name": READER, "namespace": NS}]}])
    tokens = {sa: hub.token(NS, sa) for sa in (READER, NOBODY)}
    replica, base = api_replica(hub, "hub-view")
    try:
        yield base, tokens
    finally:
        replica.stop()
        mc_world.clean((NS, "view-pinned"))
        hub.delete(f"{RBAC}/clusterrolebindings/{READER}")
        hub.delete(f"{RBAC}/clusterroles/{READER}")
        for sa in (READER, NOBODY):
            hub.delete(f"api/v1/namespaces/{NS}/serviceaccounts/{sa}")
        assert "Bearer" not in replica.tail(400) and tokens[READER] not in replica.tail(400)  # no token in the log


def test_one_view_over_both_members_with_real_tokens(mc_world: World, view: tuple[str, dict[str, str]]) -> None:
    base, tokens = view
    hub = mc_world.hub
    hub_kc = hub.sa_kubeconfig(SYSTEM, "accelstack-hub")
    assert hub.can_i(hub_kc, "create", "tokenreviews.authentication.k8s.io")
    assert hub.can_i(hub_kc, "create", "subjectaccessreviews.authorization.k8s.io")
    assert not hub.can_i(hub_kc, "get", "secrets", namespace=SYSTEM)

    # ---- the inventory: both members' GPUs, each row naming its cluster ---------------------------------------
    def both() -> dict[str, Any] | None:
        status, body = get(base, "/api/v1/inventory", tokens[READER])
        assert status == 200, body
        gpus = {c: sum(x["capacity"] for x in body["cells"] if x["cluster"] == c and x["resource"] == "nvidia.com/gpu")
                for c in ("member-a", "member-b")}
        return body if gpus == {"member-a": 16, "member-b": 16} else None

    inv = wait_for("both members' 16 GPUs in the hub's inventory", both, timeout=60)
    assert inv["hub"] is True and {(c["cluster"], c["model"]) for c in inv["cells"]} >= {
        ("member-a", "H100"), ("member-a", "A100"), ("member-b", "H100"), ("member-b", "A100")}
    assert {m["cluster"]: m["ready"] for m in inv["clusters"]} == {"member-a": True, "member-b": True}
    status, only_a = get(base, "/api/v1/inventory?cluster=member-a", tokens[READER])
    assert status == 200 and {c["cluster"] for c in only_a["cells"]} == {"member-a"}
    status, body = get(base, "/api/v1/inventory?cluster=member-z", tokens[READER])
    assert (status, body) == (404, {"error": "no member cluster 'member-z' has joined the hub"})

    # ---- a pinned hub GPR in the queue with its cluster, mirrored phase and reason -------------------------------
    hub.create(HUB_NS.format(ns=NS), gpr("view-pinned", devices=1, clusterName="member-b", models=["A100"]))
    wait_for("view-pinned placed on member-b", lambda: hub_status(mc_world, NS, "view-pinned", cluster="member-b"),
             timeout=60)

    def listed() -> dict[str, Any] | None:
        status, body = get(base, f"/api/v1/queue?cluster=member-b&namespace={NS}&phase=all", tokens[READER])
        assert status == 200, body
        rows = [r for r in body["items"] if r["name"] == "view-pinned"]
        return rows[0] if rows and rows[0]["phase"] in ("Admitted", "Running") else None

    row = wait_for("view-pinned Admitted on member-b in the hub's queue", listed, timeout=60)
    assert (row["cluster"], row["namespace"], row["pinned"], row["placed"]) == ("member-b", NS, True, "Pinned")
    status, only_a = get(base, f"/api/v1/queue?cluster=member-a&namespace={NS}&phase=all", tokens[READER])
    assert status == 200 and only_a["items"] == []

    out = cli("--server", base, "--token", tokens[READER], "queue", "--cluster", "member-b", "-n", NS,
              "--phase", "all")
    assert out.returncode == 0, out.stderr
    table = [line.split() for line in out.stdout.partition("\n\n")[0].splitlines()]
    assert table[0][:4] == ["CLUSTER", "POS", "NAMESPACE", "NAME"]
    assert ["member-b", "-", NS, "view-pinned"] in [r[:4] for r in table[1:]]
    out = cli("--server", base, "--token", tokens[READER], "inventory", "--cluster", "member-a")
    assert out.returncode == 0 and {line.split()[0] for line in out.stdout.partition("\n\n")[0].splitlines()[1:]} \
        == {"member-a"}, out.stdout + out.stderr

    # ---- usage reads the workspaces (none of ours: an empty answer, allowed) -------------------------------------
    status, body = get(base, "/api/v1/usage", tokens[READER])
    assert status == 200 and body["hub"] is True

    # ---- refused: no token, a token without the rights -------------------------------------------------------------
    for path in ("/api/v1/inventory", f"/api/v1/queue?namespace={NS}", "/api/v1/usage"):
        status, body = get(base, path)
        assert status == 401, body
        status, body = get(base, path, tokens[NOBODY])
        assert status == 403 and body["error"].startswith(f"system:serviceaccount:{NS}:{NOBODY} may not list"), body
    out = cli("--server", base, "--token", tokens[NOBODY], "queue", "--cluster", "member-b")
    assert out.returncode == 1 and "403" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
