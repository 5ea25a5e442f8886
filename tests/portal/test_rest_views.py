"""The portal's REST views against the API-server peer: the queue (order, filters, pagination, authorisation),
a GPR's Events, the inventory summary and its drill-down, health, whoami, and the portal's files and headers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import aiohttp.web
import orjson
import pytest

from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import stack
from tests.portal.cluster import ADMIN, NOBODY, SICK_SINCE, VIEWER, seed


@contextlib.asynccontextmanager
async def seeded() -> AsyncIterator[tuple[APIServerPeer, str, aiohttp.ClientSession]]:
    peer = APIServerPeer()
    await peer.start()
    await seed(peer)
    try:
        async with stack(peer) as (_, server), aiohttp.ClientSession() as http:
            yield peer, f"http://127.0.0.1:{server.port}", http
    finally:
        await peer.stop()


async def get(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, Any]:
    async with http.get(url, headers=headers) as r:
        return r.status, await r.json()


async def test_queue_in_order_with_workspace_filters_and_pages() -> None:
    async with seeded() as (_, base, http):
        status, q = await get(http, f"{base}/api/v1/queue", ADMIN)
        assert status == 200
        names = [(r["name"], r["phase"], r["position"]) for r in q["items"]]
        assert names == [("finetune", "Queued", 1), ("batch", "Queued", 2), ("sweep", "Queued", 3),
                         ("train-big", "Running", None), ("exp", "Admitted", None)]
        first = q["items"][0]
        assert first["workspace"] == "team-a" and first["reason"] == "InsufficientCapacity"
        assert 800 < first["waitSeconds"] <= 900 and first["estimatedStartRange"]["earliest"]
        assert q["counts"] == {"Queued": 3, "Running": 1, "Admitted": 1, "Complete": 1} and q["total"] == 5
        assert next(r for r in q["items"] if r["name"] == "exp")["workspace"] == "team-a"  # team-a-dev's label
        assert next(r for r in q["items"] if r["name"] == "batch")["workspace"] == "team-b"  # its own
        # the order is explained where the queue is read: each GPR's priority level and the rule (issue 35.4)
        assert [(r["priority"], r["level"]) for r in q["items"][:3]] == [(120, "medium"), (100, "low"), (90, "low")]
        assert q["order"].startswith("Queued GPRs start by priority level, strictly: high (201-300), then medium")
        assert "smaller predicted work first" in q["order"]

        _, ws = await get(http, f"{base}/api/v1/queue?workspace=team-a", ADMIN)
        assert sorted(r["name"] for r in ws["items"]) == ["exp", "finetune", "train-big"]
        _, only = await get(http, f"{base}/api/v1/queue?phase=Queued&namespace=team-b", ADMIN)
        assert [r["name"] for r in only["items"]] == ["batch", "sweep"]
        _, every = await get(http, f"{base}/api/v1/queue?phase=all", ADMIN)
        assert every["total"] == 6

        _, page1 = await get(http, f"{base}/api/v1/queue?limit=2", ADMIN)
        _, page2 = await get(http, f"{base}/api/v1/queue?limit=2&continue={page1['continue']}", ADMIN)
        _, page3 = await get(http, f"{base}/api/v1/queue?limit=2&continue={page2['continue']}", ADMIN)
        assert [r["name"] for p in (page1, page2, page3) for r in p["items"]] == [
            "finetune", "batch", "sweep", "train-big", "exp"] and page3["continue"] == ""

        for query, message in (("limit=0", "limit: must be between"), ("limit=x", "limit: must be an integer"),
                               ("phase=Sleeping", "phase: unknown 'Sleeping'")):
            status, body = await get(http, f"{base}/api/v1/queue?{query}", ADMIN)
            assert status == 400 and message in body["error"]


async def test_queue_is_authorised_per_namespace_and_answered_from_the_informer() -> None:
    async with seeded() as (peer, base, http):
        lists_before = peer.count("GET", "gpuprovisioningrequests", verb="list")
        status, body = await get(http, f"{base}/api/v1/queue", VIEWER)
        assert status == 403 and "bob may not list gpuprovisioningrequests" in body["error"]
        status, body = await get(http, f"{base}/api/v1/queue?namespace=team-b", VIEWER)
        assert status == 200 and [r["name"] for r in body["items"]] == ["batch", "sweep"]
        status, body = await get(http, f"{base}/api/v1/queue?workspace=team-a", VIEWER)
        assert status == 403 and "in namespace team-a" in body["error"]
        status, body = await get(http, f"{base}/api/v1/queue", {})
        assert status == 401
        assert peer.count("GET", "gpuprovisioningrequests", verb="list") == lists_before  # no list per request


async def test_gpr_events_oldest_first_and_authorised() -> None:
    async with seeded() as (_, base, http):
        status, body = await get(http, f"{base}/api/v1/gprs/team-a/finetune/events", ADMIN)
        assert status == 200 and len(body["items"]) == 1
        event = body["items"][0]
        assert event["reason"] == "Queued" and event["count"] == 3 and event["source"] == "accelstack-gpr-controller"
        status, body = await get(http, f"{base}/api/v1/gprs/team-a/finetune/events", VIEWER)
        assert status == 403 and "may not list events in namespace team-a" in body["error"]
        status, body = await get(http, f"{base}/api/v1/gprs/team-b/batch/events", VIEWER)
        assert status == 200 and body["items"][0]["message"] == "position 2"


async def test_a_reservations_running_pods_are_held_once_in_the_heat_map() -> None:
    """A GPR reserving all 8 devices of a node whose pods use 3 of them: the node holds 8 of 8, not 11 of 8
    (allocated + reserved counted the 3 running devices twice, and the portal drew "11/8"); devices allocated
    outside any reservation add to it."""
    from scheduler_extender.api.views import node_rows, summary
    from scheduler_extender.objects import ledger
    from scheduler_extender.objects.cluster import GPU, ClusterView
    from tests.extender.harness import gpr, node

    view = ClusterView()
    for name, entries in (("a", {"p1": ledger.Entry("p1", "default/p1", {GPU: 3}, "default/g", 1.0)}),
                          ("b", {"p2": ledger.Entry("p2", "default/p2", {GPU: 1}, "", 1.0)})):
        obj = node(name, gpus=8, labels={"nvidia.com/gpu.product": "H100", "pool": "x"})
        obj["metadata"]["annotations"] = {ledger.LEDGER_ANNOTATION: ledger.render(entries)}
        view.on_node("ADDED", obj)
    view.on_gpr("ADDED", gpr("g", reservation={"a": 8, "b": 2}))
    rows = {r["node"]: r for n in view.nodes.values() for r in node_rows(view, n, "pool")}
    assert (rows["a"]["allocated"], rows["a"]["reserved"], rows["a"]["held"]) == (3, 8, 8)
    assert (rows["b"]["allocated"], rows["b"]["reserved"], rows["b"]["held"]) == (1, 2, 3)
    cell = (await summary(view, "pool"))["cells"][0]
    assert (cell["capacity"], cell["held"]) == (16, 11)


async def test_inventory_summary_groups_and_node() -> None:
    async with seeded() as (_, base, http):
        status, s = await get(http, f"{base}/api/v1/inventory?summary=1", ADMIN)
        assert status == 200 and s["groupLabel"] == "node.kubernetes.io/instance-type"
        assert s["groups"] == ["g5.12xlarge", "nr1-box", "p5.48xlarge"]
        h100 = next(c for c in s["cells"] if c["group"] == "p5.48xlarge")
        assert (h100["model"], h100["nodes"], h100["capacity"], h100["allocated"], h100["reserved"],
                h100["unhealthyNodes"]) == ("NVIDIA-H100-80GB-HBM3", 3, 24, 0, 10, 1)
        assert h100["free"] == 6  # p5-0 reserved 8, p5-1 reserved 2, p5-2 sick
        a10 = next(c for c in s["cells"] if c["group"] == "g5.12xlarge")
        assert (a10["capacity"], a10["allocatable"], a10["unhealthyDevices"], a10["free"]) == (8, 7, 1, 7)
        nr1 = next(c for c in s["cells"] if c["group"] == "nr1-box")
        assert (nr1["resource"], nr1["model"], nr1["capacity"]) == ("neureality.com/nr1", "NR1-S", 4)
        assert s["totals"]["nodes"] == 6

        status, g = await get(http, f"{base}/api/v1/inventory/groups/p5.48xlarge?resource=nvidia.com/gpu", ADMIN)
        assert status == 200 and [n["node"] for n in g["nodes"]] == ["p5-0", "p5-1", "p5-2"]
        assert g["nodes"][2]["healthy"] is False and "Xid 79" in g["nodes"][2]["reason"]
        status, body = await get(http, f"{base}/api/v1/inventory/groups/nowhere", ADMIN)
        assert status == 404 and "nowhere" in body["error"]

        status, n = await get(http, f"{base}/api/v1/inventory/nodes/p5-0", ADMIN)
        assert status == 200 and n["group"] == "p5.48xlarge"
        assert n["reservations"] == [{"gpr": "team-a/train-big", "devices": 8, "resource": "nvidia.com/gpu",
                                      "phase": "Running", "inUse": 0}]
        status, body = await get(http, f"{base}/api/v1/inventory/nodes/ghost", ADMIN)
        assert status == 404

        # the per-node inventory is unchanged
        status, inv = await get(http, f"{base}/api/v1/inventory", ADMIN)
        assert status == 200 and {"nodes", "models"} <= set(inv)
        for path in ("inventory?summary=1", "inventory/groups/p5.48xlarge", "inventory/nodes/p5-0", "health"):
            status, body = await get(http, f"{base}/api/v1/{path}", VIEWER)
            assert status == 403 and "bob may not list nodes" in body["error"], path


async def test_health_lists_sick_nodes_and_devices_with_since() -> None:
    async with seeded() as (_, base, http):
        status, hl = await get(http, f"{base}/api/v1/health", ADMIN)
        assert status == 200 and hl["totalNodes"] == 6 and hl["unhealthyNodes"] == 2
        first, second = hl["nodes"]
        assert first["node"] == "p5-2" and first["since"] == SICK_SINCE and first["unhealthyDevices"] == 8
        assert first["problems"][0]["reason"] == "GPUUnhealthy: Xid 79 on GPU 3"
        assert second["node"] == "g5-1" and second["unhealthyDevices"] == 1
        assert "1 of 4 devices unhealthy" in second["problems"][0]["reason"]
        assert hl["unhealthyDevices"] == 9


async def test_whoami_says_what_the_caller_may_do() -> None:
    async with seeded() as (peer, base, http):
        status, me = await get(http, f"{base}/api/v1/whoami", ADMIN)
        assert status == 200 and me["user"] == "alice" and all(me["allowed"].values())
        status, bob = await get(http, f"{base}/api/v1/whoami", VIEWER)
        assert status == 200 and not any(bob["allowed"].values())
        status, bob = await get(http, f"{base}/api/v1/whoami?namespace=team-b", VIEWER)
        assert bob["allowed"]["queue"] and bob["allowed"]["events"] and not bob["allowed"]["createGPR"]
        status, carol = await get(http, f"{base}/api/v1/whoami", NOBODY)
        assert status == 200 and carol["user"] == "carol" and not any(carol["allowed"].values())
        status, body = await get(http, f"{base}/api/v1/whoami", {"Authorization": "Bearer forged"})
        assert status == 401 and "not valid" in body["error"]
        reviews = peer.count("POST", "subjectaccessreviews")
        await get(http, f"{base}/api/v1/whoami", ADMIN)
        assert peer.count("POST", "subjectaccessreviews") == reviews  # cached per token


async def test_portal_files_carry_security_headers() -> None:
    async with seeded() as (_, base, http):
        async with http.get(f"{base}/ui", allow_redirects=False) as r:
            assert r.status == 301 and r.headers["Location"] == "/ui/"
        async with http.get(f"{base}/ui/") as r:
            page = await r.text()
            csp = r.headers["Content-Security-Policy"]
            assert r.status == 200 and r.headers["X-Content-Type-Options"] == "nosniff"
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert '<script src="app.js" defer></script>' in page and "<script>" not in page and "style=" not in page
        async with http.get(f"{base}/ui/app.js") as r:
            script = await r.text()
            assert r.status == 200 and r.content_type == "text/javascript"
        assert "sessionStorage" in script and "localStorage" not in script and "document.cookie" not in script
        async with http.get(f"{base}/ui/../../etc/passwd") as r:
            assert r.status == 404
        async with http.get(f"{base}/ui/secrets.txt") as r:
            assert r.status == 404 and r.headers["X-Content-Type-Options"] == "nosniff"
        # the page names its icon, and a browser's own /favicon.ico finds it (both were 404 in the console)
        assert '<link rel="icon" href="favicon.svg"' in page
        async with http.get(f"{base}/favicon.ico") as r:
            icon = await r.read()
            assert r.status == 200 and r.content_type == "image/svg+xml" and icon.startswith(b"<svg")
            assert r.history and r.history[0].status == 301


async def test_kept_answers_follow_the_informers() -> None:
    """The queue order, the summary and health are kept between requests only while the view is unchanged."""
    from tests.portal.cluster import GPRS, gpu_node, queued

    async with seeded() as (peer, base, http):
        _, before = await get(http, f"{base}/api/v1/queue?phase=Queued", ADMIN)
        _, summary_before = await get(http, f"{base}/api/v1/inventory?summary=1", ADMIN)
        assert [r["name"] for r in before["items"]] == ["finetune", "batch", "sweep"]
        await peer.put_object(GPRS, queued("sweep", "team-b", 1, 60, priority=130, devices=2), "MODIFIED")
        await peer.put_object("api/v1/nodes", gpu_node("p5-3", "p5.48xlarge", "NVIDIA-H100-80GB-HBM3", 8))

        async def changed() -> bool:
            _, q = await get(http, f"{base}/api/v1/queue?phase=Queued", ADMIN)
            _, s = await get(http, f"{base}/api/v1/inventory?summary=1", ADMIN)
            return q["items"][0]["name"] == "sweep" and s["totals"]["nodes"] == summary_before["totals"]["nodes"] + 1

        deadline = asyncio.get_running_loop().time() + 10
        while not await changed():
            assert asyncio.get_running_loop().time() < deadline, "the kept answers did not follow the view"
            await asyncio.sleep(0.02)



async def test_the_namespace_index_refreshes_at_most_every_ttl_and_keeps_its_last_answer() -> None:
    from kubernetes_asyncio import client

    from kubeapi import KubeClient
    from scheduler_extender.api.views import NamespaceIndex
    from scheduler_extender.objects.kube import Kube

    peer = APIServerPeer()
    await peer.start()
    await seed(peer)
    api = client.ApiClient(client.Configuration(host=peer.url))
    try:
        now = [100.0]
        index = NamespaceIndex(Kube(KubeClient(api, field_manager="test")), ttl=5.0, clock=lambda: now[0])
        refused = peer.inject("GET", "namespaces", verb="list", status=403)
        await index.refresh()
        assert index.of("team-a-dev") == "team-a-dev"  # never read: each namespace is its own workspace
        refused.remove()
        now[0] += 5
        await index.refresh()
        assert index.of("team-a-dev") == "team-a" and index.namespaces("team-a") == ["team-a", "team-a-dev"]
        lists = peer.count("GET", "namespaces", verb="list")
        now[0] += 4.9
        await index.refresh()
        assert peer.count("GET", "namespaces", verb="list") == lists  # within the ttl: no list
        with peer.inject("GET", "namespaces", verb="list", status=403):
            now[0] += 5
            await index.refresh()
        assert index.of("team-a-dev") == "team-a"  # a failed refresh keeps the last answer
        assert index.namespaces("nowhere") == ["nowhere"]
    finally:
        await api.close()
        await peer.stop()


def test_node_group_label_flag_is_checked() -> None:
    from scheduler_extender.cmd.extender import parse
    from service.flags import UsageError

    insecure = ["--insecure-verbs=true"]
    assert parse([*insecure, "--node-group-label", "example.com/rack"], {})["node_group_label"] == "example.com/rack"
    assert parse(insecure, {})["node_group_label"] == "node.kubernetes.io/instance-type"
    with pytest.raises(UsageError, match="--node-group-label: a node label key"):
        parse([*insecure, "--node-group-label", "two words"], {})


async def test_the_per_node_inventory_gives_the_loop_back_and_is_kept_while_the_view_is_unchanged() -> None:
    """``GET /api/v1/inventory`` at 5,000 nodes held the loop that answers filter and bind for the whole sweep
    (19 ms here, for anyone allowed to list nodes, as often as they asked); now it is swept in slices and its
    answer kept while the view is unchanged. The rows and the per-model sums are those of the nodes."""
    from scheduler_extender.api.app import inventory
    from scheduler_extender.objects import ledger
    from scheduler_extender.objects.cluster import GPU, ClusterView
    from tests.extender.harness import gpr, hold_share, node

    view = ClusterView()
    for i in range(5000):
        obj = node(f"n{i:04}", gpus=8, labels={"nvidia.com/gpu.product": "H100" if i % 2 else "A100"})
        obj["metadata"]["annotations"] = {ledger.LEDGER_ANNOTATION: ledger.render(
            {f"p{i}": ledger.Entry(f"p{i}", f"default/p{i}", {GPU: i % 3}, "", 1.0)})}
        view.on_node("ADDED", obj)
    view.on_gpr("ADDED", gpr("g", reservation={"n0001": 4}))
    shares = []
    for _ in range(3):
        share, answer = await hold_share(lambda: inventory(view))
        shares.append(share)
    assert min(shares) < 0.2, shares
    assert [r["node"] for r in answer["nodes"]] == [f"n{i:04}" for i in range(5000)]
    assert answer["nodes"][1] == {"node": "n0001", "resource": GPU, "model": "H100", "capacity": 8, "allocated": 1,
                                  "reserved": 4, "healthy": True, "reason": ""}
    h100 = next(m for m in answer["models"] if m["model"] == "H100")
    assert h100 == {"resource": GPU, "model": "H100", "nodes": 2500, "capacity": 20000, "healthyCapacity": 20000,
                    "allocated": sum(i % 3 for i in range(1, 5000, 2)), "reserved": 4}


async def test_the_per_node_inventory_follows_the_view() -> None:
    from tests.portal.cluster import gpu_node

    async with seeded() as (peer, base, http):
        _, before = await get(http, f"{base}/api/v1/inventory", ADMIN)
        _, again = await get(http, f"{base}/api/v1/inventory", ADMIN)
        assert again == before
        await peer.put_object("api/v1/nodes", gpu_node("p5-3", "p5.48xlarge", "NVIDIA-H100-80GB-HBM3", 8))
        deadline = asyncio.get_running_loop().time() + 10
        while "p5-3" not in {r["node"] for r in (await get(http, f"{base}/api/v1/inventory", ADMIN))[1]["nodes"]}:
            assert asyncio.get_running_loop().time() < deadline, "the kept inventory did not follow the view"
            await asyncio.sleep(0.02)


async def test_lists_from_the_api_server_are_sent_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A REST list (GPRs, workspaces, templates, bindings) is encoded and written in slices: 10,000 GPRs (4 MB)
    encoded at once held the loop for most of the answer; the body is the same JSON, empty lists included, and
    an API error is mapped as for any other call.

    Judged by ordering, not by how long the loop was held (a loaded machine stretches any stretch): a task that
    takes a turn whenever the loop is given back notes how much of the body had been encoded at each turn, and no
    stretch between two turns may encode more than a small share of it."""
    from aiohttp.test_utils import TestClient, TestServer

    from kubeapi import ApiError
    from scheduler_extender.api import http as rest_http
    from scheduler_extender.api.http import api_items
    from tests.extender.harness import gpr

    items = [gpr(f"g{i}", phase="Queued") for i in range(10_000)]

    class Encoder:
        """orjson as the REST module sees it, counting the bytes it encodes."""

        encoded = 0

        def dumps(self, obj: Any) -> bytes:
            out = orjson.dumps(obj)
            self.encoded += len(out)
            return out

    encoder = Encoder()
    monkeypatch.setattr(rest_http, "orjson", encoder)

    async def listed(which: str) -> list[dict[str, Any]]:
        if which == "refused":
            raise ApiError(403, "Forbidden", "gpuprovisioningrequests is forbidden")
        return items if which == "many" else []

    async def handler(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        return await api_items(request, listed(request.query["which"]))

    app = aiohttp.web.Application()
    app.router.add_get("/list", handler)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        async def fetch(which: str) -> tuple[int, bytes]:
            async with client.get(f"/list?which={which}") as r:
                return r.status, await r.read()  # read, not parsed: the share is the server's

        marks, done = [encoder.encoded], False

        async def turns() -> None:  # a turn each time the loop is given back
            while not done:
                await asyncio.sleep(0)
                marks.append(encoder.encoded)

        ticker = asyncio.create_task(turns())
        await asyncio.sleep(0)
        status, body = await fetch("many")
        done = True
        await ticker
        marks.append(encoder.encoded)
        stretches = [b - a for a, b in itertools.pairwise(marks)]
        total = marks[-1] - marks[0]
        assert status == 200 and orjson.loads(body) == {"items": items}
        assert total > 0.99 * len(body), "the body was not encoded where the count sees it"  # all but the commas
        assert max(stretches) < 0.3 * total, (max(stretches), total)
        assert await fetch("none") == (200, b'{"items":[]}')
        status, body = await fetch("refused")
        assert status == 403 and "forbidden" in orjson.loads(body)["error"]
    finally:
        await client.close()


def test_api_server_failures_map_to_what_a_caller_can_act_on() -> None:
    """Refusals are passed on; throttling that outlasted the client's own retries is 503 with the server's
    Retry-After (rounded up, at least 1 s); no answer is 504; any other failure 502."""
    from kubeapi import ApiError
    from kubeapi.errors import TooManyRequests, TransportError
    from scheduler_extender.api.http import api_error

    def mapped(exc: ApiError) -> tuple[int, str | None, str]:
        response = api_error(exc)
        assert response.body is not None and isinstance(response.body, bytes)
        return response.status, response.headers.get("Retry-After"), orjson.loads(response.body)["error"]

    for status in (400, 403, 404, 409, 422):  # the status once, in the answer's, not again in its text
        assert mapped(ApiError(status, "Refused", "no")) == (status, None, "API server: no")
    assert mapped(TooManyRequests(429, "TooManyRequests", "slow down", retry_after=2.5))[:2] == (503, "3")
    assert mapped(TooManyRequests(429, "TooManyRequests", "slow down"))[:2] == (503, "1")
    status, after, message = mapped(TransportError("GET /apis/...: no answer within 10s"))
    assert (status, after) == (504, None) and "no answer within 10s" in message
    for status in (500, 503, 410, 401):
        assert mapped(ApiError(status, "Oops", "broken"))[:2] == (502, None)
