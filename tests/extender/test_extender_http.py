"""The extender over real HTTP with the request bodies a real kube-scheduler sent, and every bad input."""

from __future__ import annotations

import copy
import json
import time

import aiohttp
import orjson
import pytest

from scheduler_extender.objects.ledger import LEDGER_ANNOTATION
from tests.extender.harness import filter_body, gpr, node, pod, recorded, stack, wait_until


async def post(server, verb: str, body: bytes) -> tuple[int, object]:  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{server.port}/scheduler/{verb}", data=body,
            headers={"Content-Type": "application/json", "User-Agent": "Go-http-client/1.1"}) as r:
        return r.status, await r.json(content_type=None)


async def seed(peer, *objects) -> None:  # type: ignore[no-untyped-def]
    for obj in objects:
        plural = {"Node": "api/v1/nodes", "Pod": "api/v1/pods",
                  "GPUProvisioningRequest": "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"}[obj["kind"]]
        await peer.put_object(plural, obj)


async def test_recorded_filter_without_gpr_filters_by_capacity_and_health() -> None:
    async with stack() as (peer, server):
        await seed(peer, node("gpu-node-1"), node("gpu-node-2", conditions=[
            {"type": "GPUUnhealthy", "status": "True", "reason": "XID", "message": "XID 79 on GPU-1"}]),
            node("reject-node-3", gpus=0))
        await wait_until(lambda: len(server.view.nodes) == 3)
        status, body = await post(server, "filter", recorded("a-filter.request.json"))
        assert status == 200
        assert body == {"NodeNames": ["gpu-node-1"], "Nodes": None, "FailedNodes": {},
                        "FailedAndUnresolvableNodes": {
                            "gpu-node-2": "unhealthy: GPUUnhealthy: XID 79 on GPU-1",
                            "reject-node-3": "node has 0 nvidia.com/gpu, pod asks 1"},
                        "Error": ""}


async def test_recorded_filter_full_nodes_echoes_node_objects() -> None:
    async with stack() as (peer, server):
        request = json.loads(recorded("b-filter.request.json"))
        for item in copy.deepcopy(request["Nodes"]["items"]):
            await peer.put_object("api/v1/nodes", dict(item, kind="Node", apiVersion="v1"))
        await wait_until(lambda: len(server.view.nodes) == len(request["Nodes"]["items"]))
        status, body = await post(server, "filter", recorded("b-filter.request.json"))
        assert status == 200 and body["NodeNames"] is None  # type: ignore[index]
        passed = [i["metadata"]["name"] for i in body["Nodes"]["items"]]  # type: ignore[index]
        expected = [i["metadata"]["name"] for i in request["Nodes"]["items"]
                    if int(i["status"]["allocatable"].get("nvidia.com/gpu", "0")) >= 1]
        assert passed == expected and passed
        # the passing node objects come back unchanged
        by_name = {i["metadata"]["name"]: i for i in request["Nodes"]["items"]}
        for item in body["Nodes"]["items"]:  # type: ignore[index]
            assert item == by_name[item["metadata"]["name"]]


async def test_gpr_pod_goes_only_to_reserved_nodes() -> None:
    async with stack() as (peer, server):
        await seed(peer, node("n1"), node("n2"), node("n3"),
                   gpr("train", reservation={"n2": 2}), gpr("queued", phase="Queued"))
        await wait_until(lambda: len(server.view.nodes) == 3 and len(server.view.gprs) == 2)
        status, body = await post(server, "filter", filter_body(pod("p", 2, gpr="train"), ["n1", "n2", "n3"]))
        assert status == 200
        assert body["NodeNames"] == ["n2"]  # type: ignore[index]
        assert body["FailedAndUnresolvableNodes"] == {  # type: ignore[index]
            "n1": "not reserved for GPR default/train", "n3": "not reserved for GPR default/train"}
        status, body = await post(server, "filter", filter_body(pod("p", 3, gpr="train"), ["n2"]))
        assert "reservation here is used up" in body["FailedAndUnresolvableNodes"]["n2"]  # type: ignore[index]
        status, body = await post(server, "filter", filter_body(pod("q", 1, gpr="queued"), ["n1"]))
        assert body["FailedAndUnresolvableNodes"] == {"n1": "GPR default/queued is Queued, not admitted"}  # type: ignore[index]
        status, body = await post(server, "filter", filter_body(pod("r", 1, gpr="nope"), ["n1"]))
        assert body["FailedAndUnresolvableNodes"] == {"n1": "GPR default/nope not found"}  # type: ignore[index]
        # a pod without a GPR may not take devices reserved for another GPR
        status, body = await post(server, "filter", filter_body(pod("s", 3), ["n2"]))
        assert body["FailedNodes"] == {"n2": "2 nvidia.com/gpu free, pod asks 3"}  # type: ignore[index]
        # prioritize: reserved nodes score 10
        status, scores = await post(server, "prioritize", filter_body(pod("p", 1, gpr="train"), ["n1", "n2"]))
        assert scores == [{"Host": "n1", "Score": 0}, {"Host": "n2", "Score": 10}]


async def test_unmanaged_pod_passes_straight_through() -> None:
    async with stack() as (_, server):
        plain = pod("web", 0)
        plain["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
        status, body = await post(server, "filter", filter_body(plain, ["a", "b"]))
        assert status == 200 and body["NodeNames"] == ["a", "b"] and body["FailedNodes"] == {}  # type: ignore[index]


async def test_prioritize_packs_pods_without_gpr() -> None:
    async with stack() as (peer, server):
        await seed(peer, node("big", gpus=8), node("small", gpus=2))
        await wait_until(lambda: len(server.view.nodes) == 2)
        status, scores = await post(server, "prioritize", recorded("a-prioritize.request.json").replace(
            b'"NodeNames":["gpu-node-1","gpu-node-2"]', b'"NodeNames":["big","small"]'))
        assert status == 200
        assert scores == [{"Host": "big", "Score": 1}, {"Host": "small", "Score": 5}]


async def test_recorded_preempt_keeps_only_lower_priority_preemptible_victims() -> None:
    request = json.loads(recorded("a-preempt.request.json"))
    victim1, victim2 = "310f05a8-b10e-4fc8-9e99-5963fd475ab2", "3bdd85e1-db8b-451e-95b4-b4f307fbc996"
    async with stack() as (peer, server):
        low = pod("low", 2, gpr="low", uid=victim1)
        low["spec"]["nodeName"] = "gpu-node-1"
        guarded = pod("guarded", 2, gpr="guarded", uid=victim2)
        guarded["spec"]["nodeName"] = "gpu-node-2"
        await seed(peer, node("gpu-node-1"), node("gpu-node-2"), low, guarded,
                   gpr("low", priority=50), gpr("guarded", priority=50, preemptible=False),
                   gpr("high", priority=250, reservation={"gpu-node-1": 2, "gpu-node-2": 2}))
        await wait_until(lambda: len(server.view.pods) == 2 and len(server.view.gprs) == 3)
        request["Pod"]["metadata"]["labels"]["accelstack.io/gpr"] = "high"
        status, body = await post(server, "preempt", json.dumps(request).encode())
        assert status == 200
        assert body == {"NodeNameToMetaVictims": {"gpu-node-1": {"Pods": [{"UID": victim1}], "NumPDBViolations": 0}}}
        # without a GPR the scheduler's own choice stands for unmanaged pods; the recorded answer shape matches
        plain = json.loads(recorded("b-preempt.request.json"))
        status, body = await post(server, "preempt", recorded("b-preempt.request.json"))
        assert status == 200 and set(body["NodeNameToMetaVictims"]) <= set(plain["NodeNameToVictims"])  # type: ignore[index]


async def test_bind_creates_binding_and_ledger_and_refuses_overallocation() -> None:
    async with stack() as (peer, server):
        await seed(peer, node("gpu-node-1", gpus=2), pod("a", 2, uid="uid-a"), pod("b", 1, uid="uid-b"))
        await wait_until(lambda: len(server.view.pods) == 2 and len(server.view.nodes) == 1)
        body = json.dumps({"PodName": "a", "PodNamespace": "default", "PodUID": "uid-a", "Node": "gpu-node-1"})
        status, result = await post(server, "bind", body.encode())
        assert (status, result) == (200, {"Error": ""})
        assert peer.bindings == [("default", "a", "gpu-node-1")]
        # the scheduler retries a bind whose answer it lost: the pod is already there, which is success
        status, result = await post(server, "bind", body.encode())
        assert (status, result) == (200, {"Error": ""}) and len(peer.bindings) == 1
        node_obj = peer.get("api/v1/nodes", "", "gpu-node-1")
        entries = orjson.loads(node_obj["metadata"]["annotations"][LEDGER_ANNOTATION])["pods"]  # type: ignore[index]
        assert entries["uid-a"]["r"] == {"nvidia.com/gpu": 2}
        alloc = peer.get("api/v1/pods", "default", "a")["metadata"]["annotations"]["accelstack.io/allocation"]  # type: ignore[index]
        assert json.loads(alloc)["node"] == "gpu-node-1"
        body = json.dumps({"PodName": "b", "PodNamespace": "default", "PodUID": "uid-b", "Node": "gpu-node-1"})
        status, result = await post(server, "bind", body.encode())
        assert status == 200 and "0 nvidia.com/gpu free, pod asks 1" in result["Error"]  # type: ignore[index]
        assert len(peer.bindings) == 1
        # the pod ends: its devices go back, and b now binds
        await peer.delete_object("api/v1/pods", "default", "a")
        await wait_until(lambda: "uid-a" not in server.view.nodes["gpu-node-1"].ledger)
        status, result = await post(server, "bind", body.encode())
        assert result == {"Error": ""}
        # wrong UID and unknown pod are refused with a reason
        bad = json.dumps({"PodName": "b", "PodNamespace": "default", "PodUID": "other", "Node": "gpu-node-1"})
        status, result = await post(server, "bind", bad.encode())
        assert status == 200 and "has UID uid-b, not other" in result["Error"]  # type: ignore[index]
        missing = json.dumps({"PodName": "zz", "PodNamespace": "default", "PodUID": "u", "Node": "gpu-node-1"})
        status, result = await post(server, "bind", missing.encode())
        assert "not found" in result["Error"]  # type: ignore[index]


@pytest.mark.parametrize(("verb", "body", "message"), [
    ("filter", b"{not json", "filter: malformed request"),
    ("filter", b'{"Pod": 5, "NodeNames": []}', "got `int` - at `$.Pod`"),
    ("filter", b'{"Pod": {"metadata": {}}, "NodeNames": "n1"}', "got `str` - at `$.NodeNames`"),
    ("filter", b'{"Pod": {"metadata": {}}}', "neither NodeNames nor Nodes"),
    ("filter", b'{"NodeNames": ["a"]}', "Pod is missing"),
    ("filter", b"[]", "Expected `object`, got `array`"),
    ("prioritize", b'{"Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1.5"}}}]}}, "NodeNames": ["a"]}',
     "extended resources must be whole"),
    ("prioritize", b"", "malformed request"),
    ("preempt", b'{"Pod": {}, "NodeNameToMetaVictims": {"n": {"Pods": [{"UID": 3}]}}}', "Expected `str`, got `int`"),
    ("bind", b'{"PodName": "a"}', "missing required field"),
    ("bind", b'{"PodName": "a", "PodNamespace": "", "PodUID": "u", "Node": "n"}', "PodNamespace is empty"),
    ("bind", b'{"PodName": 1, "PodNamespace": "d", "PodUID": "u", "Node": "n"}', "Expected `str`, got `int`"),
])
async def test_malformed_requests_get_400_with_error(verb: str, body: bytes, message: str) -> None:
    async with stack() as (_, server):
        status, result = await post(server, verb, body)
        assert status == 400
        assert message in result["Error"]  # type: ignore[index]


async def test_oversized_body_gets_413_and_health_endpoints() -> None:
    async with stack(max_body=1024) as (_, server):
        status, result = await post(server, "filter", filter_body(pod("p"), [f"node-{i}" for i in range(500)]))
        assert status == 413 and "size limit" in result["Error"]  # type: ignore[index]
        async with aiohttp.ClientSession() as http:
            for path, code in (("/healthz", 200), ("/readyz", 200)):
                async with http.get(f"http://127.0.0.1:{server.port}{path}") as r:
                    assert r.status == code
            async with http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                text = await r.text()
        assert 'accelstack_extender_bad_requests_total{verb="filter"} 1.0' in text
        assert "accelstack_extender_request_seconds_bucket" in text


async def test_sweep_adopts_bound_pods_and_releases_stale_entries() -> None:
    async with stack() as (peer, server):
        # a pod bound before accelstack ran (no ledger entry), and a ledger entry of a pod that is long gone
        # ... and one recorded a moment ago for a pod this replica's informer has not seen yet: it must stay
        stale = ('{"gone-uid": {"p": "default/gone", "r": {"nvidia.com/gpu": 2}, "t": 1}, '
                 f'"fresh-uid": {{"p": "default/fresh", "r": {{"nvidia.com/gpu": 1}}, "t": {time.time()}}}}}')
        n = node("gpu-node-1", gpus=4)
        n["metadata"]["annotations"] = {LEDGER_ANNOTATION: stale}
        await seed(peer, n, pod("early", 3, uid="early-uid", node_name="gpu-node-1", phase="Running"),
                   pod("late", 2, uid="late-uid"))
        await wait_until(lambda: len(server.view.pods) == 2 and len(server.view.nodes) == 1)
        _, body = await post(server, "filter", filter_body(pod("late", 1), ["gpu-node-1"]))
        assert body["NodeNames"] == ["gpu-node-1"]  # type: ignore[index]  # the ledger does not know "early" yet
        assert await server.sweep() == (1, 1)
        entries = orjson.loads(peer.get("api/v1/nodes", "", "gpu-node-1")["metadata"]["annotations"][LEDGER_ANNOTATION])["pods"]  # type: ignore[index]
        assert set(entries) == {"early-uid", "fresh-uid"} and entries["early-uid"]["r"] == {"nvidia.com/gpu": 3}
        _, body = await post(server, "filter", filter_body(pod("late", 1), ["gpu-node-1"]))
        assert body["FailedNodes"] == {"gpu-node-1": "0 nvidia.com/gpu free, pod asks 1"}  # type: ignore[index]


# ---- a view that lags behind the GPR's admission -----------------------------------------------------------
async def _silence_gpr_watch(peer, server) -> None:  # type: ignore[no-untyped-def]
    """From now on the GPR watch stays open and says nothing: what the API server stores next does not reach the
    view (a watch that lags behind, at its worst)."""
    peer.inject("GET", "gpuprovisioningrequests", watch=True, half_open=True)
    since = peer.mark()
    peer.compact()  # the open watches end (410); the GPR watch that follows the relist is the silent one
    await wait_until(lambda: peer.count("GET", "gpuprovisioningrequests", watch=True, since=since) >= 1)


async def test_filter_reads_a_gpr_afresh_when_the_view_has_not_seen_its_admission() -> None:
    """The controller stores the status, then lifts the gate; the scheduler may send the pod before the view's
    GPR watch brings the status. Refused, the pod would wait in kube-scheduler's unschedulable queue for some
    other cluster event; filter reads the GPR once and answers from the newer object."""
    async with stack() as (peer, server):
        await seed(peer, node("n1"), node("n2"), gpr("train", phase="Queued"))
        await wait_until(lambda: len(server.view.nodes) == 2 and "default/train" in server.view.gprs)
        await _silence_gpr_watch(peer, server)
        await peer.put_object("apis/accelstack.io/v1alpha1/gpuprovisioningrequests",
                              gpr("train", reservation={"n2": 2}), "MODIFIED")
        assert server.view.gprs["default/train"].phase == "Queued"  # the view has not seen it
        since = peer.mark()
        status, body = await post(server, "filter", filter_body(pod("p", 2, gpr="train"), ["n1", "n2"]))
        assert status == 200
        assert body["NodeNames"] == ["n2"]  # type: ignore[index]
        assert body["FailedAndUnresolvableNodes"] == {"n1": "not reserved for GPR default/train"}  # type: ignore[index]
        assert peer.count("GET", "gpuprovisioningrequests", name="train", watch=False, since=since) == 1
        assert server.view.gprs["default/train"].phase == "Admitted"  # bind judges from the same object
        assert server.extender.metrics.catch_up.labels("newer")._value.get() == 1
        # the next pod of the GPR: the view knows it now, no read
        status, body = await post(server, "filter", filter_body(pod("p2", 2, gpr="train"), ["n2"]))
        assert body["NodeNames"] == ["n2"]  # type: ignore[index]
        assert peer.count("GET", "gpuprovisioningrequests", name="train", watch=False, since=since) == 1


async def test_filter_reads_a_queued_gpr_at_most_once_a_second_and_never_waits_long() -> None:
    async with stack() as (peer, server):
        await seed(peer, node("n1"), gpr("queued", phase="Queued"))
        await wait_until(lambda: "default/queued" in server.view.gprs)
        since = peer.mark()
        for _ in range(5):  # a pod whose gate a user lifted by hand, retried by the scheduler
            status, body = await post(server, "filter", filter_body(pod("q", 1, gpr="queued"), ["n1"]))
            assert body["FailedAndUnresolvableNodes"] == {"n1": "GPR default/queued is Queued, not admitted"}  # type: ignore[index]
        assert peer.count("GET", "gpuprovisioningrequests", name="queued", watch=False, since=since) == 1
        assert server.extender.metrics.catch_up.labels("same")._value.get() == 1
        # an API server that does not answer: filter answers within the catch-up timeout, from the view
        server.extender._read_at.clear()
        peer.inject("GET", "gpuprovisioningrequests", name="queued", watch=False, hang=True)
        started = time.monotonic()
        status, body = await post(server, "filter", filter_body(pod("q", 1, gpr="queued"), ["n1"]))
        assert status == 200 and time.monotonic() - started < 2.0
        assert body["FailedAndUnresolvableNodes"] == {"n1": "GPR default/queued is Queued, not admitted"}  # type: ignore[index]
        assert server.extender.metrics.catch_up.labels("failed")._value.get() == 1
