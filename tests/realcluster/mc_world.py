"""The multi-cluster world the real-cluster tests of issue 40 share: three real control planes on loopback.

A fresh hub (``manifests/hub`` applied; no GPR controller runs there, only ``accelstack-hub`` under its shipped
ServiceAccount) and two members, ``member-a`` and ``member-b``, each with the product's own extender (webhooks) and
GPR controller (``Stack``) and two 8-GPU nodes (``X-h100``: H100, ``X-a100``: A100), both joined with the real
``kubectl accelstack cluster join`` (labels region and provider), each agent running as a real process with the hub
kubeconfig join stored in its member (the real, scoped token). ``LOST_AFTER`` is 4 s; the agents beat every 0.5 s.

One world per test run (the fixture ``mc_world`` of the package tests/realcluster/multicluster/, whose files all
share it): starting three planes and the members' stacks costs 30-60 s on a 2-core machine. A test
leaves it as it found it: it deletes what it made (GPRs, workspaces, nodes), restarts what it stopped, and uses names
of its own; ``World.clean`` deletes hub GPRs and waits for their member copies to go.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from tests.realcluster.controlplane import ControlPlane, assets_dir, free_port
from tests.realcluster.objects import GPRS, wait_for
from tests.realcluster.shipped import ROOT, install, render
from tests.realcluster.stack import Product, Stack

CLUSTERS = "apis/accelstack.io/v1alpha1/clusters"
WORKSPACES = "apis/accelstack.io/v1alpha1/workspaces"
HUB_NS = "apis/accelstack.io/v1alpha1/namespaces/{ns}/gpuprovisioningrequests"
SYSTEM = "accelstack-system"
LOST_AFTER = 4.0  # seconds: the agents beat every 0.5 s
REGIONS = {"member-a": "eu-west", "member-b": "us-east"}
SECONDS: dict[str, float] = {}


class Member:
    """A member control plane with accelstack installed, its nodes and its agent."""

    def __init__(self, name: str, plane: ControlPlane) -> None:
        self.name, self.cp = name, plane
        self.agent: Product | None = None

    def add_node(self, node: str, gpus: int, model: str = "H100") -> None:
        self.cp.create("api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": node, "labels": {"kubernetes.io/hostname": node, "nvidia.com/gpu.product": model}}})
        alloc = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        self.cp.patch(f"api/v1/nodes/{node}/status", {"status": {
            "capacity": alloc, "allocatable": alloc,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})

    def hub_kubeconfig(self) -> Path:
        """The hub kubeconfig exactly as join stored it in the member's Secret."""
        secret = self.cp.get(f"api/v1/namespaces/{SYSTEM}/secrets/accelstack-hub-kubeconfig") or {}
        path = self.cp.dir / "hub-from-secret.kubeconfig"
        path.write_bytes(base64.b64decode(secret["data"]["kubeconfig"]))
        return path

    def start_agent(self) -> Product:
        port = free_port()
        secret = self.cp.get(f"api/v1/namespaces/{SYSTEM}/secrets/accelstack-hub-kubeconfig") or {}
        cluster = base64.b64decode(secret["data"]["cluster"]).decode()
        self.agent = Product(self.cp, f"member-agent-{self.name}", "scheduler_extender.cmd.member_agent", [
            "--kubeconfig", str(self.cp.sa_kubeconfig(SYSTEM, "accelstack-member-agent")),
            "--hub-kubeconfig", str(self.hub_kubeconfig()), "--cluster", cluster, "--heartbeat", "0.5",
            "--min-write-gap", "0.2", "--listen", f"127.0.0.1:{port}", "--log-format", "json"],
            env={"POD_NAMESPACE": SYSTEM}, health=f"http://127.0.0.1:{port}").start()
        return self.agent


class World:
    def __init__(self, hub: ControlPlane, members: dict[str, Member], stacks: list[Stack]) -> None:
        self.hub, self.members, self.stacks = hub, members, stacks
        self.hub_proc: Product | None = None
        self.joined: dict[str, list[str]] = {}  # each member's first join output, line by line

    def join(self, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        """``kubectl accelstack cluster join NAME`` with the world's labels, as the admin runs it."""
        m = self.members[name]
        return cli("cluster", "join", name, "--hub-kubeconfig", str(self.hub.admin_kubeconfig),
                   "--kubeconfig", str(m.cp.admin_kubeconfig), "--label", f"region={REGIONS[name]}",
                   "--label", "provider=onprem", "--token-expiry", "1h", *extra)

    def clean(self, *keys: tuple[str, str], timeout: float = 60) -> None:
        """Delete these hub GPRs (namespace, name) and wait until no member holds a copy of them."""
        for ns, name in keys:
            self.hub.delete(f"{HUB_NS.format(ns=ns)}/{name}")
        for ns, name in keys:
            for m in self.members.values():
                wait_for(f"{m.name}'s copy of {ns}/{name} gone", partial(_gone, m.cp, f"{GPRS.format(ns=ns)}/{name}"),
                         timeout=timeout)


def _gone(cp: ControlPlane, path: str) -> bool:
    return cp.get(path) is None


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real plugin as a user runs it: ``kubectl-accelstack ARGS`` (python -m, the same entry point)."""
    return subprocess.run([sys.executable, "-m", "scheduler_extender.cli.kubectl_plugin", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _plane(role: str) -> ControlPlane:
    folder = assets_dir()
    assert folder is not None
    plane = ControlPlane(folder)
    plane.dir.joinpath("role").write_text(role)
    return plane.start()


def cluster(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.get(f"{CLUSTERS}/{name}") or {}


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def ready_with(cp: ControlPlane, name: str, gpus: int) -> dict[str, Any] | None:
    """The Cluster when it is Ready with ``gpus`` allocatable GPUs, else None."""
    obj = cluster(cp, name)
    status = obj.get("status") or {}
    ok = condition(obj, "Ready").get("status") == "True" and \
        (status.get("devices") or {}).get("gpuAllocatable") == gpus
    return obj if ok else None


def namespace(cp: ControlPlane, name: str) -> None:
    """A namespace with its default ServiceAccount (no controller-manager here makes it; pods need it), unless it
    is there already (tests share the world)."""
    if cp.get(f"api/v1/namespaces/{name}") is None:
        cp.create("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    if cp.get(f"api/v1/namespaces/{name}/serviceaccounts/default") is None:
        cp.create(f"api/v1/namespaces/{name}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                                 "metadata": {"name": "default"}})


def hub_gpr(w: World, ns: str, name: str) -> dict[str, Any]:
    return w.hub.get(f"{HUB_NS.format(ns=ns)}/{name}") or {}


def member_gpr(m: Member, ns: str, name: str) -> dict[str, Any]:
    return m.cp.get(f"{GPRS.format(ns=ns)}/{name}") or {}


def dispatches(w: World, member: str) -> list[str]:
    items = w.hub.api("GET", HUB_NS.format(ns=f"accelstack-member-{member}")).get("items") or []
    return sorted(o["metadata"]["name"] for o in items)


def hub_status(w: World, ns: str, name: str, **want: Any) -> dict[str, Any] | None:
    status = hub_gpr(w, ns, name).get("status") or {}
    return status if all(status.get(k) == v for k, v in want.items()) else None


def reserved(cp: ControlPlane, cluster_name: str, model: str) -> int:
    obj = cp.get(f"{CLUSTERS}/{cluster_name}") or {}
    return sum(int(r.get("reserved") or 0) for r in (obj.get("status") or {}).get("inventory") or []
               if r.get("model") == model)


def api_replica(hub: ControlPlane, identity: str) -> tuple[Product, str]:
    """Another ``accelstack-hub`` replica (the world's hub leads; this one does not, and serves from its own
    informers as every replica does) with its REST API on ``--api-listen``, under the shipped ServiceAccount:
    (the started process, the API's base URL). The caller stops it."""
    port, api_port = free_port(), free_port()
    replica = Product(hub, identity, "scheduler_extender.cmd.hub", [
        "--kubeconfig", str(hub.sa_kubeconfig(SYSTEM, "accelstack-hub")), "--listen", f"127.0.0.1:{port}",
        "--api-listen", f"127.0.0.1:{api_port}", "--lost-after", f"{LOST_AFTER:g}s", "--lease-seconds", "3",
        "--identity", identity, "--resync", "1", "--log-format", "json"],
        env={"POD_NAMESPACE": SYSTEM}, health=f"http://127.0.0.1:{port}").start(ready_timeout=90)
    return replica, f"http://127.0.0.1:{api_port}"


def readyz(m: Member) -> tuple[int, str]:
    """The agent's /readyz: (status, body)."""
    assert m.agent is not None
    try:
        with urllib.request.urlopen(m.agent.health + "/readyz", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def not_ready(m: Member) -> str | None:
    """The body of the agent's /readyz while it answers 503."""
    code, body = readyz(m)
    return body if code == 503 else None


def call(base: str, path: str, token: str = "", method: str = "GET", timeout: float = 60) -> tuple[int, Any]:
    """An HTTP call to a hub API (``base`` its URL) as a user would make it: (status, JSON body)."""
    request = urllib.request.Request(base + path, method=method,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())


def start_world() -> Iterator[World]:
    """A hub and two members (three real control planes), each member with the product's extender and controller
    and two 8-GPU nodes, both joined through the real CLI, their agents and the hub controller running."""
    started = time.monotonic()
    hub = _plane("hub")
    members = {n: Member(n, _plane(n)) for n in ("member-a", "member-b")}
    stacks: list[Stack] = []
    w = World(hub, members, stacks)
    try:
        objects = [o for o in render("manifests/hub") if o["kind"] != "Deployment"]
        hub.apply([o for o in objects if o["kind"] == "CustomResourceDefinition"])
        for crd in (o for o in objects if o["kind"] == "CustomResourceDefinition"):
            hub.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
        hub.apply([o for o in objects if o["kind"] == "Namespace"])
        hub.apply([o for o in objects if o["kind"] not in ("CustomResourceDefinition", "Namespace")])
        for m in members.values():
            shipped = install(m.cp, render())
            stacks.append(Stack(m.cp, shipped).start())
            m.add_node(f"{m.name[-1]}-h100", 8)
            m.add_node(f"{m.name[-1]}-a100", 8, model="A100")
        SECONDS["three planes, members with their stack"] = time.monotonic() - started
        for name in members:
            res = w.join(name)
            assert res.returncode == 0, res.stderr
            w.joined[name] = res.stdout.splitlines()
        port = free_port()
        w.hub_proc = Product(hub, "hub", "scheduler_extender.cmd.hub", [
            "--kubeconfig", str(hub.sa_kubeconfig(SYSTEM, "accelstack-hub")), "--listen", f"127.0.0.1:{port}",
            "--lost-after", f"{LOST_AFTER:g}s", "--lease-seconds", "3", "--identity", "hub-0", "--resync", "1",
            "--log-format", "json"], env={"POD_NAMESPACE": SYSTEM}, health=f"http://127.0.0.1:{port}").start()
        for m in members.values():
            m.start_agent()
        for name in members:
            wait_for(f"{name} Ready with 16 GPUs", partial(ready_with, hub, name, 16), timeout=90)
        SECONDS["set-up"] = time.monotonic() - started
        print(f"\nmulticluster world set-up seconds: {({k: round(v, 1) for k, v in SECONDS.items()})}")
        yield w
    finally:
        for m in members.values():
            if m.agent is not None:
                m.agent.stop()
        if w.hub_proc is not None:
            w.hub_proc.stop()
        for s in stacks:
            s.stop()
        keep = os.environ.get("ACCELSTACK_KEEP_CONTROL_PLANE")  # as the session plane: logs kept to read
        for plane in (*(m.cp for m in members.values()), hub):
            plane.stop() if keep else plane.cleanup()
