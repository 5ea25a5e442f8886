"""Admission with workspaces (issue #14): a GPR against its workspace's policy (and the namespace's annotations:
the stricter wins), the template an automatic GPR is made from (GPRTemplateBindings: weight, then selector >
namespaces > workspace, then name; fallbacks), and Workspace / GPRTemplateBinding specs the schema cannot judge.
Over real HTTP with real AdmissionReviews; KubeLookup's lookups against the API-server peer (cached, no list per
pod)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kubeapi.client import connected
from scheduler_extender.admission.webhook import BINDING_ANNOTATION, KubeLookup, Webhook
from scheduler_extender.objects.kube import Kube
from scheduler_extender.objects.workspaces import WORKSPACE_LABEL
from tests.apiserver_peer import APIServerPeer
from tests.extender.test_webhook import NOW, MemoryLookup, call, patched, pod, review, serve

GPR_RES = "gpuprovisioningrequests"
POLICY = {"priorityRange": {"min": 10, "max": 50}, "maxGPRs": 2, "maxExitDuration": "2h", "maxIdleTimeout": "30m",
          "devices": [{"resource": "nvidia.com/gpu", "max": 4}, {"resource": "nvidia.com/gpu", "model": "H100", "max": 2}]}
OK_SPEC = {"priority": 20, "exitDuration": "1h", "idleTimeout": "10m"}


def workspace(name: str, namespaces: list[str], policy: dict[str, Any] | None = None,
              default: tuple[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"namespaces": namespaces}
    if policy:
        spec["policy"] = policy
    if default:
        spec["defaultTemplate"] = {"namespace": default[0], "name": default[1]}
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": name}, "spec": spec}


def binding(namespace: str, name: str, template: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplateBinding",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"template": template, **spec}}


def gpr(spec: dict[str, Any], name: str = "g", namespace: str = "team-a") -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"resource": "nvidia.com/gpu", **spec}}


def of(kind: str, resource: str, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
    body = review(obj, resource=resource, **kw)
    for key in ("kind", "requestKind"):
        body["request"][key] = {"group": "accelstack.io", "version": "v1alpha1", "kind": kind}
    return body


def join(lookup: MemoryLookup, namespace: str, ws: str, **annotations: str) -> None:
    lookup.namespace(namespace, **annotations)
    lookup.namespaces[namespace]["metadata"]["labels"] = {WORKSPACE_LABEL: ws}


@pytest.fixture
def lookup() -> MemoryLookup:
    lk = MemoryLookup()
    lk.workspaces["team"] = workspace("team", ["team-a", "team-b"], POLICY, default=("team-b", "ws-default"))
    join(lk, "team-a", "team")
    join(lk, "team-b", "team")
    return lk


@pytest.fixture
async def http(lookup: MemoryLookup) -> AsyncIterator[TestClient[Any, Any]]:
    c = await serve(Webhook(lookup, clock=lambda: NOW))
    yield c
    await c.close()


async def refused(http: TestClient[Any, Any], spec: dict[str, Any], **kw: Any) -> str:
    response = await call(http, "/validate-gprs", review(gpr(spec, **kw), resource=GPR_RES))
    assert response["allowed"] is False, spec
    assert response["status"]["code"] == 403
    return str(response["status"]["message"])


async def allowed(http: TestClient[Any, Any], spec: dict[str, Any], **kw: Any) -> bool:
    return bool((await call(http, "/validate-gprs", review(gpr(spec, **kw), resource=GPR_RES)))["allowed"])


# ---- GPRs against the workspace policy -----------------------------------------------------------------------
async def test_gprs_breaking_the_workspace_policy_are_refused_with_what_to_change(
        http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    assert await allowed(http, OK_SPEC)
    assert await refused(http, {**OK_SPEC, "priority": 100}) == (
        "spec.priority: 100 is outside 10-50, the range workspace team allows (spec.policy.priorityRange)")
    assert await refused(http, {"priority": 20, "idleTimeout": "10m"}) == (
        "spec.exitDuration: required in workspace team, at most 2h0m0s (spec.policy.maxExitDuration)")
    assert "spec.exitDuration: 3h0m0s is over 2h0m0s, the most workspace team allows" in await refused(
        http, {**OK_SPEC, "exitDuration": "3h"})
    assert "spec.idleTimeout: required in workspace team, at most 30m0s" in await refused(
        http, {"priority": 20, "exitDuration": "1h"})
    assert "spec.idleTimeout: 1h0m0s is over 30m0s" in await refused(http, {**OK_SPEC, "idleTimeout": "1h"})
    message = await refused(http, {**OK_SPEC, "devicesPerNode": 4, "nodeCount": 2})
    assert "8 nvidia.com/gpu (4 per node x 2 nodes) is more than workspace team may hold at once (4" in message
    assert "could never be admitted" in message
    assert "of models H100 is more than workspace team may hold of them at once (2" in await refused(
        http, {**OK_SPEC, "devicesPerNode": 3, "models": ["H100"]})
    assert await allowed(http, {**OK_SPEC, "devicesPerNode": 3, "models": ["H100", "A100"]})  # A100 is not capped
    # maxGPRs counts unfinished GPRs across every namespace of the workspace
    lookup.gpr("team-a", "one", OK_SPEC, phase="Running")
    lookup.gpr("team-b", "two", OK_SPEC)
    lookup.gpr("team-b", "old", OK_SPEC, phase="Complete")
    assert await refused(http, OK_SPEC, name="three") == (
        "workspace team already has 2 unfinished GPRs, the most it allows is 2 (spec.policy.maxGPRs); delete "
        "finished or unneeded GPRs first")
    # an update of one of them is not a new GPR
    old = gpr(OK_SPEC, name="one")
    response = await call(http, "/validate-gprs", review(gpr({**OK_SPEC, "priority": 30}, name="one"),
                                                         resource=GPR_RES, operation="UPDATE", old=old))
    assert response["allowed"] is True


async def test_the_stricter_of_namespace_annotation_and_workspace_policy_wins(
        http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    join(lookup, "team-a", "team", **{"accelstack.io/priority-range": "1-15"})
    assert await allowed(http, {**OK_SPEC, "priority": 12})
    assert "the range namespace team-a allows" in await refused(http, {**OK_SPEC, "priority": 20})
    assert "the range workspace team allows" in await refused(http, {**OK_SPEC, "priority": 5})


async def test_a_label_alone_does_not_join_a_workspace(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    join(lookup, "intruder", "team")  # labelled, but the workspace does not list it
    assert await allowed(http, {"priority": 300}, namespace="intruder")


# ---- which template an automatic GPR is made from ------------------------------------------------------------
def tpl(lookup: MemoryLookup, namespace: str, name: str, priority: int) -> None:
    lookup.template(namespace, name, {"priority": priority, "exitDuration": "1h", "idleTimeout": "5m"})


async def made_from(http: TestClient[Any, Any], lookup: MemoryLookup, p: dict[str, Any]) -> tuple[int, str]:
    """(priority of the GPR made for the pod, the binding that chose its template or '')."""
    before = len(lookup.created)
    patched(p, await call(http, "/mutate-pods", review(p)))
    (made,) = lookup.created[before:]
    lookup.gprs.clear()
    return made["spec"]["priority"], made["metadata"]["annotations"].get(BINDING_ANNOTATION, "")


def job(name: str) -> list[dict[str, Any]]:
    return [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": f"u-{name}"}]


async def test_bindings_choose_the_template_by_weight_then_specificity_then_name(
        http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    join(lookup, "team-a", "team", **{"accelstack.io/default-template": "annotated"})
    for ns, name, priority in (("team-a", "annotated", 11), ("team-b", "ws-default", 12), ("team-b", "ws-wide", 13),
                               ("team-a", "ns-tpl", 14), ("team-a", "sel-tpl", 15), ("evil", "evil-tpl", 16)):
        tpl(lookup, ns, name, priority)
    lookup.owners[("team-a", "Job", "train")] = {"metadata": {"name": "train", "labels": {"app": "train"}}}
    lookup.owners[("team-a", "Job", "etl")] = {"metadata": {"name": "etl", "labels": {"app": "etl"}}}
    lookup.owners[("team-a", "ReplicaSet", "web-5d8")] = {"metadata": {
        "name": "web-5d8", "labels": {"pod-template-hash": "5d8"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "d"}]}}
    lookup.owners[("team-a", "Deployment", "web")] = {"metadata": {"name": "web", "labels": {"app": "train"}}}
    lookup.bindings = [
        binding("team-b", "wide", "ws-wide", workspace="team"),
        binding("team-a", "here", "ns-tpl", namespaces=["team-a"]),
        binding("team-a", "trainers", "sel-tpl", workloadSelector={"matchExpressions": [
            {"key": "app", "operator": "In", "values": ["train"]}]}),
        binding("evil", "steal", "evil-tpl", namespaces=["team-a"], weight=1000),  # out of its reach: ignored
    ]
    assert await made_from(http, lookup, pod(ownerReferences=job("train"))) == (15, "team-a/trainers")
    assert await made_from(http, lookup, pod(ownerReferences=job("etl"))) == (14, "team-a/here")
    rs = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8", "uid": "r"}]
    assert await made_from(http, lookup, pod(ownerReferences=rs)) == (15, "team-a/trainers")  # the Deployment's
    assert await made_from(http, lookup, pod(name="solo", labels={"app": "train"})) == (15, "team-a/trainers")
    lookup.bindings[0]["spec"]["weight"] = 5  # weight first
    assert await made_from(http, lookup, pod(ownerReferences=job("train"))) == (13, "team-b/wide")
    lookup.bindings[0]["spec"]["weight"] = 0
    lookup.bindings.append(binding("team-a", "a-first", "ns-tpl", workloadSelector={"matchLabels": {"app": "train"}}))
    lookup.template("team-a", "ns-tpl", {"priority": 17, "exitDuration": "1h", "idleTimeout": "5m"})
    assert await made_from(http, lookup, pod(ownerReferences=job("train"))) == (17, "team-a/a-first")  # the name
    # namespaces and a workspace together: those namespaces, inside that workspace only
    lookup.bindings.append(binding("team-b", "both", "ws-wide", workspace="team", namespaces=["team-a"], weight=50))
    assert await made_from(http, lookup, pod(ownerReferences=job("etl"))) == (13, "team-b/both")
    lookup.bindings[-1]["spec"]["workspace"] = "another"
    assert await made_from(http, lookup, pod(ownerReferences=job("etl"))) == (17, "team-a/here")  # (ns-tpl now 17)
    lookup.bindings = [b for b in lookup.bindings if b["metadata"]["name"] in ("wide", "steal")]
    assert await made_from(http, lookup, pod(ownerReferences=job("train"))) == (13, "team-b/wide")
    lookup.bindings = []  # no binding: the namespace annotation, then the workspace's default template
    assert await made_from(http, lookup, pod(ownerReferences=job("train"))) == (11, "")
    join(lookup, "team-a", "team")
    assert await made_from(http, lookup, pod(ownerReferences=job("train"))) == (12, "")


async def test_a_bound_template_that_is_missing_is_a_refusal_naming_the_binding(
        http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.bindings = [binding("team-a", "here", "gone", namespaces=["team-a"])]
    response = await call(http, "/mutate-pods", review(pod()))
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(
        "GPRTemplateBinding team-a/here names the template 'gone', but there is no GPRTemplate team-a/gone")


async def test_an_owner_that_cannot_be_read_leaves_selectors_out_with_a_warning(
        http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    tpl(lookup, "team-a", "sel-tpl", 15)
    tpl(lookup, "team-a", "ns-tpl", 14)
    lookup.bindings = [binding("team-a", "trainers", "sel-tpl", workloadSelector={"matchLabels": {"app": "x"}}),
                       binding("team-a", "here", "ns-tpl")]
    response = await call(http, "/mutate-pods", review(pod(ownerReferences=job("vanished"))))
    assert response["allowed"] is True
    assert any("could not be read" in w for w in response["warnings"])
    assert lookup.created[-1]["spec"]["priority"] == 14


# ---- Workspace and GPRTemplateBinding specs ------------------------------------------------------------------
async def test_workspace_specs_the_schema_cannot_judge_are_refused(http: TestClient[Any, Any]) -> None:
    def check(obj: dict[str, Any]) -> Any:
        return call(http, "/validate-workspaces", of("Workspace", "workspaces", obj))

    response = await check(workspace("other", ["team-b", "fresh"]))
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert response["status"]["message"] == (
        "spec.namespaces: team-b already belongs to workspace team; a namespace belongs to one workspace (remove "
        "it there first)")
    response = await check(workspace("other", ["kube-system"]))
    assert "kube-system is a system namespace" in response["status"]["message"]
    response = await check(workspace("other", ["accelstack-system"]))
    assert response["allowed"] is False
    assert (await check(workspace("other", ["fresh"])))["allowed"] is True
    assert (await check(workspace("team", ["team-a", "team-b", "team-c"])))["allowed"] is True  # itself: no clash
    bad = workspace("other", ["fresh"], {"maxExitDuration": "forever"})
    assert "spec.policy.maxExitDuration: 'forever' is not a duration" in (await check(bad))["status"]["message"]


async def test_adopting_an_existing_namespace_needs_what_the_workspace_grants_there(
        http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    """The writer of the spec is asked (SubjectAccessReview) every right the roles its access rules name grant,
    in each existing namespace it did not create; a new namespace asks nothing; accelstack's own account (the
    REST API, acting for someone the request does not name) may not adopt at all."""
    lookup.namespace("ops")
    lookup.namespace("made", **{"accelstack.io/created-by-workspace": "other"})
    ws = workspace("other", ["ops", "fresh"])
    ws["spec"]["access"] = [{"kind": "User", "name": "eve", "role": "admin"}]

    def as_user(obj: dict[str, Any], user: str) -> dict[str, Any]:
        body = of("Workspace", "workspaces", obj)
        body["request"]["userInfo"] = {"username": user, "groups": ["system:authenticated"]}
        return body

    # only workspace verbs (no rights in ops): refused, naming a missing right and the namespace
    lookup.grants["eve"] = set()
    response = await call(http, "/validate-workspaces", as_user(ws, "eve"))
    assert response["allowed"] is False and response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith("spec.namespaces: ops exists and would be adopted") and "eve may not" in message
    asked = {(r["resourceAttributes"]["namespace"], r["resourceAttributes"]["verb"],
              r["resourceAttributes"]["resource"], r["resourceAttributes"].get("subresource", ""))
             for r in lookup.reviews}
    assert {ns for ns, *_ in asked} == {"ops"}  # fresh does not exist: created, nothing handed out
    assert ("ops", "get", "pods", "log") in asked and ("ops", "delete", "gprtemplates", "") in asked
    assert all(r["user"] == "eve" and r["groups"] == ["system:authenticated"] for r in lookup.reviews)
    # one right short: still refused; every right: allowed
    full = {(a["namespace"], a["verb"], a["group"], a["resource"], a.get("subresource", ""))
            for a in (r["resourceAttributes"] for r in lookup.reviews)}
    lookup.grants["eve"] = full - {("ops", "get", "", "pods", "log")}
    response = await call(http, "/validate-workspaces", as_user(ws, "eve"))
    assert response["allowed"] is False and "may not get pods/log in ops" in response["status"]["message"]
    lookup.grants["eve"] = full
    assert (await call(http, "/validate-workspaces", as_user(ws, "eve")))["allowed"] is True
    # a namespace the workspace created itself asks nothing
    lookup.reviews.clear()
    lookup.grants["eve"] = set()
    made = workspace("other", ["made"])
    made["spec"]["access"] = ws["spec"]["access"]
    assert (await call(http, "/validate-workspaces", as_user(made, "eve")))["allowed"]
    assert lookup.reviews == []
    # the REST API's own account cannot vouch for the person behind it
    response = await call(http, "/validate-workspaces", as_user(ws, "system:serviceaccount:accelstack-system:x"))
    assert response["allowed"] is False and "accelstack's own account" in response["status"]["message"]


async def test_bindings_that_reach_outside_their_workspace_are_refused(http: TestClient[Any, Any],
                                                                        lookup: MemoryLookup) -> None:
    lookup.namespace("loner")

    def check(obj: dict[str, Any]) -> Any:
        return call(http, "/validate-gprtemplatebindings", of("GPRTemplateBinding", "gprtemplatebindings", obj))

    assert (await check(binding("team-a", "b", "t", namespaces=["team-a", "team-b"])))["allowed"] is True
    assert (await check(binding("team-b", "b", "t", workspace="team")))["allowed"] is True
    assert (await check(binding("loner", "b", "t")))["allowed"] is True
    response = await check(binding("team-a", "b", "t", namespaces=["team-a", "loner"]))
    assert response["allowed"] is False and response["status"]["message"] == (
        "spec.namespaces: loner is outside the binding's reach (namespace team-a belongs to workspace team); a "
        "binding reaches only its own namespace or its workspace's")
    response = await check(binding("loner", "b", "t", workspace="team"))
    assert response["status"]["message"].startswith(
        "spec.workspace: team is not the binding's own workspace (namespace loner belongs to no workspace)")
    response = await check(binding("team-a", "b", "t", workloadSelector={"matchExpressions": [
        {"key": "app", "operator": "In"}]}))
    assert "In and NotIn need values" in response["status"]["message"]


# ---- KubeLookup on the API server ----------------------------------------------------------------------------
async def test_bindings_and_workspaces_are_read_once_per_ttl_not_per_pod() -> None:
    peer = APIServerPeer()
    await peer.start()
    try:
        await peer.put_object("apis/accelstack.io/v1alpha1/workspaces", workspace("team", ["team-a"]))
        await peer.put_object("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": "team-a", "labels": {WORKSPACE_LABEL: "team"}}})
        await peer.put_object("apis/accelstack.io/v1alpha1/gprtemplates", {
            "apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate",
            "metadata": {"name": "bound", "namespace": "team-a"}, "spec": {"priority": 42}})
        await peer.put_object("apis/accelstack.io/v1alpha1/gprtemplatebindings",
                              binding("team-a", "all", "bound", workspace="team"))
        async with connected(peer.url, field_manager="accelstack-extender") as client:
            http = await serve(Webhook(KubeLookup(Kube(client)), clock=lambda: NOW))
            try:
                for i in range(5):
                    p = pod(name=f"p{i}")
                    patched(p, await call(http, "/mutate-pods", review(p)))
                    stored = peer.get("apis/accelstack.io/v1alpha1/gpuprovisioningrequests", "team-a", f"p{i}")
                    assert stored is not None and stored["spec"]["priority"] == 42
                    assert stored["metadata"]["annotations"][BINDING_ANNOTATION] == "team-a/all"
            finally:
                await http.close()
        assert peer.count("GET", "gprtemplatebindings") == 1
        assert peer.count("GET", "workspaces") == 1
        assert peer.count("GET", "gpuprovisioningrequests") == 0  # no list of the namespace's GPRs per pod
    finally:
        await peer.stop()


async def test_a_policy_of_wrong_types_is_a_denial_naming_the_field_not_a_500(http: TestClient[Any, Any]) -> None:
    """``policy.devices: 5`` was a TypeError in parse_policy: answered code 500 "admission failed: TypeError"
    (and a 500 with a traceback on the REST API's PUT)."""
    for policy, field in (({"devices": 5}, "spec.policy.devices:"), ({"devices": {"a": 1}}, "spec.policy.devices:"),
                          ({"devices": [{"resource": "nvidia.com/gpu", "max": 1, "model": 3}]},
                           "spec.policy.devices[0]:"),
                          ({"devices": [{"resource": "nvidia.com/gpu", "max": True}]}, "spec.policy.devices[0]:")):
        response = await call(http, "/validate-workspaces", of("Workspace", "workspaces",
                                                               workspace("other", ["fresh"], policy)))
        assert response["allowed"] is False and response["status"]["code"] == 422, (policy, response)
        assert response["status"]["message"].startswith(field), (policy, response["status"]["message"])
