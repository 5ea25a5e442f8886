"""Preemption along the whole path while the API server misbehaves (issue #10, point 8, end to end).

The cluster is full of low-priority, preemptible GPRs whose pods run until they are stopped. High-priority GPRs
that may evict arrive. As on a real cluster, an evicted pod does not vanish: the API server marks it
(``deletionTimestamp``) and it holds its devices until its kubelet has stopped it, a while later; some pods are
held by a PodDisruptionBudget for a time; a stand-in Job controller creates a new (gated) pod for every pod of
a low GPR that is gone. Two replicas behind one address, the scheduler stand-in of the whole-path test (a sample
of the feasible nodes, retries on its own clock), the API server failing a share of every call (evictions
included) and breaking watches, and the leader losing its lease halfway.

What must hold, read from the API server's own history of every change, in order:
- no node ever runs pods (terminating ones included, until they are gone) that ask for more devices than it has;
- no node is reserved past its devices by the GPRs that hold it: Admitted, Running and Evicting (an eviction
  under way still holds its nodes), nor past what the pods outside those reservations still hold there (a
  preemptor is never admitted onto devices a stopping pod still has);
- a pod is bound only to a node its GPR's stored reservation names, only while that GPR holds, and only once;
- a GPR moves only along its life cycle (… Running -> Evicting -> [Queued ->] Admitted …), a high-priority one
  straight to Complete; evictions are counted on the victims, never failures on anyone;
- the end: every high-priority GPR complete, every low-priority one admitted again and its pod running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from typing import Any

import aiohttp
import pytest

from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, pod, wait_until
from tests.extender.test_controller import GPRS, set_phase
from tests.extender.test_whole_path_faults import (
    PODS,
    Scheduler,
    break_watches,
    misbehave,
    replica,
    wind_down,
)

NODES_PATH = "api/v1/nodes"
NODES, GPUS = 8, 4
LOW, HIGH = 8, 4  # low GPRs fill the cluster (one node each); high ones need evictions
MOVES = {("Queued", "Admitted"), ("Admitted", "Running"), ("Running", "Complete"), ("Admitted", "Complete"),
         ("Admitted", "Evicting"), ("Running", "Evicting"), ("Evicting", "Queued"),
         # its pods gone, requeued and placed again in the same pass (the preemptor found room elsewhere
         # meanwhile): the Queued in between is never stored
         ("Evicting", "Admitted")}
HOLDING = ("Admitted", "Running", "Evicting")
CORES_PER_GPU = [0]  # set by the test: what each pod asks of its node's 8 cores a GPU (2: a 4-GPU pod takes all 8)


def gpu_pod(name: str, devices: int, group: str) -> dict[str, Any]:
    p = pod(name, devices, gpr=group, gated=True)
    if CORES_PER_GPU[0]:
        p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = str(CORES_PER_GPU[0] * devices)
    return p


class PatientScheduler(Scheduler):
    """kube-scheduler never schedules a pod that is being deleted."""

    def next_pod(self, now: float) -> dict[str, Any] | None:
        waiting = [p for (res, _, _), p in self.peer.objects.items()
                   if res == PODS and not p["spec"].get("nodeName") and not p["spec"].get("schedulingGates")
                   and not p["metadata"].get("deletionTimestamp")
                   and self.not_before.get(p["metadata"]["uid"], 0) <= now]
        return min(waiting, key=lambda p: self.not_before.get(p["metadata"]["uid"], 0), default=None)


async def kubelet(peer: APIServerPeer, rng: random.Random, stop: asyncio.Event) -> None:
    """Starts each bound pod; a high-priority GPR's pod succeeds a moment later, a low one runs until stopped
    (the peer removes a terminating pod once its grace is over, as the kubelet confirms)."""
    ends: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        for (res, _, name), p in list(peer.objects.items()):
            if res != PODS or not p["spec"].get("nodeName") or p["metadata"].get("deletionTimestamp"):
                continue
            phase = (p.get("status") or {}).get("phase")
            if phase == "Pending":
                await set_phase(peer, name, "Running", p["spec"]["nodeName"])
                ends[name] = loop.time() + rng.uniform(0.5, 1.5)
            elif phase == "Running" and name.startswith("hi") and ends.get(name, 0) <= loop.time():
                await set_phase(peer, name, "Succeeded", p["spec"]["nodeName"])
        await asyncio.sleep(0.02)


async def job_controller(peer: APIServerPeer, wants: dict[str, int], stop: asyncio.Event) -> None:
    """Every low GPR keeps one pod: when its pod is gone (evicted, then stopped), a new one is created, gated
    (as the webhook gates it)."""
    made = dict.fromkeys((f"low{g}" for g in range(LOW)), 0)
    while not stop.is_set():
        for group in made:
            if not any(res == PODS and (p["metadata"].get("labels") or {}).get("accelstack.io/gpr") == group
                       for (res, _, _), p in list(peer.objects.items())):
                made[group] += 1
                name = f"{group}-r{made[group]}"
                wants[name] = GPUS
                await peer.put_object(PODS, gpu_pod(name, GPUS, group))
        await asyncio.sleep(0.05)


async def budgets(peer: APIServerPeer, rng: random.Random, stop: asyncio.Event) -> None:
    """Now and then a PodDisruptionBudget holds one low pod's eviction for a while."""
    while not stop.is_set():
        lows = [f"default/{name}" for (res, _, name), _p in list(peer.objects.items())
                if res == PODS and name.startswith("low")]
        if lows:
            held = rng.choice(lows)
            peer.pdb_blocks.add(held)
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            peer.pdb_blocks.discard(held)
        await asyncio.sleep(rng.uniform(0.5, 1.5))


def check_history(peer: APIServerPeer, wants: dict[str, int]) -> dict[str, int]:
    used: dict[str, int] = {}
    live: dict[str, tuple[str, int]] = {}  # pod UID -> (node, devices) while it holds them
    group_of: dict[str, str] = {}  # pod UID -> its GPR
    bound_to: dict[str, str] = {}
    phase_of: dict[str, str] = {}

    def promised() -> None:
        """Reservations of the holding GPRs plus the devices of live pods outside them, per node."""
        total: dict[str, int] = {}
        for nodes in holding.values():
            for n, d in nodes.items():
                total[n] = total.get(n, 0) + d
        for uid, (n, d) in live.items():
            if n not in holding.get(group_of[uid], {}):
                total[n] = total.get(n, 0) + d
        assert all(d <= GPUS for d in total.values()), ("promised past a node's devices", total, holding)

    reserved: dict[str, set[str]] = {}
    holding: dict[str, dict[str, int]] = {}
    seen = {"bindings": 0, "terminating": 0, "evicting": 0}
    for _, resource, kind, obj in peer.events:
        meta = obj.get("metadata") or {}
        if resource == GPRS:
            status = obj.get("status") or {}
            name, phase = meta["name"], status.get("phase")
            reserved[name] = {r["node"] for r in status.get("reservation") or []}
            holding[name] = {r["node"]: r["devices"] for r in status.get("reservation") or []
                             if kind != "DELETED" and phase in HOLDING}
            on: dict[str, int] = {}
            for nodes in holding.values():
                for n, d in nodes.items():
                    on[n] = on.get(n, 0) + d
            assert all(d <= GPUS for d in on.values()), ("two reservations on one node", name, holding)
            before = phase_of.get(name)
            if phase and before and phase != before:
                assert (before, phase) in MOVES, (name, before, phase, status)
                if name.startswith("hi"):
                    assert phase != "Evicting", (name, status)
            if phase == "Evicting" and before != "Evicting":
                seen["evicting"] += 1
            if phase:
                phase_of[name] = phase
            assert not status.get("failures"), (name, status)
            promised()
        elif resource == PODS:
            uid, spec = meta["uid"], obj.get("spec") or {}
            where = str(spec.get("nodeName") or "")
            group = (meta.get("labels") or {}).get("accelstack.io/gpr", "")
            if where and uid not in bound_to:
                bound_to[uid] = where
                seen["bindings"] += 1
                assert where in reserved.get(group, set()), (meta["name"], where, reserved.get(group))
                assert phase_of.get(group) in ("Admitted", "Running"), (meta["name"], phase_of.get(group))
            assert not where or bound_to[uid] == where, (meta["name"], "moved", bound_to[uid], where)
            if meta.get("deletionTimestamp") and kind == "MODIFIED" and uid in live:
                seen["terminating"] += 1
            # a terminating pod holds its devices until it is gone
            holds = bool(kind != "DELETED" and where
                         and (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
            if uid in live and not holds:
                n, d = live.pop(uid)
                used[n] -= d
            elif holds and uid not in live:
                group_of[uid] = group
                live[uid] = (where, wants[meta["name"]])
                used[where] = used.get(where, 0) + wants[meta["name"]]
                assert used[where] <= GPUS, (where, used[where], meta["name"], {
                    u: v for u, v in live.items() if v[0] == where})
            promised()
    return seen


def stuck(peer: APIServerPeer) -> str:
    lines = []
    for (res, _, name), obj in sorted(peer.objects.items()):
        status = obj.get("status") or {}
        if res == PODS:
            lines.append(f"pod {name}: node={obj['spec'].get('nodeName')} phase={status.get('phase')} "
                         f"gated={bool(obj['spec'].get('schedulingGates'))} "
                         f"deleting={bool(obj['metadata'].get('deletionTimestamp'))}")
        elif res == GPRS:
            lines.append(f"gpr {name}: {status.get('phase')} {status.get('reason')} "
                         f"{[r['node'] for r in status.get('reservation') or []]} {status.get('conditions')}")
    return "\n".join(lines[:60])


async def until(peer: APIServerPeer, wants: dict[str, int], predicate: Any, timeout: float) -> None:
    try:
        await wait_until(predicate, timeout)
    except TimeoutError:
        try:  # an invariant broken on the way says more than where it got stuck
            check_history(peer, wants)
        except AssertionError as broken:
            raise AssertionError(f"not reached in {timeout:g}s; on the way: {broken}\n{stuck(peer)}") from None
        raise AssertionError(f"not reached in {timeout:g}s:\n{stuck(peer)}") from None


def phase(peer: APIServerPeer, name: str) -> str:
    return str(((peer.get(GPRS, "default", name) or {}).get("status") or {}).get("phase") or "")


def running_pod(peer: APIServerPeer, group: str) -> bool:
    return any(res == PODS and (p["metadata"].get("labels") or {}).get("accelstack.io/gpr") == group
               and (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
               for (res, _, _), p in list(peer.objects.items()))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cores_per_gpu", [0, 2], ids=["devices", "devices-and-cpu"])
async def test_evictions_hold_their_nodes_until_the_pods_are_gone_while_the_api_server_misbehaves(
        cores_per_gpu: int) -> None:
    """With ``cores_per_gpu`` 2, every pod asks for 2 of its node's 8 cores a GPU: a low GPR's pod holds all of a
    node's CPU, and an eviction makes room only if it counts the CPU its victims' pods give back."""
    CORES_PER_GPU[0] = cores_per_gpu
    rng = random.Random(int(os.environ.get("WHOLE_PATH_SEED", "20261202")))
    peer = APIServerPeer(history=500_000)
    peer.pod_grace = rng.uniform(0.4, 1.0)  # an evicted pod holds its devices this long after its eviction
    await peer.start()
    for i in range(NODES):
        await peer.put_object(NODES_PATH, node(f"n{i:02d}", gpus=GPUS))
    wants: dict[str, int] = {}
    for g in range(LOW):
        await peer.put_object(GPRS, gpr(f"low{g}", phase=None, devices=GPUS, priority=50, exitDuration="1h"))
        wants[f"low{g}-r0"] = GPUS
        await peer.put_object(PODS, gpu_pod(f"low{g}-r0", GPUS, f"low{g}"))
    stop = asyncio.Event()
    faults = misbehave(peer, rng)
    every = [0]

    def one_in(n: int) -> Any:
        def when(_request: Any) -> bool:
            every[0] += 1
            return every[0] % n == 0
        return when

    faults += [peer.inject("POST", "pods", subresource="eviction", status=500, when=one_in(7)),
               peer.inject("POST", "pods", subresource="eviction", status=429, retry_after=0, when=one_in(11)),
               peer.inject("POST", "pods", subresource="eviction", hang=True, lands=True, when=one_in(13))]
    tasks: list[asyncio.Task[None]] = []
    try:
        async with contextlib.AsyncExitStack() as replicas, aiohttp.ClientSession() as http:
            a = await replicas.enter_async_context(replica(peer, "a"))
            b = await replicas.enter_async_context(replica(peer, "b"))
            scheduler = PatientScheduler(peer, [a.port, b.port], rng)
            tasks += [asyncio.create_task(scheduler.run(http, stop)), asyncio.create_task(kubelet(peer, rng, stop)),
                      asyncio.create_task(job_controller(peer, wants, stop)),
                      asyncio.create_task(break_watches(peer, rng, stop))]
            await until(peer, wants, lambda: all(running_pod(peer, f"low{g}") for g in range(LOW)), 60)
            tasks.append(asyncio.create_task(budgets(peer, rng, stop)))
            for h in range(HIGH):
                devices, count = rng.choice([(4, 1), (2, 2), (4, 2)])
                await peer.put_object(GPRS, gpr(f"hi{h}", phase=None, devices=devices, nodes=count, priority=250,
                                                enable_eviction=True, exitDuration="1h"))
                for k in range(count):
                    wants[f"hi{h}-{k}"] = devices
                    await peer.put_object(PODS, gpu_pod(f"hi{h}-{k}", devices, f"hi{h}"))
            await until(peer, wants, lambda: sum(phase(peer, f"hi{h}") in ("Running", "Complete") for h in range(HIGH)) >= 2,
                        60)
            leader = a if a.service is not None and a.service.elector.leading.is_set() else b
            assert leader.service is not None
            with peer.inject(None, "leases", verb="update", status=500):
                await wait_until(lambda: not leader.service.elector.leading.is_set(), timeout=10)  # type: ignore[union-attr]
            await until(peer, wants, lambda: all(phase(peer, f"hi{h}") == "Complete" for h in range(HIGH)), 90)
            await until(peer, wants, lambda: all(running_pod(peer, f"low{g}") for g in range(LOW)), 90)
            stop.set()
            await asyncio.gather(*tasks)
        peer.clear_faults()
        seen = check_history(peer, wants)
        assert seen["evicting"] > 0 and seen["terminating"] > 0, seen  # evictions happened, pods lingered
        evictions = sum(((peer.get(GPRS, "default", f"low{g}") or {})["status"].get("evictions") or 0)
                        for g in range(LOW))
        assert evictions >= seen["evicting"], (evictions, seen)
        for h in range(HIGH):
            status = (peer.get(GPRS, "default", f"hi{h}") or {})["status"]
            assert status["phase"] == "Complete" and not status.get("evictions"), status
        assert scheduler.failed == []
        assert peer.count("POST", "pods", subresource="eviction") > 0
    finally:
        await wind_down(peer, stop, tasks)
