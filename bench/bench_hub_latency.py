"""The hub's two latencies on real API servers (issue 40, "Tests and figures"): a member's change -> the hub's
inventory, and a hub GPR -> Admitted on its member and mirrored back.

The world (real kube-apiserver v1.36.2 + etcd from ``KUBEBUILDER_ASSETS``, through the tests' harness):

- **the hub**: ``manifests/hub`` applied, the real ``accelstack-hub`` process under its shipped ServiceAccount
  (leader-elected, the shipped defaults: resync 30 s, lost after 15 min).
- **one real member**: its own API server with the product's stack (extender webhooks + GPR controller,
  ``tests/realcluster/stack.Stack``), ``--nodes`` fake nodes x ``--gpus`` GPUs created through its API, joined
  with the real ``kubectl accelstack cluster join``, its agent the real ``accelstack-member-agent`` process with the
  token join stored, heartbeats as shipped (10 s, at most one write a second on changes).
- **``--members`` - 1 simulated members**: the product's :class:`~scheduler_extender.multicluster.agent.MemberAgent`,
  in this process on one asyncio loop, each writing its own Cluster on the hub **with join's scoped token** (the
  hub side made with join's own :func:`~.join.hub_items`, :func:`~.join.ensure` and :func:`~.join.issue_token`),
  heartbeats as shipped. Their member side has no API server: it is fed synthetic informer events (a list of
  ``--nodes`` Node objects, then one MODIFIED event per change) through the agent's own handlers.
- **the load**: ``--gprs`` hub GPRs created before timing and left in place: most pinned to simulated members
  (the hub records the choice and writes a dispatch; no agent follows it, so it sits Dispatched), ``--too-big``
  of them too big for any member (Unschedulable, re-judged by every pass). Timing starts once the hub has
  written a status on every one of them.

Measured:

- **member change -> hub inventory**: at random moments (0-1.5 s apart) one node's allocatable GPUs go 8 -> 7 or
  back, on the real member (a status patch through its API server; the clock starts before the call) or on a
  simulated one (the synthetic MODIFIED event); timed until a watch on the hub's Clusters shows the member's
  ``devices.gpuAllocatable`` with the change. Half the changes on the real member.
- **hub -> member Admitted**: ``--batch`` hub GPRs of 1 GPU at a time, pinned to the real member; watches on both
  API servers give: create -> the member's copy seen (the hub's pass, the dispatch, the agent's follow), the
  copy seen -> Admitted (the member's own pass), the copy Admitted -> the hub GPR Admitted (the agent's mirror, the
  hub's pass). The hub's part is the first plus the last. Deleted after each batch.

``--rounds`` rounds each take their share of both; the table gives p50/p99 over all samples and each round's p50
in brackets, the targets (inventory p99 <= 2 s; the hub's part p99 <= 1 s) and met / NOT met, and how long the hub
took to place or judge the load. Run it on a quiet machine. The set-up grows with ``--gprs`` (the hub writes a status
and a dispatch for each, in turn): ``--gprs 2000`` took 1.5-3 minutes on 2 busy cores; the default 10,000 longer.

Usage: KUBEBUILDER_ASSETS=/tmp/k8s-bin .venv/bin/python bench/bench_hub_latency.py [--nodes 1000] [--gprs 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kubeapi import KubeClient  # noqa: E402
from kubeapi.client import from_config  # noqa: E402
from kubeapi.informer import Informer  # noqa: E402
from kubeapi.resources import GPRS as GPR_RESOURCE  # noqa: E402
from scheduler_extender.multicluster.agent import MemberAgent  # noqa: E402
from scheduler_extender.multicluster.clusters import CLUSTERS as CLUSTER_RESOURCE  # noqa: E402
from scheduler_extender.multicluster.join import ensure, hub_items, hub_kubeconfig, issue_token  # noqa: E402
from scheduler_extender.objects.cluster import GPU, NR1  # noqa: E402
from tests.realcluster.controlplane import ControlPlane, assets_dir, free_port, missing_assets  # noqa: E402
from tests.realcluster.mc_world import SYSTEM, cli, namespace  # noqa: E402
from tests.realcluster.shipped import install, render  # noqa: E402
from tests.realcluster.stack import Product, Stack  # noqa: E402

NEEDED = ("kube-apiserver", "etcd", "kubectl")
INVENTORY_TARGET_S = 2.0
HUB_PART_TARGET_S = 1.0
REAL = "member-00"
LOAD_NAMESPACES = 10
BENCH_NS = "bench-latency"
GPRS_PATH = "apis/accelstack.io/v1alpha1/namespaces/{ns}/gpuprovisioningrequests"
MODELS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number above 0")
    return value


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number from 0 to 1") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number from 0 to 1")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_hub_latency.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--members", type=_positive_int, default=20, help="members: 1 real + the rest simulated (20)")
    p.add_argument("--nodes", type=_positive_int, default=1000, help="nodes per member (1,000)")
    p.add_argument("--gpus", type=_positive_int, default=8, help="GPUs per node (8)")
    p.add_argument("--gprs", type=_positive_int, default=10_000, help="hub GPRs queued as load (10,000)")
    p.add_argument("--too-big", type=_share, default=0.1,
                   help="share of the load too big for any member (Unschedulable), the rest pinned (0.1)")
    p.add_argument("--changes", type=_positive_int, default=60, help="inventory changes timed (60)")
    p.add_argument("--admits", type=_positive_int, default=30, help="hub GPRs timed to Admitted (30)")
    p.add_argument("--batch", type=_positive_int, default=3, help="hub GPRs created at a time (3)")
    p.add_argument("--rounds", type=_positive_int, default=3, help="rounds the samples are split over (3)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one step (120)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.members < 2:
        p.error("--members: at least 2 (one real member and one simulated)")
    if args.timeout <= 0:
        p.error("--timeout: expected seconds above 0")
    if args.changes < args.rounds or args.admits < args.rounds:
        p.error("--changes and --admits: at least one per round (--rounds)")
    return args


# ---- pure helpers -------------------------------------------------------------------------------------------
def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank (p99 of fewer than 100 samples is the largest)."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def node_object(name: str, gpus: int, model: str, allocatable: int | None = None) -> dict[str, Any]:
    """A Ready fake node with ``gpus`` GPUs of ``model`` (``allocatable`` of them allocatable)."""
    alloc = gpus if allocatable is None else allocatable
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": model}},
            "status": {"capacity": {"cpu": "32", "memory": "256Gi", "pods": "110", GPU: str(gpus)},
                       "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110", GPU: str(alloc)},
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                                       "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}


def load_gpr(index: int, simulated: Sequence[str], too_big: float, max_gpus: int, rng: random.Random) -> dict[str, Any]:
    """One hub GPR of the load: pinned to a simulated member (dispatched, never followed) or, with probability
    ``too_big``, unpinned and asking more 8-GPU nodes than any member has (``max_gpus``: the largest member's)."""
    ns = f"load-{index % LOAD_NAMESPACES:02d}"
    if rng.random() < too_big:
        spec: dict[str, Any] = {"resource": GPU, "devicesPerNode": 8, "nodeCount": max_gpus // 8 + 1}
    else:
        spec = {"resource": GPU, "devicesPerNode": rng.choice((1, 2, 4, 8)), "nodeCount": 1,
                "clusterName": rng.choice(list(simulated))}
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": f"load-{index:05d}", "namespace": ns}, "spec": spec}


def settled(status: dict[str, Any]) -> bool:
    """Whether the hub has written its verdict on a load GPR: placed (``cluster``) or waiting with a reason."""
    return bool(status.get("cluster")) or bool(status.get("reason"))


@dataclass
class Admit:
    """One hub GPR's times (monotonic seconds) on its way to Admitted."""
    created: float
    member_seen: float | None = None
    member_admitted: float | None = None
    hub_admitted: float | None = None

    def done(self) -> bool:
        return None not in (self.member_seen, self.member_admitted, self.hub_admitted)

    def hub_part(self) -> float:
        assert self.member_seen is not None and self.member_admitted is not None and self.hub_admitted is not None
        return (self.member_seen - self.created) + max(0.0, self.hub_admitted - self.member_admitted)

    def member_pass(self) -> float:
        assert self.member_seen is not None and self.member_admitted is not None
        return self.member_admitted - self.member_seen


@dataclass
class Samples:
    inventory_real: list[list[float]] = field(default_factory=list)  # per round
    inventory_sim: list[list[float]] = field(default_factory=list)
    hub_part: list[list[float]] = field(default_factory=list)
    to_member: list[list[float]] = field(default_factory=list)
    member_pass: list[list[float]] = field(default_factory=list)
    mirrored: list[list[float]] = field(default_factory=list)
    load_rewritten: tuple[int, int] = (0, 0)  # (pinned, too big) load GPRs written again while timing
    load_seconds: float = 0.0  # first load create -> the hub's verdict on every load GPR


def row(what: str, rounds: list[list[float]], target: float | None) -> str:
    flat = [v for r in rounds for v in r]
    p50, p99 = statistics.median(flat), quantile(flat, 0.99)
    per = ", ".join(f"{statistics.median(r) * 1000:.0f}" for r in rounds if r)
    verdict = "" if target is None else (f"p99 <= {target:g} s: " + ("met" if p99 <= target else "NOT met"))
    return f"| {what} | {p50 * 1000:.0f} ms | {p99 * 1000:.0f} ms | {len(flat)} | {per} | {verdict} |"


# ---- the simulated members ------------------------------------------------------------------------------------
class SimulatedAgent(MemberAgent):
    """The product's agent with its member side fed by hand: its informers never run (no member API server), so
    it counts as synced; everything else (summary, change detection, write gap, heartbeat, the hub write) is the
    product's."""

    def synced(self) -> bool:
        return True


# ---- the world (blocking set-up through the tests' harness) ---------------------------------------------------
def start_hub(folder: Path) -> ControlPlane:
    hub = ControlPlane(folder).start()
    objects = [o for o in render("manifests/hub") if o["kind"] != "Deployment"]
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    hub.apply(crds)
    for crd in crds:
        hub.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
    hub.apply([o for o in objects if o["kind"] == "Namespace"])
    hub.apply([o for o in objects if o["kind"] not in ("CustomResourceDefinition", "Namespace")])
    for ns in [BENCH_NS, *(f"load-{i:02d}" for i in range(LOAD_NAMESPACES))]:
        namespace(hub, ns)
    return hub


def add_nodes(cp: ControlPlane, names: Sequence[str], gpus: int) -> None:
    def one(i_name: tuple[int, str]) -> None:
        i, name = i_name
        obj = node_object(name, gpus, MODELS[i % len(MODELS)])
        status = obj.pop("status")
        cp.create("api/v1/nodes", obj)
        cp.patch(f"api/v1/nodes/{name}/status", {"status": status})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, enumerate(names)))


def start_real_member(folder: Path, hub: ControlPlane, nodes: int, gpus: int) -> tuple[ControlPlane, Stack, Product]:
    cp = ControlPlane(folder).start()
    stack = Stack(cp, install(cp, render())).start()
    namespace(cp, BENCH_NS)
    add_nodes(cp, [f"real-n{n:04d}" for n in range(nodes)], gpus)
    res = cli("cluster", "join", REAL, "--hub-kubeconfig", str(hub.admin_kubeconfig), "--kubeconfig",
              str(cp.admin_kubeconfig), "--label", "region=r0", "--token-expiry", "1h")
    if res.returncode != 0:
        raise SystemExit(f"bench hub latency: cluster join {REAL} failed: {res.stderr.strip()}")
    secret = cp.get(f"api/v1/namespaces/{SYSTEM}/secrets/accelstack-hub-kubeconfig") or {}
    hub_config = cp.dir / "hub-from-secret.kubeconfig"
    hub_config.write_bytes(base64.b64decode(secret["data"]["kubeconfig"]))
    port = free_port()
    agent = Product(cp, f"member-agent-{REAL}", "scheduler_extender.cmd.member_agent", [
        "--kubeconfig", str(cp.sa_kubeconfig(SYSTEM, "accelstack-member-agent")), "--hub-kubeconfig", str(hub_config),
        "--cluster", REAL, "--listen", f"127.0.0.1:{port}", "--log-format", "json"],
        env={"POD_NAMESPACE": SYSTEM}, health=f"http://127.0.0.1:{port}").start(ready_timeout=120)
    return cp, stack, agent


def start_hub_process(hub: ControlPlane) -> Product:
    port = free_port()
    return Product(hub, "hub", "scheduler_extender.cmd.hub", [
        "--kubeconfig", str(hub.sa_kubeconfig(SYSTEM, "accelstack-hub")), "--listen", f"127.0.0.1:{port}",
        "--identity", "hub-0", "--log-format", "json"], env={"POD_NAMESPACE": SYSTEM},
        health=f"http://127.0.0.1:{port}").start(ready_timeout=120)


# ---- the measurement (one asyncio loop: the simulated agents, the watches, the changes) -----------------------
class Watches:
    """The bench's own watches: the hub's Clusters (gpuAllocatable per member) and the bench namespace's GPRs on
    both sides (the first time each is seen, and seen Admitted)."""

    def __init__(self, hub: KubeClient, member: KubeClient) -> None:
        self.allocatable: dict[str, int] = {}
        self.admits: dict[str, Admit] = {}
        self.poke = asyncio.Event()
        self.informers = [
            Informer(hub, CLUSTER_RESOURCE, self._on_cluster, self._sync_clusters, name="bench-clusters"),
            Informer(member, GPR_RESOURCE, self._on_member_gpr, lambda items: None, name="bench-member-gprs",
                     namespace=BENCH_NS),
            Informer(hub, GPR_RESOURCE, self._on_hub_gpr, lambda items: None, name="bench-hub-gprs",
                     namespace=BENCH_NS)]

    def _on_cluster(self, kind: str, obj: dict[str, Any]) -> None:
        name = str(obj["metadata"]["name"])
        self.allocatable[name] = int(((obj.get("status") or {}).get("devices") or {}).get("gpuAllocatable") or 0)
        self.poke.set()

    def _sync_clusters(self, items: Sequence[dict[str, Any]]) -> None:
        for obj in items:
            self._on_cluster("ADDED", obj)

    def _on_member_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        a = self.admits.get(obj["metadata"]["name"])
        if a is None or kind == "DELETED":
            return
        now = time.monotonic()
        a.member_seen = a.member_seen or now
        if (obj.get("status") or {}).get("phase") in ("Admitted", "Running") and a.member_admitted is None:
            a.member_admitted = now
        self.poke.set()

    def _on_hub_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        a = self.admits.get(obj["metadata"]["name"])
        if a is not None and kind != "DELETED" and a.hub_admitted is None and \
                (obj.get("status") or {}).get("phase") in ("Admitted", "Running"):
            a.hub_admitted = time.monotonic()
            self.poke.set()

    async def until(self, what: str, probe: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"bench hub latency: {what} not reached within {timeout:.0f} s")
            self.poke.clear()
            try:
                await asyncio.wait_for(self.poke.wait(), min(left, 1.0))
            except TimeoutError:
                pass


async def simulated_members(admin: KubeClient, hub: ControlPlane, names: Sequence[str], nodes: int,
                            gpus: int) -> tuple[list[SimulatedAgent], list[KubeClient]]:
    """Each simulated member joined on the hub as join does it (its objects, its scoped token), its agent fed a
    synthetic list of ``nodes`` nodes."""
    agents, clients = [], []
    for i, name in enumerate(names):
        token = ""
        for item in hub_items(name, {"region": f"r{(i + 1) % 4}"}):
            if item.body is None:
                token, _ = await issue_token(admin, name, 3600)
            else:
                await ensure(admin, item, item.body)
        path = hub.dir / f"hub-{name}.kubeconfig"
        path.write_text(hub_kubeconfig(hub.url, hub.pki.ca_crt.read_bytes(), token, name))
        client = await from_config(str(path), field_manager="accelstack-member-agent")
        clients.append(client)
        agent = SimulatedAgent(client, client, name, resources=(GPU, NR1))
        agent.versions = {"kubernetes": "v1.36.2", "accelstack": "bench"}
        agent._sync_nodes([node_object(f"{name}-n{n:04d}", gpus, MODELS[(n + i) % len(MODELS)])
                           for n in range(nodes)])
        agent._sync_accelerator_nodes([])
        agent._sync_gprs([])
        agents.append(agent)
    return agents, clients


async def create_load(admin: KubeClient, objects: Sequence[dict[str, Any]]) -> None:
    gate = asyncio.Semaphore(16)

    async def one(obj: dict[str, Any]) -> None:
        async with gate:
            await admin.create(GPR_RESOURCE, obj, obj["metadata"]["namespace"], retry=True)

    await asyncio.gather(*(one(o) for o in objects))


Versions = dict[str, tuple[str, bool, bool]]


async def load_versions(admin: KubeClient) -> Versions:
    """Each load GPR: (its resourceVersion, whether the hub has written its verdict, whether it is pinned)."""
    items, _ = await admin.list(GPR_RESOURCE, page_size=2000)
    return {f"{o['metadata']['namespace']}/{o['metadata']['name']}":
            (str(o["metadata"].get("resourceVersion")), settled(o.get("status") or {}),
             bool((o.get("spec") or {}).get("clusterName")))
            for o in items if str(o["metadata"]["namespace"]).startswith("load-")}


def rewritten(before: Versions, after: Versions) -> tuple[int, int]:
    """(pinned, too big) load GPRs written (their resourceVersion moved) between two reads."""
    moved = [pinned for key, (rv, _, pinned) in after.items() if key in before and before[key][0] != rv]
    return sum(moved), len(moved) - sum(moved)


async def measure(args: argparse.Namespace, hub: ControlPlane, member: ControlPlane) -> Samples:
    rng = random.Random(args.seed)
    admin = await from_config(str(hub.admin_kubeconfig), field_manager="bench")
    member_admin = await from_config(str(member.admin_kubeconfig), field_manager="bench")
    sim_names = [f"member-{i:02d}" for i in range(1, args.members)]
    stop = asyncio.Event()
    watches = Watches(admin, member_admin)
    tasks = [asyncio.create_task(i.run(stop)) for i in watches.informers]
    agents, clients = await simulated_members(admin, hub, sim_names, args.nodes, args.gpus)
    tasks += [asyncio.create_task(a.run(stop)) for a in agents]
    total = args.nodes * args.gpus
    samples = Samples()
    try:
        everyone = [REAL, *sim_names]
        await watches.until(f"{len(everyone)} members with {total} GPUs on the hub",
                            lambda: all(watches.allocatable.get(n) == total for n in everyone), args.timeout)
        started = time.monotonic()
        await create_load(admin, [load_gpr(i, sim_names, args.too_big, total, rng) for i in range(args.gprs)])
        progress(f"{args.gprs:,} load GPRs created in {time.monotonic() - started:.1f} s; waiting for the hub's "
                 "verdict on each")
        deadline = time.monotonic() + max(args.timeout, args.gprs / 20)
        while True:
            versions = await load_versions(admin)
            done, count = sum(1 for _, ok, _ in versions.values() if ok), len(versions)
            if done == count == args.gprs:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"bench hub latency: the hub wrote a verdict on {done} of {count} load GPRs only")
            await asyncio.sleep(2.0)
        samples.load_seconds = time.monotonic() - started
        progress(f"the hub placed or judged every load GPR {samples.load_seconds:.1f} s after the first create")
        by_name = {a.cluster: a for a in agents}
        lowered: set[tuple[str, str]] = set()
        serial = 0
        for rnd in range(args.rounds):
            real_r: list[float] = []
            sim_r: list[float] = []
            for c in range(args.changes // args.rounds):
                await asyncio.sleep(rng.uniform(0.0, 1.5))
                target = REAL if c % 2 == 0 else rng.choice(sim_names)
                node = (f"real-n{rng.randrange(args.nodes):04d}" if target == REAL else
                        f"{target}-n{rng.randrange(args.nodes):04d}")
                key = (target, node)
                want_alloc = args.gpus if key in lowered else args.gpus - 1
                lowered.symmetric_difference_update({key})
                expect = watches.allocatable[target] + (1 if want_alloc == args.gpus else -1)
                t0 = time.monotonic()
                if target == REAL:
                    body = {"status": {"allocatable": {GPU: str(want_alloc)}}}
                    await asyncio.to_thread(member.patch, f"api/v1/nodes/{node}/status", body)
                else:
                    i = sim_names.index(target) + 1
                    model = MODELS[(int(node.rsplit("n", 1)[1]) + i) % len(MODELS)]
                    by_name[target]._on_node("MODIFIED", node_object(node, args.gpus, model, want_alloc))
                await watches.until(f"{target}'s change on the hub",
                                    lambda t=target, e=expect: watches.allocatable.get(t) == e,  # type: ignore[misc]
                                    args.timeout)
                (real_r if target == REAL else sim_r).append(time.monotonic() - t0)
            samples.inventory_real.append(real_r)
            samples.inventory_sim.append(sim_r)
            parts: list[float] = []
            to_member: list[float] = []
            passes: list[float] = []
            mirrored: list[float] = []
            n = args.admits // args.rounds
            while n > 0:
                names = []
                for _ in range(min(args.batch, n)):
                    serial += 1
                    name = f"lat-{serial:04d}"
                    watches.admits[name] = Admit(time.monotonic())
                    await admin.create(GPR_RESOURCE, {
                        "apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
                        "metadata": {"name": name}, "spec": {"resource": GPU, "devicesPerNode": 1, "nodeCount": 1,
                                                              "clusterName": REAL}}, BENCH_NS)
                    names.append(name)
                await watches.until(f"{', '.join(names)} Admitted on {REAL} and on the hub",
                                    lambda ns=names: all(watches.admits[x].done() for x in ns),  # type: ignore[misc]
                                    args.timeout)
                for x in names:
                    a = watches.admits[x]
                    parts.append(a.hub_part())
                    passes.append(a.member_pass())
                    to_member.append((a.member_seen or 0.0) - a.created)
                    mirrored.append(max(0.0, (a.hub_admitted or 0.0) - (a.member_admitted or 0.0)))
                    await admin.delete(GPR_RESOURCE, x, BENCH_NS)
                n -= len(names)
            samples.hub_part.append(parts)
            samples.to_member.append(to_member)
            samples.member_pass.append(passes)
            samples.mirrored.append(mirrored)
            samples.load_rewritten = rewritten(versions, await load_versions(admin))
            progress(f"round {rnd + 1}/{args.rounds}: inventory p50 real {statistics.median(real_r) * 1000:.0f} ms, "
                     f"simulated {statistics.median(sim_r) * 1000:.0f} ms; hub's part p50 "
                     f"{statistics.median(parts) * 1000:.0f} ms, member's pass p50 "
                     f"{statistics.median(passes) * 1000:.0f} ms")
        return samples
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in [*clients, admin, member_admin]:
            await client.close()


def report(args: argparse.Namespace, samples: Samples, hub_writes: str) -> list[str]:
    load = os.getloadavg()
    return [
        f"hub latencies on real hub kube-apiserver v1.36.2, 1 real + {args.members - 1} simulated members x "
        f"{args.nodes:,} nodes x {args.gpus} GPUs, {args.gprs:,} hub GPRs queued ({args.too_big:.0%} too big, "
        f"the rest pinned to simulated members); {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; {args.rounds} round(s), each round's p50 in brackets (ms)", "",
        "| what | p50 | p99 | samples | rounds' p50 | target |", "|---|---|---|---|---|---|",
        row("member change -> hub inventory, all", [r + s for r, s in zip(samples.inventory_real,
                                                                       samples.inventory_sim, strict=True)],
            INVENTORY_TARGET_S),
        row("... the real member (node status patch -> Cluster status)", samples.inventory_real, None),
        row("... simulated members (node event -> Cluster status)", samples.inventory_sim, None),
        row("hub -> member Admitted: the hub's part (-> member copy, + Admitted -> hub mirrored)", samples.hub_part,
            HUB_PART_TARGET_S),
        row("... hub create -> member copy seen", samples.to_member, None),
        row("... member copy Admitted -> hub GPR Admitted", samples.mirrored, None),
        row("the member's own pass (copy seen -> Admitted), not the hub's", samples.member_pass, None),
        f"hub: {hub_writes}; load placed or judged {samples.load_seconds:.0f} s after its first create; load GPRs whose status the hub wrote again while timing: "
        f"{samples.load_rewritten[0]:,} pinned, {samples.load_rewritten[1]:,} too big"]


def hub_writes(health: str) -> str:
    """The hub's status writes (its /metrics), so a load that makes it rewrite statuses shows."""
    import urllib.request

    try:
        with urllib.request.urlopen(health + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as exc:
        return f"no /metrics ({exc})"
    lines = [line for line in text.splitlines() if line.startswith(("accelstack_hub_status_writes",
                                                                    "accelstack_hub_dispatch"))]
    return "; ".join(lines) or "no write counters on /metrics"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    folder = assets_dir()
    if folder is None or missing_assets(folder, NEEDED):
        raise SystemExit(f"bench hub latency: KUBEBUILDER_ASSETS must name a folder with {', '.join(NEEDED)} "
                         "(scripts/test.sh unpacks ../shared/k8s into .cache/k8s-bin)")
    started = time.monotonic()
    hub = start_hub(folder)
    planes = [hub]
    procs: list[Product] = []
    stack: Stack | None = None
    try:
        member, stack, agent = start_real_member(folder, hub, args.nodes, args.gpus)
        planes.append(member)
        procs.append(agent)
        hub_proc = start_hub_process(hub)
        procs.append(hub_proc)
        progress(f"hub, real member ({args.nodes:,} nodes), join, agent and accelstack-hub up in "
                 f"{time.monotonic() - started:.1f} s")
        samples = asyncio.run(measure(args, hub, member))
        writes = hub_writes(hub_proc.health)
    finally:
        for proc in reversed(procs):
            proc.stop()
        if stack is not None:
            stack.stop()
        for cp in planes:
            if os.environ.get("ACCELSTACK_KEEP_CONTROL_PLANE"):
                cp.stop()
            else:
                cp.cleanup()
    for line in report(args, samples, writes):
        print(line)
    progress(f"whole run {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
