"""The taint controller against the API-server peer through the project's client layer (``kubeapi``) over real
HTTP: condition on -> taint; off for less than the hold time -> taint kept; after -> removed."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeapi import KubeClient
from kubeapi.client import connected
from kubeapi.resources import NODES as NODE_RESOURCE
from npd.config import load
from npd.remediation import (
    CORDON_ANNOTATION,
    HEALTHY_SINCE_ANNOTATION,
    SINCE_ANNOTATION,
    TaintController,
    decide,
)
from tests.apiserver_peer import APIServerPeer

NODES = "api/v1/nodes"
KEY = "accelstack.io/unhealthy"


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(name: str, conditions: dict[str, tuple[str, float]], taints: list[dict[str, Any]] | None = None,
         capacity: dict[str, str] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {}},
            "spec": {"taints": taints} if taints else {},
            "status": {**({"capacity": capacity, "allocatable": capacity} if capacity else {}), "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastTransitionTime": iso(0)},
                *({"type": t, "status": s, "reason": "r", "lastTransitionTime": iso(at)}
                  for t, (s, at) in conditions.items())]}}


def settings(*flags: str) -> Any:
    return load(list(flags), environ={})[0].values


@pytest.fixture
async def api():
    peer = APIServerPeer()
    url = await peer.start()
    async with connected(url, field_manager="accelstack-remediation", timeout=2.0, backoff_base=0.05,
                         backoff_cap=0.2) as kube:
        yield peer, Core(kube)
    await peer.stop()


class Core:
    """The client as the tests use it: ``core.kube`` for the controller, ``read_node`` for a fresh Node."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    async def read_node(self, name: str) -> dict[str, Any]:
        return await self.kube.get(NODE_RESOURCE, name)


def taints_of(peer: APIServerPeer, name: str) -> list[dict[str, Any]]:
    return (peer.get(NODES, "", name) or {}).get("spec", {}).get("taints") or []


async def set_condition(peer: APIServerPeer, name: str, ctype: str, status: str, at: float) -> None:
    obj = peer.get(NODES, "", name)
    assert obj is not None
    for c in obj["status"]["conditions"]:
        if c["type"] == ctype:
            c.update(status=status, lastTransitionTime=iso(at))
    await peer.put_object(NODES, obj, "MODIFIED")


async def test_taint_hold_and_lift_with_a_controlled_clock(api) -> None:
    peer, core = api
    now = [1_800_000_000.0]
    controller = TaintController(core.kube, settings("--remediation-hold-time", "10m"), clock=lambda: now[0])
    other = {"key": "example.com/maintenance", "value": "x", "effect": "NoSchedule"}
    await peer.put_object(NODES, node("gpu-1", {"GPUUnhealthy": ("True", now[0] - 5)}, taints=[other]))
    await controller.reconcile(await core.read_node("gpu-1"))
    assert taints_of(peer, "gpu-1") == [other, {"key": KEY, "value": "GPUUnhealthy", "effect": "NoSchedule"}]
    assert peer.get(NODES, "", "gpu-1")["metadata"]["annotations"][SINCE_ANNOTATION] == iso(now[0])

    # the GPU recovers; 9 minutes later the taint is still there
    await set_condition(peer, "gpu-1", "GPUUnhealthy", "False", now[0])
    now[0] += 540
    decision = await controller.reconcile(await core.read_node("gpu-1"))
    assert decision.taint is None and decision.wake_in == pytest.approx(60)
    assert any(t["key"] == KEY for t in taints_of(peer, "gpu-1"))
    # it flaps: True again, then False again -> the hold starts over from the last transition
    await set_condition(peer, "gpu-1", "GPUUnhealthy", "True", now[0])
    await controller.reconcile(await core.read_node("gpu-1"))
    await set_condition(peer, "gpu-1", "GPUUnhealthy", "False", now[0] + 1)
    now[0] += 601 - 60
    await controller.reconcile(await core.read_node("gpu-1"))
    assert any(t["key"] == KEY for t in taints_of(peer, "gpu-1"))
    now[0] += 61
    decision = await controller.reconcile(await core.read_node("gpu-1"))
    assert decision.taint is False
    assert taints_of(peer, "gpu-1") == [other]  # only our taint goes
    events = [o for (r, _, _), o in peer.objects.items() if r == "api/v1/events"]
    assert [(e["reason"], e["type"], e["involvedObject"]["name"]) for e in
            sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"]))] == [
        ("AccelstackTainted", "Warning", "gpu-1"), ("AccelstackUntainted", "Normal", "gpu-1")]
    assert events[0]["message"].startswith("added taint accelstack.io/unhealthy:NoSchedule: GPUUnhealthy True")
    assert SINCE_ANNOTATION not in (peer.get(NODES, "", "gpu-1")["metadata"].get("annotations") or {})


async def test_unknown_keeps_the_taint_and_healthy_nodes_are_left_alone(api) -> None:
    peer, core = api
    now = 1_800_000_000.0
    controller = TaintController(core.kube, settings("--remediation-hold-time", "1s"), clock=lambda: now)
    await peer.put_object(NODES, node("nr1-1", {"NR1Unhealthy": ("Unknown", 0)},
                                      taints=[{"key": KEY, "value": "NR1Unhealthy", "effect": "NoSchedule"}]))
    await peer.put_object(NODES, node("fine", {"GPUUnhealthy": ("False", 0)}))
    before = len(peer.requests)
    assert (await controller.reconcile(await core.read_node("nr1-1"))).taint is None
    assert (await controller.reconcile(await core.read_node("fine"))).taint is None
    assert [m for m, _ in peer.requests[before:]] == ["GET", "GET"]  # no writes
    assert taints_of(peer, "nr1-1")


async def npd_restart(peer: APIServerPeer, name: str, at: float) -> None:
    """What node-problem-detector does when it starts (initialConditions): every condition of its monitors False,
    reason and message back to the defaults, lastTransitionTime now, whatever the status was."""
    obj = peer.get(NODES, "", name)
    assert obj is not None
    for c in obj["status"]["conditions"]:
        if c["type"] in ("GPUUnhealthy", "NR1Unhealthy"):
            c.update(status="False", reason="default", message="default", lastTransitionTime=iso(at))
    await peer.put_object(NODES, obj, "MODIFIED")


def annotations_of(peer: APIServerPeer, name: str) -> dict[str, str]:
    return (peer.get(NODES, "", name) or {}).get("metadata", {}).get("annotations") or {}


async def test_npd_restart_in_the_middle_of_a_hold_does_not_restart_it(api) -> None:
    peer, core = api
    now = [1_800_000_000.0]
    controller = TaintController(core.kube, settings("--remediation-hold-time", "10m"), clock=lambda: now[0])
    gpus = {"nvidia.com/gpu": "8"}
    await peer.put_object(NODES, node("gpu-r", {"GPUUnhealthy": ("True", now[0])}, capacity=gpus))
    await controller.reconcile(await core.read_node("gpu-r"))
    assert taints_of(peer, "gpu-r")
    recovered = now[0] + 60
    await set_condition(peer, "gpu-r", "GPUUnhealthy", "False", recovered)
    now[0] = recovered + 5
    decision = await controller.reconcile(await core.read_node("gpu-r"))
    assert decision.wake_in == pytest.approx(595)
    assert annotations_of(peer, "gpu-r")[HEALTHY_SINCE_ANNOTATION] == iso(recovered)
    # 4 minutes into the hold NPD restarts (a DaemonSet rollout): still False, but a new transition time
    now[0] = recovered + 240
    await npd_restart(peer, "gpu-r", now[0])
    decision = await controller.reconcile(await core.read_node("gpu-r"))
    assert decision.taint is None and decision.wake_in == pytest.approx(360)  # not 600: the hold goes on
    # a controller restart meanwhile changes nothing either: the annotation is on the node
    controller = TaintController(core.kube, settings("--remediation-hold-time", "10m"), clock=lambda: now[0])
    now[0] = recovered + 599
    assert (await controller.reconcile(await core.read_node("gpu-r"))).taint is None
    assert taints_of(peer, "gpu-r")
    now[0] = recovered + 601
    assert (await controller.reconcile(await core.read_node("gpu-r"))).taint is False
    assert not taints_of(peer, "gpu-r")
    assert not {SINCE_ANNOTATION, HEALTHY_SINCE_ANNOTATION} & set(annotations_of(peer, "gpu-r"))


async def test_a_real_flap_or_unknown_during_the_hold_restarts_it(api) -> None:
    peer, core = api
    now = [1_800_000_000.0]
    controller = TaintController(core.kube, settings("--remediation-hold-time", "10m"), clock=lambda: now[0])
    gpus = {"nvidia.com/gpu": "8"}
    await peer.put_object(NODES, node("gpu-f", {"GPUUnhealthy": ("True", now[0])}, capacity=gpus))
    await controller.reconcile(await core.read_node("gpu-f"))
    await set_condition(peer, "gpu-f", "GPUUnhealthy", "False", now[0] + 10)
    now[0] += 20
    await controller.reconcile(await core.read_node("gpu-f"))
    for status in ("True", "Unknown"):  # the controller sees the break: the annotation goes
        now[0] += 100
        await set_condition(peer, "gpu-f", "GPUUnhealthy", status, now[0])
        await controller.reconcile(await core.read_node("gpu-f"))
        assert HEALTHY_SINCE_ANNOTATION not in annotations_of(peer, "gpu-f")
        assert taints_of(peer, "gpu-f")
        await set_condition(peer, "gpu-f", "GPUUnhealthy", "False", now[0] + 1)
        decision = await controller.reconcile(await core.read_node("gpu-f"))
        assert decision.wake_in == pytest.approx(601)
    events = [o["reason"] for (r, _, _), o in peer.objects.items() if r == "api/v1/events"]
    assert events == ["AccelstackTainted"]  # tainted once, never untainted


async def test_unknown_for_a_resource_the_node_lacks_neither_taints_nor_keeps_the_taint(api) -> None:
    """An NR1-only node whose GPU check runs without NVML: GPUUnhealthy Unknown for ever. The taint NR1 caused
    goes when NR1 has been healthy for the hold time."""
    peer, core = api
    now = [1_800_000_000.0]
    controller = TaintController(core.kube, settings("--remediation-hold-time", "10m"), clock=lambda: now[0])
    nr1_only = {"cpu": "64", "memory": "512Gi", "neureality.com/nr1": "4"}
    await peer.put_object(NODES, node("nr1-only", {"GPUUnhealthy": ("Unknown", now[0]),
                                                   "NR1Unhealthy": ("False", now[0])}, capacity=nr1_only))
    assert (await controller.reconcile(await core.read_node("nr1-only"))).taint is None
    assert not taints_of(peer, "nr1-only")  # Unknown does not taint
    await set_condition(peer, "nr1-only", "NR1Unhealthy", "True", now[0])
    assert (await controller.reconcile(await core.read_node("nr1-only"))).taint is True
    assert [t["value"] for t in taints_of(peer, "nr1-only")] == ["NR1Unhealthy"]
    await set_condition(peer, "nr1-only", "NR1Unhealthy", "False", now[0] + 30)
    now[0] += 31
    assert (await controller.reconcile(await core.read_node("nr1-only"))).wake_in == pytest.approx(599)
    now[0] += 600
    assert (await controller.reconcile(await core.read_node("nr1-only"))).taint is False
    assert not taints_of(peer, "nr1-only")


async def test_unknown_for_a_resource_the_node_has_keeps_the_taint_but_never_adds_one(api) -> None:
    peer, core = api
    now = [1_800_000_000.0]
    controller = TaintController(core.kube, settings("--remediation-hold-time", "1m"), clock=lambda: now[0])
    both = {"nvidia.com/gpu": "0", "neureality.com/nr1": "4"}  # GPUs gone from the device plugin: still a GPU node
    await peer.put_object(NODES, node("mixed", {"GPUUnhealthy": ("Unknown", now[0]),
                                                "NR1Unhealthy": ("False", now[0])}, capacity=both))
    assert (await controller.reconcile(await core.read_node("mixed"))).taint is None
    assert not taints_of(peer, "mixed")
    await set_condition(peer, "mixed", "NR1Unhealthy", "True", now[0])
    await controller.reconcile(await core.read_node("mixed"))
    await set_condition(peer, "mixed", "NR1Unhealthy", "False", now[0] + 1)
    now[0] += 3600
    decision = await controller.reconcile(await core.read_node("mixed"))
    assert decision.taint is None and "GPUUnhealthy Unknown" in decision.why
    assert taints_of(peer, "mixed")


async def test_conflicting_write_is_retried_on_a_fresh_read(api) -> None:
    peer, core = api
    controller = TaintController(core.kube, settings(), clock=time.time)
    await peer.put_object(NODES, node("gpu-2", {"GPUUnhealthy": ("True", 0)}))
    stale = await core.read_node("gpu-2")
    obj = peer.get(NODES, "", "gpu-2")
    obj["spec"]["taints"] = [{"key": "someone/else", "effect": "NoExecute"}]
    await peer.put_object(NODES, obj, "MODIFIED")  # another writer added a taint meanwhile
    await controller.reconcile(stale)
    assert [t["key"] for t in taints_of(peer, "gpu-2")] == ["someone/else", KEY]
    assert ("PATCH", "/api/v1/nodes/gpu-2?fieldManager=accelstack-remediation") in peer.requests
    assert peer.count(method="PATCH", resource="nodes", status=409) == 1  # the stale write was refused


async def test_cordon_is_optional_and_undone_only_when_ours(api) -> None:
    peer, core = api
    now = [1_800_000_000.0]
    controller = TaintController(core.kube, settings("--remediation-cordon", "true", "--remediation-hold-time", "0"),
                                 clock=lambda: now[0])
    await peer.put_object(NODES, node("gpu-3", {"GPUUnhealthy": ("True", now[0])}))
    await controller.reconcile(await core.read_node("gpu-3"))
    stored = peer.get(NODES, "", "gpu-3")
    assert stored["spec"]["unschedulable"] is True and stored["metadata"]["annotations"][CORDON_ANNOTATION] == "true"
    await set_condition(peer, "gpu-3", "GPUUnhealthy", "False", now[0])
    now[0] += 1
    await controller.reconcile(await core.read_node("gpu-3"))
    stored = peer.get(NODES, "", "gpu-3")
    assert "unschedulable" not in stored["spec"] and not taints_of(peer, "gpu-3")
    # without the option nothing is cordoned
    plain = TaintController(core.kube, settings(), clock=lambda: now[0])
    await peer.put_object(NODES, node("gpu-4", {"GPUUnhealthy": ("True", now[0])}))
    await plain.reconcile(await core.read_node("gpu-4"))
    assert "unschedulable" not in peer.get(NODES, "", "gpu-4")["spec"]


async def test_drain_evicts_pods_using_managed_resources(api) -> None:
    peer, core = api
    evicted: list[str] = []

    def eviction(request, body):
        from aiohttp import web

        evicted.append(body["metadata"]["name"])
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success"}, status=201)

    peer.hooks["POST pods/eviction"] = eviction

    def pod(name: str, node_name: str, resources: dict | None, daemonset: bool = False) -> dict:
        meta: dict[str, Any] = {"name": name, "namespace": "ml"}
        if daemonset:
            meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u"}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": node_name, "containers": [
            {"name": "c", "image": "i", "resources": {"limits": resources} if resources else {}}]}}

    for obj in (pod("trainer", "gpu-5", {"nvidia.com/gpu": "1"}), pod("web", "gpu-5", None),
                pod("elsewhere", "gpu-6", {"nvidia.com/gpu": "1"}),
                pod("exporter", "gpu-5", {"nvidia.com/gpu": "1"}, daemonset=True)):
        await peer.put_object("api/v1/pods", obj)
    await peer.put_object(NODES, node("gpu-5", {"GPUUnhealthy": ("True", 0)}))
    controller = TaintController(core.kube, settings("--remediation-drain", "true"))
    await controller.reconcile(await core.read_node("gpu-5"))
    assert evicted == ["trainer"]
    await controller.reconcile(await core.read_node("gpu-5"))  # already tainted: no second drain
    assert evicted == ["trainer"]


async def test_controller_loop_end_to_end(api) -> None:
    """Watch-driven: condition on -> taint; off for less than the hold -> kept; after the hold -> removed."""
    peer, core = api
    await peer.put_object(NODES, node("gpu-7", {"GPUUnhealthy": ("False", 0)}))
    controller = TaintController(core.kube, settings("--remediation-hold-time", "2s", "--remediation-resync", "30s"))
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await asyncio.sleep(0.3)
        assert not taints_of(peer, "gpu-7")
        await set_condition(peer, "gpu-7", "GPUUnhealthy", "True", time.time())
        await wait_for(lambda: bool(taints_of(peer, "gpu-7")), 3)
        off_at = time.time()
        await set_condition(peer, "gpu-7", "GPUUnhealthy", "False", off_at)
        await asyncio.sleep(1.0)
        assert taints_of(peer, "gpu-7"), "lifted before the hold time"
        await wait_for(lambda: not taints_of(peer, "gpu-7"), 5)
        assert time.time() - off_at >= 1.0  # lastTransitionTime has whole seconds
        await wait_for(lambda: controller.tainted == set(), 2)  # counted after its Event is written
    finally:
        stop.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_controller_loop_npd_restart_during_the_hold(api) -> None:
    """Watch-driven, real time: NPD restarts 1.5 s into a 3 s hold; the taint still goes 3 s after the recovery,
    not 3 s after the restart."""
    peer, core = api
    await peer.put_object(NODES, node("gpu-9", {"GPUUnhealthy": ("True", time.time())},
                                      capacity={"nvidia.com/gpu": "8"}))
    controller = TaintController(core.kube, settings("--remediation-hold-time", "3s", "--remediation-resync", "30s"))
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await wait_for(lambda: bool(taints_of(peer, "gpu-9")), 3)
        off_at = float(int(time.time()))  # lastTransitionTime has whole seconds
        await set_condition(peer, "gpu-9", "GPUUnhealthy", "False", off_at)
        await wait_for(lambda: HEALTHY_SINCE_ANNOTATION in annotations_of(peer, "gpu-9"), 3)
        while time.time() < off_at + 1.5:
            await asyncio.sleep(0.05)
        await npd_restart(peer, "gpu-9", time.time())
        await wait_for(lambda: not taints_of(peer, "gpu-9"), 4)
        assert off_at + 3 <= time.time() < off_at + 4.4
    finally:
        stop.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def wait_for(predicate, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_decide_table() -> None:
    c = lambda t, s, at: {"type": t, "status": s, "lastTransitionTime": iso(at)}  # noqa: E731
    watched = ["GPUUnhealthy", "NR1Unhealthy"]
    both = [c("GPUUnhealthy", "True", 0), c("NR1Unhealthy", "True", 0)]
    assert decide(both, False, watched, 60, 100).value == "GPUUnhealthy_NR1Unhealthy"
    assert decide([c("Ready", "False", 0)], True, watched, 60, 100).taint is None  # nothing watched on the node
    assert decide([c("GPUUnhealthy", "False", 50)], True, watched, 60, 100).wake_in == pytest.approx(10)
    assert decide([c("GPUUnhealthy", "False", 40)], True, watched, 60, 100).taint is False
    mixed = [c("GPUUnhealthy", "False", 0), c("NR1Unhealthy", "False", 90)]
    assert decide(mixed, True, watched, 60, 100).taint is None  # the later transition counts


async def test_controller_recovers_from_watch_history_compaction(api) -> None:
    peer, core = api
    await peer.put_object(NODES, node("gpu-8", {"GPUUnhealthy": ("False", 0)}))
    controller = TaintController(core.kube, settings("--remediation-hold-time", "1s", "--remediation-resync", "30s"))
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await asyncio.sleep(0.3)
        peer.compact()  # the watch's resourceVersion is now too old: 410 Gone on the next watch
        for i in range(3):
            await peer.put_object("api/v1/namespaces", {"metadata": {"name": f"churn-{i}"}})
        await set_condition(peer, "gpu-8", "GPUUnhealthy", "True", time.time())
        await wait_for(lambda: bool(taints_of(peer, "gpu-8")), 5)
    finally:
        stop.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@given(st.lists(st.tuples(st.sampled_from(["GPUUnhealthy", "NR1Unhealthy", "Ready"]),
                          st.sampled_from(["True", "False", "Unknown"]), st.integers(0, 1000)), max_size=4),
       st.booleans(), st.integers(0, 600), st.integers(0, 2000), st.none() | st.integers(0, 2000),
       st.none() | st.sets(st.sampled_from(["nvidia.com/gpu", "neureality.com/nr1", "cpu"])))
def test_decide_invariants(conditions, tainted: bool, hold: int, now: int, healthy_since: int | None,
                           resources: set[str] | None) -> None:
    watched = ["GPUUnhealthy", "NR1Unhealthy"]
    about = {"GPUUnhealthy": "nvidia.com/gpu", "NR1Unhealthy": "neureality.com/nr1"}
    latest = {}
    for ctype, status, at in conditions:  # one condition per type, as on a Node
        latest[ctype] = {"type": ctype, "status": status, "lastTransitionTime": iso(at)}
    decision = decide(list(latest.values()), tainted, watched, hold, now, healthy_since=healthy_since,
                      resources=resources, about=about)
    present = [c for c in latest.values() if c["type"] in watched]
    if any(c["status"] == "True" for c in present):
        assert decision.taint is True
    if decision.taint is True:  # only True taints; Unknown never does
        assert any(c["status"] == "True" for c in present)
    if decision.taint is False:  # lifted only when every counted condition is False for at least the hold
        assert tainted and present
        for c in present:
            has = resources is None or about[c["type"]] in resources
            assert c["status"] == "False" or (c["status"] == "Unknown" and not has)
        if healthy_since is not None:
            assert now - healthy_since >= hold
        else:
            assert all(now - int(dt.datetime.fromisoformat(c["lastTransitionTime"].replace("Z", "+00:00"))
                                 .timestamp()) >= hold for c in present if c["status"] == "False")
    if not tainted:
        assert decision.taint is not False


def test_the_taint_value_of_many_conditions_is_a_valid_label_value() -> None:
    """Several long condition names joined were over 63 bytes: the API server refused the taint (422) on every
    reconcile and the node was never tainted. The value keeps whole names that fit, then how many more."""
    import re

    from npd.remediation import decide, taint_value

    names = [f"Accelerator{i}MemoryUncorrectableErrors" for i in range(5)]
    conds = [{"type": n, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"} for n in names]
    d = decide(conds, tainted=False, watched=names, hold=150, now=0.0)
    assert d.taint is True and len(d.value) <= 63, d.value
    assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", d.value), d.value
    assert d.value == "Accelerator0MemoryUncorrectableErrors_4more"
    assert taint_value(["GPUUnhealthy", "NR1Unhealthy"]) == "GPUUnhealthy_NR1Unhealthy"  # short: as before
    assert taint_value(["X" * 80]) == "X" * 63
    assert len(taint_value(["A" * 62, "B"])) <= 63
