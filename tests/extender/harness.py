"""The extender stack against the API-server peer: real HTTP on both sides, the real kubernetes_asyncio client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from kubernetes_asyncio import client

from kubeapi import KubeClient
from scheduler_extender.cmd.server import ExtenderServer
from scheduler_extender.objects.kube import Kube
from tests.apiserver_peer import APIServerPeer

WIRE = Path(__file__).parent / "wire"
GPU = "nvidia.com/gpu"


T = TypeVar("T")


async def loop_hold(work: Callable[[], Awaitable[T]]) -> tuple[float, float, T]:
    """(the longest stretch ``work()`` held the event loop without a yield, its whole time, its result), in this
    thread's CPU time: a task that yields at every turn measures the stretches. CPU time, not wall time: a machine
    that takes the CPU away from this process mid-stretch (a loaded CI runner, a niced test run) lengthens a wall
    stretch without the code holding the loop any longer."""
    longest, done = 0.0, False
    clock = time.thread_time

    async def ticker() -> None:
        nonlocal longest
        last = clock()
        while not done:
            await asyncio.sleep(0)
            now = clock()
            longest, last = max(longest, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    started = clock()
    result = await work()
    took = clock() - started
    done = True
    await task
    return longest, took, result


async def hold_share(work: Callable[[], Awaitable[T]]) -> tuple[float, T]:
    """The longest stretch ``work()`` held the loop as a share of its whole time (CPU time, see
    :func:`loop_hold`), and its result. A share, not milliseconds: a slower machine slows both."""
    longest, took, result = await loop_hold(work)
    return longest / took, result


def recorded(name: str) -> bytes:
    return (WIRE / name).read_bytes()


def node(name: str, gpus: int = 4, labels: dict[str, str] | None = None, conditions: list[dict[str, Any]] | None = None,
         taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    alloc = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    if gpus:
        alloc[GPU] = str(gpus)
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": {"taints": taints or []},
            "status": {"capacity": alloc, "allocatable": alloc,
                       "conditions": [{"type": "Ready", "status": "True"}, *(conditions or [])]}}


def pod(name: str, gpus: int = 1, gpr: str = "", namespace: str = "default", uid: str = "",
        priority: int = 0, gated: bool = False, node_name: str = "", phase: str = "Pending") -> dict[str, Any]:
    labels = {"accelstack.io/gpr": gpr} if gpr else {}
    spec: dict[str, Any] = {"priority": priority, "containers": [{"name": "main", "image": "pause",
                            "resources": {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}}}]}
    if gated:
        spec["schedulingGates"] = [{"name": "accelstack.io/gpr"}]
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, **({"uid": uid} if uid else {})},
            "spec": spec, "status": {"phase": phase}}


def gpr(name: str, phase: str | None = "Admitted", reservation: dict[str, int] | None = None, priority: int = 100,
        namespace: str = "default", preemptible: bool = True, enable_eviction: bool = False, devices: int = 1,
        nodes: int = 1, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
        "metadata": {"name": name, "namespace": namespace, "generation": 1},
        "spec": {"resource": GPU, "devicesPerNode": devices, "nodeCount": nodes, "priority": priority,
                 "preemptible": preemptible, "enableEviction": enable_eviction, **spec}}
    if phase is not None:
        obj["status"] = {"phase": phase,
                         "reservation": [{"node": n, "devices": d} for n, d in (reservation or {}).items()]}
    return obj


def filter_body(pod_obj: dict[str, Any], names: list[str]) -> bytes:
    return json.dumps({"Pod": pod_obj, "Nodes": None, "NodeNames": names}).encode()


@contextlib.asynccontextmanager
async def stack(peer: APIServerPeer | None = None, **kwargs: Any) -> AsyncIterator[tuple[APIServerPeer, ExtenderServer]]:
    own = peer is None
    if peer is None:
        peer = APIServerPeer()
        await peer.start()
    api_client = client.ApiClient(client.Configuration(host=peer.url))
    kwargs.setdefault("run_controller", False)  # verb tests seed GPR statuses themselves
    server = ExtenderServer(Kube(KubeClient(api_client, field_manager="accelstack-extender")), **kwargs)
    await server.start()
    try:
        yield peer, server
    finally:
        await server.stop()
        await api_client.close()
        if own:
            await peer.stop()


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)
