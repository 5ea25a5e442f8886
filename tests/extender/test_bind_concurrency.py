"""2,000 concurrent binds over 500 nodes through two extender replicas, one restarted in the middle of the
load: no node ever holds more devices than it has, and the ledger agrees with the Bindings."""

from __future__ import annotations

import asyncio
import collections
import json
import random

import aiohttp

from scheduler_extender.objects import ledger
from scheduler_extender.objects.ledger import LEDGER_ANNOTATION
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import node, pod, stack

NODES, PODS, GPUS_PER_NODE = 500, 2000, 4


async def test_2000_concurrent_binds_two_replicas_and_a_restart() -> None:
    rng = random.Random(7)
    peer = APIServerPeer()
    await peer.start()
    for i in range(NODES):
        await peer.put_object("api/v1/nodes", node(f"n{i:03d}", gpus=GPUS_PER_NODE))
    wants: dict[str, int] = {}
    for i in range(PODS):
        gpus = rng.choice((1, 2, 2, 3))  # demand ~4,000 devices for 2,000: most binds must be refused
        wants[f"p{i:04d}"] = gpus
        await peer.put_object("api/v1/pods", pod(f"p{i:04d}", gpus, uid=f"uid-{i:04d}"))
    # a skewed choice of nodes, as a scheduler racing on the same best-fit nodes would make
    targets = [f"n{min(NODES - 1, int(rng.expovariate(1 / 60))):03d}" for _ in range(PODS)]
    results: collections.Counter[str] = collections.Counter()

    async def bind(http: aiohttp.ClientSession, port_of: list[int], i: int) -> None:
        body = json.dumps({"PodName": f"p{i:04d}", "PodNamespace": "default", "PodUID": f"uid-{i:04d}",
                           "Node": targets[i]})
        for _attempt in range(50):  # like the scheduler: a failed call is retried later
            try:
                async with http.post(f"http://127.0.0.1:{port_of[i % 2]}/scheduler/bind", data=body) as r:
                    result = await r.json()
                results["bound" if not result["Error"] else "refused"] += 1
                return
            except (TimeoutError, aiohttp.ClientError):
                results["connection-error"] += 1
                await asyncio.sleep(0.1)

    async with stack(peer) as (_, a):
        b_cm = stack(peer)
        _, b = await b_cm.__aenter__()
        ports = [a.port, b.port]
        connector = aiohttp.TCPConnector(limit=400)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
            first = [asyncio.create_task(bind(http, ports, i)) for i in range(PODS // 2)]
            await asyncio.sleep(0.3)
            conflicts = b.binder.conflicts  # the first replica B's races
            await b_cm.__aexit__(None, None, None)  # replica B goes away mid-load ...
            b_cm = stack(peer)
            _, b = await b_cm.__aenter__()  # ... and a new one rebuilds its state from the API server
            ports[1] = b.port
            second = [asyncio.create_task(bind(http, ports, i)) for i in range(PODS // 2, PODS)]
            await asyncio.gather(*first, *second)
        conflicts += a.binder.conflicts + b.binder.conflicts
        await b_cm.__aexit__(None, None, None)

    # ground truth from the API server
    per_node: collections.Counter[str] = collections.Counter()
    bound = 0
    for (res, _, name), obj in peer.objects.items():
        if res == "api/v1/pods" and obj["spec"].get("nodeName"):
            per_node[obj["spec"]["nodeName"]] += wants[name]
            bound += 1
    assert bound == len(peer.bindings) == results["bound"]
    assert results["bound"] + results["refused"] == PODS  # every bind got an answer in the end
    assert results["connection-error"] > 0  # the restart really hit requests in flight
    assert conflicts > 0  # the replicas really raced on the same nodes
    assert bound >= NODES // 2  # the load really filled nodes
    over = {n: used for n, used in per_node.items() if used > GPUS_PER_NODE}
    assert not over, f"over-allocated nodes: {over}"
    for i in range(NODES):
        node_obj = peer.get("api/v1/nodes", "", f"n{i:03d}")
        assert node_obj is not None
        entries = ledger.parse((node_obj["metadata"].get("annotations") or {}).get(LEDGER_ANNOTATION))
        ledger_used = sum(e.requests["nvidia.com/gpu"] for e in entries.values())
        assert ledger_used <= GPUS_PER_NODE
        assert ledger_used >= per_node[f"n{i:03d}"]  # every Binding is in the ledger
    await peer.stop()
