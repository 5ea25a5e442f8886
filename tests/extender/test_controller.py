"""The GPR controller end to end against the API-server peer: admission, gates, status, life cycle, eviction
through the Eviction API with a PodDisruptionBudget refusal, leader election, the REST API."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import time
import types
import warnings
from typing import Any

import aiohttp

from scheduler_extender.controller.gpr_controller import ControllerMetrics, GPRController
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, pod, stack, wait_until

GPRS = "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"
FAST: dict[str, Any] = {"resync": 0.05, "lease_seconds": 2, "run_controller": True, "evict_every": 0.2}


def status(peer: APIServerPeer, name: str) -> dict[str, Any]:
    obj = peer.get(GPRS, "default", name)
    return (obj or {}).get("status") or {}


async def set_phase(peer: APIServerPeer, name: str, phase: str, node_name: str = "", at: float | None = None) -> None:
    obj = peer.get("api/v1/pods", "default", name)
    assert obj is not None
    status: dict[str, Any] = {"phase": phase}
    if phase in ("Succeeded", "Failed"):  # as the kubelet reports it: when the container ended
        status["containerStatuses"] = [{"name": "main", "state": {"terminated": {
            "exitCode": 0 if phase == "Succeeded" else 1,
            "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))}}}]
    obj = dict(obj, status=status)
    if node_name:
        obj["spec"] = dict(obj["spec"], nodeName=node_name)
    await peer.put_object("api/v1/pods", obj, "MODIFIED")


async def seed_nodes(peer: APIServerPeer, count: int = 2) -> None:
    for i in range(count):
        await peer.put_object("api/v1/nodes", node(f"n{i}", gpus=4, labels={"nvidia.com/gpu.product": "H100"}))


async def test_admission_gate_status_and_life_cycle() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer)
    await peer.put_object(GPRS, gpr("train", phase=None, devices=4, priority=150, exitDuration="2h"))
    await peer.put_object("api/v1/pods", pod("train-0", 4, gpr="train", gated=True))
    async with stack(peer, **FAST) as (_, server):
        await wait_until(lambda: status(peer, "train").get("phase") == "Admitted")
        st = status(peer, "train")
        assert st["reservation"] == [{"node": st["reservedNodes"][0], "devices": 4}] and st["admittedAt"]
        await wait_until(lambda: not peer.get("api/v1/pods", "default", "train-0")["spec"].get("schedulingGates"))  # type: ignore[index]
        # a second, wider GPR waits: position 1, estimated start when train's exitDuration ends
        await peer.put_object(GPRS, gpr("wide", phase=None, devices=4, nodes=2, priority=100, exitDuration="1h"))
        await wait_until(lambda: status(peer, "wide").get("queuePosition") == 1)
        assert status(peer, "wide")["phase"] == "Queued" and status(peer, "wide")["estimatedStart"]
        async with aiohttp.ClientSession(headers=admin(peer)) as http:
            async with http.post(f"http://127.0.0.1:{server.port}/api/v1/waittime",
                                 json={"namespace": "default", "spec": {"devicesPerNode": 1}}) as r:
                estimate = await r.json()
            assert r.status == 200 and estimate["queuePosition"] == 2 and estimate["estimable"]
            # behind "wide": its calibrated P10-P90 range carries over (issue 12)
            rng = estimate["estimatedStartRange"]
            assert rng["earliest"] <= estimate["estimatedStart"] <= rng["latest"]
            assert status(peer, "wide")["estimatedStartRange"]["latest"] == rng["latest"]
        await set_phase(peer, "train-0", "Running", st["reservedNodes"][0])
        await wait_until(lambda: status(peer, "train").get("phase") == "Running")
        await set_phase(peer, "train-0", "Succeeded")
        await wait_until(lambda: status(peer, "train").get("phase") == "Complete")
        await wait_until(lambda: status(peer, "wide").get("phase") == "Admitted")
        assert sorted(status(peer, "wide")["reservedNodes"]) == ["n0", "n1"]
        await wait_until(lambda: {"Admitted", "Completed"} <= {e["reason"] for (r, _, _), e in peer.objects.items()
                                                               if r == "api/v1/events"})
    await peer.stop()


async def test_an_auto_gpr_admitted_at_once_gets_no_admitted_event() -> None:
    """One API write less per pod of an auto-GPR: admitted by the pass that first saw it, its pod's Scheduled
    Event is the record. A GPR made by hand, and an auto-GPR that waited first, still get ``Admitted``."""
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)
    # three priority levels (1-100, 101-200, 201-300), so the order of admission is known
    auto = gpr("auto-now", phase=None, devices=4, priority=250, exitDuration="1h")
    auto["metadata"]["labels"] = {"accelstack.io/auto-gpr": "true"}
    await peer.put_object(GPRS, auto)
    await peer.put_object(GPRS, gpr("by-hand", phase=None, devices=4, priority=150, exitDuration="1h"))
    waits = gpr("auto-later", phase=None, devices=4, priority=50, exitDuration="1h")
    waits["metadata"]["labels"] = {"accelstack.io/auto-gpr": "true"}
    await peer.put_object(GPRS, waits)
    for name in ("auto-now", "auto-later"):  # an auto-GPR without its pod is an orphan, deleted
        await peer.put_object("api/v1/pods", pod(f"{name}-0", 4, gpr=name, gated=True))

    def reasons(name: str) -> list[str]:
        return [e["reason"] for (r, _, _), e in peer.objects.items()
                if r == "api/v1/events" and e["involvedObject"]["name"] == name]

    async with stack(peer, **FAST):
        await wait_until(lambda: status(peer, "auto-now").get("phase") == "Admitted")
        await wait_until(lambda: status(peer, "auto-later").get("phase") == "Queued")
        assert "Admitted" not in reasons("auto-now")
        await peer.delete_object(GPRS, "default", "auto-now")
        await wait_until(lambda: status(peer, "by-hand").get("phase") == "Admitted")
        await wait_until(lambda: "Admitted" in reasons("by-hand"))
        await peer.delete_object(GPRS, "default", "by-hand")
        await wait_until(lambda: status(peer, "auto-later").get("phase") == "Admitted")
        await wait_until(lambda: "Admitted" in reasons("auto-later"))
    await peer.stop()


async def test_eviction_respects_pod_disruption_budgets() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer)
    await peer.put_object(GPRS, gpr("low", phase=None, devices=4, nodes=2, priority=50))
    await peer.put_object("api/v1/pods", pod("low-0", 4, gpr="low", gated=True))
    await peer.put_object("api/v1/pods", pod("low-1", 4, gpr="low", gated=True))
    async with stack(peer, **FAST):
        await wait_until(lambda: status(peer, "low").get("phase") == "Admitted")
        await set_phase(peer, "low-0", "Running", "n0")
        await set_phase(peer, "low-1", "Running", "n1")
        await wait_until(lambda: status(peer, "low").get("phase") == "Running")
        peer.pdb_blocks.add("default/low-1")
        await peer.put_object(GPRS, gpr("urgent", phase=None, devices=4, priority=250, enable_eviction=True))
        # eviction is not done when it is decided: the victim is Evicting and keeps its nodes while a pod of it
        # still runs (here held by a PodDisruptionBudget); the preemptor waits, and nobody else is evicted
        await wait_until(lambda: status(peer, "low").get("phase") == "Evicting")
        assert status(peer, "low")["evictions"] == 1 and status(peer, "low")["reservedNodes"] == ["n0", "n1"]
        await wait_until(lambda: any(c["type"] == "EvictionBlocked" and c["status"] == "True"
                                     for c in status(peer, "low").get("conditions", [])))
        assert "default/low-0" in peer.evicted and "default/low-1" not in peer.evicted
        assert peer.get("api/v1/pods", "default", "low-1") is not None  # the budget was not bypassed
        assert status(peer, "urgent")["phase"] == "Queued" and "queuePosition" not in status(peer, "low")
        peer.pdb_blocks.clear()
        await wait_until(lambda: "default/low-1" in peer.evicted)
        await wait_until(lambda: status(peer, "urgent").get("phase") == "Admitted")
        await wait_until(lambda: status(peer, "low").get("phase") == "Queued")
        assert status(peer, "low")["evictions"] == 1
        assert not any(c["type"] == "EvictionBlocked" for c in status(peer, "low").get("conditions", []))
    await peer.stop()


async def test_invalid_spec_is_reported_on_the_gpr() -> None:
    async with stack(**FAST) as (peer, _):
        await seed_nodes(peer, 1)
        await peer.put_object(GPRS, gpr("bad", phase=None, devices=2, milliPerDevice=500))
        await wait_until(lambda: status(peer, "bad").get("reason") == "InvalidSpec")
        assert "milliPerDevice" in status(peer, "bad")["message"]
        fixed = peer.get(GPRS, "default", "bad")
        assert fixed is not None
        fixed = dict(fixed, spec=dict(fixed["spec"], milliPerDevice=1000))
        fixed["metadata"] = dict(fixed["metadata"], generation=2)
        await peer.put_object(GPRS, fixed, "MODIFIED")  # the user fixes the spec: it is judged again
        await wait_until(lambda: status(peer, "bad").get("phase") == "Admitted")


async def test_one_leader_and_failover() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)
    async with stack(peer, **FAST) as (_, a), stack(peer, **FAST) as (_, b):
        await wait_until(lambda: a.elector.leading.is_set() or b.elector.leading.is_set())
        await asyncio.sleep(0.5)
        assert a.elector.leading.is_set() != b.elector.leading.is_set()
        leader, follower = (a, b) if a.elector.leading.is_set() else (b, a)
        await leader.stop()  # releases the Lease
        await wait_until(lambda: follower.elector.leading.is_set(), timeout=5)
        await peer.put_object(GPRS, gpr("after", phase=None, devices=1))
        await wait_until(lambda: status(peer, "after").get("phase") == "Admitted")
    await peer.stop()


def admin(peer: APIServerPeer) -> dict[str, str]:
    """A token whose user may do everything the REST API offers."""
    peer.tokens["admin-token"] = {"username": "alice", "groups": ["team-a"]}
    for verb in ("list", "get", "create", "delete"):
        peer.grants.add(("alice", verb, "accelstack.io", "gpuprovisioningrequests", ""))
    peer.grants.add(("alice", "list", "", "nodes", ""))
    return {"Authorization": "Bearer admin-token"}


async def test_rest_api_needs_a_token_and_rbac() -> None:
    async with stack(**FAST) as (peer, server):
        peer.tokens["bob-token"] = {"username": "bob", "groups": []}
        peer.grants.add(("bob", "list", "accelstack.io", "gpuprovisioningrequests", "team-b"))
        base = f"http://127.0.0.1:{server.port}/api/v1"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/inventory") as r:
                assert r.status == 401 and "bearer token is required" in (await r.json())["error"]
            async with http.get(f"{base}/inventory", headers={"Authorization": "Bearer forged"}) as r:
                assert r.status == 401 and "not valid" in (await r.json())["error"]
            bob = {"Authorization": "Bearer bob-token"}
            async with http.get(f"{base}/inventory", headers=bob) as r:
                assert r.status == 403 and "bob may not list nodes" in (await r.json())["error"]
            async with http.get(f"{base}/gprs?namespace=team-b", headers=bob) as r:
                assert r.status == 200
            async with http.get(f"{base}/gprs?namespace=team-a", headers=bob) as r:
                assert r.status == 403
            async with http.post(f"{base}/gprs", headers=bob, json={"namespace": "team-b", "name": "x",
                                                                    "spec": {"devicesPerNode": 1}}) as r:
                assert r.status == 403 and "may not create" in (await r.json())["error"]
            assert peer.get(GPRS, "team-b", "x") is None


async def test_rest_api_inventory_and_gprs() -> None:
    async with stack(**FAST) as (peer, server):
        await seed_nodes(peer, 2)
        auth = admin(peer)
        await peer.put_object("api/v1/nodes", node("sick", gpus=8, taints=[
            {"key": "accelstack.io/unhealthy", "effect": "NoSchedule"}]))
        await wait_until(lambda: len(server.view.nodes) == 3)
        base = f"http://127.0.0.1:{server.port}/api/v1"
        async with aiohttp.ClientSession(headers=auth) as http:
            async with http.get(f"{base}/inventory") as r:
                inv = await r.json()
            sick = next(n for n in inv["nodes"] if n["node"] == "sick")
            assert sick["healthy"] is False and sick["capacity"] == 8
            h100 = next(m for m in inv["models"] if m["model"] == "H100")
            assert h100 == {"resource": "nvidia.com/gpu", "model": "H100", "nodes": 2, "capacity": 8, "allocated": 0,
                            "reserved": 0, "healthyCapacity": 8}
            async with http.post(f"{base}/gprs", json={"namespace": "default", "name": "api-made",
                                                       "spec": {"devicesPerNode": 2, "priority": 120}}) as r:
                assert r.status == 201
            async with http.get(f"{base}/gprs?namespace=default") as r:
                assert [i["metadata"]["name"] for i in (await r.json())["items"]] == ["api-made"]
            async with http.get(f"{base}/gprs/default/api-made") as r:
                assert (await r.json())["spec"]["priority"] == 120
            for body, message in (({"namespace": "default", "name": "x", "spec": {"priority": 0}}, "spec.priority"),
                                  ({"name": "x"}, "namespace and name"), ([1], "JSON object")):
                async with http.post(f"{base}/gprs", json=body) as r:
                    assert r.status == 400 and message in (await r.json())["error"]
            async with http.post(f"{base}/waittime", data=b"{oops") as r:
                assert r.status == 400
            async with http.get(f"{base}/gprs/default/missing") as r:
                assert r.status == 404
            async with http.delete(f"{base}/gprs/default/api-made") as r:
                assert r.status == 200


async def test_exit_duration_ends_the_gpr_and_evicts_its_pods() -> None:
    async with stack(**FAST) as (peer, _):
        await seed_nodes(peer, 1)
        await peer.put_object(GPRS, gpr("short", phase=None, devices=2, exitDuration="3s"))
        await peer.put_object("api/v1/pods", pod("short-0", 2, gpr="short", gated=True))
        await wait_until(lambda: status(peer, "short").get("phase") in ("Admitted", "Running"))
        await set_phase(peer, "short-0", "Running", "n0")
        await wait_until(lambda: status(peer, "short").get("phase") == "Complete", timeout=10)
        assert status(peer, "short")["reason"] == "ExitDurationReached"
        await wait_until(lambda: "default/short-0" in peer.evicted)


async def test_failed_pods_requeue_with_backoff() -> None:
    async with stack(**FAST) as (peer, _):
        await seed_nodes(peer, 1)
        await peer.put_object(GPRS, gpr("flaky", phase=None, devices=1, requeueOnFailure=True, retryLimit=2))
        await peer.put_object("api/v1/pods", pod("flaky-0", 1, gpr="flaky", gated=True))
        await wait_until(lambda: status(peer, "flaky").get("phase") == "Admitted")
        await set_phase(peer, "flaky-0", "Failed", "n0")
        await wait_until(lambda: status(peer, "flaky").get("failures") == 1)
        st = status(peer, "flaky")
        assert st["phase"] == "Queued" and st["reason"] == "Backoff"  # 60 s before it may run again
        assert "; Backoff: until " in st["message"] and "after failure 1 (PodFailed)" in st["message"], st
        await peer.delete_object("api/v1/pods", "default", "flaky-0")
        await asyncio.sleep(0.3)
        assert status(peer, "flaky")["phase"] == "Queued"


async def test_fractional_gprs_are_refused_on_a_live_cluster() -> None:
    async with stack(**FAST) as (peer, _):
        await seed_nodes(peer, 1)
        await peer.put_object(GPRS, gpr("slice", phase=None, devices=1, milliPerDevice=250))
        await wait_until(lambda: status(peer, "slice").get("reason") == "InvalidSpec")
        assert "time-slicing replicas" in status(peer, "slice")["message"]


async def test_unhealthy_node_fails_its_gprs_and_evicts_their_pods() -> None:
    async with stack(**FAST) as (peer, _):
        await seed_nodes(peer, 1)
        await peer.put_object(GPRS, gpr("job", phase=None, devices=2, requeueOnFailure=True))
        await peer.put_object("api/v1/pods", pod("job-0", 2, gpr="job", gated=True))
        await wait_until(lambda: status(peer, "job").get("phase") == "Admitted")
        await set_phase(peer, "job-0", "Running", "n0")
        sick = node("n0", gpus=4, labels={"nvidia.com/gpu.product": "H100"}, conditions=[
            {"type": "GPUUnhealthy", "status": "True", "reason": "XID", "message": "XID 79"}])
        await peer.put_object("api/v1/nodes", sick, "MODIFIED")
        await wait_until(lambda: status(peer, "job").get("failures") == 1)
        assert status(peer, "job")["phase"] == "Queued"  # requeued with backoff, not on the sick node
        await wait_until(lambda: "default/job-0" in peer.evicted)


def test_writes_cancelled_before_their_turn_are_dropped_without_a_warning() -> None:
    """A pass's bounded writes and Events cancelled while they wait for their turn, or before any took a step
    (leadership lost, shutdown), are dropped cleanly: none is left as 'coroutine was never awaited'."""
    started: list[int] = []

    async def job(i: int) -> None:
        started.append(i)
        await asyncio.sleep(10)

    async def main() -> None:
        owner = types.SimpleNamespace(concurrency=1)
        jobs = (functools.partial(job, i) for i in range(3))
        task = asyncio.ensure_future(GPRController._bounded(owner, jobs))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        task.cancel()
        cancelled_at_once = asyncio.ensure_future(
            GPRController._bounded(owner, (functools.partial(job, 9),)))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # cancelled before its jobs took a step
        cancelled_at_once.cancel()
        for t in (task, cancelled_at_once):
            with contextlib.suppress(asyncio.CancelledError):
                await t

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert started == [0]
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_an_admitted_gprs_gates_go_right_after_its_own_status_write() -> None:
    """Three GPRs admitted in one pass, one write at a time: each GPR's pod is ungated right after that GPR's own
    status write, not after every status write of the pass (with 2,000 admissions in a pass the first pod would
    otherwise wait for all of them)."""
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 3)
    for name in ("a", "b", "c"):
        await peer.put_object(GPRS, gpr(name, phase=None, devices=4))
        await peer.put_object("api/v1/pods", pod(f"{name}-0", 4, gpr=name, gated=True))
    async with stack(peer, **FAST, concurrency=1):
        await wait_until(lambda: all(not peer.get("api/v1/pods", "default", f"{n}-0")["spec"].get(  # type: ignore[index]
            "schedulingGates") for n in ("a", "b", "c")))
    writes = [("status" if path.split("?")[0].endswith("/status") else "ungate") for method, path in peer.requests
              if (method == "PUT" and "gpuprovisioningrequests" in path) or (method == "PATCH" and "/pods/" in path)]
    assert writes[:6] == ["status", "ungate"] * 3, writes
    await peer.stop()


def test_a_burst_of_events_makes_few_passes_min_gap_apart() -> None:
    """Events arriving back to back (a burst of pod creations and binds) make passes at least ``min_gap`` apart,
    each taking every event since the last; with no gap, one pass follows another as long as events come."""

    async def burst(min_gap: float) -> tuple[int, list[float]]:
        ctl = GPRController.__new__(GPRController)
        ctl.min_gap, ctl.resync, ctl.estimate_every, ctl._queue_at = min_gap, 60.0, 60.0, 0.0
        ctl.history_namespace, ctl.clock, ctl.poke = None, time.time, asyncio.Event()
        ctl.metrics = ControllerMetrics()
        starts: list[float] = []

        async def reconcile() -> Any:
            starts.append(time.monotonic())
            await asyncio.sleep(0.005)
            return types.SimpleNamespace(wakeup=time.time() + 60)

        ctl.reconcile = reconcile  # type: ignore[method-assign]
        stop = asyncio.Event()
        runner = asyncio.create_task(ctl._run(stop))
        for _ in range(100):  # an event every 10 ms for a second
            ctl.poke.set()
            await asyncio.sleep(0.01)
        stop.set()
        await runner
        return len(starts), [b - a for a, b in itertools.pairwise(starts)]

    gapped, gaps = asyncio.run(burst(0.25))
    ungapped, _ = asyncio.run(burst(0.0))
    assert all(g >= 0.25 for g in gaps), gaps  # the order of events, not a bound on how fast the machine is
    assert gapped < ungapped, (gapped, ungapped)
