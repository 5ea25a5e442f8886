"""The whole GPR path driven as a cluster drives it, while the API server misbehaves all along (issue #10).

Two extender replicas, each with its controller (one leads), behind one address: every call the scheduler makes
lands on either replica, as through a Service. The stand-in scheduler takes one pod at a time, sends the
extender only a sample of the nodes its own filters let through (``percentageOfNodesToScore``; node affinity
included, so the narrowing done at ungating is what keeps a pod on its reservation), retries on its own clock,
and now and then sends a bind a second time (a retry after a lost answer). A stand-in kubelet runs each bound
pod, then ends it. Meanwhile the API server answers a share of the writes and reads of every kind with 409,
429, 500 or 503, holds some calls past the client's timeout, makes some writes it answers as failed or never
answers (a Binding may land after the binder gave up and looked again), ends watches with 410 and 500, fails
a leader's lease renewals, and one replica is replaced.

What must hold, read from the API server's own history of every change, in order:
- no node ever runs pods that ask for more devices than it has, nor is reserved past its devices by the GPRs
  that hold it (Admitted or Running);
- a pod is bound only to a node its GPR's stored reservation names, and only once;
- a GPR's phase only moves forward (Queued -> Admitted -> Running -> Complete) and is never admitted twice;
- API errors are not GPR failures: every GPR completes with ``failures`` and ``evictions`` 0;
- nothing is lost: every pod runs and succeeds, and every ledger is empty at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s

from kubeapi import KubeClient
from scheduler_extender.cmd.server import ExtenderServer
from scheduler_extender.objects import ledger
from scheduler_extender.objects.kube import Kube
from tests import nodeaffinity
from tests.apiserver_peer import APIServerPeer
from tests.apiserver_peer.faults import Fault
from tests.extender.harness import gpr, node, pod, wait_until
from tests.extender.test_controller import GPRS, set_phase

PODS, NODES_PATH = "api/v1/pods", "api/v1/nodes"
NODES, GPUS, GROUPS = 16, 4, 36
SAMPLE = 0.5  # the share of the feasible nodes the scheduler sends (percentageOfNodesToScore)
KEEP_RUNNING = "test.accelstack.io/keep-running"  # a pod the kubelet stand-in leaves as it is (a web server, say)
ORDER = ["Queued", "Admitted", "Running", "Complete"]


@contextlib.asynccontextmanager
async def replica(peer: APIServerPeer, identity: str) -> AsyncIterator[ExtenderServer]:
    """One extender + controller replica as the Deployment runs it, with a short client-side timeout (the
    API server's hung calls must end within the test)."""
    api = k8s.ApiClient(k8s.Configuration(host=peer.url))
    server = ExtenderServer(Kube(KubeClient(api, field_manager="accelstack-extender", timeout=1.0)),
                            identity=identity, resync=0.05, lease_seconds=2, evict_every=0.2, sweep_every=0.5,
                            run_controller=True)
    await server.start(sync_timeout=20)
    try:
        yield server
    finally:
        await server.stop()
        await api.close()


async def wind_down(peer: APIServerPeer, stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    """End the stand-ins, lift the faults, stop the peer."""
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    peer.clear_faults()
    await peer.stop()


def misbehave(peer: APIServerPeer, rng: random.Random) -> list[Fault]:
    """A share of every kind of call the stack makes fails, all through the run: each fault takes one in
    ``n`` of the calls it matches (that reach it), at a random phase, so every one of them is met."""
    def every(n: int) -> Any:
        seen, phase = [0], rng.randrange(n)

        def when(_request: Any) -> bool:
            seen[0] += 1
            return seen[0] % n == phase
        return when

    # GPR status (PUT), ungating (PATCH of the pod), the ledger (PATCH of the node)
    for method, resource, subresource in (("PUT", "gpuprovisioningrequests", "status"), ("PATCH", "pods", ""),
                                          ("PATCH", "nodes", "")):
        peer.inject(method, resource, subresource=subresource, status=500, when=every(12))
        peer.inject(method, resource, subresource=subresource, status=429, retry_after=0, when=every(25))
        peer.inject(method, resource, subresource=subresource, status=503, when=every(25))
        # made all the same (etcd committed), but the answer says 500 or never comes
        peer.inject(method, resource, subresource=subresource, status=500, lands=True, when=every(30))
    peer.inject("PATCH", "nodes", status=409, when=every(12))  # as if another writer changed the node
    peer.inject("PATCH", "nodes", hang=True, when=every(40))  # no answer: the ledger write's outcome unknown
    peer.inject("PATCH", "nodes", hang=True, lands=True, when=every(40))
    peer.inject("PUT", "gpuprovisioningrequests", subresource="status", hang=True, lands=True, when=every(40))
    peer.inject("POST", "pods", subresource="binding", status=500, when=every(12))
    peer.inject("POST", "pods", subresource="binding", hang=True, when=every(30))
    # a Binding made while its answer is a 500, or made only once the binder gave up on it and looked again
    peer.inject("POST", "pods", subresource="binding", status=500, lands=True, when=every(15))
    peer.inject("POST", "pods", subresource="binding", hang=True, lands=True, when=every(15))
    peer.inject("GET", None, watch=False, status=503, when=every(20))  # gets and lists
    peer.inject("GET", None, watch=False, status=429, retry_after=0, when=every(30))
    return list(peer.faults)


async def break_watches(peer: APIServerPeer, rng: random.Random, stop: asyncio.Event) -> None:
    """Every so often one resource's next watch gets an ERROR event: 410 (relist) or 500. At most one such error
    waits per resource: a server does not save errors up for the next watcher. (Saved up, they all went to the one
    replica whose watches restarted, the new one, whose every retry then met the next, backing off ever longer
    while its view of the pods stood still: the test's own starvation, 1 run in about 25.)"""
    waiting: dict[str, Fault] = {}
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.3, 0.8))
        resource, code = rng.choice(["pods", "nodes", "gpuprovisioningrequests"]), rng.choice([410, 500])
        if resource in waiting and not waiting[resource].hits:
            continue
        waiting[resource] = peer.inject("GET", resource, watch_error=code, times=1)


class Scheduler:
    """kube-scheduler's part: one pod at a time, its own filters (gates, node affinity, taints), a sample of the feasible
    nodes to the extender, the extender's answer, bind through the extender; a pod that fails waits a backoff."""

    def __init__(self, peer: APIServerPeer, ports: list[int], rng: random.Random) -> None:
        self.peer, self.ports, self.rng = peer, ports, rng
        self.not_before: dict[str, float] = {}
        self.calls = {"filter": 0, "bind": 0, "errors": 0, "refused": 0, "twice": 0}
        self.bound = 0
        self.failed: list[str] = []  # answers other than 200

    def url(self, verb: str) -> str:
        return f"http://127.0.0.1:{self.rng.choice(self.ports)}/scheduler/{verb}"

    def next_pod(self, now: float) -> dict[str, Any] | None:
        waiting = [p for (res, _, _), p in self.peer.objects.items()
                   if res == PODS and not p["spec"].get("nodeName") and not p["spec"].get("schedulingGates")
                   and self.not_before.get(p["metadata"]["uid"], 0) <= now]
        return min(waiting, key=lambda p: self.not_before.get(p["metadata"]["uid"], 0), default=None)

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            p = self.next_pod(loop.time())
            if p is None:
                await asyncio.sleep(0.01)
                continue
            uid = p["metadata"]["uid"]
            try:
                bound = await self.schedule(http, p)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.calls["errors"] += 1
                bound = False
            if not bound:
                self.not_before[uid] = loop.time() + self.rng.uniform(0.05, 0.3)

    async def call(self, http: aiohttp.ClientSession, verb: str, body: dict[str, Any]) -> Any:
        self.calls[verb] = self.calls.get(verb, 0) + 1
        async with http.post(self.url(verb), data=json.dumps(body),
                             timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:  # kube-scheduler takes it as a failed call; the extender should have said why
                self.failed.append(f"{verb}: {r.status} {await r.text()}")
                raise ValueError(self.failed[-1])
            return await r.json()

    async def schedule(self, http: aiohttp.ClientSession, p: dict[str, Any]) -> bool:
        requested = nodeaffinity.requested(self.peer.objects[k] for k in self.peer.objects if k[0] == PODS)
        feasible = sorted(name for (res, _, name), obj in self.peer.objects.items() if res == NODES_PATH
                          and nodeaffinity.matches(p, name, obj["metadata"].get("labels") or {})
                          and nodeaffinity.tolerates(p, obj) and nodeaffinity.room(p, obj, requested))
        names = self.rng.sample(feasible, max(1, round(len(feasible) * SAMPLE)))
        answer = await self.call(http, "filter", {"Pod": p, "Nodes": None, "NodeNames": names})
        assert answer.get("Error", "") == "", answer
        passed = answer.get("NodeNames") or []
        assert set(passed) <= set(names)
        if not passed:
            return False
        scores = await self.call(http, "prioritize", {"Pod": p, "Nodes": None, "NodeNames": passed})
        best = max(scores, key=lambda s: (s["Score"], s["Host"]))["Host"]
        meta = p["metadata"]
        bind = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": best}
        result = await self.call(http, "bind", bind)
        if result.get("Error"):
            self.calls["refused"] += 1
            return False
        self.bound += 1
        if self.bound % 10 == 1:  # the answer was "lost": the same bind again must not fail or move the pod
            # (every tenth bind, the first included: a 10% chance per bind left a run without one, ~0.3% of runs)
            self.calls["twice"] += 1
            again = await self.call(http, "bind", bind)
            stored = self.peer.get(PODS, meta["namespace"], meta["name"])
            assert stored is not None and stored["spec"]["nodeName"] == best, (again, stored)
        return True


async def kubelet(peer: APIServerPeer, rng: random.Random, stop: asyncio.Event) -> None:
    """Runs each bound pod for a moment, then it succeeds (status written as the kubelet writes it)."""
    started: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        for (res, _, name), p in list(peer.objects.items()):
            if res != PODS or not p["spec"].get("nodeName") or (p["metadata"].get("labels") or {}).get(KEEP_RUNNING):
                continue
            phase = (p.get("status") or {}).get("phase")
            if phase == "Pending":
                await set_phase(peer, name, "Running", p["spec"]["nodeName"])
                started[name] = loop.time() + rng.uniform(0.2, 0.6)
            elif phase == "Running" and started.get(name, 0) <= loop.time():
                await set_phase(peer, name, "Succeeded", p["spec"]["nodeName"])
        await asyncio.sleep(0.02)


def stuck(peer: APIServerPeer) -> str:
    """What has not finished: pods (node, phase, gates) and GPRs (phase, reason, reserved nodes)."""
    lines = []
    for (res, _, name), obj in sorted(peer.objects.items()):
        status = obj.get("status") or {}
        if res == PODS and status.get("phase") != "Succeeded":
            lines.append(f"pod {name}: node={obj['spec'].get('nodeName')} phase={status.get('phase')} "
                         f"gated={bool(obj['spec'].get('schedulingGates'))} allowed={nodeaffinity.named_nodes(obj)}")
        elif res == GPRS and status.get("phase") != "Complete":
            lines.append(f"gpr {name}: {status.get('phase')} {status.get('reason')} "
                         f"{[r['node'] for r in status.get('reservation') or []]}")
    return "\n".join(lines[:40])


def gpr_phase(peer: APIServerPeer, name: str) -> str:
    """The stored phase of GPR default/``name`` ("" before its first status)."""
    return str(((peer.get(GPRS, "default", name) or {}).get("status") or {}).get("phase") or "")


def reserved_nodes(peer: APIServerPeer, names: list[str]) -> set[str]:
    """The nodes the stored statuses of GPRs default/``names`` reserve."""
    return {r["node"] for n in names for r in ((peer.get(GPRS, "default", n) or {}).get("status") or {}).get(
        "reservation") or []}


def follow_reservation(reserved: dict[str, list[tuple[str, ...]]], obj: dict[str, Any]) -> None:
    """Replaying the history: add a GPR version's reserved nodes to its trail when they differ from the last
    (while it holds them), and check it counts no failure."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    nodes = tuple(sorted(r["node"] for r in status.get("reservation") or []))
    if nodes and status.get("phase") in ("Admitted", "Running"):
        trail = reserved.setdefault(meta["name"], [])
        if not trail or trail[-1] != nodes:
            trail.append(nodes)
    assert not status.get("failures"), (meta["name"], status)


def stand_ins(peer: APIServerPeer, ports: list[int], rng: random.Random, http: aiohttp.ClientSession,
              stop: asyncio.Event) -> list[asyncio.Task[None]]:
    """The scheduler, kubelet and watch-breaking stand-ins of the whole-path tests, running until ``stop``."""
    scheduler = Scheduler(peer, ports, rng)
    return [asyncio.create_task(scheduler.run(http, stop)), asyncio.create_task(kubelet(peer, rng, stop)),
            asyncio.create_task(break_watches(peer, rng, stop))]


def seen_by(peer: APIServerPeer, replicas: Sequence[ExtenderServer]) -> str:
    """What each replica's controller makes of the GPRs not Complete in the API server: whether it leads, its
    passes, the GPR's stored admission it holds, and its view of each of the GPR's pods (a failure's story)."""
    open_ = {name for (res, _, name), obj in peer.objects.items()
             if res == GPRS and (obj.get("status") or {}).get("phase") != "Complete"}
    lines = []
    for server in replicas:
        service = server.service
        if service is None:
            continue
        ctl = service.controller
        lines.append(f"replica {service.elector.identity}: leading={service.elector.leading.is_set()} passes={ctl.passes} "
                     f"informers={[(i.name, i.healthy, i.last_error[:60]) for i in server.informers]}")
        for obj in ctl.objects.values():
            name = obj["metadata"]["name"]
            if name not in open_:
                continue
            status = obj.get("status") or {}
            lines.append(f"  gpr {name}: rv={obj['metadata'].get('resourceVersion')} {status.get('phase')} "
                         f"admittedAt={status.get('admittedAt')}")
            for p in server.view.pods.values():
                if p.gpr == f"default/{name}":
                    lines.append(f"    pod {p.key}: {p.phase} node={p.node} bound_at={p.bound_at:.3f} "
                                 f"ended_at={p.ended_at:.3f}")
    return "\n".join(lines)


async def until(peer: APIServerPeer, predicate: Any, timeout: float,
                replicas: Sequence[ExtenderServer] = ()) -> None:
    try:
        await wait_until(predicate, timeout)
    except TimeoutError:
        raise AssertionError(f"not reached in {timeout:g}s; unfinished:\n{stuck(peer)}\n"
                             f"{seen_by(peer, replicas)}") from None


def check_history(peer: APIServerPeer, wants: dict[str, int]) -> dict[str, int]:
    """Replay the API server's history in order and assert the invariants of the module docstring. Returns
    counts of what was seen."""
    used: dict[str, int] = {}
    live: dict[str, tuple[str, int]] = {}  # pod UID -> (node, devices) while it holds them
    bound_to: dict[str, str] = {}
    reserved: dict[str, set[str]] = {}  # GPR name -> nodes its stored status reserves
    holding: dict[str, dict[str, int]] = {}  # GPR name -> node -> devices, while Admitted or Running
    phases: dict[str, list[str]] = {}
    seen = {"bindings": 0, "gpr_writes": 0}
    for _, resource, kind, obj in peer.events:
        meta = obj.get("metadata") or {}
        if resource == GPRS:
            status = obj.get("status") or {}
            reserved[meta["name"]] = {r["node"] for r in status.get("reservation") or []}
            holding[meta["name"]] = {r["node"]: r["devices"] for r in status.get("reservation") or []
                                     if kind != "DELETED" and status.get("phase") in ("Admitted", "Running")}
            on: dict[str, int] = {}
            for nodes in holding.values():
                for n, d in nodes.items():
                    on[n] = on.get(n, 0) + d
            assert all(d <= GPUS for d in on.values()), ("two reservations on one node", meta["name"], {
                g: h for g, h in holding.items() if any(on[n] > GPUS for n in h)})
            trail = phases.setdefault(meta["name"], [])
            phase = status.get("phase")
            if phase and (not trail or trail[-1] != phase):
                assert phase in ORDER and (not trail or ORDER.index(phase) > ORDER.index(trail[-1])), \
                    (meta["name"], trail, status)
                trail.append(phase)
            seen["gpr_writes"] += 1
        elif resource == PODS:
            uid, spec = meta["uid"], obj.get("spec") or {}
            where = str(spec.get("nodeName") or "")
            if where and uid not in bound_to:
                bound_to[uid] = where
                seen["bindings"] += 1
                group = meta["labels"]["accelstack.io/gpr"]
                assert where in reserved.get(group, set()), (meta["name"], where, reserved.get(group))
            assert not where or bound_to[uid] == where, (meta["name"], "moved", bound_to[uid], where)
            holds = bool(kind != "DELETED" and where
                         and (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
            if uid in live and not holds:
                n, d = live.pop(uid)
                used[n] -= d
            elif holds and uid not in live:
                live[uid] = (where, wants[meta["name"]])
                used[where] = used.get(where, 0) + wants[meta["name"]]
                assert used[where] <= GPUS, (where, used[where], meta["name"])
    assert all(trail[-1] == "Complete" for trail in phases.values()), phases
    return seen


@pytest.mark.timeout(240)
async def test_the_whole_path_holds_while_the_api_server_misbehaves() -> None:
    rng = random.Random(int(os.environ.get("WHOLE_PATH_SEED", "20261201")))  # another seed: another run
    peer = APIServerPeer(history=500_000)
    await peer.start()
    for i in range(NODES):
        await peer.put_object(NODES_PATH, node(f"n{i:02d}", gpus=GPUS))
    wants: dict[str, int] = {}
    for g in range(GROUPS):
        devices, count = rng.choice([(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (1, 3)])
        await peer.put_object(GPRS, gpr(f"g{g:02d}", phase=None, devices=devices, nodes=count,
                                        priority=rng.choice([50, 100, 200]), exitDuration="1h"))
        for k in range(count):
            wants[f"g{g:02d}-{k}"] = devices
            await peer.put_object(PODS, pod(f"g{g:02d}-{k}", devices, gpr=f"g{g:02d}", gated=True))
    assert sum(wants.values()) > NODES * GPUS  # more asked than there is: GPRs must wait for each other
    stop = asyncio.Event()
    faults = misbehave(peer, rng)
    tasks: list[asyncio.Task[None]] = []
    try:
        async with contextlib.AsyncExitStack() as replicas, aiohttp.ClientSession() as http:
            a = await replicas.enter_async_context(replica(peer, "a"))
            b_cm = replica(peer, "b")
            b = await b_cm.__aenter__()
            ports = [a.port, b.port]
            scheduler = Scheduler(peer, ports, rng)
            tasks += [asyncio.create_task(scheduler.run(http, stop)), asyncio.create_task(kubelet(peer, rng, stop)),
                      asyncio.create_task(break_watches(peer, rng, stop))]

            def done() -> int:
                return sum(1 for (res, _, _), p in peer.objects.items()
                           if res == PODS and (p.get("status") or {}).get("phase") == "Succeeded")

            try:
                await until(peer, lambda: done() >= len(wants) // 4, 60)
                # the leader's renewals fail until it steps down; the other replica takes over
                leader = a if a.service is not None and a.service.elector.leading.is_set() else b
                assert leader.service is not None
                with peer.inject(None, "leases", verb="update", status=500):
                    await wait_until(lambda: not leader.service.elector.leading.is_set(), timeout=10)  # type: ignore[union-attr]
                await until(peer, lambda: done() >= len(wants) // 2, 60)
            finally:
                # replica b is replaced (a rolling update): the new one starts from the API server's state
                await b_cm.__aexit__(None, None, None)
            c = await replicas.enter_async_context(replica(peer, "c"))
            ports[1] = c.port
            await until(peer, lambda: done() == len(wants), 90, [a, c])
            await until(peer, lambda: all(((peer.get(GPRS, "default", f"g{g:02d}") or {}).get("status") or {})
                                          .get("phase") == "Complete" for g in range(GROUPS)), 30, [a, c])
            # every ledger entry given back by the sweep once its pod ended
            await wait_until(lambda: all(not ledger.parse((n["metadata"].get("annotations") or {})
                                                          .get(ledger.LEDGER_ANNOTATION))
                                         for (res, _, _), n in list(peer.objects.items()) if res == NODES_PATH),
                             timeout=30)
            stop.set()
            await asyncio.gather(*tasks)
        peer.clear_faults()
        seen = check_history(peer, wants)
        assert seen["bindings"] == len(wants)
        for g in range(GROUPS):
            status = (peer.get(GPRS, "default", f"g{g:02d}") or {})["status"]
            assert status["phase"] == "Complete" and not status.get("failures") and not status.get("evictions"), status
        # the faults were met: calls were refused and retried at every step
        assert scheduler.calls["refused"] > 0 and scheduler.calls["twice"] > 0, scheduler.calls
        assert scheduler.failed == []  # every refusal said why in the Error field, with HTTP 200
        assert all(f.hits for f in faults), [f for f in faults if not f.hits]  # every fault was met
    finally:
        await wind_down(peer, stop, tasks)
