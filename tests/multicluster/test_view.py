"""One view (issue 40.4): the hub's inventory, queue and usage over every member as pure functions of its own
Cluster, GPR and Workspace objects; the hub API's authentication (401/403 before anything is computed, 404 for a
cluster no member joined with, 429 past the rate limit); the per-cluster /metrics; and the plugin's --cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from scheduler_extender.api.app import RateLimiter
from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.hub import HubAPI
from scheduler_extender.cli.kubectl_plugin import main as plugin
from scheduler_extender.multicluster import view
from scheduler_extender.multicluster.clusters import micro_time
from service.http_listener import serve_app

GPU = "nvidia.com/gpu"
NOW = 1_800_000_000.0


def member(name: str, *, ready: bool = True, beat_age: float = 2.0, rows: list[dict[str, Any]] | None = None
           ) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                        "reason": "HeartbeatSeen" if ready else "HeartbeatMissed"},
                       {"type": "Lost", "status": "False" if ready else "True"}],
        "observedHeartbeatTime": micro_time(NOW - beat_age), "nodes": 2,
        "inventory": rows if rows is not None else [
            {"resource": GPU, "model": "H100", "nodes": 1, "capacity": 8, "allocatable": 8, "allocated": 2,
             "reserved": 1, "unhealthy": 0, "queued": 0},
            {"resource": GPU, "model": "A100", "nodes": 1, "capacity": 8, "allocatable": 7, "allocated": 0,
             "reserved": 0, "unhealthy": 1, "queued": 4}]}}


CLUSTERS = {"member-a": member("member-a"), "member-b": member("member-b", ready=False, beat_age=90)}


def gpr(ns: str, name: str, *, cluster: str = "", phase: str = "Queued", position: int | None = None,
        reason: str = "", pinned: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "reason": reason}
    if cluster:
        status.update(cluster=cluster, conditions=[{"type": "Placed", "status": "True",
                                                    "reason": "Pinned" if pinned else "EarliestStart"}])
    if position is not None:
        status.update(queuePosition=position, estimatedStart="2027-01-15T09:00:00Z")
    return {"metadata": {"namespace": ns, "name": name, "creationTimestamp": "2027-01-15T07:00:00Z"},
            "spec": {"resource": GPU, "devicesPerNode": 2, "nodeCount": 1, **({"clusterName": pinned} if pinned else {})},
            "status": status}


GPRS = [gpr("team-a", "train", cluster="member-a", position=1, pinned="member-a"),
        gpr("team-a", "serve", cluster="member-b", phase="Running"),
        gpr("team-b", "huge", reason="Unschedulable"),
        gpr("accelstack-member-member-a", "team-a.train", cluster="member-a", position=1),  # a dispatch: not a row
        gpr("team-b", "old", cluster="member-a", phase="Complete")]

WORKSPACES = [{"metadata": {"name": "ml"}, "status": {"clusters": [
    {"name": "member-a", "ready": True, "namespaces": ["ml"], "message": "",
     "usage": [{"resource": GPU, "model": "", "inUse": 2, "reserved": 1, "queued": 0, "max": 16}]},
    {"name": "member-b", "ready": False, "namespaces": [], "usage": [], "message": "sending to the member"}]}}]


# ---- the views ------------------------------------------------------------------------------------------------
def test_inventory_rows_per_cluster_and_model_with_ready_and_lost() -> None:
    inv = view.inventory(CLUSTERS, "", NOW)
    assert inv["hub"] is True
    assert [(c["cluster"], c["model"]) for c in inv["cells"]] == [
        ("member-a", "A100"), ("member-a", "H100"), ("member-b", "A100"), ("member-b", "H100")]
    h100 = inv["cells"][1]
    assert (h100["capacity"], h100["allocated"], h100["reserved"], h100["free"], h100["group"]) == \
        (8, 2, 1, 5, view.NOT_REPORTED)
    # a Lost member's devices are its last report: none of them is free to place on
    assert all(c["free"] == 0 and c["lost"] and not c["ready"] for c in inv["cells"] if c["cluster"] == "member-b")
    assert inv["totals"]["capacity"] == 32 and inv["totals"]["free"] == 5 + 7
    assert [(m["cluster"], m["ready"], m["lost"], m["heartbeatAgeSeconds"]) for m in inv["clusters"]] == [
        ("member-a", True, False, 2.0), ("member-b", False, True, 90.0)]
    assert "node group" in inv["groupLabel"]
    only_a = view.inventory(CLUSTERS, "member-a", NOW)
    assert {c["cluster"] for c in only_a["cells"]} == {"member-a"} and len(only_a["clusters"]) == 1


def test_an_unknown_cluster_is_a_lookup_error_naming_it() -> None:
    for call in (lambda: view.inventory(CLUSTERS, "member-z", NOW),
                 lambda: view.queue(GPRS, CLUSTERS, cluster="member-z", namespace="", phases=("Queued",), now=NOW),
                 lambda: view.usage(WORKSPACES, CLUSTERS, cluster="member-z")):
        with pytest.raises(LookupError, match="no member cluster 'member-z' has joined the hub"):
            call()


def test_queue_has_the_users_gprs_with_their_cluster_placed_or_not() -> None:
    q = view.queue(GPRS, CLUSTERS, cluster="", namespace="", phases=("Queued", "Running"), now=NOW)
    assert [(r["cluster"], r["namespace"], r["name"], r["phase"]) for r in q["items"]] == [
        ("", "team-b", "huge", "Queued"), ("member-a", "team-a", "train", "Queued"),
        ("member-b", "team-a", "serve", "Running")]
    train = q["items"][1]
    assert (train["position"], train["pinned"], train["placed"], train["estimatedStart"]) == \
        (1, True, "Pinned", "2027-01-15T09:00:00Z")
    assert q["items"][0]["reason"] == "Unschedulable"
    assert q["counts"] == {"Queued": 2, "Running": 1, "Complete": 1}
    only_a = view.queue(GPRS, CLUSTERS, cluster="member-a", namespace="", phases=("Queued",), now=NOW)
    assert [r["name"] for r in only_a["items"]] == ["train"]
    team_b = view.queue(GPRS, CLUSTERS, cluster="", namespace="team-b", phases=("Queued",), now=NOW)
    assert [r["name"] for r in team_b["items"]] == ["huge"]


def test_usage_per_workspace_and_cluster() -> None:
    u = view.usage(WORKSPACES, CLUSTERS, cluster="")
    assert [(r["workspace"], r["cluster"], r["inUse"], r["max"]) for r in u["items"]] == [
        ("ml", "member-a", 2, 16), ("ml", "member-b", None, None)]
    assert u["items"][1]["message"] == "sending to the member"
    assert [r["cluster"] for r in view.usage(WORKSPACES, CLUSTERS, cluster="member-b")["items"]] == ["member-b"]


def test_metrics_count_gprs_by_cluster_and_phase_and_heartbeat_age() -> None:
    registry = CollectorRegistry()
    registry.register(view.ViewCollector(lambda: CLUSTERS, lambda: GPRS, lambda: NOW))
    text = generate_latest(registry).decode()
    assert 'accelstack_hub_cluster_gprs{cluster="member-a",phase="Queued"} 1.0' in text  # the dispatch not counted
    assert 'accelstack_hub_cluster_gprs{cluster="",phase="Queued"} 1.0' in text
    assert 'accelstack_hub_cluster_gprs{cluster="member-b",phase="Running"} 1.0' in text
    assert 'accelstack_hub_cluster_heartbeat_age_seconds{cluster="member-b"} 90.0' in text


# ---- the API: authentication first --------------------------------------------------------------------------
class FakeKube:
    """TokenReview and SubjectAccessReview answers: ``admin`` may list everything, ``viewer`` only Clusters."""

    def __init__(self) -> None:
        self.reviews: list[dict[str, Any]] = []

    async def token_review(self, token: str) -> dict[str, Any]:
        user = {"admin-token": "admin", "viewer-token": "viewer"}.get(token)
        return {"authenticated": True, "user": {"username": user}} if user else {"authenticated": False}

    async def access_review(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.reviews.append(spec)
        attrs = spec["resourceAttributes"]
        return {"allowed": spec["user"] == "admin" or attrs["resource"] == "clusters"}


class Source:
    def __init__(self) -> None:
        self.calls = 0

    def inventory(self, cluster: str) -> dict[str, Any]:
        self.calls += 1
        return view.inventory(CLUSTERS, cluster, NOW)

    def queue(self, cluster: str, namespace: str, phases: tuple[str, ...]) -> dict[str, Any]:
        self.calls += 1
        return view.queue(GPRS, CLUSTERS, cluster=cluster, namespace=namespace, phases=phases, now=NOW)

    def usage(self, cluster: str, workspace: str) -> dict[str, Any]:
        self.calls += 1
        return view.usage(WORKSPACES, CLUSTERS, cluster=cluster, workspace=workspace)


@asynccontextmanager
async def hub_api(limiter: RateLimiter | None = None) -> AsyncIterator[tuple[str, Source, FakeKube]]:
    kube, source = FakeKube(), Source()
    app = aiohttp.web.Application()
    app.add_routes(HubAPI(source, Authorizer(kube), limiter).routes())  # type: ignore[arg-type]
    runner, port = await serve_app(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", source, kube
    finally:
        await runner.cleanup()


async def get(http: aiohttp.ClientSession, url: str, token: str = "") -> tuple[int, Any]:
    async with http.get(url, headers={"Authorization": f"Bearer {token}"} if token else {}) as r:
        return r.status, await r.json()


async def test_the_api_refuses_before_it_computes_and_asks_rbac_for_the_matching_action() -> None:
    async with hub_api() as (base, source, kube), aiohttp.ClientSession() as http:
        for path in ("inventory", "queue", "usage"):
            status, body = await get(http, f"{base}/api/v1/{path}")
            assert status == 401 and "bearer token is required" in body["error"]
            status, body = await get(http, f"{base}/api/v1/{path}", "bogus")
            assert status == 401 and "not valid" in body["error"]
        assert source.calls == 0
        status, body = await get(http, f"{base}/api/v1/queue?namespace=team-a", "viewer-token")
        assert status == 403 and body["error"].startswith("viewer may not list gpuprovisioningrequests in namespace team-a")
        status, body = await get(http, f"{base}/api/v1/usage", "viewer-token")
        assert status == 403 and "may not list workspaces" in body["error"]
        assert source.calls == 0
        assert {(r["resourceAttributes"]["resource"], r["resourceAttributes"].get("namespace")) for r in kube.reviews} == \
            {("gpuprovisioningrequests", "team-a"), ("workspaces", None)}
        status, body = await get(http, f"{base}/api/v1/inventory?cluster=member-a", "viewer-token")
        assert status == 200 and {c["cluster"] for c in body["cells"]} == {"member-a"}
        status, body = await get(http, f"{base}/api/v1/inventory?cluster=nope", "viewer-token")
        assert status == 404 and body == {"error": "no member cluster 'nope' has joined the hub"}
        status, body = await get(http, f"{base}/api/v1/queue?phase=Bogus", "admin-token")
        assert status == 400 and "phase: unknown 'Bogus'" in body["error"]
        status, body = await get(http, f"{base}/api/v1/queue?workspace=ml", "admin-token")
        assert status == 400 and body["error"].startswith("workspace: not a filter of the hub's queue")
        status, body = await get(http, f"{base}/api/v1/queue?limit=1", "admin-token")
        assert status == 200 and len(body["items"]) == 1 and body["total"] == 3
        status, body = await get(http, f"{base}/api/v1/whoami", "viewer-token")
        assert body == {"user": "viewer", "namespace": "", "hub": True,
                        "allowed": {"inventory": True, "queue": False, "usage": False}}


async def test_the_api_rate_limits_each_user() -> None:
    async with hub_api(RateLimiter(rate=0.001, burst=2)) as (base, _, _k), aiohttp.ClientSession() as http:
        statuses = [(await get(http, f"{base}/api/v1/inventory", "admin-token"))[0] for _ in range(3)]
        assert statuses == [200, 200, 429]
        assert (await get(http, f"{base}/api/v1/inventory", "viewer-token"))[0] == 200  # another user's bucket


# ---- the plugin -----------------------------------------------------------------------------------------------
async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(plugin, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_the_plugin_shows_a_cluster_column_on_a_hub_and_passes_cluster(capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    async with hub_api() as (base, _, _k):
        auth = ("--server", base, "--token", "admin-token")
        code, out, err = await run(capsys, *auth, "inventory")
        assert code == 0, err
        rows = [line.split() for line in out.partition("\n\n")[0].splitlines()]
        assert rows[0][:4] == ["CLUSTER", "STATE", "RESOURCE", "MODEL"]
        assert [(r[0], r[1], r[3]) for r in rows[1:]] == [("member-a", "Ready", "A100"), ("member-a", "Ready", "H100"),
                                                          ("member-b", "Lost", "A100"), ("member-b", "Lost", "H100")]
        code, out, _ = await run(capsys, *auth, "inventory", "--cluster", "member-b")
        assert {line.split()[0] for line in out.partition("\n\n")[0].splitlines()[1:]} == {"member-b"}
        code, out, _ = await run(capsys, *auth, "queue", "--cluster", "member-a")
        rows = [line.split() for line in out.partition("\n\n")[0].splitlines()]
        assert rows[0][:4] == ["CLUSTER", "POS", "NAMESPACE", "NAME"] and [r[:4] for r in rows[1:]] == [
            ["member-a", "1", "team-a", "train"]]
        code, out, _ = await run(capsys, *auth, "queue")
        assert "(unplaced)" in out and "huge" in out
        code, out, _ = await run(capsys, *auth, "workspace", "usage")
        rows = [line.split() for line in out.splitlines()]
        assert rows[0][:3] == ["WORKSPACE", "CLUSTER", "READY"] and [r[:3] for r in rows[1:]] == [
            ["ml", "member-a", "yes"], ["ml", "member-b", "no"]]
        code, out, _ = await run(capsys, *auth, "workspace", "usage", "--cluster", "member-a")
        assert [line.split()[1] for line in out.splitlines()[1:]] == ["member-a"]
        code, _, err = await run(capsys, *auth, "queue", "--cluster", "member-z")
        assert code == 1 and err.strip().endswith("404 no member cluster 'member-z' has joined the hub")
