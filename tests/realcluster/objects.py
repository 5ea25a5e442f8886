"""Objects and waits the real-cluster tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from tests.realcluster.controlplane import ControlPlane

GPU = "nvidia.com/gpu"
GPRS = "apis/accelstack.io/v1alpha1/namespaces/{ns}/gpuprovisioningrequests"
SCHEDULER = "accelstack-scheduler"
T = TypeVar("T")


def gpr(name: str, *, devices: int = 1, nodes: int = 1, priority: int = 100, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest", "metadata": {"name": name},
            "spec": {"resource": GPU, "devicesPerNode": devices, "nodeCount": nodes, "priority": priority, **spec}}


def pod(name: str, *, gpus: int = 1, gpr_name: str = "", scheduler: str = SCHEDULER, cpu: str = "100m",
        labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    lab = {**({"accelstack.io/gpr": gpr_name} if gpr_name else {}), **(labels or {})}
    res: dict[str, Any] = {"requests": {"cpu": cpu}}
    if gpus:
        res = {"requests": {"cpu": cpu, GPU: str(gpus)}, "limits": {GPU: str(gpus)}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": lab},
            "spec": {"schedulerName": scheduler, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": res}],
                     **spec}}


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, every: float = 0.2) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` and the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def gpr_status(cp: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    obj = cp.get(f"{GPRS.format(ns=ns)}/{name}") or {}
    return dict(obj.get("status") or {})


def admitted(cp: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    """The GPR's status once it is Admitted or Running, else None."""
    status = gpr_status(cp, ns, name)
    return status if status.get("phase") in ("Admitted", "Running") else None


def pod_obj(cp: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return cp.get(f"api/v1/namespaces/{ns}/pods/{name}") or {}


def bound_node(cp: ControlPlane, ns: str, name: str) -> str:
    return str((pod_obj(cp, ns, name).get("spec") or {}).get("nodeName") or "")


def bound_gpus(cp: ControlPlane, node: str) -> int:
    """GPUs requested by the live pods bound to ``node`` (what the kubelet would have to hand out)."""
    items = cp.api("GET", f"api/v1/pods?fieldSelector=spec.nodeName={node}")["items"]
    return sum(int(c.get("resources", {}).get("requests", {}).get(GPU, 0))
               for p in items if not p["metadata"].get("deletionTimestamp") for c in p["spec"]["containers"])


def wait_bound(cp: ControlPlane, ns: str, name: str, timeout: float = 60.0) -> str:
    """The node pod ``name`` gets bound to. On a timeout the failure says why the pod was not bound, as far as the
    cluster tells: its gates, its PodScheduled condition, its last Events and the scheduler's last lines about it
    (a wait that a loaded machine overran is then told apart from a pod the scheduler gave up on)."""
    try:
        return wait_for(f"{name} bound", lambda: bound_node(cp, ns, name), timeout=timeout)
    except AssertionError as exc:
        pod = pod_obj(cp, ns, name)
        gates = [g.get("name") for g in (pod.get("spec") or {}).get("schedulingGates") or []]
        scheduled = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"]
        events = [f"{e.get('reason')}: {str(e.get('message'))[:300]}" for e in events_for(cp, ns, name)[-5:]]
        said = []
        for proc_name, proc in cp.procs.items():
            if "scheduler" in proc_name and proc.log.exists():
                said += [f"{proc_name}: {line[:300]}" for line in proc.log.read_text(errors="replace").splitlines()
                         if f"{ns}/{name}" in line or f'"{name}"' in line][-5:]
        raise AssertionError(f"{exc}; gates {gates}, PodScheduled {scheduled}, events {events}, "
                             f"scheduler lines {said}") from None


def events_for(cp: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    items = cp.api("GET", f"api/v1/namespaces/{ns}/events").get("items") or []
    return [e for e in items if (e.get("involvedObject") or {}).get("name") == name]


def account_token(cp: ControlPlane, ns: str, name: str, rules: list[dict[str, Any]] | None = None) -> str:
    """A real token of a new ServiceAccount ``ns/name``; with ``rules``, a ClusterRole ``<ns>-<name>`` of them bound
    to it (the test removes the two cluster-wide objects, or the next run's create meets them)."""
    cp.create(f"api/v1/namespaces/{ns}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                         "metadata": {"name": name}})
    if rules:
        role = f"{ns}-{name}"
        cp.create("apis/rbac.authorization.k8s.io/v1/clusterroles", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
            "rules": rules})
        cp.create("apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]})
    return cp.token(ns, name)
