"""An NR1 node joining and leaving on the real API server, checked with the real plugin through the REST API
(issue 39.5): ``kubectl accelstack node check NODE`` with a real ServiceAccount token, on a node missing each item
in turn as it joins (labels, the device plugin's count, the resource advertised, the CNI installer Ready, NPD's
condition, the exporter), then all ok (exit 0); a caller without ``get nodes`` is refused. Then the removal steps
of docs/nr1-nodes.md: ``kubectl accelstack node deboard``, Deboarded, ``kubectl drain NODE --ignore-daemonsets``
(the DaemonSet pods are real pods of real DaemonSet objects, so drain judges them as it would on a cluster) and
``kubectl delete node NODE``, after which the check is a one-line 404. Fails on the code before: there was no
check route or verb."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from scheduler_extender.cli import kubectl_plugin
from scheduler_extender.objects.gpr_codec import rfc3339
from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import account_token, wait_for
from tests.realcluster.stack import Stack
from tests.realcluster.test_accelerator_nodes import AN, label_as_device_plugin, wait_status
from tests.realcluster.test_gpr_control_plane import pods_path, set_running

# the shipped node DaemonSets' names and pod labels (manifests/device-plugin, cni, npd, monitoring)
DAEMONSETS = {"plugin": ("accelstack-device-plugin-nr1", {}), "cni": ("accelstack-nr1-cni", {}),
              "npd": ("accelstack-npd-nr1", {}),
              "exporter": ("accelstack-device-exporter-nr1", {"app.kubernetes.io/name": "accelstack-device-exporter",
                                                          "app.kubernetes.io/component": "nr1"})}


def pod_labels(key: str) -> dict[str, str]:
    name, labels = DAEMONSETS[key]
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "accelstack", **labels}


def daemonset(cp: ControlPlane, ns: str, key: str) -> str:
    """A DaemonSet object as shipped (no controller runs here: its pods are made by the test); its UID."""
    name = DAEMONSETS[key][0]
    labels = pod_labels(key)
    obj = cp.create(f"apis/apps/v1/namespaces/{ns}/daemonsets", {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "labels": labels},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}}})
    return str(obj["metadata"]["uid"])


def ds_pod(cp: ControlPlane, ns: str, node: str, key: str, uid: str) -> str:
    name = f"{DAEMONSETS[key][0]}-{node[-6:]}"
    cp.create(pods_path(ns), {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "labels": pod_labels(key), "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": DAEMONSETS[key][0], "uid": uid,
             "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}})
    return name


def node_reader(cp: ControlPlane, ns: str, allowed: bool) -> str:
    """A real ServiceAccount token; ``allowed``: may get nodes and patch acceleratornodes (check and deboard)."""
    if not allowed:
        return account_token(cp, ns, "onlooker")
    return account_token(cp, ns, "node-admin", [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        {"apiGroups": ["accelstack.io"], "resources": ["acceleratornodes"], "verbs": ["get", "patch"]}])


def test_an_nr1_node_joins_item_by_item_then_is_removed(cp: ControlPlane, stack: Stack, ns: str, nodes: Nodes,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    plugin = ("--server", stack.url, "--insecure-skip-tls-verify", "--token", node_reader(cp, ns, True))

    def check(node: str) -> tuple[int, dict[str, str], dict[str, Any]]:
        """`kubectl accelstack node check NODE -o json`: exit code, status per item, the answer."""
        capsys.readouterr()
        code = kubectl_plugin.main([*plugin, "node", "check", node, "-o", "json"])
        data = json.loads(capsys.readouterr().out)
        return code, {i["name"]: i["status"] for i in data["items"]}, data

    def not_ok(node: str) -> set[str]:
        code, got, data = check(node)
        assert code == (0 if all(s == "ok" for s in got.values()) else 1), data
        return {k for k, s in got.items() if s != "ok"}

    # kubeadm join done: a Ready node with nothing of accelstack's yet, and someone else's pod on it
    node = nodes.add("nr1", gpus=0)
    cp.create(pods_path(ns), {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "workload-secret-name"},
                              "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}})
    items = ["labels", "modules", "device plugin", "cni", "npd", "exporter"]
    assert not_ok(node) == set(items)
    assert "workload-secret-name" not in json.dumps(check(node)[2])  # only accelstack's DaemonSet pods are read
    cp.api("DELETE", f"{pods_path(ns)}/workload-secret-name", {"gracePeriodSeconds": 0})  # no kubelet to end it

    # onboarding, one item at a time: each flips to ok, the others stay missing
    cp.patch(f"api/v1/nodes/{node}", {"metadata": {"labels": {"accelstack.io/nr1-node": "true"}}})
    assert not_ok(node) == set(items[1:])
    uids = {key: daemonset(cp, ns, key) for key in DAEMONSETS}
    plugin_pod = ds_pod(cp, ns, node, "plugin", uids["plugin"])
    set_running(cp, ns, plugin_pod)
    label_as_device_plugin(cp, node, {"accelstack.io/nr1.count": "4", "accelstack.io/nr1.product": "NR1-M"})
    assert not_ok(node) == set(items[2:])
    four = {"neureality.com/nr1": "4"}
    cp.patch(f"api/v1/nodes/{node}/status", {"status": {"capacity": four, "allocatable": four}})
    assert not_ok(node) == set(items[3:])
    cni = ds_pod(cp, ns, node, "cni", uids["cni"])  # created, its probe not passed yet: still missing
    code, got, data = check(node)
    assert got["cni"] == "missing" and code == 1, data
    set_running(cp, ns, cni)
    assert not_ok(node) == set(items[4:])
    npd = ds_pod(cp, ns, node, "npd", uids["npd"])
    set_running(cp, ns, npd)
    assert "npd" in not_ok(node)  # NPD runs but has not reported its condition
    cp.api("PATCH", f"api/v1/nodes/{node}/status", {"status": {"conditions": [
        {"type": "NR1Unhealthy", "status": "False", "reason": "NoNR1Problem", "message": "no NR1 problem found",
         "lastHeartbeatTime": rfc3339(time.time()), "lastTransitionTime": rfc3339(time.time())}]}},
        content_type="application/strategic-merge-patch+json")
    assert not_ok(node) == {"exporter"}
    set_running(cp, ns, ds_pod(cp, ns, node, "exporter", uids["exporter"]))
    code, got, data = check(node)
    assert code == 0 and data["ok"] and set(got) == {"node", *items}, data
    capsys.readouterr()
    assert kubectl_plugin.main([*plugin, "node", "check", node]) == 0  # the table
    out = capsys.readouterr().out
    assert f"node {node}: all 7 checks ok" in out
    assert "4 NR1 modules in sysfs (label accelstack.io/nr1.count=4, written by accelstack-device-plugin)" in out

    # a caller who may not get nodes is refused, one line, before anything is read
    onlooker = ("--server", stack.url, "--insecure-skip-tls-verify", "--token", node_reader(cp, ns, False))
    capsys.readouterr()
    assert kubectl_plugin.main([*onlooker, "node", "check", node]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "403" in err and "may not get nodes" in err, err

    wait_for("its AcceleratorNode", lambda: cp.get(f"{AN}/{node}"))  # the controller's, what deboard writes

    # removing it: deboard, Deboarded, drain, delete — the commands of docs/nr1-nodes.md
    assert kubectl_plugin.main([*plugin, "node", "deboard", "--grace", "10s", node]) == 0, capsys.readouterr()
    wait_status(cp, node, phase="Deboarded")
    assert "node" in not_ok(node)
    cp.kubectl("drain", node, "--ignore-daemonsets", "--timeout=60s")
    assert ((cp.get(f"api/v1/nodes/{node}") or {}).get("spec") or {}).get("unschedulable") is True
    cp.kubectl("delete", "node", node)
    wait_for("the node gone", lambda: cp.get(f"api/v1/nodes/{node}") is None)
    capsys.readouterr()
    assert kubectl_plugin.main([*plugin, "node", "check", node]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip().endswith(f"404 node '{node}' not found"), err
    for kind in ("clusterrolebindings", "clusterroles"):
        cp.api("DELETE", f"apis/rbac.authorization.k8s.io/v1/{kind}/{ns}-node-admin", ok=(200, 404))
