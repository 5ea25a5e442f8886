"""Many clusters, step 1 (issue 40.1): three real API servers on loopback, a hub and two members.

``kubectl accelstack cluster join`` (the real CLI, as a process) registers both members with the admin's two
kubeconfigs; each member's agent runs as a real process with the hub kubeconfig join wrote into the member's
Secret (its real, scoped token) and the member ServiceAccount join made; ``accelstack-hub`` runs under the
shipped ``manifests/hub`` ServiceAccount. On the hub the Clusters go Ready with each member's GPUs; real
``kubectl auth can-i`` with member-a's token shows it can write its own Cluster and nothing of member-b's or the
hub's secrets; member-b's agent stopped makes its Cluster Lost (a short ``--lost-after``) and started again
Ready; ``cluster leave`` removes what join made. The two extra control planes are module-scoped: one start.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.realcluster.controlplane import ApiCallError, ControlPlane, assets_dir, free_port
from tests.realcluster.objects import wait_for
from tests.realcluster.shipped import ROOT, render
from tests.realcluster.stack import Product

CLUSTERS = "apis/accelstack.io/v1alpha1/clusters"
SYSTEM = "accelstack-system"
LOST_AFTER = 4.0  # seconds: the agents beat every 0.5 s
SETUP_SECONDS: dict[str, float] = {}


class Member:
    """A member control plane with accelstack's CRDs and namespace, and fake GPU nodes."""

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


def _plane(name: str) -> ControlPlane:
    folder = assets_dir()
    assert folder is not None
    plane = ControlPlane(folder)
    plane.dir.joinpath("role").write_text(name)
    return plane.start()


@pytest.fixture(scope="module")
def members(cp: ControlPlane) -> Iterator[dict[str, Member]]:
    """Two more real control planes (etcd + kube-apiserver each), accelstack's CRDs and namespace on each."""
    started = time.monotonic()
    planes = {n: Member(n, _plane(n)) for n in ("member-a", "member-b")}
    SETUP_SECONDS["two extra control planes"] = time.monotonic() - started
    crds = [o for o in render("manifests/crds")]
    try:
        for m in planes.values():
            m.cp.apply(crds)
            for crd in crds:
                m.cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
            m.cp.create("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYSTEM}})
        SETUP_SECONDS["with CRDs"] = time.monotonic() - started
        yield planes
    finally:
        for m in planes.values():
            if m.agent is not None:
                m.agent.stop()
            m.cp.cleanup()


@pytest.fixture(scope="module")
def hub(cp: ControlPlane, shipped: list[dict[str, Any]]) -> Iterator[Product]:
    """The session's control plane as the hub: manifests/hub applied, accelstack-hub under its ServiceAccount."""
    objects = [o for o in render("manifests/hub") if o["kind"] != "Deployment"]
    cp.apply([o for o in objects if o["kind"] == "CustomResourceDefinition"])
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/clusters.accelstack.io")
    cp.apply([o for o in objects if o["kind"] != "CustomResourceDefinition"])
    port = free_port()
    proc = Product(cp, "hub", "scheduler_extender.cmd.hub", [
        "--kubeconfig", str(cp.sa_kubeconfig(SYSTEM, "accelstack-hub")), "--listen", f"127.0.0.1:{port}",
        "--lost-after", f"{LOST_AFTER:g}s", "--lease-seconds", "3", "--identity", "hub-0", "--resync", "1",
        "--log-format", "json"], env={"POD_NAMESPACE": SYSTEM}, health=f"http://127.0.0.1:{port}").start()
    yield proc
    proc.stop()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real plugin as a user runs it: ``kubectl-accelstack ARGS`` (python -m, the same entry point)."""
    return subprocess.run([sys.executable, "-m", "scheduler_extender.cli.kubectl_plugin", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def cluster(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.get(f"{CLUSTERS}/{name}") or {}


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def ready_with(cp: ControlPlane, name: str, gpus: int) -> dict[str, Any] | None:
    obj = cluster(cp, name)
    status = obj.get("status") or {}
    ok = condition(obj, "Ready").get("status") == "True" and \
        (status.get("devices") or {}).get("gpuAllocatable") == gpus
    return obj if ok else None


def test_join_agents_ready_scoped_lost_and_leave(cp: ControlPlane, hub: Product,
                                                 members: dict[str, Member]) -> None:
    a, b = members["member-a"], members["member-b"]
    a.add_node("a-gpu-1", 8)
    a.add_node("a-gpu-2", 8, model="A100")
    b.add_node("b-gpu-1", 4)

    # ---- the CRD's own checks (CEL), as the API server applies them ------------------------------------------
    for name, labels, says in (("x" * 46, {}, "a cluster's name is a DNS label of at most 45"),
                               ("ok", {"bad key!": "v"}, "spec.labels: every key is a label key")):
        with pytest.raises(ApiCallError) as refused_crd:
            cp.create(CLUSTERS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Cluster",
                                 "metadata": {"name": name}, "spec": {"labels": labels}})
        assert refused_crd.value.status == 422 and says in str(refused_crd.value), refused_crd.value

    # ---- join, through the real CLI, printing one line per object -------------------------------------------
    joined = {}
    for m, region in ((a, "eu-west"), (b, "us-east")):
        res = cli("cluster", "join", m.name, "--hub-kubeconfig", str(cp.admin_kubeconfig),
                  "--kubeconfig", str(m.cp.admin_kubeconfig), "--label", f"region={region}", "--label",
                  "provider=onprem", "--token-expiry", "1h")
        assert res.returncode == 0, res.stderr
        joined[m.name] = res.stdout.splitlines()
    lines = joined["member-a"]
    assert lines[0] == "hub: Namespace accelstack-member-member-a: created"
    assert "hub: ClusterRole accelstack-member-member-a: created" in lines
    assert "hub: Cluster member-a: created" in lines
    assert any(ln.startswith("hub: ServiceAccount member-agent/token in accelstack-member-member-a: issued, "
                             "expires ") for ln in lines)
    assert "member: Secret accelstack-hub-kubeconfig in accelstack-system: created" in lines
    assert lines[-1] == "member: Deployment accelstack-member-agent in accelstack-system: created"
    assert len(lines) == 15
    # join again: idempotent (only the token and the Secret holding it change)
    again = cli("cluster", "join", "member-a", "--hub-kubeconfig", str(cp.admin_kubeconfig),
                "--kubeconfig", str(a.cp.admin_kubeconfig), "--label", "region=eu-west", "--label",
                "provider=onprem", "--token-expiry", "1h")
    assert again.returncode == 0, again.stderr
    changed = [ln for ln in again.stdout.splitlines() if not ln.endswith(": unchanged")]
    assert [ln.split(":")[0] + ":" + ln.split(":")[1] for ln in changed] == [
        "hub: ServiceAccount member-agent/token in accelstack-member-member-a",
        "member: Secret accelstack-hub-kubeconfig in accelstack-system"], again.stdout
    assert cluster(cp, "member-a")["spec"]["labels"] == {"region": "eu-west", "provider": "onprem"}

    # ---- the agents, as real processes with what join made: Ready with each member's GPUs ---------------------
    started = time.monotonic()
    a.start_agent()
    b.start_agent()
    got_a = wait_for("member-a Ready with 16 GPUs", lambda: ready_with(cp, "member-a", 16), timeout=60)
    wait_for("member-b Ready with 4 GPUs", lambda: ready_with(cp, "member-b", 4), timeout=60)
    SETUP_SECONDS["agents start to both Ready"] = time.monotonic() - started
    rows = {(i["resource"], i["model"]): i for i in got_a["status"]["inventory"]}
    assert rows[("nvidia.com/gpu", "H100")]["allocatable"] == 8 and rows[("nvidia.com/gpu", "A100")]["capacity"] == 8
    assert got_a["status"]["versions"]["kubernetes"].startswith("v1.")
    assert condition(got_a, "Lost")["status"] == "False"
    # a change in the member reaches the hub without waiting for anything but the agent's write gap
    b.add_node("b-gpu-2", 8)
    wait_for("member-b's new node on the hub", lambda: ready_with(cp, "member-b", 12), timeout=30)
    out = cp.kubectl("get", "clusters.accelstack.io", "-o", "wide")
    assert "member-a" in out and "eu-west" in out and "16" in out, out

    # ---- the scope of member-a's hub token (the real token join issued), with the real kubectl --------------
    token_a = a.hub_kubeconfig()
    ns_a, ns_b = "accelstack-member-member-a", "accelstack-member-member-b"
    g = "clusters.accelstack.io"
    assert cp.can_i(token_a, "update", f"{g}/member-a", subresource="status")
    assert cp.can_i(token_a, "patch", f"{g}/member-a", subresource="status")
    assert not cp.can_i(token_a, "update", f"{g}/member-b", subresource="status")
    assert not cp.can_i(token_a, "patch", f"{g}/member-b")
    assert not cp.can_i(token_a, "list", g)
    assert not cp.can_i(token_a, "delete", f"{g}/member-a")
    for verb in ("get", "list"):
        for what in ("serviceaccounts", "secrets", "configmaps", "pods"):
            assert not cp.can_i(token_a, verb, what, namespace=ns_b), (verb, what)
    assert not cp.can_i(token_a, "create", "serviceaccounts/member-agent", namespace=ns_b, subresource="token")
    assert cp.can_i(token_a, "create", "serviceaccounts/member-agent", namespace=ns_a, subresource="token")
    assert not cp.can_i(token_a, "list", "secrets")
    assert not cp.can_i(token_a, "list", "secrets", namespace=ns_a)
    assert not cp.can_i(token_a, "get", "secrets", namespace=SYSTEM)
    # and a write to member-b's status with that token is refused by the API server, not only by can-i
    refused = cp.kubectl("patch", f"{g}/member-b", "--subresource=status", "--type=merge", "-p",
                         json.dumps({"status": {"nodes": 0}}), kubeconfig=token_a, check=False)
    assert "forbidden" in refused.lower(), refused
    # the member agent's own account on its member reads and nothing else
    agent_kc = a.cp.sa_kubeconfig(SYSTEM, "accelstack-member-agent")
    assert a.cp.can_i(agent_kc, "list", "nodes") and a.cp.can_i(agent_kc, "watch", "acceleratornodes.accelstack.io")
    assert not a.cp.can_i(agent_kc, "patch", "nodes") and not a.cp.can_i(agent_kc, "list", "secrets",
                                                                          namespace=SYSTEM)
    assert a.cp.can_i(agent_kc, "update", "secrets/accelstack-hub-kubeconfig", namespace=SYSTEM)

    # ---- member-b's agent stops: Lost on the hub's clock; started again: Ready -----------------------------
    assert b.agent is not None
    stopped = time.monotonic()
    assert b.agent.stop() == 0  # SIGTERM: a clean exit
    lost = wait_for("member-b Lost", lambda: (o := cluster(cp, "member-b")) and
                    condition(o, "Lost").get("status") == "True" and o, timeout=30)
    waited = time.monotonic() - stopped
    assert waited >= LOST_AFTER - 0.6, waited  # not before --lost-after (the last beat may be 0.5 s older)
    assert condition(lost, "Ready") == {**condition(lost, "Ready"), "status": "False", "reason": "HeartbeatMissed"}
    assert ready_with(cp, "member-a", 16), "member-a stays Ready"
    b.start_agent()
    wait_for("member-b Ready again", lambda: ready_with(cp, "member-b", 12), timeout=30)
    def metrics_with_b_ready() -> str:
        text = urlopen_text(hub.health + "/metrics")
        return text if 'accelstack_hub_cluster_ready{cluster="member-b"} 1.0' in text else ""

    metrics = wait_for("the hub's metrics say member-b is ready", metrics_with_b_ready, timeout=10)
    assert 'accelstack_hub_cluster_devices{cluster="member-a",kind="allocatable",resource="nvidia.com/gpu"} 16.0' \
        in metrics

    # ---- leave: deletes what join made, on both sides, and says so --------------------------------------
    b.agent.stop()
    token_b = b.hub_kubeconfig()
    res = cli("cluster", "leave", "member-b", "--hub-kubeconfig", str(cp.admin_kubeconfig),
              "--kubeconfig", str(b.cp.admin_kubeconfig))
    assert res.returncode == 0, res.stderr
    left = res.stdout.splitlines()
    assert left[0] == "member: Deployment accelstack-member-agent in accelstack-system: deleted"
    assert left[-1] == "hub: Namespace accelstack-member-member-b: deleted"
    assert all(ln.endswith(": deleted") for ln in left) and len(left) == 14, left
    assert cluster(cp, "member-b") == {}
    assert cp.get("apis/rbac.authorization.k8s.io/v1/clusterroles/accelstack-member-member-b") is None
    assert b.cp.get(f"api/v1/namespaces/{SYSTEM}/secrets/accelstack-hub-kubeconfig") is None
    assert b.cp.get(f"api/v1/namespaces/{SYSTEM}") is not None  # never the member's namespace itself
    ns = cp.get(f"api/v1/namespaces/{ns_b}")
    assert ns is None or ns["metadata"].get("deletionTimestamp")  # no namespace controller on this plane
    # member-b's old token can no longer touch anything (its ServiceAccount is gone)
    assert not cp.can_i(token_b, "patch", f"{g}/member-b", subresource="status")
    again = cli("cluster", "leave", "member-b", "--hub-kubeconfig", str(cp.admin_kubeconfig),
                "--kubeconfig", str(b.cp.admin_kubeconfig))
    assert again.returncode == 0 and all(ln.endswith((": absent", ": being deleted"))
                                         for ln in again.stdout.splitlines()), again.stdout
    print(f"\nmulticluster set-up seconds: {json.dumps({k: round(v, 1) for k, v in SETUP_SECONDS.items()})}")


def urlopen_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())
