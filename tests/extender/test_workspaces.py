"""The workspace controller against the API-server peer (issue #14): namespaces created or adopted (never
deleted), Roles, RoleBindings and ServiceAccounts created, changed (an access rule's role, the role templates
ConfigMap) and removed (a rule, a namespace, the workspace); status; the device quota enforced where GPRs are
admitted; API faults that do not wedge it; and a restart that plans nothing new."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from scheduler_extender.objects import workspaces as wsp
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, stack
from tests.extender.harness import wait_until as wait_within
from tests.extender.test_controller import FAST, GPRS, seed_nodes
from tests.extender.test_controller_process import kubeconfig
from tests.extender.test_extender_process import free_port

WS = "apis/accelstack.io/v1alpha1/workspaces"
NS = "api/v1/namespaces"
ROLES = "apis/rbac.authorization.k8s.io/v1/roles"
BINDINGS = "apis/rbac.authorization.k8s.io/v1/rolebindings"
SAS = "api/v1/serviceaccounts"
CM = "api/v1/configmaps"
WRITES = ("POST", "PUT", "PATCH", "DELETE")


async def wait_until(predicate: Any, timeout: float = 30.0) -> None:
    """A whole controller runs behind each of these conditions, on a machine the suite shares: a generous
    deadline (one run of a full suite under load missed the 10 s default)."""
    await wait_within(predicate, timeout)


def workspace(name: str, namespaces: list[str], access: list[dict[str, Any]] | None = None,
              policy: dict[str, Any] | None = None, created: str = "2026-11-30T00:00:00Z") -> dict[str, Any]:
    spec: dict[str, Any] = {"namespaces": namespaces, "access": access or []}
    if policy:
        spec["policy"] = policy
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
            "metadata": {"name": name, "generation": 1, "creationTimestamp": created}, "spec": spec}


def namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}},
            "status": {"phase": "Active"}}


async def new_peer() -> APIServerPeer:
    peer = APIServerPeer()
    peer.status_subresources.add("workspaces")
    await peer.start()
    return peer


def ws_status(peer: APIServerPeer, name: str) -> dict[str, Any]:
    return (peer.get(WS, "", name) or {}).get("status") or {}


def ready(peer: APIServerPeer, name: str) -> dict[str, Any]:
    return next((c for c in ws_status(peer, name).get("conditions") or () if c["type"] == "Ready"), {})


def names(peer: APIServerPeer, resource: str, ns: str) -> set[str]:
    return {n for (r, space, n) in peer.objects if r == resource and space == ns}


def subjects(peer: APIServerPeer, ns: str, role: str) -> list[tuple[str, str]]:
    obj = peer.get(BINDINGS, ns, wsp.role_name(role))
    return sorted((s["kind"], s["name"]) for s in (obj or {}).get("subjects") or ())


async def edit_spec(peer: APIServerPeer, name: str, **spec: Any) -> None:
    obj = copy.deepcopy(peer.get(WS, "", name))  # a copy: the peer bumps the generation of a changed spec
    assert obj is not None
    obj["spec"].update(spec)
    await peer.put_object(WS, obj, "MODIFIED")


async def edit(peer: APIServerPeer, resource: str, ns: str, name: str, **changes: Any) -> None:
    obj = copy.deepcopy(peer.get(resource, ns, name))
    assert obj is not None
    obj.update(changes)
    await peer.put_object(resource, obj, "MODIFIED")


ACCESS = [{"kind": "User", "name": "alice", "role": "admin"},
          {"kind": "Group", "name": "ml-devs", "role": "member"},
          {"kind": "ServiceAccount", "name": "ci", "role": "viewer"}]


async def test_rbac_objects_are_created_changed_and_removed_and_namespaces_are_never_deleted() -> None:
    peer = await new_peer()
    await peer.put_object(NS, namespace("team-b"))  # exists already: adopted
    await peer.put_object(SAS, {"apiVersion": "v1", "kind": "ServiceAccount",  # someone else's: never touched
                                "metadata": {"name": "bot", "namespace": "team-b"}})
    access = [*ACCESS, {"kind": "ServiceAccount", "name": "bot", "role": "member"}]
    await peer.put_object(WS, workspace("team", ["team-a", "team-b"], access))
    async with stack(peer, **FAST):
        await wait_until(lambda: ready(peer, "team").get("status") == "True")
        for ns in ("team-a", "team-b"):
            labels = peer.get(NS, "", ns)["metadata"]["labels"]  # type: ignore[index]
            assert labels[wsp.WORKSPACE_LABEL] == "team"
            assert names(peer, ROLES, ns) == {wsp.role_name(r) for r in wsp.ROLES}
            assert subjects(peer, ns, "admin") == [("User", "alice")]
            assert subjects(peer, ns, "member") == [("Group", "ml-devs"), ("ServiceAccount", "bot")]
            assert subjects(peer, ns, "viewer") == [("ServiceAccount", "ci")]
            assert "ci" in names(peer, SAS, ns)
        assert "managedFields" not in (peer.get(SAS, "team-b", "bot") or {}).get("metadata", {}).get("labels", {})
        assert wsp.MANAGED_LABEL not in (peer.get(SAS, "team-b", "bot")["metadata"].get("labels") or {})  # type: ignore[index]
        role = peer.get(ROLES, "team-a", wsp.role_name("viewer"))
        assert role is not None and role["rules"] == wsp.DEFAULT_TEMPLATES["viewer"]
        assert role["metadata"]["ownerReferences"][0]["kind"] == "Workspace"
        st = ws_status(peer, "team")
        assert [(n["name"], n["adopted"], n["ready"]) for n in st["namespaces"]] == [
            ("team-a", False, True), ("team-b", True, True)]
        assert {(m["kind"], m["name"], m["role"]) for m in st["members"]} == {
            (a["kind"], a["name"], a["role"]) for a in access}
        assert st["observedGeneration"] == 1

        # a rule's role changes; the ServiceAccount rule goes
        await edit_spec(peer, "team", access=[{"kind": "User", "name": "alice", "role": "viewer"}, access[1]])
        await wait_until(lambda: subjects(peer, "team-a", "viewer") == [("User", "alice")]
                         and peer.get(BINDINGS, "team-a", wsp.role_name("admin")) is None
                         and "ci" not in names(peer, SAS, "team-a") | names(peer, SAS, "team-b")
                         and subjects(peer, "team-b", "member") == [("Group", "ml-devs")])
        assert "bot" in names(peer, SAS, "team-b")  # not the controller's: left alone
        await wait_until(lambda: ws_status(peer, "team").get("observedGeneration") == 2)

        # the role templates change: the Roles follow
        rules = [{"apiGroups": ["accelstack.io"], "resources": ["gpuprovisioningrequests"], "verbs": ["get"]}]
        await peer.put_object(CM, {"apiVersion": "v1", "kind": "ConfigMap",
                                   "metadata": {"name": wsp.ROLE_TEMPLATES, "namespace": "accelstack-system"},
                                   "data": {"viewer": yaml.safe_dump(rules)}})
        await wait_until(lambda: all(peer.get(ROLES, ns, wsp.role_name("viewer"))["rules"] == rules  # type: ignore[index]
                                     for ns in ("team-a", "team-b")))
        assert peer.get(ROLES, "team-a", wsp.role_name("admin"))["rules"] == wsp.DEFAULT_TEMPLATES["admin"]  # type: ignore[index]
        # a broken template: said on the status; that role's Roles are left as they are
        await edit(peer, CM, "accelstack-system", wsp.ROLE_TEMPLATES, data={"viewer": "verbs: [get"})
        await wait_until(lambda: ready(peer, "team").get("reason") == "RoleTemplateInvalid")
        assert "key viewer: not YAML" in ready(peer, "team")["message"]
        assert peer.get(ROLES, "team-a", wsp.role_name("viewer"))["rules"] == rules  # type: ignore[index]
        await peer.delete_object(CM, "accelstack-system", wsp.ROLE_TEMPLATES)
        await wait_until(lambda: peer.get(ROLES, "team-a", wsp.role_name("viewer"))["rules"]  # type: ignore[index]
                         == wsp.DEFAULT_TEMPLATES["viewer"] and ready(peer, "team").get("status") == "True")

        # a namespace leaves the workspace: what was created there goes, the namespace stays, unlabelled
        await edit_spec(peer, "team", namespaces=["team-a"])
        await wait_until(lambda: not names(peer, ROLES, "team-b") and not names(peer, BINDINGS, "team-b")
                         and wsp.WORKSPACE_LABEL not in peer.get(NS, "", "team-b")["metadata"]["labels"])  # type: ignore[index]
        assert peer.get(NS, "", "team-b") is not None and "bot" in names(peer, SAS, "team-b")

        # the workspace is deleted: everything it created goes, no namespace does (not even one it created), and
        # the namespace it created no longer says so (issue 35.7: the annotation stayed)
        assert peer.get(NS, "", "team-a")["metadata"]["annotations"][wsp.CREATED_ANNOTATION] == "team"  # type: ignore[index]
        await peer.delete_object(WS, "", "team")
        await wait_until(lambda: not names(peer, ROLES, "team-a") and not names(peer, BINDINGS, "team-a")
                         and not names(peer, SAS, "team-a")
                         and wsp.WORKSPACE_LABEL not in peer.get(NS, "", "team-a")["metadata"]["labels"])  # type: ignore[index]
        await wait_until(lambda: wsp.CREATED_ANNOTATION not in (
            peer.get(NS, "", "team-a")["metadata"].get("annotations") or {}))  # type: ignore[index]
        assert peer.get(NS, "", "team-a") is not None
    assert peer.count("DELETE", "namespaces") == 0
    await peer.stop()


async def test_a_namespace_claimed_by_two_workspaces_stays_with_the_first_and_the_second_says_so() -> None:
    peer = await new_peer()
    await peer.put_object(WS, workspace("first", ["shared"], created="2026-11-30T00:00:00Z"))
    await peer.put_object(WS, workspace("second", ["shared", "own"], ACCESS[:1], created="2026-11-30T01:00:00Z"))
    async with stack(peer, **FAST):
        await wait_until(lambda: ready(peer, "second").get("reason") == "NamespaceConflict")
        assert "namespace shared belongs to workspace first" in ready(peer, "second")["message"]
        assert peer.get(NS, "", "shared")["metadata"]["labels"][wsp.WORKSPACE_LABEL] == "first"  # type: ignore[index]
        await wait_until(lambda: subjects(peer, "own", "admin") == [("User", "alice")])
        assert not names(peer, BINDINGS, "shared")  # the second workspace's rules stay out of it
        await wait_until(lambda: ready(peer, "first").get("status") == "True")
    await peer.stop()


async def test_an_api_fault_on_a_create_is_shown_and_retried_and_does_not_stop_the_rest() -> None:
    peer = await new_peer()
    await peer.put_object(NS, namespace("fa"))
    await peer.put_object(WS, workspace("faulty", ["fa"], ACCESS[:1]))
    forbidden = peer.inject("POST", "rolebindings", status=403, reason="Forbidden",
                            message='rolebindings.rbac.authorization.k8s.io is forbidden: user cannot create')
    broken = peer.inject("POST", "roles", status=500, reason="InternalError", message="etcd timeout", times=2)
    async with stack(peer, **FAST) as (_, server):
        await wait_until(lambda: ready(peer, "faulty").get("reason") == "Forbidden")
        assert "create RoleBinding fa/accelstack-workspace-admin: 403" in ready(peer, "faulty")["message"]
        await wait_until(lambda: names(peer, ROLES, "fa") == {wsp.role_name(r) for r in wsp.ROLES})
        assert broken.hits == 2
        # passes keep coming (GPR changes poke it), the refused create is retried with its own backoff
        assert server.service is not None
        controller = server.service.workspaces
        hits, passes = forbidden.hits, controller.passes
        for _ in range(30):
            controller.changed()
            await asyncio.sleep(0.05)
        assert controller.passes - passes >= 10
        assert forbidden.hits - hits <= 2, forbidden.hits - hits  # backoff 1 s, then 2 s
        assert ready(peer, "faulty").get("reason") == "Forbidden"  # and the status still says why
        forbidden.remove()
        await wait_until(lambda: ready(peer, "faulty").get("status") == "True", timeout=15)
        assert subjects(peer, "fa", "admin") == [("User", "alice")]
    await peer.stop()


async def test_a_new_controller_plans_nothing_for_a_reconciled_workspace() -> None:
    peer = await new_peer()
    await seed_nodes(peer)
    await peer.put_object(WS, workspace("calm", ["calm-a", "calm-b"], ACCESS,
                                        {"devices": [{"resource": "nvidia.com/gpu", "max": 4}]}))
    await peer.put_object(NS, namespace("calm-b"))
    async with stack(peer, **FAST):
        await wait_until(lambda: ready(peer, "calm").get("status") == "True")
    mark = peer.mark()
    async with stack(peer, **FAST) as (_, server):
        assert server.service is not None
        controller = server.service.workspaces
        await wait_until(lambda: controller.passes >= 5)
        assert controller.last_plan is not None
        assert controller.last_plan.actions == [] and controller.last_plan.statuses == {}
    writes = [(r.method, r.path) for r in peer.calls(since=mark) if r.method in WRITES
              and r.plural in ("namespaces", "roles", "rolebindings", "serviceaccounts", "workspaces")]
    assert writes == []
    await peer.stop()


def holding(peer: APIServerPeer, ns: str, name: str) -> str:
    return ((peer.get(GPRS, ns, name) or {}).get("status") or {}).get("phase", "")


async def test_the_device_quota_holds_across_the_workspace_namespaces() -> None:
    peer = await new_peer()
    await seed_nodes(peer)  # 2 nodes x 4 GPUs
    await peer.put_object(WS, workspace("q", ["q-a", "q-b"], policy={
        # the H100 cap (6) leaves room for "more": the resource's quota (4) is what holds it back
        "devices": [{"resource": "nvidia.com/gpu", "max": 4}, {"resource": "nvidia.com/gpu", "model": "H100",
                                                              "max": 6}]}))
    await peer.put_object(GPRS, gpr("big", phase=None, devices=4, namespace="q-a"))
    async with stack(peer, **FAST):
        await wait_until(lambda: holding(peer, "q-a", "big") == "Admitted")
        await peer.put_object(GPRS, gpr("more", phase=None, devices=2, namespace="q-b"))
        await peer.put_object(GPRS, gpr("elsewhere", phase=None, devices=2, namespace="other"))
        # 4 GPUs are free, but the workspace holds its 4 already: only the GPR outside it is admitted
        await wait_until(lambda: holding(peer, "other", "elsewhere") == "Admitted")
        await wait_until(lambda: holding(peer, "q-b", "more") == "Queued")
        await asyncio.sleep(0)
        usage = {(u["resource"], u["model"]): u for u in ws_status(peer, "q").get("usage") or ()}
        await wait_until(lambda: {(u["resource"], u["model"]): (u["reserved"], u["queued"])
                                  for u in ws_status(peer, "q").get("usage") or ()} == {
            ("nvidia.com/gpu", ""): (4, 2), ("nvidia.com/gpu", "H100"): (4, 0)})
        usage = {(u["resource"], u["model"]): u for u in ws_status(peer, "q")["usage"]}
        assert usage["nvidia.com/gpu", ""]["max"] == 4 and usage["nvidia.com/gpu", "H100"]["max"] == 6
        assert ws_status(peer, "q")["gprs"] == {"queued": 1, "admitted": 1, "running": 0}
        for _ in range(20):  # it stays queued over many passes
            await asyncio.sleep(0.05)
            assert holding(peer, "q-b", "more") == "Queued"
        await peer.delete_object(GPRS, "q-a", "big")  # the workspace's devices are released
        await wait_until(lambda: holding(peer, "q-b", "more") == "Admitted")
    await peer.stop()


async def test_a_model_cap_holds_across_the_workspace_namespaces_and_leaves_other_models_open() -> None:
    peer = await new_peer()
    for name, model, gpus in (("h0", "H100", 4), ("h1", "H100", 4), ("a0", "A100", 8)):
        await peer.put_object("api/v1/nodes", node(name, gpus=gpus, labels={"nvidia.com/gpu.product": model}))
    await peer.put_object(WS, workspace("m", ["m-a", "m-b"], policy={
        "devices": [{"resource": "nvidia.com/gpu", "model": "H100", "max": 4}]}))
    await peer.put_object(GPRS, gpr("first", phase=None, devices=4, namespace="m-a", models=["H100"]))
    async with stack(peer, **FAST):
        await wait_until(lambda: holding(peer, "m-a", "first") == "Admitted")
        # 4 H100s are free, but the workspace holds its 4 H100s already
        await peer.put_object(GPRS, gpr("second", phase=None, devices=4, namespace="m-b", models=["H100"]))
        await wait_until(lambda: (gpr_status(peer, "m-b", "second").get("reason")) == "ModelQuota")
        assert holding(peer, "m-b", "second") == "Queued"
        await wait_until(lambda: any(  # one event says why, naming the model and its cap
            e["reason"] == "ModelQuota" and "H100: 4 of 4 devices held" in e["message"]
            for (r, space, _), e in peer.objects.items() if r == "api/v1/events" and space == "m-b"))
        # a request of the workspace for any model goes to the A100s (BestFit would rather fill an H100 node);
        # another workspace takes the free H100s
        await peer.put_object(GPRS, gpr("anywhere", phase=None, devices=4, namespace="m-a"))
        await peer.put_object(GPRS, gpr("other", phase=None, devices=4, namespace="other", models=["H100"]))
        await wait_until(lambda: holding(peer, "m-a", "anywhere") == "Admitted")
        assert gpr_status(peer, "m-a", "anywhere")["reservedNodes"] == ["a0"]
        await wait_until(lambda: holding(peer, "other", "other") == "Admitted")
        for _ in range(20):  # it stays queued over many passes
            await asyncio.sleep(0.05)
            assert holding(peer, "m-b", "second") == "Queued"
        await peer.delete_object(GPRS, "other", "other")  # H100s free up, but not the workspace's: still waits
        await peer.delete_object(GPRS, "m-a", "first")  # the workspace's H100s are released
        await wait_until(lambda: holding(peer, "m-b", "second") == "Admitted")
        assert gpr_status(peer, "m-b", "second")["reservedNodes"][0] in ("h0", "h1")
    await peer.stop()


def gpr_status(peer: APIServerPeer, ns: str, name: str) -> dict[str, Any]:
    return (peer.get(GPRS, ns, name) or {}).get("status") or {}


async def test_the_controller_process_runs_the_workspace_controller_under_its_lease(tmp_path: Path) -> None:
    """``accelstack-controller`` as the manifests run it: the workspace controller is one of its leader's tasks,
    writes as the controller's field manager and shows its metrics."""
    peer = await new_peer()
    await peer.put_object(WS, workspace("proc", ["proc-a"], ACCESS[:1]))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_extender.cmd.controller", "--kubeconfig",
        str(kubeconfig(tmp_path, peer.url)), "--listen", f"127.0.0.1:{port}", "--lease-seconds", "3",
        "--resync", "0.2", "--log-format", "text", stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, env={**os.environ, "ACCELSTACK_CTL_LEASE_NAMESPACE": "accelstack-system"})
    try:
        await wait_until(lambda: ready(peer, "proc").get("status") == "True", timeout=20)
        assert subjects(peer, "proc-a", "admin") == [("User", "alice")]
        binding = peer.get(BINDINGS, "proc-a", wsp.role_name("admin"))
        assert binding is not None
        assert {m["manager"] for m in binding["metadata"]["managedFields"]} == {"accelstack-gpr-controller"}
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
        assert 'accelstack_workspace_actions_total{kind="RoleBinding",result="ok",verb="create"} 1.0' in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await peer.stop()


async def test_a_delete_forgets_only_the_object_it_named_not_one_re_created_meanwhile() -> None:
    """The controller deletes a Role it manages by UID. Meanwhile someone re-created the Role (a new UID) and the
    informer brought that one: the delete answers 409 (or the old one is gone), and the controller must keep
    knowing the new Role, or it never deletes it (no event comes until the next relist, minutes later)."""
    from kubernetes_asyncio import client as k8s

    from kubeapi import KubeClient
    from scheduler_extender.controller.workspaces import WorkspaceController
    from scheduler_extender.objects.cluster import ClusterView
    from scheduler_extender.objects.kube import Kube

    peer = await new_peer()
    await peer.put_object(NS, namespace("team-a"))
    name = wsp.role_name("viewer")
    labels = {wsp.MANAGED_LABEL: wsp.MANAGED_BY, wsp.WORKSPACE_LABEL: "team"}
    await peer.put_object(ROLES, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                                  "metadata": {"name": name, "namespace": "team-a", "labels": labels,
                                               "uid": "new-uid"}, "rules": []})
    api = k8s.ApiClient(k8s.Configuration(host=peer.url))
    try:
        ctl = WorkspaceController(Kube(KubeClient(api, field_manager="test")), ClusterView(), list)
        key = ("Role", "team-a", name)
        held = peer.get(ROLES, "team-a", name)
        assert held is not None
        ctl.managed[key] = held  # what the informer holds: the re-created Role
        stale = wsp.Action("delete", "Role", "team-a", name, "team", uid="old-uid")
        assert await ctl._do(stale) == ""  # 409: the precondition names the old UID
        assert peer.get(ROLES, "team-a", name) is not None
        assert ctl.managed[key]["metadata"]["uid"] == "new-uid"  # still known: the next pass deletes it
        current = wsp.Action("delete", "Role", "team-a", name, "team", uid="new-uid")
        assert await ctl._do(current) == ""
        assert peer.get(ROLES, "team-a", name) is None and key not in ctl.managed
        # a 404 for a UID that is not the one held forgets nothing either
        ctl.managed[key] = {"metadata": {"name": name, "namespace": "team-a", "uid": "newer-uid", "labels": labels}}
        assert await ctl._do(stale) == ""
        assert key in ctl.managed
    finally:
        await api.close()
        await peer.stop()
