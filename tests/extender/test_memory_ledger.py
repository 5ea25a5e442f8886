"""Ledger "memory" (``--ledger=memory``): one replica binds at a time, the holder of the binder Lease; the ledger is
its memory and the pods' own allocations, so a bind is one API call (the Binding) instead of a conditional Node
patch and then the Binding. The view records every live pod bound to a node and keeps the binder's entries for
pods whose Binding is on the way; node events never touch it; a replica that takes the Lease over reads every pod
afresh before it binds; a replica without it answers the verbs 503 and closes the connection."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import ClusterView
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, pod, stack, wait_until
from tests.extender.test_extender_http import seed

GPU = "nvidia.com/gpu"


def _with_stale_ledger(name: str) -> dict[str, Any]:
    obj = node(name, gpus=8)
    obj["metadata"]["annotations"] = {ledger.LEDGER_ANNOTATION: ledger.render(
        {"old": ledger.Entry("old", "default/old", {GPU: 8}, "", 1.0)})}
    return obj


def _entry(uid: str) -> ledger.Entry:
    return ledger.Entry(uid, f"default/{uid}", {GPU: 1}, "default/g", 5.0)


def test_the_view_records_the_pods_bound_and_keeps_the_binders_entries() -> None:
    view = ClusterView(ledger="memory")
    view.on_node("ADDED", _with_stale_ledger("n0"))
    view.on_node("ADDED", node("n1", gpus=8))
    assert view.nodes["n0"].ledger == {}  # a Node's annotation is not the ledger here
    view.on_pod("ADDED", pod("a", 2, uid="a", node_name="n0", phase="Running"))
    assert set(view.nodes["n0"].ledger) == {"a"} and view.nodes["n0"].used == {GPU: 2}
    view.on_node("MODIFIED", _with_stale_ledger("n0"))  # a heartbeat: what the pods hold stays
    assert set(view.nodes["n0"].ledger) == {"a"}
    # the binder records a pod it is binding; the pod's own events do not take it back before its Binding shows
    view.set_ledger("n0", {**view.nodes["n0"].ledger, "b": _entry("b")})
    view.on_pod("ADDED", pod("b", 1, uid="b", gpr="g"))
    assert set(view.nodes["n0"].ledger) == {"a", "b"} and view.recorded["b"] == "n0"
    view.on_pod("MODIFIED", pod("b", 1, uid="b", gpr="g", node_name="n0"))
    assert view.nodes["n0"].ledger["b"] == _entry("b")  # the binder's entry, as it made it
    # ended, deleted, or bound elsewhere: out
    view.on_pod("MODIFIED", pod("a", 2, uid="a", node_name="n0", phase="Succeeded"))
    assert set(view.nodes["n0"].ledger) == {"b"}
    view.on_pod("ADDED", pod("c", 1, uid="c", node_name="n1"))
    view.on_pod("DELETED", pod("b", 1, uid="b", gpr="g", node_name="n0"))
    assert view.nodes["n0"].ledger == {} and set(view.nodes["n1"].ledger) == {"c"}
    # a relist of the pods: the bound ones recorded, the binder's entry for a pod not bound yet kept, the rest gone
    view.set_ledger("n0", {"d": _entry("d"), "gone": _entry("gone")})
    view.sync_pods([pod("c", 1, uid="c", node_name="n1"), pod("d", 1, uid="d", gpr="g"),
                    pod("e", 4, uid="e", node_name="n0")])
    assert set(view.nodes["n0"].ledger) == {"d", "e"} and set(view.nodes["n1"].ledger) == {"c"}
    assert view.recorded == {"c": "n1", "d": "n0", "e": "n0"}
    # a relist of the nodes keeps what the pods hold
    view.sync_nodes([_with_stale_ledger("n0"), node("n1", gpus=8)])
    assert set(view.nodes["n0"].ledger) == {"d", "e"} and view.recorded["e"] == "n0"
    # a pod bound to a node the view has not seen yet (the pod informer ran ahead), which ends before the node
    # shows: nothing of it is left for the node when it comes
    view.on_pod("ADDED", pod("f", 1, uid="f", node_name="n2", phase="Running"))
    view.on_pod("MODIFIED", pod("f", 1, uid="f", node_name="n2", phase="Failed"))
    view.on_pod("ADDED", pod("g", 2, uid="g", node_name="n2", phase="Running"))
    view.on_node("ADDED", node("n2", gpus=8))
    assert set(view.nodes["n2"].ledger) == {"g"} and view.recorded["g"] == "n2" and "f" not in view.held_at
    with pytest.raises(ValueError, match="ledger must be one of node, memory"):
        ClusterView(ledger="etcd")


async def _binding(server: Any) -> None:
    await wait_until(lambda: server.binding, timeout=10)


async def _post(port: int, verb: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{port}/scheduler/{verb}", data=json.dumps(body),
            headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None), r.headers.get("Connection", "")


def _bind(name: str, node_name: str) -> dict[str, Any]:
    return {"PodName": name, "PodNamespace": "default", "PodUID": name, "Node": node_name}


async def test_a_bind_is_one_api_call_and_the_devices_are_held_in_memory() -> None:
    async with stack(ledger="memory", lease_seconds=2) as (peer, server):
        await _binding(server)
        await seed(peer, node("n0", gpus=2), gpr("g", reservation={"n0": 2}, devices=2),
                   pod("a", 1, gpr="g", uid="a"), pod("b", 1, gpr="g", uid="b"), pod("c", 1, gpr="g", uid="c"))
        await wait_until(lambda: len(server.view.pods) == 3 and "default/g" in server.view.gprs)
        mark = peer.mark()
        assert (await _post(server.port, "bind", _bind("a", "n0")))[1] == {"Error": ""}
        writes = [(r.method, r.plural, r.subresource) for r in peer.calls(since=mark)
                  if r.method != "GET" and r.plural != "leases"]
        assert writes == [("POST", "pods", "binding")]  # no Node patch
        assert "a" in server.view.nodes["n0"].ledger
        assert (await _post(server.port, "bind", _bind("b", "n0")))[1] == {"Error": ""}
        status, answer, _ = await _post(server.port, "bind", _bind("c", "n0"))
        assert status == 200 and "reservation here is used up" in answer["Error"]  # the memory is the guarantee
        annotations = peer.get("api/v1/pods", "default", "a")["metadata"]["annotations"]  # type: ignore[index]
        assert json.loads(annotations["accelstack.io/allocation"])["node"] == "n0"  # rode on the Binding
        node_annotations = peer.get("api/v1/nodes", "", "n0")["metadata"].get("annotations") or {}  # type: ignore[index]
        assert ledger.LEDGER_ANNOTATION not in node_annotations


async def test_one_replica_binds_and_the_next_takes_over_with_what_the_pods_hold() -> None:
    peer = APIServerPeer()
    await peer.start()
    try:
        await seed(peer, node("n0", gpus=2), gpr("g", reservation={"n0": 2}, devices=2),
                   pod("a", 1, gpr="g", uid="a"), pod("b", 1, gpr="g", uid="b"), pod("c", 1, gpr="g", uid="c"))
        async with stack(peer, ledger="memory", lease_seconds=2, identity="first") as (_, first):
            await _binding(first)
            async with stack(peer, ledger="memory", lease_seconds=2, identity="second") as (_, second):
                await wait_until(lambda: len(second.view.pods) == 3 and "default/g" in second.view.gprs)
                await asyncio.sleep(0.5)  # a few retry periods: the second does not take the Lease while it is held
                assert first.binding and not second.binding
                status, answer, connection = await _post(second.port, "bind", _bind("a", "n0"))
                assert status == 503 and "not the active binder" in answer["Error"]
                assert connection.lower() == "close"  # kube-scheduler's next connection is routed anew
                status, answer, _ = await _post(second.port, "filter", {"Pod": pod("a", 1, gpr="g", uid="a"),
                                                                        "NodeNames": ["n0"]})
                assert status == 503
                assert (await _post(first.port, "bind", _bind("a", "n0")))[1] == {"Error": ""}
                await first.stop()  # gives the Lease up: the second takes over without waiting for it to expire
                await _binding(second)
                # the first's bind is in the second's ledger from its read of the pods at the start of its term
                assert "a" in second.view.nodes["n0"].ledger
                assert (await _post(second.port, "bind", _bind("b", "n0")))[1] == {"Error": ""}
                status, answer, _ = await _post(second.port, "bind", _bind("c", "n0"))
                assert "reservation here is used up" in answer["Error"]
        bound = [obj["metadata"]["name"] for (kind, _, _), obj in peer.objects.items()
                 if kind == "api/v1/pods" and obj["spec"].get("nodeName")]
        assert sorted(bound) == ["a", "b"]
    finally:
        await peer.stop()


async def test_a_new_binder_waits_for_the_pods_the_last_one_sent_before_it_offers_their_devices() -> None:
    """kube-scheduler binds a pod itself after the binder's filter offered it a node and claimed its devices; that
    claim goes with the binder. The next binder waits ``handover_settle`` before it answers the verbs, so a pod
    the last one sent and kube-scheduler bound meanwhile is in its ledger before it offers anything: a GPR with a
    share of 2 on n0 and pod a bound there during the handover leaves b the last device and c nothing."""
    peer = APIServerPeer()
    await peer.start()
    try:
        await seed(peer, node("n0", gpus=2), node("n1", gpus=8), gpr("g", reservation={"n0": 2}, devices=2),
                   pod("a", 1, gpr="g", uid="a"), pod("b", 1, gpr="g", uid="b"), pod("c", 1, gpr="g", uid="c"))
        async with stack(peer, ledger="memory", lease_seconds=2, identity="first") as (_, first):
            await _binding(first)
            async with stack(peer, ledger="memory", lease_seconds=2, identity="second") as (_, second):
                second.handover_settle = 1.0
                await wait_until(lambda: len(second.view.pods) == 3 and "default/g" in second.view.gprs)
                offer = await _post(first.port, "filter", {"Pod": pod("a", 1, gpr="g", uid="a"),
                                                           "NodeNames": ["n0", "n1"]})
                assert offer[1]["NodeNames"] == ["n0"]
                handed = asyncio.get_running_loop().time()  # before the Lease can go: a lower bound
                await first.stop()  # the Lease handed over at once; a's Binding still to come
                a = peer.get("api/v1/pods", "default", "a")
                assert a is not None
                await asyncio.sleep(0.2)
                assert not second.binding  # still settling: no verbs answered
                await peer.put_object("api/v1/pods", {**a, "spec": {**a["spec"], "nodeName": "n0"}}, "MODIFIED")
                await _binding(second)
                assert asyncio.get_running_loop().time() - handed >= second.handover_settle
                assert "a" in second.view.nodes["n0"].ledger
                for uid, nodes in (("b", ["n0"]), ("c", [])):
                    status, answer, _ = await _post(second.port, "filter", {"Pod": pod(uid, 1, gpr="g", uid=uid),
                                                                            "NodeNames": ["n0", "n1"]})
                    assert status == 200 and (answer["NodeNames"] or []) == nodes, answer
    finally:
        await peer.stop()


async def test_a_node_the_binder_reads_itself_takes_the_pods_ledger_not_the_annotation() -> None:
    """A bind for a node the informer has not delivered yet reads the Node; an old accelstack.io/ledger annotation
    on it (left by --ledger=node) must not become the ledger."""
    import types

    from scheduler_extender.extender.binder import Binder

    async def get_node(name: str) -> dict[str, Any]:
        return _with_stale_ledger(name)

    view = ClusterView(ledger="memory")
    view.on_pod("ADDED", pod("a", 1, uid="a", node_name="n9", phase="Running"))
    binder = Binder(types.SimpleNamespace(get_node=get_node), view)  # type: ignore[arg-type]
    await binder._fresh_node("n9")
    assert set(view.nodes["n9"].ledger) == {"a"} and view.nodes["n9"].used == {GPU: 1}
