"""The device plugin's node labeller through the shipped ValidatingAdmissionPolicy, with the API server's real CEL.

``manifests/device-plugin-policy/label-policy.yaml`` narrows what the ``accelstack-device-plugin`` ServiceAccount
may do with its RBAC ``patch`` on nodes: only the node its token is bound to (the token's extra
``authentication.kubernetes.io/node-name``), only labels under ``nvidia.com/gpu.``, ``nvidia.com/cuda.`` and
``accelstack.io/nr1.``, never the spec. The labeller runs here as the shipped DaemonSet runs it — the real
``accelstack-device-plugin`` process (NR1 backend on a fake sysfs, no NVML needed), ``NODE_NAME`` set, a
kubeconfig holding a real token of that ServiceAccount bound to one node — and, for writes the process never
makes, its :class:`NodeLabeller` and :class:`KubeClient` with the same token.

The policy also keeps the node's annotations (the extender's ``accelstack.io/ledger``, remediation's
``accelstack.io/healthy-since``), finalizers and owner references as they are: the labeller writes labels only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from device_plugin.labeller import FIELD_MANAGER, OWNED_PREFIXES, NodeLabeller
from kubeapi import ApiError
from kubeapi.client import KubeClient, from_config
from kubeapi.resources import NODES
from npd.remediation import HEALTHY_SINCE_ANNOTATION
from scheduler_extender.objects.ledger import LEDGER_ANNOTATION
from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import wait_for
from tests.realcluster.shipped import ROOT
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

NODE_NS, SA = "accelstack-node", "accelstack-device-plugin"
USER = f"system:serviceaccount:{NODE_NS}:{SA}"
POLICY = "accelstack-device-plugin-labels"
ONLY_ITS_NODE = "the device plugin may only label the node it runs on"
ONLY_ITS_PREFIXES = ("the device plugin may only change labels under nvidia.com/gpu., nvidia.com/cuda. and "
                     "accelstack.io/nr1.")
NO_SPEC = "the device plugin may not change the node's spec"
NO_METADATA = "the device plugin may not change the node's annotations, finalizers or owners"


# ---- helpers --------------------------------------------------------------------------------------------------
def bound_kubeconfig(cp: ControlPlane, node: str) -> Path:
    """A real token of the device plugin's ServiceAccount bound to ``node``, checked to carry the node name."""
    kc = cp.sa_kubeconfig(NODE_NS, SA, bound={"kind": "Node", "name": node})
    info = json.loads(cp.kubectl("auth", "whoami", "-o", "json", kubeconfig=kc))["status"]["userInfo"]
    assert info["username"] == USER, info
    assert info.get("extra", {}).get("authentication.kubernetes.io/node-name") == [node], info
    return kc


def wait_policy_enforced(cp: ControlPlane, kubeconfig: Path, foreign_node: str) -> None:
    """The API server loads a new ValidatingAdmissionPolicy asynchronously (a second or so after it is created):
    wait until a server-side dry run of a forbidden write (another node's label) is denied by the policy. A dry
    run goes through admission and persists nothing."""
    def denied() -> bool:
        out = cp.kubectl("label", "node", foreign_node, "nvidia.com/gpu.probe=1", "--dry-run=server",
                         kubeconfig=kubeconfig, check=False)
        return f"ValidatingAdmissionPolicy '{POLICY}'" in out and ONLY_ITS_NODE in out
    wait_for(f"{POLICY} enforced", denied, timeout=60, every=0.5)


def labels_of(cp: ControlPlane, node: str) -> dict[str, str]:
    return dict(((cp.get(f"api/v1/nodes/{node}") or {}).get("metadata") or {}).get("labels") or {})


def annotations_of(cp: ControlPlane, node: str) -> dict[str, str]:
    return dict(((cp.get(f"api/v1/nodes/{node}") or {}).get("metadata") or {}).get("annotations") or {})


def refused_by_policy(exc: ApiError, message: str) -> None:
    """A refusal of the shipped policy: 422 Invalid naming the policy and the validation's message."""
    assert exc.status == 422 and exc.reason == "Invalid", exc
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in exc.message and message in exc.message, exc.message


class PluginProcess:
    """``python -m device_plugin.main`` as the NR1 DaemonSet runs it (NR1 backend, labeller on), with a fake sysfs
    of four modules, no kubelet (the runner waits for ``kubelet.sock``: the labeller does not need one), and
    ``KUBECONFIG`` pointing at the bound token (the in-cluster path's fallback outside a pod)."""

    def __init__(self, cp: ControlPlane, workdir: Path, node: str, kubeconfig: Path, name: str) -> None:
        self.workdir = workdir / name
        sysfs = self.workdir / "sys"
        # the plugin's socket path must fit a unix socket's 107 bytes: not under pytest's long tmp_path
        self.plugin_dir = Path(tempfile.mkdtemp(prefix="dp-"))
        plugin_dir = self.plugin_dir
        nr1_node(sysfs)
        self.log = cp.dir / f"device-plugin-{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}  # never in-cluster here
        env.update({"PYTHONUNBUFFERED": "1", "KUBECONFIG": str(kubeconfig), "NODE_NAME": node,
                    "ACCELSTACK_DP_NR1_ENABLED": "true", "ACCELSTACK_DP_NR1_VENDOR_IDS": NR1_VENDOR})
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "device_plugin.main", "--device-plugin-path", str(plugin_dir),
                 "--sysfs-root", str(sysfs), "--nvidia-enabled", "false", "--metrics-address", "",
                 "--labeller-interval", "1s", "--log-format", "json"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> int | None:
        try:
            return self._stop()
        finally:
            shutil.rmtree(self.plugin_dir, ignore_errors=True)

    def _stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


@pytest.fixture
def processes(cp: ControlPlane, tmp_path: Path) -> Iterator[list[PluginProcess]]:
    started: list[PluginProcess] = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture
def two_nodes(cp: ControlPlane, nodes: Nodes) -> tuple[str, str, Path]:
    """Nodes ``a`` (the device plugin's own, with a stale owned label and a label of someone else) and ``b``, and
    the device plugin's kubeconfig bound to ``a``, once the policy is enforced."""
    a = nodes.add("a", gpus=0, nr1=4, labels={"nvidia.com/gpu.stale": "x", "team": "vision"})
    b = nodes.add("b", gpus=0, nr1=4, labels={"accelstack.io/nr1.count": "2"})
    kc = bound_kubeconfig(cp, a)
    wait_policy_enforced(cp, kc, b)
    return a, b, kc


@pytest.fixture
async def kube_a(two_nodes: tuple[str, str, Path]) -> AsyncIterator[KubeClient]:
    """The labeller's client (its field manager, the same KubeClient) with the token bound to node ``a``."""
    kube = await from_config(str(two_nodes[2]), field_manager=FIELD_MANAGER, max_retries=1)
    try:
        yield kube
    finally:
        await kube.close()


# ---- the real process -----------------------------------------------------------------------------------------
def test_the_device_plugin_process_labels_its_own_node(cp: ControlPlane, two_nodes: tuple[str, str, Path],
                                                       processes: list[PluginProcess], tmp_path: Path) -> None:
    a, b, kc = two_nodes
    b_before = labels_of(cp, b)
    proc = PluginProcess(cp, tmp_path, a, kc, "own")
    processes.append(proc)
    def labelled() -> dict[str, str] | None:
        lab = labels_of(cp, a)
        return lab if lab.get("accelstack.io/nr1.count") == "4" else None
    labels = wait_for("the labeller's labels on its node", labelled, timeout=60)
    assert labels.get("accelstack.io/nr1.product"), labels
    assert "nvidia.com/gpu.stale" not in labels, labels  # a stale owned label is taken off: the policy allows it
    assert labels["team"] == "vision" and labels["kubernetes.io/hostname"] == a  # others' labels stay
    assert labels_of(cp, b) == b_before
    node = cp.get(f"api/v1/nodes/{a}") or {}
    managers = {m["manager"] for m in node["metadata"].get("managedFields") or ()}
    assert FIELD_MANAGER in managers, managers
    updated = [r for r in proc.records() if r.get("msg") == "node labels updated"]
    assert updated and updated[0]["node"] == a and "nvidia.com/gpu.stale" in updated[0]["changed"], proc.tail()
    assert not [r for r in proc.records() if r.get("level") in ("warning", "error")], proc.tail()
    assert proc.stop() == 0, proc.tail()


def test_the_device_plugin_process_is_refused_another_node_logs_it_and_keeps_running(
        cp: ControlPlane, two_nodes: tuple[str, str, Path], processes: list[PluginProcess],
        tmp_path: Path) -> None:
    _, b, kc = two_nodes  # the token is bound to a; NODE_NAME says b (a DaemonSet pod with a wrong token)
    before = labels_of(cp, b)
    proc = PluginProcess(cp, tmp_path, b, kc, "other")
    processes.append(proc)

    def refusals() -> list[dict[str, Any]]:
        return [r for r in proc.records() if r.get("msg") == "labelling failed; will retry"]
    # one warning per round (interval 1 s): two of them show the process went on after the first refusal
    found = wait_for("two refusals logged", lambda: refusals() if len(refusals()) >= 2 else None, timeout=60)
    first = found[0]
    assert first.get("node") == b, first
    assert str(first.get("error", "")).startswith("422 Invalid"), first
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in first["error"] and ONLY_ITS_NODE in first["error"], first
    assert proc.proc.poll() is None, proc.tail()  # no crash: the device plugin goes on
    assert labels_of(cp, b) == before  # nothing written ("accelstack.io/nr1.count" would have become 4)
    assert proc.stop() == 0, proc.tail()


# ---- the labeller's code path with the same token, for writes the process never makes -------------------------
async def test_a_label_outside_the_prefixes_is_refused_and_nothing_is_written(
        cp: ControlPlane, two_nodes: tuple[str, str, Path], kube_a: KubeClient,
        caplog: pytest.LogCaptureFixture) -> None:
    a, _, _ = two_nodes
    before = labels_of(cp, a)
    desired = {"accelstack.io/nr1.count": "4", "node-role.kubernetes.io/gpu": ""}
    labeller = NodeLabeller(kube_a, a, lambda: desired, interval=3600)
    with pytest.raises(ApiError) as err:
        await labeller.reconcile()
    refused_by_policy(err.value, ONLY_ITS_PREFIXES)
    assert labels_of(cp, a) == before  # one patch, refused whole: not even the owned label went in
    # what run() makes of it: one warning naming the node and the API's answer, and no exception
    stop = asyncio.Event()
    task = asyncio.create_task(labeller.run(stop))
    try:
        await asyncio.wait_for(_until(lambda: any(r.getMessage() == "labelling failed; will retry"
                                                  for r in caplog.records)), 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    warning = next(r for r in caplog.records if r.getMessage() == "labelling failed; will retry")
    assert warning.levelname == "WARNING" and warning.__dict__["node"] == a
    assert warning.__dict__["error"].startswith("422 Invalid"), warning.__dict__
    assert ONLY_ITS_PREFIXES in warning.__dict__["error"], warning.__dict__  # the policy's reason, whole
    # the same labeller with only owned keys goes through (the refusal was the key, not the client)
    labeller.compute = lambda: {"accelstack.io/nr1.count": "4"}
    assert await labeller.reconcile() == {"accelstack.io/nr1.count": "4", "nvidia.com/gpu.stale": None}
    assert labels_of(cp, a)["accelstack.io/nr1.count"] == "4"


async def _until(probe: Any) -> None:
    while not probe():
        await asyncio.sleep(0.05)


async def test_changing_the_spec_or_another_node_is_refused(cp: ControlPlane, two_nodes: tuple[str, str, Path],
                                                            kube_a: KubeClient) -> None:
    a, b, _ = two_nodes
    spec_before = (cp.get(f"api/v1/nodes/{a}") or {})["spec"]
    patch: dict[str, Any]
    for patch in ({"spec": {"unschedulable": True}},
                  {"spec": {"taints": [{"key": "accelstack.io/x", "value": "y", "effect": "NoSchedule"}]}},
                  {"metadata": {"labels": {"nvidia.com/gpu.count": "8"}}, "spec": {"podCIDR": "10.0.0.0/24"}}):
        with pytest.raises(ApiError) as err:
            await kube_a.patch(NODES, a, patch, patch_type="strategic")
        refused_by_policy(err.value, NO_SPEC)
    assert (cp.get(f"api/v1/nodes/{a}") or {})["spec"] == spec_before
    # another node: even an owned label, even its annotations
    for patch in ({"metadata": {"labels": {"nvidia.com/gpu.count": "8"}}},
                  {"metadata": {"annotations": {"example.com/note": "x"}}}):
        with pytest.raises(ApiError) as err:
            await kube_a.patch(NODES, b, patch, patch_type="strategic")
        refused_by_policy(err.value, ONLY_ITS_NODE)
    assert "nvidia.com/gpu.count" not in labels_of(cp, b) and "example.com/note" not in annotations_of(cp, b)
    # RBAC, before the policy: no status, no delete, no create
    for call in (kube_a.patch(NODES, a, {"status": {"capacity": {"example.com/x": "1"}}}, subresource="status"),
                 kube_a.delete(NODES, a),
                 kube_a.create(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"{a}-new"}})):
        with pytest.raises(ApiError) as err:
            await call
        assert err.value.status == 403, err.value


def test_a_token_bound_to_no_node_may_label_nothing(cp: ControlPlane, two_nodes: tuple[str, str, Path]) -> None:
    a, _, _ = two_nodes
    unbound = cp.sa_kubeconfig(NODE_NS, SA)
    out = cp.kubectl("label", "node", a, "nvidia.com/gpu.count=1", kubeconfig=unbound, check=False)
    assert ONLY_ITS_NODE in out, out
    assert "nvidia.com/gpu.count" not in labels_of(cp, a)


def test_the_token_a_kubelet_projects_into_the_pod_carries_the_node(cp: ControlPlane,
                                                                    two_nodes: tuple[str, str, Path]) -> None:
    """What the DaemonSet's pod really gets: a token bound to the pod, which names the pod's node."""
    a, b, _ = two_nodes
    name = f"dp-{a}"[:63]
    cp.create(f"api/v1/namespaces/{NODE_NS}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeName": a, "serviceAccountName": SA, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
    try:
        kc = cp.sa_kubeconfig(NODE_NS, SA, bound={"kind": "Pod", "name": name})
        info = json.loads(cp.kubectl("auth", "whoami", "-o", "json", kubeconfig=kc))["status"]["userInfo"]
        assert info["extra"].get("authentication.kubernetes.io/node-name") == [a], info
        assert info["extra"].get("authentication.kubernetes.io/pod-name") == [name], info
        assert "node/" in cp.kubectl("label", "node", a, "accelstack.io/nr1.count=4", "--overwrite", kubeconfig=kc)
        out = cp.kubectl("label", "node", b, "accelstack.io/nr1.count=4", "--overwrite", kubeconfig=kc, check=False)
        assert ONLY_ITS_NODE in out, out
    finally:
        cp.delete(f"api/v1/namespaces/{NODE_NS}/pods/{name}", force=True)


# ---- annotations, finalizers, owners: other components' bookkeeping on the same node -------------------------
def metadata_of(cp: ControlPlane, node: str) -> dict[str, Any]:
    meta = (cp.get(f"api/v1/nodes/{node}") or {})["metadata"]
    return {k: meta.get(k) for k in ("labels", "annotations", "finalizers", "ownerReferences")}


async def test_annotations_of_its_own_node_are_refused(cp: ControlPlane, two_nodes: tuple[str, str, Path],
                                                       kube_a: KubeClient) -> None:
    """Adding the extender's ledger, changing or removing remediation's hold, or any other annotation, even in the
    same patch as an owned label: refused whole, the node as it was."""
    a, _, _ = two_nodes
    cp.patch(f"api/v1/nodes/{a}", {"metadata": {"annotations": {HEALTHY_SINCE_ANNOTATION: "2026-01-01T00:00:00Z"}}})
    before = metadata_of(cp, a)
    patch: dict[str, Any]
    try:
        for patch in ({"metadata": {"annotations": {LEDGER_ANNOTATION: '{"v": 1, "pods": {}}'}}},
                      {"metadata": {"annotations": {HEALTHY_SINCE_ANNOTATION: "2020-01-01T00:00:00Z"}}},
                      {"metadata": {"annotations": {HEALTHY_SINCE_ANNOTATION: None}}},
                      {"metadata": {"annotations": {"example.com/note": "x"}}},
                      {"metadata": {"labels": {"accelstack.io/nr1.count": "4"},
                                    "annotations": {"example.com/note": "x"}}}):
            with pytest.raises(ApiError) as err:
                await kube_a.patch(NODES, a, patch, patch_type="strategic")
            refused_by_policy(err.value, NO_METADATA)
        assert metadata_of(cp, a) == before
        # the same client, labels only: allowed, and the annotations stay as they were
        await kube_a.patch(NODES, a, {"metadata": {"labels": {"accelstack.io/nr1.count": "4"}}},
                           patch_type="strategic")
        assert labels_of(cp, a)["accelstack.io/nr1.count"] == "4"
        assert annotations_of(cp, a) == before["annotations"]
    finally:
        cp.patch(f"api/v1/nodes/{a}", {"metadata": {"annotations": {LEDGER_ANNOTATION: None, "example.com/note": None}}})


async def test_finalizers_and_owners_of_its_own_node_are_refused(cp: ControlPlane, two_nodes: tuple[str, str, Path],
                                                                 kube_a: KubeClient) -> None:
    """A finalizer would hold the node's deletion; an owner reference would hand the node to the garbage
    collector. Neither may the device plugin add (nor take off one someone else set)."""
    a, _, _ = two_nodes
    owner = {"apiVersion": "v1", "kind": "Namespace", "name": "example", "uid": "0f3c1a52-8f0e-4d6b-9a43-4f6f2b0c1d2e"}
    try:
        for patch in ({"metadata": {"finalizers": ["example.com/hold"]}},
                      {"metadata": {"ownerReferences": [owner]}}):
            with pytest.raises(ApiError) as err:
                await kube_a.patch(NODES, a, patch, patch_type="merge")
            refused_by_policy(err.value, NO_METADATA)
        meta = metadata_of(cp, a)
        assert not meta["finalizers"] and not meta["ownerReferences"], meta
        # one set by someone else (the admin here) stays: the device plugin may not take it off
        cp.patch(f"api/v1/nodes/{a}", {"metadata": {"finalizers": ["example.com/hold"]}})
        with pytest.raises(ApiError) as err:
            await kube_a.patch(NODES, a, {"metadata": {"finalizers": None}}, patch_type="merge")
        refused_by_policy(err.value, NO_METADATA)
        assert metadata_of(cp, a)["finalizers"] == ["example.com/hold"]
    finally:
        cp.patch(f"api/v1/nodes/{a}", {"metadata": {"finalizers": None, "ownerReferences": None}})


def test_only_the_labeller_prefixes_are_in_the_policy() -> None:
    """The policy's prefixes and the labeller's are the same list (a new prefix in one needs the other)."""
    text = (ROOT / "manifests/device-plugin-policy/label-policy.yaml").read_text()
    listed = "[" + ", ".join(f"'{p}'" for p in OWNED_PREFIXES) + "]"
    assert listed in text, (listed, text)
