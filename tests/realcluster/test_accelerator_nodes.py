"""Accelerator nodes detected on the real API server (issue 39 points 1-2): an AcceleratorNode per node with GPUs
or NR1 modules, with the phase, devices, holders and managed-by docs/nodes.md promises, shown by the real kubectl
through the CRD's printer columns; gone with its node; a restarted controller writes nothing.

Nodes are fake (no kubelet): their labels and resources are what GPU feature discovery, node-feature-discovery,
another device plugin or accelstack's own device plugin would have left. accelstack's labels are written with
the device plugin's field manager (``accelstack-device-plugin``, as its labeller writes them), which is what tells
them from GPU feature discovery's labels of the same names.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from typing import Any

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import pod, wait_for
from tests.realcluster.stack import Product, Stack

AN = "apis/accelstack.io/v1alpha1/acceleratornodes"
GFD = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8"}
NR1 = {"accelstack.io/nr1.count": "4", "accelstack.io/nr1.product": "NR1-M"}
OUTSIDE = "kube-system"  # no pod webhook there: a pod bound by nodeName, as another scheduler would place it


def label_as_device_plugin(cp: ControlPlane, node: str, labels: dict[str, str]) -> None:
    cp.api("PATCH", f"api/v1/nodes/{node}?fieldManager=accelstack-device-plugin", {"metadata": {"labels": labels}},
           content_type="application/strategic-merge-patch+json")


def npd_reports(cp: ControlPlane, node: str, ctype: str = "GPUUnhealthy") -> None:
    """The condition accelstack's node-problem-detector keeps, as it writes it (tests/realcluster/test_node_health.py
    runs the real NPD binary), beside the Ready condition the fake kubelet left."""
    stamp = "2026-01-01T00:00:00Z"
    cp.patch(f"api/v1/nodes/{node}/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": stamp,
         "lastTransitionTime": stamp},
        {"type": ctype, "status": "False", "reason": "NoProblem", "lastHeartbeatTime": stamp,
         "lastTransitionTime": stamp}]}}, kind="strategic")


def plugin_reports(cp: ControlPlane, node: str, resource: str, devices: int, in_use: int, unknown: int = 0) -> None:
    """The kubelet's pod-resources view as accelstack's device plugin reports it on its Node (its field manager)."""
    view = {"resource": resource, "devices": devices, "inUse": in_use, "unknownIDs": unknown,
            "observedAt": "2026-01-01T00:00:00Z"}
    key = "accelstack.io/pod-resources-nr1" if resource == "neureality.com/nr1" else "accelstack.io/pod-resources"
    cp.api("PATCH", f"api/v1/nodes/{node}?fieldManager=accelstack-device-plugin",
           {"metadata": {"annotations": {key: json.dumps(view)}}},
           content_type="application/strategic-merge-patch+json")


def status_of(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    obj = cp.get(f"{AN}/{name}")
    return (obj or {}).get("status") or None


def wait_status(cp: ControlPlane, name: str, **want: Any) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        st = status_of(cp, name)
        return st if st and all(st.get(k) == v for k, v in want.items()) else None
    try:
        return wait_for(f"AcceleratorNode {name} with {want}", probe, timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nstatus: {status_of(cp, name)}") from None


def metric(product: Product, name: str) -> float:
    """The sum of a metric's samples on the controller's /metrics."""
    with urllib.request.urlopen(product.health + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def lease_holder(cp: ControlPlane) -> str:
    lease = cp.get("apis/coordination.k8s.io/v1/namespaces/accelstack-system/leases/accelstack-gpr-controller") or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def test_accelerator_nodes_phases_holders_columns_and_gone(cp: ControlPlane, stack: Stack, ns: str,
                                                           nodes: Nodes) -> None:
    gfd = nodes.add("gfd", gpus=0, labels=GFD)  # GPU feature discovery only: no device plugin advertises GPUs
    nfd = nodes.add("nfd", gpus=0, labels={"feature.node.kubernetes.io/pci-10de.present": "true"})
    other = nodes.add("other", gpus=8, labels=GFD)  # NVIDIA's device plugin + GFD
    ours = nodes.add("ours", gpus=8)
    label_as_device_plugin(cp, ours, GFD)
    nr1 = nodes.add("nr1", gpus=0, nr1=4)
    label_as_device_plugin(cp, nr1, NR1)
    cpu = nodes.add("cpu", gpus=0)

    wait_status(cp, gfd, phase="Detected", managedBy="none", resource="nvidia.com/gpu", deviceCount=8)
    wait_status(cp, nfd, phase="Detected", managedBy="none", deviceCount=0)
    st = wait_status(cp, other, phase="Detected", managedBy="other-plugin", deviceCount=8, reason="OtherDevicePlugin")
    assert st["model"] == "NVIDIA-H100-80GB-HBM3"
    # served by accelstack's plugin already: onboarded without being asked (the landing label put on), and Managed
    # once node-problem-detector reports and the plugin's pod-resources view matches the pods there
    st = wait_status(cp, ours, phase="Onboarding", managedBy="accelstack", reason="WaitingForNodeProblemDetector")
    assert st["onboard"]["by"] == "accelstack" and st["onboard"]["step"] == "3/5 WaitingForNodeProblemDetector"
    assert (cp.get(f"api/v1/nodes/{ours}") or {})["metadata"]["labels"].get("accelstack.io/gpu-node") == "true"
    npd_reports(cp, ours)
    plugin_reports(cp, ours, "nvidia.com/gpu", 8, 0)
    st = wait_status(cp, ours, phase="Managed", managedBy="accelstack", deviceCount=8)
    assert {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]} == {
        "Detected": ("True", "ResourceAdvertised"), "Managed": ("True", "AccelstackDevicePlugin"),
        "Onboarded": ("True", "Onboarded")}
    assert "nvidia.com/gpu labels written by accelstack-device-plugin" in st["evidence"]
    npd_reports(cp, nr1, "NR1Unhealthy")
    plugin_reports(cp, nr1, "neureality.com/nr1", 4, 0)
    wait_status(cp, nr1, phase="Managed", managedBy="accelstack", resource="neureality.com/nr1", deviceCount=4,
                model="NR1-M")
    # another plugin's node and feature-discovery-only nodes are never labelled without being asked
    for name in (gfd, nfd, other):
        assert "accelstack.io/gpu-node" not in (cp.get(f"api/v1/nodes/{name}") or {})["metadata"]["labels"]
    assert cp.get(f"{AN}/{cpu}") is None
    # named as the node, owned by it
    for name in (gfd, ours):
        obj = cp.get(f"{AN}/{name}") or {}
        node_uid = (cp.get(f"api/v1/nodes/{name}") or {})["metadata"]["uid"]
        assert [(r["kind"], r["name"], r["uid"]) for r in obj["metadata"]["ownerReferences"]] == \
            [("Node", name, node_uid)]

    # a pod placed on the other plugin's node holds 2 GPUs there: a holder, counted in Allocated
    try:
        cp.create(f"api/v1/namespaces/{OUTSIDE}/serviceaccounts", {"metadata": {"name": "default"}})
    except ApiCallError as exc:
        if exc.status != 409:
            raise
    holder = f"{ns}-holder"[:63]
    cp.create(f"api/v1/namespaces/{OUTSIDE}/pods", pod(holder, gpus=2, scheduler="default-scheduler", nodeName=other))
    try:
        st = wait_status(cp, other, allocated=2, holderCount=1)
        assert st["holders"] == [{"namespace": OUTSIDE, "name": holder, "resource": "nvidia.com/gpu", "count": 2}]

        # what a platform engineer sees: the real kubectl with the CRD's printer columns
        wide = cp.kubectl("get", "acceleratornodes", gfd, nfd, other, ours, nr1, "-o", "wide").splitlines()
        assert wide[0].split() == ["NAME", "PHASE", "RESOURCE", "DEVICES", "ALLOCATED", "MANAGED-BY", "AGE", "MODEL",
                                   "REASON", "HOLDERS"], wide[0]
        rows = {line.split()[0]: line.split() for line in wide[1:]}
        drop_age = {n: r[:6] + r[7:] for n, r in rows.items()}
        assert drop_age == {
            gfd: [gfd, "Detected", "nvidia.com/gpu", "8", "0", "none", "NVIDIA-H100-80GB-HBM3", "NoDevicePlugin", "0"],
            nfd: [nfd, "Detected", "nvidia.com/gpu", "0", "0", "none", "NoDevicePlugin", "0"],
            other: [other, "Detected", "nvidia.com/gpu", "8", "2", "other-plugin", "NVIDIA-H100-80GB-HBM3",
                    "OtherDevicePlugin", "1"],
            ours: [ours, "Managed", "nvidia.com/gpu", "8", "0", "accelstack", "NVIDIA-H100-80GB-HBM3", "Onboarded", "0"],
            nr1: [nr1, "Managed", "neureality.com/nr1", "4", "0", "accelstack", "NR1-M", "Onboarded", "0"],
        }, "\n".join(wide)
        plain = cp.kubectl("get", "acceleratornodes", other).splitlines()
        assert plain[0].split() == ["NAME", "PHASE", "RESOURCE", "DEVICES", "ALLOCATED", "MANAGED-BY", "AGE"]
    finally:
        cp.api("DELETE", f"api/v1/namespaces/{OUTSIDE}/pods/{holder}", {"gracePeriodSeconds": 0}, ok=(200, 202, 404))
    wait_status(cp, other, allocated=0, holderCount=0)

    # the node deleted: its AcceleratorNode goes (by the controller; the garbage collector would too)
    cp.delete(f"api/v1/nodes/{gfd}")
    wait_for(f"AcceleratorNode {gfd} gone", lambda: cp.get(f"{AN}/{gfd}") is None, timeout=60)

    # level-triggered: a new leader over the same cluster writes nothing; then a change is written again
    before = list(stack.controllers)
    for ctl in before:
        ctl.signal(signal.SIGTERM)
    for ctl in before:
        ctl.stop()
    fresh = stack.controller("controller-an", 4.0, "--nr1-vendor-ids", "0x1e2d").start()
    stack.controllers[:] = [fresh]
    wait_for("the new controller leads", lambda: lease_holder(cp) == fresh.name, timeout=40)
    # its first pass runs once its informers have synced and compares every node with every object: what a new
    # leader would write, it writes then (waiting for a second pass cost the 30 s resync)
    wait_for("an accelerator-node pass", lambda: metric(fresh, "accelstack_accelerator_node_passes_total") >= 1,
             timeout=90)
    assert metric(fresh, "accelstack_accelerator_node_writes_total") == 0
    # node-feature-discovery's label of the configured NR1 vendor
    nfd_nr1 = nodes.add("nfd-nr1", gpus=0, labels={"feature.node.kubernetes.io/pci-1e2d.present": "true"})
    wait_status(cp, nfd_nr1, phase="Detected", resource="neureality.com/nr1", managedBy="none")
    assert metric(fresh, "accelstack_accelerator_node_writes_total") == 2  # create + status
