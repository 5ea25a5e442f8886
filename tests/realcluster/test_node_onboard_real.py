"""Onboarding an NR1 node with the REAL device plugin and the REAL node-problem-detector in the loop (issue 39): on
the real API server, a node where another plugin advertised ``neureality.com/nr1`` (capacity 4) and a pod of
another scheduler holds 2 modules (the pod-resources peer lists its 2 device IDs). ``kubectl accelstack node
onboard`` (through the REST API, a real ServiceAccount token); once the controller's landing label is on (the NR1
DaemonSets would land) the test starts what they run: accelstack's device plugin (in-cluster as its shipped
ServiceAccount, its shipped config, an NR1 sysfs fixture of 4 modules, the kubelet gRPC peer as the kubelet, the
pod-resources peer) and NPD with accelstack's NR1 plugin. Every step to ``Managed`` is driven by what those
processes write (the plugin's labels under its field manager, its ``accelstack.io/pod-resources-nr1`` report,
NPD's ``NR1Unhealthy``); the holder pod is untouched and counted. A variant: the peer lists IDs the plugin does
not serve, so the node waits at ``DeviceIDsDiffer`` while the plugin reports its free modules Unhealthy to the
kubelet, and is Managed once the pod ends. ``tests/realcluster/test_node_onboard.py`` walks the same steps with the
processes' writes played by the test; ``nr1_agents.py`` says what differs from the shipped DaemonSets."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scheduler_extender.cli import kubectl_plugin
from scheduler_extender.objects.accelerator_nodes import ONBOARD_STEPS
from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.nr1_agents import NR1, DevicePlugin, Kubelet, landing_label_seen, nr1_npd, nr1_pod
from tests.realcluster.objects import wait_for
from tests.realcluster.stack import Stack
from tests.realcluster.test_accelerator_nodes import AN, OUTSIDE, status_of, wait_status
from tests.realcluster.test_node_deboard import operator_token
from tests.realcluster.test_node_health import condition
from tests.sysfs_fixture import nr1_node

PLUGIN_MANAGER = "accelstack-device-plugin"
REPORT = "accelstack.io/pod-resources-nr1"


class Reasons:
    """Every distinct ``status.reason`` of the AcceleratorNode in the order seen (polled in a thread)."""

    def __init__(self, cp: ControlPlane, node: str) -> None:
        self.cp, self.node, self.seen = cp, node, []  # type: ignore[var-annotated]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                reason = (status_of(self.cp, self.node) or {}).get("reason")
                if reason and (not self.seen or self.seen[-1] != reason):
                    self.seen.append(reason)
            self.stop.wait(0.05)

    def __enter__(self) -> Reasons:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def step_of(reason: str) -> int:
    """The onboarding step a reason belongs to (docs/nodes.md's table); Managed's ``Onboarded`` after all."""
    extra = {"OtherDevicePlugin": 0, "NotRequested": 0, "PodResourcesUnreadable": 4, "DeviceIDsDiffer": 5,
             "InventoryMismatch": 5, "Onboarded": len(ONBOARD_STEPS) + 1}
    return extra[reason] if reason in extra else ONBOARD_STEPS.index(reason) + 1


def plugin_labels(node_obj: dict[str, Any]) -> set[str]:
    """The labels the device plugin's field manager owns on the Node (managedFields)."""
    owned: set[str] = set()
    for entry in node_obj["metadata"].get("managedFields") or []:
        if entry.get("manager") == PLUGIN_MANAGER:
            labels = ((entry.get("fieldsV1") or {}).get("f:metadata") or {}).get("f:labels") or {}
            owned |= {k.removeprefix("f:") for k in labels}
    return owned


@contextlib.contextmanager
def nr1_node_agents(cp: ControlPlane, shipped: list[dict[str, Any]], node: str, sysfs: Path, kubelet: Kubelet,
                    workdir: Path) -> Iterator[tuple[DevicePlugin, Any]]:
    """The real device plugin and NPD for ``node`` (started by the caller), stopped at the end, their logs in an
    assertion that fails."""
    plugin = DevicePlugin(cp, shipped, node, sysfs, kubelet, workdir / "plugin")
    npd = nr1_npd(cp, shipped, node, sysfs, workdir / "npd")
    try:
        yield plugin, npd
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n---- device plugin:\n{plugin.tail()}\n---- npd:\n{npd.tail()}") from None
    finally:
        plugin.stop()
        npd.stop()


def setup(cp: ControlPlane, ns: str, nodes: Nodes, tmp_path: Path, held: list[str] | None
          ) -> tuple[str, str, list[str], Kubelet, dict[str, Any]]:
    """A node another plugin serves (capacity 4), 4 modules in sysfs, a pod of another scheduler holding 2 of them
    under ``held`` (default: the IDs accelstack's plugin serves); the kubelet's part running."""
    node = nodes.add("nr1", gpus=0, nr1=4)
    modules = nr1_node(tmp_path / "sys", 4)
    with contextlib.suppress(ApiCallError):
        cp.create(f"api/v1/namespaces/{OUTSIDE}/serviceaccounts", {"metadata": {"name": "default"}})
    holder = f"{ns}-held"[:63]
    made = cp.create(f"api/v1/namespaces/{OUTSIDE}/pods", nr1_pod(holder, 2, node))
    kubelet = Kubelet(cp, node)
    kubelet.pods.set_pod(OUTSIDE, holder, {NR1: held if held is not None else modules[:2]})
    kubelet.start()
    return node, holder, modules, kubelet, made


def onboard(cp: ControlPlane, stack: Stack, ns: str, node: str) -> None:
    """`kubectl accelstack node onboard NODE`, through the REST API with a real ServiceAccount token."""
    token = operator_token(cp, ns, True)
    assert kubectl_plugin.main(["--server", stack.url, "--insecure-skip-tls-verify", "--token", token,
                                "node", "onboard", node]) == 0


def cleanup(cp: ControlPlane, ns: str, holder: str, kubelet: Kubelet) -> None:
    kubelet.stop()
    cp.api("DELETE", f"api/v1/namespaces/{OUTSIDE}/pods/{holder}", {"gracePeriodSeconds": 0}, ok=(200, 202, 404))
    cp.api("DELETE", f"apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{ns}-node-operator", ok=(200, 404))
    cp.api("DELETE", f"apis/rbac.authorization.k8s.io/v1/clusterroles/{ns}-node-operator", ok=(200, 404))


def test_an_nr1_node_is_onboarded_by_the_real_plugin_and_npd_with_its_pod_untouched(
        cp: ControlPlane, shipped: list[dict[str, Any]], stack: Stack, ns: str, nodes: Nodes, tmp_path: Path) -> None:
    node, holder, modules, kubelet, made = setup(cp, ns, nodes, tmp_path, None)
    try:
        st = wait_status(cp, node, phase="Detected", managedBy="other-plugin", resource=NR1, allocated=2,
                         holderCount=1)
        with Reasons(cp, node) as reasons, nr1_node_agents(cp, shipped, node, tmp_path / "sys", kubelet,
                                                           tmp_path) as (plugin, npd):
            onboard(cp, stack, ns, node)
            labelled = landing_label_seen(cp, node)
            st = wait_status(cp, node, phase="Onboarding", reason="WaitingForDevicePlugin")
            assert "another device plugin" in next(c for c in st["conditions"] if c["type"] == "Onboarded")["message"]
            plugin.start()  # the DaemonSets land
            npd.start()
            wait_for("the plugin registered with the kubelet", plugin.ready, timeout=60, every=0.05)
            st = wait_status(cp, node, phase="Managed", reason="Onboarded", managedBy="accelstack", allocated=2,
                             holderCount=1)
            took = time.monotonic() - labelled
            registered = (kubelet.registered_at or 0.0) - labelled
        # the steps in order, each written by a real process: never back to an earlier one
        steps = [step_of(r) for r in reasons.seen]
        assert steps == sorted(steps) and reasons.seen[-1] == "Onboarded", reasons.seen
        assert "WaitingForDevicePlugin" in reasons.seen, reasons.seen
        obj = cp.get(f"api/v1/nodes/{node}") or {}
        labels = obj["metadata"]["labels"]
        assert labels["accelstack.io/nr1.count"] == "4" and labels["accelstack.io/nr1-node"] == "true"
        assert "accelstack.io/nr1.count" in plugin_labels(obj)  # by the plugin's field manager
        report = json.loads(obj["metadata"]["annotations"][REPORT])
        assert {k: v for k, v in report.items() if k != "observedAt"} == {
            "resource": NR1, "devices": 4, "inUse": 2, "unknownIDs": 0}, report
        npd_said = condition(cp, node, "NR1Unhealthy")
        assert (npd_said["status"], npd_said["reason"]) == ("False", "NoNR1Problem"), npd_said
        assert kubelet.health() == dict.fromkeys(modules, "Healthy")  # same IDs: nothing withheld
        assert kubelet.written and kubelet.written[-1] == (4, 4)
        # the pod untouched (the same object, bound where it was) and counted
        assert st["holders"] == [{"namespace": OUTSIDE, "name": holder, "resource": NR1, "count": 2}]
        now = cp.get(f"api/v1/namespaces/{OUTSIDE}/pods/{holder}") or {}
        assert now["metadata"]["uid"] == made["metadata"]["uid"] and now["spec"]["nodeName"] == node
        assert not now["metadata"].get("deletionTimestamp")
        print(f"onboarding with the real plugin and NPD: landing label -> plugin registered {registered:.1f} s, "
              f"-> Managed {took:.1f} s; steps {reasons.seen}")
    finally:
        cleanup(cp, ns, holder, kubelet)


def test_ids_the_plugin_does_not_serve_hold_the_node_at_device_ids_differ_until_the_pod_ends(
        cp: ControlPlane, shipped: list[dict[str, Any]], stack: Stack, ns: str, nodes: Nodes, tmp_path: Path) -> None:
    old = ["nr1-old-0", "nr1-old-1"]  # the other plugin's naming: not a PCI address accelstack's plugin serves
    node, holder, modules, kubelet, _ = setup(cp, ns, nodes, tmp_path, old)
    try:
        wait_status(cp, node, phase="Detected", managedBy="other-plugin", allocated=2)
        with nr1_node_agents(cp, shipped, node, tmp_path / "sys", kubelet, tmp_path) as (plugin, npd):
            onboard(cp, stack, ns, node)
            landing_label_seen(cp, node)
            plugin.start()
            npd.start()
            st = wait_status(cp, node, phase="Onboarding", reason="DeviceIDsDiffer", managedBy="accelstack")
            assert st["onboard"]["step"] == "5/5 InventoryMatch"
            assert "2 neureality.com/nr1 in use" in next(
                c for c in st["conditions"] if c["type"] == "Onboarded")["message"]
            # the plugin withholds every free module from the kubelet (none is in use under its own IDs)
            wait_for("all 4 modules Unhealthy at the kubelet", lambda: kubelet.health() == dict.fromkeys(
                modules, "Unhealthy"), timeout=30, every=0.05)
            wait_for("the kubelet's allocatable 0", lambda: kubelet.written and kubelet.written[-1] == (4, 0))
            report = json.loads((cp.get(f"api/v1/nodes/{node}") or {})["metadata"]["annotations"][REPORT])
            assert report["unknownIDs"] == 2 and report["inUse"] == 2, report
            time.sleep(2)  # the controller's passes go on: still waiting, never Managed while the IDs differ
            assert (status_of(cp, node) or {}).get("reason") == "DeviceIDsDiffer"

            # the pod ends (the kubelet forgets it, the API object goes): Managed, every module back
            cp.api("DELETE", f"api/v1/namespaces/{OUTSIDE}/pods/{holder}", {"gracePeriodSeconds": 0})
            with kubelet.pods.lock:
                del kubelet.pods.pods[(OUTSIDE, holder)]
            wait_status(cp, node, phase="Managed", reason="Onboarded", allocated=0, holderCount=0)
            wait_for("all 4 modules Healthy again", lambda: kubelet.health() == dict.fromkeys(modules, "Healthy"),
                     timeout=30, every=0.05)
            wait_for("the kubelet's allocatable 4", lambda: kubelet.written[-1] == (4, 4))
        assert cp.get(f"{AN}/{node}") is not None
    finally:
        cleanup(cp, ns, holder, kubelet)
