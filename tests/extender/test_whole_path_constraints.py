"""GPRs whose pods may run on some nodes only, along the whole path (issue #10: reservations follow the pods'
constraints).

A mixed cluster: H100 and A100 nodes (the GPU product label), one H100 node kept for one team by a taint. GPRs'
pods select a product, tolerate the taint or neither; some GPRs are made before their pods (admitted from the
spec alone, wherever there is room), the rest with their pods, gated. The scheduler stand-in filters as
kube-scheduler does (node affinity and nodeSelector, taints), so a pod sent to a node it cannot run on would wait
for ever. While a share of the API server's calls fail:

- every GPR completes, every pod bound once, to a node its constraints accept, never past the node's devices;
- a GPR made with its pods is only ever reserved on nodes they accept (placed by them, not moved afterwards);
- a GPR admitted before its pods existed, onto nodes they cannot run on, is moved (its reservation given back and
  taken elsewhere before any pod of it ran), without a failure counted.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import aiohttp
import pytest

from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, pod
from tests.extender.test_controller import GPRS
from tests.extender.test_whole_path_faults import (
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

GPUS = 4
PRODUCT = "nvidia.com/gpu.product"
TAINT = {"key": "dedicated", "value": "team-a", "effect": "NoSchedule"}
# name -> (product, tainted)
NODES = {"h0": ("H100", False), "h1": ("H100", False), "h2": ("H100", True), "a0": ("A100", False),
         "a1": ("A100", False), "a2": ("A100", False)}


def constrained_pod(name: str, devices: int, group: str, select: str | None, tolerate: bool) -> dict[str, Any]:
    p = pod(name, devices, gpr=group, gated=True)
    if select:
        p["spec"]["nodeSelector"] = {PRODUCT: select}
    if tolerate:
        p["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Equal", "value": "team-a",
                                     "effect": "NoSchedule"}]
    return p


def accepts(p: dict[str, Any], name: str) -> bool:
    product, tainted = NODES[name]
    selector = (p["spec"].get("nodeSelector") or {}).get(PRODUCT)
    return (selector is None or selector == product) and (not tainted or bool(p["spec"].get("tolerations")))


@pytest.mark.timeout(180)
async def test_reservations_follow_where_the_pods_can_run_while_the_api_server_misbehaves() -> None:
    rng = random.Random(int(os.environ.get("WHOLE_PATH_SEED", "20261202")))
    peer = APIServerPeer(history=200_000)
    await peer.start()
    for name, (product, tainted) in NODES.items():
        await peer.put_object(NODES_PATH, node(name, gpus=GPUS, labels={PRODUCT: product},
                                               taints=[TAINT] if tainted else None))
    groups: dict[str, list[dict[str, Any]]] = {}
    # made first, before their pods: admitted from the spec alone onto the first nodes by name (a0, a1), A100
    # nodes, which their pods (H100 only) cannot use
    late = ["late0", "late1"]
    for name in late:
        groups[name] = [constrained_pod(f"{name}-0", GPUS, name, "H100", False)]
        await peer.put_object(GPRS, gpr(name, phase=None, devices=GPUS, exitDuration="1h"))
    for g in range(16):
        name = f"g{g:02d}"
        devices, count = rng.choice([(1, 1), (2, 1), (4, 1), (2, 2)])
        select = rng.choice(["H100", "A100", None])
        tolerate = select == "H100" and rng.random() < 0.5
        groups[name] = [constrained_pod(f"{name}-{k}", devices, name, select, tolerate) for k in range(count)]
    wants = {p["metadata"]["name"]: int(p["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"])
             for pods in groups.values() for p in pods}
    by_pod = {p["metadata"]["name"]: p for pods in groups.values() for p in pods}
    stop = asyncio.Event()
    # the whole-path test's faults: 500, 429 and 503 on every write, writes that land but answer 500 or hang,
    # conflicts on the ledger, failing gets and lists, and watches broken by ERROR events (410, 500)
    faults = misbehave(peer, rng)
    tasks: list[asyncio.Task[None]] = []
    try:
        async with replica(peer, "a") as server, aiohttp.ClientSession() as http:
            tasks += stand_ins(peer, [server.port], rng, http, stop)
            # the late GPRs are admitted from their specs; then the rest arrive, with pods, and the late ones' pods
            await until(peer, lambda: all(gpr_phase(peer, n) == "Admitted" for n in late), 30)
            first = reserved_nodes(peer, late)
            assert first == {"a0", "a1"}, first
            for name, pods in groups.items():
                if name not in late:
                    await peer.put_object(GPRS, gpr(name, phase=None, devices=int(pods[0]["spec"]["containers"][0][
                        "resources"]["requests"]["nvidia.com/gpu"]), nodes=len(pods), exitDuration="1h"))
                for p in pods:
                    await peer.put_object(PODS, p)

            def done() -> int:
                return sum(1 for (res, _, _), p in peer.objects.items()
                           if res == PODS and (p.get("status") or {}).get("phase") == "Succeeded")

            await until(peer, lambda: done() == len(wants), 120)
            # the moves, as the controller's metrics count them: each once its status write was answered 201/200;
            # a write that landed while its answer was an error or never came cannot be counted
            registry = server.metrics.registry
            moves = registry.get_sample_value("accelstack_controller_gpr_events_total", {"kind": "requeued"}) or 0
            unknown = sum(f.hits for f in faults if f.lands and f.match["resource"] == "gpuprovisioningrequests")
            assert len(late) - unknown <= moves <= len(late), (moves, unknown)
            assert (registry.get_sample_value("accelstack_controller_gpr_events_total", {"kind": "failed"})
                    or 0) == 0
            await until(peer, lambda: all(gpr_phase(peer, n) == "Complete" for n in groups), 30)
            stop.set()
            await asyncio.gather(*tasks)
        met = [f for f in faults if f.hits]
        assert len(met) >= len(faults) // 2, f"only {len(met)} of {len(faults)} kinds of fault were met"
        peer.clear_faults()
        # the history, in order
        reserved: dict[str, list[tuple[str, ...]]] = {}
        bound: dict[str, str] = {}
        used: dict[str, int] = {}
        live: dict[str, tuple[str, int]] = {}
        for _, resource, kind, obj in peer.events:
            meta = obj.get("metadata") or {}
            if resource == GPRS:
                follow_reservation(reserved, obj)
            elif resource == PODS:
                where = obj["spec"].get("nodeName")
                name = meta["name"]
                if where and name not in bound:
                    bound[name] = where
                    assert accepts(by_pod[name], where), (name, where, by_pod[name]["spec"])
                    group = meta["labels"]["accelstack.io/gpr"]
                    assert reserved.get(group) and where in reserved[group][-1], (name, where, reserved.get(group))
                holds = kind != "DELETED" and where and (obj.get("status") or {}).get("phase") not in (
                    "Succeeded", "Failed")
                if name in live and not holds:
                    n, d = live.pop(name)
                    used[n] -= d
                elif holds and name not in live:
                    live[name] = (where, wants[name])
                    used[where] = used.get(where, 0) + wants[name]
                    assert used[where] <= GPUS, (where, used[where])
        assert set(bound) == set(wants)
        for name, trail in reserved.items():
            if name in late:
                continue
            # placed by its pods: never anywhere they cannot run, never moved
            assert len(trail) == 1, (name, trail)
            assert all(all(accepts(p, n) for p in groups[name]) for n in trail[0]), (name, trail)
        for name in late:  # moved once, to where its pod can run
            assert len(reserved[name]) == 2 and reserved[name][0][0] in ("a0", "a1"), (name, reserved[name])
            assert all(accepts(p, n) for p in groups[name] for n in reserved[name][-1]), (name, reserved[name])
    finally:
        await wind_down(peer, stop, tasks)
