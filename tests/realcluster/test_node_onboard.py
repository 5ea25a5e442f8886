"""Onboarding a brownfield node on the real API server (issue 39 point 3): a GPU node served by another device
plugin, a pod of another scheduler holding 2 of its GPUs. It stays Detected (never labelled) until asked; asked,
the controller puts the landing label on and the AcceleratorNode says, step by step, what it waits for (the other
plugin still serving, node-problem-detector, the device plugin's pod-resources report, device IDs the plugin does
not serve, a view that does not match the pods), and it is Managed only when all agree, the pod untouched and counted throughout. A node deleted while
onboarding takes its AcceleratorNode with it. Fails on the code before: there was no onboarding, label or step.

The fake node has no kubelet: what accelstack's device plugin and node-problem-detector write there (labels by the
plugin's field manager, its pod-resources annotation, NPD's condition) is written as they write it; the plugin's
side is tested against the real kubelet gRPC peer in tests/device_plugin and NPD's by test_node_health.py."""

from __future__ import annotations

import time
from typing import Any

from scheduler_extender.cli import kubectl_plugin
from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import pod, wait_for
from tests.realcluster.stack import Stack
from tests.realcluster.test_accelerator_nodes import (
    AN,
    GFD,
    OUTSIDE,
    label_as_device_plugin,
    npd_reports,
    plugin_reports,
    status_of,
    wait_status,
)
from tests.realcluster.test_gpr_control_plane import set_running
from tests.realcluster.test_node_deboard import operator_token

LANDING = "accelstack.io/gpu-node"


def node_labels(cp: ControlPlane, node: str) -> dict[str, str]:
    return dict(((cp.get(f"api/v1/nodes/{node}") or {}).get("metadata") or {}).get("labels") or {})


def condition(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in st["conditions"] if c["type"] == ctype)


def test_a_brownfield_node_is_onboarded_step_by_step_with_its_pods_untouched(cp: ControlPlane, stack: Stack,
                                                                            ns: str, nodes: Nodes) -> None:
    brown = nodes.add("brown", gpus=8, labels=GFD)  # NVIDIA's device plugin + GPU feature discovery
    try:
        cp.create(f"api/v1/namespaces/{OUTSIDE}/serviceaccounts", {"metadata": {"name": "default"}})
    except ApiCallError as exc:
        if exc.status != 409:
            raise
    holder = f"{ns}-held"[:63]
    made = cp.create(f"api/v1/namespaces/{OUTSIDE}/pods",
                     pod(holder, gpus=2, scheduler="default-scheduler", nodeName=brown))
    set_running(cp, OUTSIDE, holder)  # as the kubelet reports it
    try:
        st = wait_status(cp, brown, phase="Detected", managedBy="other-plugin", allocated=2, holderCount=1)
        assert (condition(st, "Onboarded")["status"], condition(st, "Onboarded")["reason"]) == ("False", "NotRequested")
        assert "kubectl accelstack node onboard" in condition(st, "Onboarded")["message"]
        time.sleep(2)  # a few passes: another plugin's node is never labelled unasked
        assert LANDING not in node_labels(cp, brown)

        # `kubectl accelstack node onboard` through the REST API: a caller who may not patch AcceleratorNodes is
        # refused and nothing changes; an allowed one sets spec.onboard (asking twice changes nothing)
        tokens = {allowed: operator_token(cp, ns, allowed) for allowed in (True, False)}

        def plugin(allowed: bool, *argv: str) -> int:
            return kubectl_plugin.main(["--server", stack.url, "--insecure-skip-tls-verify", "--token",
                                        tokens[allowed], *argv])
        assert plugin(False, "node", "onboard", brown) == 1
        assert plugin(True, "node", "onboard", f"{ns}-no-such-node") == 1  # a one-line 404
        assert "onboard" not in ((cp.get(f"{AN}/{brown}") or {}).get("spec") or {})
        asked = time.monotonic()
        assert plugin(True, "node", "onboard", brown) == 0
        requested = ((cp.get(f"{AN}/{brown}") or {}).get("spec") or {})["onboard"]
        assert plugin(True, "node", "onboard", brown) == 0
        assert ((cp.get(f"{AN}/{brown}") or {}).get("spec") or {})["onboard"] == requested
        st = wait_status(cp, brown, phase="Onboarding", reason="WaitingForDevicePlugin")
        assert node_labels(cp, brown).get(LANDING) == "true"
        assert st["onboard"]["by"] == "requested" and st["onboard"]["step"] == "2/5 WaitingForDevicePlugin"
        assert "another device plugin" in condition(st, "Onboarded")["message"]

        # accelstack's plugin registers in its place (the same GPU UUIDs, so the capacity stays) and writes its
        # labels (GFD's values already: the API server records no change, so no ownership) and its report of the
        # kubelet's view: the 2 GPUs the pod holds are under IDs it does not serve (MIG or sharing names)
        label_as_device_plugin(cp, brown, GFD)
        plugin_reports(cp, brown, "nvidia.com/gpu", 8, 2, unknown=2)
        st = wait_status(cp, brown, phase="Onboarding", reason="WaitingForNodeProblemDetector", managedBy="accelstack")
        assert st["onboard"]["step"] == "3/5 WaitingForNodeProblemDetector"
        npd_reports(cp, brown)
        st = wait_status(cp, brown, phase="Onboarding", reason="DeviceIDsDiffer")
        assert "2 nvidia.com/gpu in use" in condition(st, "Onboarded")["message"]
        plugin_reports(cp, brown, "nvidia.com/gpu", 8, 3)  # a view that does not match the pods bound here
        wait_status(cp, brown, phase="Onboarding", reason="InventoryMismatch")
        plugin_reports(cp, brown, "nvidia.com/gpu", 8, 2)
        st = wait_status(cp, brown, phase="Managed", reason="Onboarded", allocated=2, holderCount=1)
        took = time.monotonic() - asked
        assert condition(st, "Onboarded")["status"] == "True"
        assert st["onboard"]["since"] <= st["onboard"]["completedAt"] and "step" not in st["onboard"]
        assert st["holders"] == [{"namespace": OUTSIDE, "name": holder, "resource": "nvidia.com/gpu", "count": 2}]
        # the pod was never touched: the same object, bound where it was
        now = cp.get(f"api/v1/namespaces/{OUTSIDE}/pods/{holder}") or {}
        assert now["metadata"]["uid"] == made["metadata"]["uid"] and now["spec"]["nodeName"] == brown
        assert not now["metadata"].get("deletionTimestamp")
        print(f"onboarding, request to Managed with every step written as it came: {took:.1f} s")
        assert "accelstack.io/gpr" not in (now["metadata"].get("labels") or {})  # not adopted unasked
        # asked again, now to adopt the pods already there: the pod gets an automatic GPR, placed where it runs and
        # Running at once; the pod is only labelled (same UID, still bound)
        assert plugin(True, "node", "onboard", "--adopt-pods", brown) == 0
        assert ((cp.get(f"{AN}/{brown}") or {}).get("spec") or {})["onboard"] == {**requested, "adoptPods": True}
        gprs = f"apis/accelstack.io/v1alpha1/namespaces/{OUTSIDE}/gpuprovisioningrequests"

        def adopted() -> dict[str, Any] | None:
            st = (cp.get(f"{gprs}/{holder}") or {}).get("status") or {}
            return st if st.get("phase") == "Running" else None

        st_gpr = wait_for("the adopted pod's GPR Running", adopted)
        assert st_gpr["reservation"] == [{"devices": 2, "node": brown}], st_gpr
        gpr_obj = cp.get(f"{gprs}/{holder}") or {}
        assert gpr_obj["metadata"]["labels"]["accelstack.io/adopted-on"] == brown
        now = cp.get(f"api/v1/namespaces/{OUTSIDE}/pods/{holder}") or {}
        assert now["metadata"]["uid"] == made["metadata"]["uid"] and now["spec"]["nodeName"] == brown
        assert now["metadata"]["labels"]["accelstack.io/gpr"] == holder
        wait_for("the holder shown with its GPR", lambda: (status_of(cp, brown) or {}).get("holders") == [
            {"namespace": OUTSIDE, "name": holder, "gpr": holder, "resource": "nvidia.com/gpu", "count": 2}])
        assert (status_of(cp, brown) or {}).get("phase") == "Managed"
        # a node being deboarded is not onboarded: the request is refused with what to do instead
        assert plugin(True, "node", "deboard", "--grace", "1h", brown) == 0
        assert plugin(True, "node", "onboard", brown) == 1
        assert plugin(True, "node", "deboard", "--abort", brown) == 0
    finally:
        cp.api("DELETE", f"api/v1/namespaces/{OUTSIDE}/pods/{holder}", {"gracePeriodSeconds": 0}, ok=(200, 202, 404))
        cp.api("DELETE", f"apis/accelstack.io/v1alpha1/namespaces/{OUTSIDE}/gpuprovisioningrequests/{holder}",
               ok=(200, 202, 404))
        cp.api("DELETE", f"apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{ns}-node-operator", ok=(200, 404))
        cp.api("DELETE", f"apis/rbac.authorization.k8s.io/v1/clusterroles/{ns}-node-operator", ok=(200, 404))


def test_a_node_deleted_while_onboarding_takes_its_accelerator_node(cp: ControlPlane, stack: Stack, ns: str,
                                                                    nodes: Nodes) -> None:
    gone = nodes.add("gone", gpus=8, labels=GFD)
    wait_status(cp, gone, phase="Detected")
    cp.patch(f"{AN}/{gone}", {"spec": {"onboard": {"requestedAt": "2026-12-03T10:00:00Z"}}})
    wait_status(cp, gone, phase="Onboarding")
    cp.delete(f"api/v1/nodes/{gone}")
    wait_for(f"AcceleratorNode {gone} gone", lambda: status_of(cp, gone) is None and cp.get(f"{AN}/{gone}") is None,
             timeout=60)
