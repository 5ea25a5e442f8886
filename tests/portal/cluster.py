"""A small cluster for the REST views, the portal and the kubectl plugin, seeded into the API-server peer: three
node groups (H100 servers, A10G servers, NR1 boxes), one sick node and one with a device out, two workspaces'
worth of namespaces, GPRs in every phase with the statuses the controller writes, Events, a workspace with its
status, a template and a binding, and three callers (an admin, a team-b viewer, a nobody)."""

from __future__ import annotations

import time
from typing import Any

from scheduler_extender.objects import gpr_codec as gr
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node

GPRS = "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"
WORKSPACES = "apis/accelstack.io/v1alpha1/workspaces"
TEMPLATES = "apis/accelstack.io/v1alpha1/gprtemplates"
BINDINGS = "apis/accelstack.io/v1alpha1/gprtemplatebindings"
GROUP = "node.kubernetes.io/instance-type"
ADMIN = {"Authorization": "Bearer admin-token"}
VIEWER = {"Authorization": "Bearer bob-token"}  # may list GPRs and Events in team-b, nothing else
NOBODY = {"Authorization": "Bearer carol-token"}
SICK_SINCE = "2026-11-30T08:15:00Z"
ADMIN_RESOURCES = [("", "nodes"), ("", "events"), ("accelstack.io", "gpuprovisioningrequests"),
                   ("accelstack.io", "workspaces"), ("accelstack.io", "gprtemplates"),
                   ("accelstack.io", "gprtemplatebindings")]


def grant_admin(peer: APIServerPeer, user: str = "alice") -> None:
    for group, resource in ADMIN_RESOURCES:
        for verb in ("get", "list", "create", "update", "delete"):
            peer.grants.add((user, verb, group, resource, ""))


def gpu_node(name: str, group: str, model: str, gpus: int, **kw: Any) -> dict[str, Any]:
    return node(name, gpus=gpus, labels={GROUP: group, "nvidia.com/gpu.product": model}, **kw)


def queued(name: str, namespace: str, position: int, wait: float, priority: int = 100, devices: int = 1,
           reason: str = "Waiting", message: str = "") -> dict[str, Any]:
    obj = gpr(name, phase="Queued", namespace=namespace, priority=priority, devices=devices, exitDuration="2h")
    start = time.time() + wait
    obj["status"].update({
        "queuePosition": position, "estimatedStart": gr.rfc3339(start), "reason": reason,
        "message": message or f"queued at position {position}",
        "estimatedStartRange": {"earliest": gr.rfc3339(start - 60), "latest": gr.rfc3339(start + 600)},
        "conditions": [{"type": "Queued", "status": "True", "reason": reason, "message": message or "waiting",
                        "lastTransitionTime": gr.rfc3339(time.time() - 300)}]})
    return obj


async def seed(peer: APIServerPeer) -> None:
    peer.tokens["admin-token"] = {"username": "alice", "groups": ["platform"]}
    peer.tokens["bob-token"] = {"username": "bob", "groups": ["team-b"]}
    peer.tokens["carol-token"] = {"username": "carol", "groups": []}
    grant_admin(peer)
    for verb in ("list", "get"):
        peer.grants.add(("bob", verb, "accelstack.io", "gpuprovisioningrequests", "team-b"))
    peer.grants.add(("bob", "list", "", "events", "team-b"))

    for i in range(3):
        conditions = [{"type": "GPUUnhealthy", "status": "True", "reason": "XidError",
                       "message": "Xid 79 on GPU 3", "lastTransitionTime": SICK_SINCE}] if i == 2 else None
        await peer.put_object("api/v1/nodes", gpu_node(f"p5-{i}", "p5.48xlarge", "NVIDIA-H100-80GB-HBM3", 8,
                                                       conditions=conditions))
    for i in range(2):
        await peer.put_object("api/v1/nodes", gpu_node(f"g5-{i}", "g5.12xlarge", "NVIDIA-A10G", 4))
    lost = gpu_node("g5-1", "g5.12xlarge", "NVIDIA-A10G", 4)
    lost["status"]["allocatable"] = {**lost["status"]["allocatable"], "nvidia.com/gpu": "3"}  # one device out
    await peer.put_object("api/v1/nodes", lost, "MODIFIED")
    nr1 = node("nr1-0", gpus=0, labels={GROUP: "nr1-box", "accelstack.io/nr1.product": "NR1-S"})
    for key in ("capacity", "allocatable"):
        nr1["status"][key] = {**nr1["status"][key], "neureality.com/nr1": "4"}
    await peer.put_object("api/v1/nodes", nr1)

    for ns, ws in (("team-a", "team-a"), ("team-a-dev", "team-a"), ("team-b", "")):
        labels = {"accelstack.io/workspace": ws} if ws else {}
        await peer.put_object("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": ns, "labels": labels}})

    await peer.put_object(GPRS, gpr("train-big", phase="Running", namespace="team-a", reservation={"p5-0": 8},
                                    priority=150, devices=8, exitDuration="4h"))
    await peer.put_object(GPRS, gpr("exp", phase="Admitted", namespace="team-a-dev", reservation={"p5-1": 2},
                                    devices=2))
    await peer.put_object(GPRS, queued("finetune", "team-a", 1, 900, priority=120, devices=8,
                                       reason="InsufficientCapacity",
                                       message="needs 8 free nvidia.com/gpu on one node; p5-0 holds train-big"))
    await peer.put_object(GPRS, queued("batch", "team-b", 2, 1800, priority=100, devices=4))
    await peer.put_object(GPRS, queued("sweep", "team-b", 3, 3600, priority=90, devices=2))
    done = gpr("old", phase="Complete", namespace="team-b")
    await peer.put_object(GPRS, done)

    await peer.put_object("api/v1/events", {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": "finetune.1", "namespace": "team-a"},
        "involvedObject": {"kind": "GPUProvisioningRequest", "name": "finetune", "namespace": "team-a"},
        "type": "Normal", "reason": "Queued", "message": "position 1; estimated start in 15m", "count": 3,
        "firstTimestamp": gr.rfc3339(time.time() - 600), "lastTimestamp": gr.rfc3339(time.time() - 60),
        "source": {"component": "accelstack-gpr-controller"}})
    await peer.put_object("api/v1/events", {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": "batch.1", "namespace": "team-b"},
        "involvedObject": {"kind": "GPUProvisioningRequest", "name": "batch", "namespace": "team-b"},
        "type": "Normal", "reason": "Queued", "message": "position 2", "count": 1,
        "lastTimestamp": gr.rfc3339(time.time() - 30)})

    await peer.put_object(WORKSPACES, workspace("team-a"))
    await peer.put_object(TEMPLATES, {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate",
        "metadata": {"name": "small-gpu", "namespace": "team-a"},
        "spec": {"description": "one GPU for 2 hours", "resource": "nvidia.com/gpu", "devicesPerNode": 1,
                 "priority": 100, "exitDuration": "2h"}})
    await peer.put_object(BINDINGS, {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplateBinding",
        "metadata": {"name": "notebooks", "namespace": "team-a"},
        "spec": {"template": "small-gpu", "workspace": "team-a",
                 "workloadSelector": {"matchLabels": {"app": "notebook"}}, "weight": 10}})


def workspace(name: str) -> dict[str, Any]:
    """A Workspace with the status the workspace controller writes (the contract's shape)."""
    return {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": name, "generation": 1},
        "spec": {"namespaces": [name, f"{name}-dev"],
                 "access": [{"kind": "User", "name": "alice", "role": "admin"},
                            {"kind": "Group", "name": name, "role": "member"}],
                 "policy": {"priorityRange": {"min": 1, "max": 200}, "maxGPRs": 10,
                            "devices": [{"resource": "nvidia.com/gpu", "max": 16}]},
                 "defaultTemplate": {"namespace": name, "name": "small-gpu"}},
        "status": {"namespaces": [{"name": name, "adopted": True, "ready": True},
                                  {"name": f"{name}-dev", "adopted": False, "ready": True}],
                   "members": [{"kind": "User", "name": "alice", "role": "admin"},
                               {"kind": "Group", "name": name, "role": "member"}],
                   "usage": [{"resource": "nvidia.com/gpu", "model": "", "max": 16, "inUse": 8, "reserved": 2,
                              "queued": 8}],
                   "gprs": {"queued": 1, "admitted": 1, "running": 1},
                   "conditions": [{"type": "Ready", "status": "True", "reason": "Reconciled", "message": "",
                                   "lastTransitionTime": "2026-11-30T07:00:00Z"}],
                   "observedGeneration": 1}}
