"""GPRs whose pods ask for CPU and memory, along the whole path (issue #10: a reservation is only as good as the
node's room for its pods, as kube-scheduler's NodeResourcesFit judges it).

Three nodes of 4 GPUs and 8 cores each. A web server that asks for no device holds 7 of c0's cores all through
the run. Each GPR pod asks for 1 GPU and 3 cores: two fit c1 or c2 at a time, none fits c0, whatever its free
GPUs. Some GPRs are made before their pods (admitted from the spec alone: best fit packs them onto c0, whose CPU
is the fullest), the rest with their pods, gated. The scheduler stand-in filters as kube-scheduler does, CPU
included, so a pod narrowed to c0 would wait for ever. While a share of the API server's calls fail:

- every GPR completes, every pod is bound once, never past a node's devices or CPU;
- a GPR made with its pods is never reserved on c0;
- a GPR admitted before its pods existed, onto c0, is moved before its pod runs, without a failure counted.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import aiohttp
import pytest

from tests import nodeaffinity
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, pod
from tests.extender.test_controller import GPRS
from tests.extender.test_whole_path_faults import (
    KEEP_RUNNING,
    NODES_PATH,
    PODS,
    follow_reservation,
    gpr_phase,
    misbehave,
    replica,
    reserved_nodes,
    stand_ins,
    until,
    wind_down,
)

GPUS, CORES = 4, 8


def host_node(name: str) -> dict[str, Any]:
    obj = node(name, gpus=GPUS)
    alloc = {**obj["status"]["allocatable"], "cpu": str(CORES), "memory": "32Gi"}
    obj["status"]["allocatable"] = obj["status"]["capacity"] = alloc
    return obj


def cpu_pod(name: str, group: str, cores: int, gpus: int = 1) -> dict[str, Any]:
    p = pod(name, gpus, gpr=group, gated=bool(group))
    requests = p["spec"]["containers"][0]["resources"]["requests"]
    requests.update(cpu=str(cores), memory="1Gi")
    if not gpus:
        del requests["nvidia.com/gpu"], p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    return p


@pytest.mark.timeout(180)
async def test_reservations_leave_out_nodes_whose_cpu_other_pods_hold_while_the_api_server_misbehaves() -> None:
    rng = random.Random(int(os.environ.get("WHOLE_PATH_SEED", "20261202")))
    peer = APIServerPeer(history=200_000)
    await peer.start()
    for name in ("c0", "c1", "c2"):
        await peer.put_object(NODES_PATH, host_node(name))
    web = cpu_pod("web", "", 7, gpus=0)
    web["metadata"]["labels"][KEEP_RUNNING] = "true"
    web["spec"]["nodeName"] = "c0"
    web["status"] = {"phase": "Running"}
    await peer.put_object(PODS, web)
    groups: dict[str, list[dict[str, Any]]] = {}
    early = ["early0", "early1"]
    for name in early:
        groups[name] = [cpu_pod(f"{name}-0", name, 3)]
        await peer.put_object(GPRS, gpr(name, phase=None, devices=1, exitDuration="1h"))
    for g in range(12):
        name = f"g{g:02d}"
        devices, count = rng.choice([(1, 1), (2, 1), (1, 2)])  # (devices a node, nodes): 1 GPU, 3 cores a pod
        groups[name] = [cpu_pod(f"{name}-{k}-{i}", name, 3) for k in range(count) for i in range(devices)]
        groups[name][0]["metadata"]["annotations"] = {"test/shape": f"{devices}x{count}"}
    stop = asyncio.Event()
    faults = misbehave(peer, rng)
    tasks: list[asyncio.Task[None]] = []
    try:
        async with replica(peer, "a") as server, aiohttp.ClientSession() as http:
            tasks += stand_ins(peer, [server.port], rng, http, stop)
            await until(peer, lambda: all(gpr_phase(peer, n) == "Admitted" for n in early), 30)
            first = reserved_nodes(peer, early)
            assert first == {"c0"}, first  # packed where the CPU is fullest: no pod says otherwise yet
            for name, pods in groups.items():
                if name not in early:
                    devices, count = (int(x) for x in pods[0]["metadata"]["annotations"]["test/shape"].split("x"))
                    await peer.put_object(GPRS, gpr(name, phase=None, devices=devices, nodes=count,
                                                    exitDuration="1h"))
                for p in pods:
                    await peer.put_object(PODS, p)
            wanted = sum(len(pods) for pods in groups.values())

            def done() -> int:
                return sum(1 for (res, _, _), p in peer.objects.items()
                           if res == PODS and (p.get("status") or {}).get("phase") == "Succeeded")

            await until(peer, lambda: done() == wanted, 120)
            await until(peer, lambda: all(gpr_phase(peer, n) == "Complete" for n in groups), 30)
            registry = server.metrics.registry
            assert (registry.get_sample_value("accelstack_controller_gpr_events_total", {"kind": "failed"})
                    or 0) == 0
            stop.set()
            await asyncio.gather(*tasks)
        met = [f for f in faults if f.hits]
        assert len(met) >= len(faults) // 2, f"only {len(met)} of {len(faults)} kinds of fault were met"
        peer.clear_faults()
        # the history, in order: reservations, and each node's devices and CPU while pods hold them
        reserved: dict[str, list[tuple[str, ...]]] = {}
        bound: dict[str, str] = {}
        live: dict[str, tuple[str, int, float]] = {}
        devices_on: dict[str, int] = {}
        cores_on: dict[str, float] = {}
        for _, resource, kind, obj in peer.events:
            meta = obj.get("metadata") or {}
            if resource == GPRS:
                follow_reservation(reserved, obj)
            elif resource == PODS:
                name, where = meta["name"], obj["spec"].get("nodeName")
                holds = kind != "DELETED" and where and (obj.get("status") or {}).get("phase") not in (
                    "Succeeded", "Failed")
                if where and name not in bound and name != "web":
                    bound[name] = where
                    group = meta["labels"]["accelstack.io/gpr"]
                    assert reserved.get(group) and where in reserved[group][-1], (name, where, reserved.get(group))
                if name in live and not holds:
                    n, d, c = live.pop(name)
                    devices_on[n] -= d
                    cores_on[n] -= c
                elif holds and name not in live:
                    cores = nodeaffinity.requested([obj])[where][0]
                    gpus = int(obj["spec"]["containers"][0]["resources"]["requests"].get("nvidia.com/gpu", 0))
                    live[name] = (where, gpus, cores)
                    devices_on[where] = devices_on.get(where, 0) + gpus
                    cores_on[where] = cores_on.get(where, 0) + cores
                    assert devices_on[where] <= GPUS and cores_on[where] <= CORES, (where, devices_on, cores_on)
        assert set(bound) == {p["metadata"]["name"] for pods in groups.values() for p in pods}
        assert "c0" not in set(bound.values())
        for name, trail in reserved.items():
            if name in early:  # moved once, off c0, before its pod ran
                assert trail[0] == ("c0",) and "c0" not in trail[-1], (name, trail)
            else:
                assert all("c0" not in nodes for nodes in trail), (name, trail)
    finally:
        await wind_down(peer, stop, tasks)
