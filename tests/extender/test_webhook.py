"""Admission webhooks over real HTTP with real AdmissionReview objects: the pod mutation (gate, label, automatic
GPRs from the namespace's default template), the GPR validation (spec and namespace limits), every refusal and
every malformed body on its own, and KubeLookup against the API-server peer through kubernetes_asyncio."""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kubeapi.client import connected
from scheduler_extender.admission.webhook import (
    AUTO_LABEL,
    CREATED_FOR_ANNOTATION,
    AlreadyExists,
    KubeLookup,
    Webhook,
    add_webhook_routes,
)
from scheduler_extender.objects.kube import Kube
from tests.apiserver_peer import APIServerPeer, json_patch
from tests.apiserver_peer.pods import affinity_errors
from tests.extender.harness import wait_until

NOW = 1_796_018_400.0
NS_RES = "api/v1/namespaces"
TEMPLATES = "apis/accelstack.io/v1alpha1/gprtemplates"
GPRS = "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"


class MemoryLookup:
    """An in-memory cluster for the decision tests (KubeLookup is tested against the API-server peer below)."""

    def __init__(self) -> None:
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.templates: dict[tuple[str, str], dict[str, Any]] = {}
        self.gprs: dict[tuple[str, str], dict[str, Any]] = {}
        self.created: list[dict[str, Any]] = []
        self.fail = False
        self.workspaces: dict[str, dict[str, Any]] = {}
        self.bindings: list[dict[str, Any]] = []
        self.owners: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}
        # SubjectAccessReviews: a user named here may do only what its set lists (namespace, verb, group,
        # resource, subresource); anyone else anything
        self.grants: dict[str, set[tuple[str, str, str, str, str]]] = {}
        self.reviews: list[dict[str, Any]] = []

    async def get_namespace(self, name: str) -> dict[str, Any] | None:
        if self.fail:
            raise ConnectionError("API server unreachable")
        return self.namespaces.get(name)

    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.configmaps.get((namespace, name))

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        raise AssertionError("only the binder's hand-offs read pods (tests/extender/test_direct_admission.py)")

    async def patch_pod(self, namespace: str, name: str, patch: Any) -> None:
        raise AssertionError("only the binder's hand-offs patch pods (tests/extender/test_direct_admission.py)")

    async def access_review(self, spec: dict[str, Any]) -> bool:
        self.reviews.append(spec)
        a = spec["resourceAttributes"]
        allowed = self.grants.get(spec["user"])
        return allowed is None or (a["namespace"], a["verb"], a["group"], a["resource"],
                                   a.get("subresource", "")) in allowed

    async def get_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.templates.get((namespace, name))

    # workspaces and template bindings (tests/extender/test_workspace_admission.py fills these)
    async def get_workspace(self, name: str) -> dict[str, Any] | None:
        return self.workspaces.get(name)

    async def list_workspaces(self) -> list[dict[str, Any]]:
        return list(self.workspaces.values())

    async def list_bindings(self) -> list[dict[str, Any]]:
        return list(self.bindings)

    async def get_owner(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self.owners.get((namespace, kind, name))

    async def get_gpr(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.fail:
            raise ConnectionError("API server unreachable")
        return self.gprs.get((namespace, name))

    async def list_gprs(self, namespace: str) -> list[dict[str, Any]]:
        if self.fail:
            raise ConnectionError("API server unreachable")
        return [g for (ns, _), g in self.gprs.items() if ns == namespace]

    async def create_gpr(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        key = (namespace, body["metadata"]["name"])
        if key in self.gprs:
            raise AlreadyExists(key[1])
        self.gprs[key] = copy.deepcopy(body)
        self.created.append(body)
        return body

    def namespace(self, name: str, **annotations: str) -> None:
        self.namespaces[name] = {"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": name, "annotations": annotations}}

    def template(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self.templates[(namespace, name)] = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate",
                                             "metadata": {"name": name, "namespace": namespace}, "spec": spec}

    def gpr(self, namespace: str, name: str, spec: dict[str, Any], phase: str | None = None) -> None:
        obj: dict[str, Any] = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
                               "metadata": {"name": name, "namespace": namespace}, "spec": spec}
        if phase:
            obj["status"] = {"phase": phase}
        self.gprs[(namespace, name)] = obj


def pod(name: str = "p", namespace: str = "team-a", gpus: int | None = 1, labels: dict[str, str] | None = None,
        **extra: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "busybox"}
    if gpus is not None:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels is not None:
        meta["labels"] = labels
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [container]}}
    for key, value in extra.items():
        (obj["metadata"] if key in ("ownerReferences", "generateName") else obj["spec"])[key] = value
    return obj


def review(obj: dict[str, Any] | None, *, resource: str = "pods", operation: str = "CREATE",
           old: dict[str, Any] | None = None, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002",
           dry_run: bool = False) -> dict[str, Any]:
    """An AdmissionReview as kube-apiserver sends it."""
    group, version, kind = ("", "v1", "Pod") if resource == "pods" else \
        ("accelstack.io", "v1alpha1", "GPUProvisioningRequest")
    meta = (obj or old or {}).get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "name": meta.get("name", ""), "namespace": meta.get("namespace", "team-a"), "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller",
                         "uid": "b1c1f8e3-0000-4000-8000-000000000001", "groups": ["system:serviceaccounts"]},
            "object": obj, "oldObject": old, "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"} if operation == "CREATE" else None,
        },
    }


@pytest.fixture
def lookup() -> MemoryLookup:
    lk = MemoryLookup()
    lk.namespace("team-a")
    return lk


async def serve(webhook: Webhook) -> TestClient[Any, Any]:
    app = web.Application()
    add_webhook_routes(app, webhook)
    http = TestClient(TestServer(app))
    await http.start_server()
    return http


@pytest.fixture
async def http(lookup: MemoryLookup) -> AsyncIterator[TestClient[Any, Any]]:
    c = await serve(Webhook(lookup, clock=lambda: NOW))
    yield c
    await c.close()


@pytest.fixture
async def http_manual(lookup: MemoryLookup) -> AsyncIterator[TestClient[Any, Any]]:
    c = await serve(Webhook(lookup, auto_gpr=False, clock=lambda: NOW))
    yield c
    await c.close()


async def call(http: TestClient[Any, Any], path: str, body: Any) -> dict[str, Any]:
    r = await http.post(path, json=body)
    assert r.status == 200, await r.text()
    answer = await r.json()
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == body["request"]["uid"]
    return answer["response"]


def patched(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    assert isinstance(ops, list) and all(op["op"] in ("add", "replace") for op in ops)
    return json_patch(obj, ops)


def gates(obj: dict[str, Any]) -> list[str]:
    return [g["name"] for g in obj["spec"].get("schedulingGates", [])]


# ---- pods: allowed -------------------------------------------------------------------------------------------
async def test_pod_without_managed_resources_passes_unchanged(http: TestClient[Any, Any]) -> None:
    p = pod(gpus=None)
    p["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "2", "memory": "1Gi"}}
    response = await call(http, "/mutate-pods", review(p))
    assert response == {"uid": review(p)["request"]["uid"], "allowed": True}


async def test_labelled_pod_gets_the_gate(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.gpr("team-a", "train", {"devicesPerNode": 2})
    p = pod(gpus=2, labels={"accelstack.io/gpr": "train", "app": "x"})
    response = await call(http, "/mutate-pods", review(p))
    out = patched(p, response)
    assert gates(out) == ["accelstack.io/gpr"]
    assert out["metadata"]["labels"] == {"accelstack.io/gpr": "train", "app": "x"}
    assert "warnings" not in response and lookup.created == []


async def test_existing_gates_are_kept_and_ours_is_not_doubled(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.gpr("team-a", "train", {})
    p = pod(labels={"accelstack.io/gpr": "train"}, schedulingGates=[{"name": "kueue.x-k8s.io/admission"}])
    out = patched(p, await call(http, "/mutate-pods", review(p)))
    assert gates(out) == ["kueue.x-k8s.io/admission", "accelstack.io/gpr"]
    again = await call(http, "/mutate-pods", review(out))
    assert again["allowed"] is True and "patch" not in again  # already gated and labelled: nothing to change


async def test_requests_without_limits_and_init_containers_count(http: TestClient[Any, Any],
                                                                 lookup: MemoryLookup) -> None:
    lookup.gpr("team-a", "nr1", {"resource": "neureality.com/nr1", "devicesPerNode": 2})
    p = pod(gpus=None, labels={"accelstack.io/gpr": "nr1"})
    p["spec"]["initContainers"] = [{"name": "warm", "image": "x",
                                    "resources": {"requests": {"neureality.com/nr1": "2"}}}]
    assert gates(patched(p, await call(http, "/mutate-pods", review(p)))) == ["accelstack.io/gpr"]
    q = pod(gpus=None, labels={"accelstack.io/gpr": "nr1"})
    q["spec"]["containers"][0]["resources"] = {"requests": {"neureality.com/nr1": "1"}}
    assert gates(patched(q, await call(http, "/mutate-pods", review(q)))) == ["accelstack.io/gpr"]


async def test_labelled_pod_whose_gpr_is_missing_is_gated_with_a_warning(http: TestClient[Any, Any]) -> None:
    p = pod(labels={"accelstack.io/gpr": "later"})
    response = await call(http, "/mutate-pods", review(p))
    assert gates(patched(p, response)) == ["accelstack.io/gpr"]
    assert "GPR team-a/later does not exist" in response["warnings"][0]


async def test_finished_gpr_warns(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.gpr("team-a", "old", {}, phase="Complete")
    response = await call(http, "/mutate-pods", review(pod(labels={"accelstack.io/gpr": "old"})))
    assert response["allowed"] and "has finished" in response["warnings"][0]


async def test_pod_with_a_node_name_is_labelled_but_not_gated(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.gpr("team-a", "train", {})
    p = pod(labels={"accelstack.io/gpr": "train"}, nodeName="n1")
    response = await call(http, "/mutate-pods", review(p))
    assert response["allowed"] and "patch" not in response
    assert "names its node (n1)" in response["warnings"][0]


async def test_update_and_subresources_are_not_mutated(http: TestClient[Any, Any]) -> None:
    p = pod()
    response = await call(http, "/mutate-pods", review(p, operation="UPDATE", old=p))
    assert response == {"uid": review(p)["request"]["uid"], "allowed": True}


# ---- pods: automatic GPRs ------------------------------------------------------------------------------------
async def test_unlabelled_pod_gets_a_gpr_from_the_default_template(http: TestClient[Any, Any],
                                                                   lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "default"})
    lookup.template("team-a", "default", {"description": "d", "priority": 50, "exitDuration": "4h"})
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "train-7", "uid": "0b5f0c0e-1", "controller": True}
    p = pod(gpus=2, ownerReferences=[owner])
    response = await call(http, "/mutate-pods", review(p))
    out = patched(p, response)
    assert out["metadata"]["labels"] == {"accelstack.io/gpr": "train-7"}
    assert gates(out) == ["accelstack.io/gpr"]
    (created,) = lookup.created
    assert created["apiVersion"] == "accelstack.io/v1alpha1" and created["kind"] == "GPUProvisioningRequest"
    assert created["metadata"]["name"] == "train-7" and created["metadata"]["namespace"] == "team-a"
    assert created["spec"] == {"priority": 50, "exitDuration": "4h", "resource": "nvidia.com/gpu",
                               "devicesPerNode": 2}
    assert created["metadata"]["labels"] == {AUTO_LABEL: "true"}
    assert created["metadata"]["annotations"][CREATED_FOR_ANNOTATION] == "Job/train-7"
    assert created["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": "train-7",
                                                       "uid": "0b5f0c0e-1", "blockOwnerDeletion": False}]
    assert "created GPR team-a/train-7" in response["warnings"][0]
    # the Job's next pod links to the same GPR without making another
    q = pod(name="p2", gpus=2, labels={"app": "t"}, ownerReferences=[owner])
    out = patched(q, await call(http, "/mutate-pods", review(q)))
    assert out["metadata"]["labels"] == {"app": "t", "accelstack.io/gpr": "train-7"}
    assert len(lookup.created) == 1


async def test_auto_gpr_named_from_generate_name(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "default"})
    lookup.template("team-a", "default", {})
    p = pod(name="", generateName="notebook-")
    del p["metadata"]["name"]
    out = patched(p, await call(http, "/mutate-pods", review(p)))
    assert out["metadata"]["labels"]["accelstack.io/gpr"] == "notebook"
    assert lookup.created[0]["metadata"]["annotations"][CREATED_FOR_ANNOTATION] == "Pod/notebook-*"
    assert "ownerReferences" not in lookup.created[0]["metadata"]


async def test_auto_gpr_on_dry_run_creates_nothing(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "default"})
    lookup.template("team-a", "default", {})
    p = pod(name="solo")
    response = await call(http, "/mutate-pods", review(p, dry_run=True))
    assert patched(p, response)["metadata"]["labels"] == {"accelstack.io/gpr": "solo"}
    assert lookup.created == [] and "dry run" in response["warnings"][0]


async def test_auto_gpr_is_judged_by_the_namespace_and_workspace_limits_before_it_is_made(
        http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    """The shipped configuration does not send the extender's own automatic GPRs to /validate-gprs (a round trip
    a pod less): /mutate-pods judges them with the same code, so the namespace's limits still hold for them."""
    lookup.namespace("team-a", **{"accelstack.io/default-template": "default", "accelstack.io/max-gprs": "1",
                                  "accelstack.io/max-exit-duration": "2h"})
    lookup.template("team-a", "default", {"exitDuration": "4h"})
    response = await call(http, "/mutate-pods", review(pod(name="first")))
    assert response["allowed"] is False and lookup.created == []
    assert "spec.exitDuration: 4h0m0s is over 2h0m0s" in response["status"]["message"]
    lookup.template("team-a", "default", {"exitDuration": "1h"})
    assert (await call(http, "/mutate-pods", review(pod(name="first"))))["allowed"] is True
    lookup.gpr("team-a", "first", {"exitDuration": "1h"})
    response = await call(http, "/mutate-pods", review(pod(name="second")))
    assert response["allowed"] is False and len(lookup.created) == 1
    assert "already has 1 unfinished GPRs, the most it allows is 1" in response["status"]["message"]


# ---- pods: refusals ------------------------------------------------------------------------------------------
async def test_unlabelled_pod_refused_when_auto_gpr_is_disabled(http_manual: TestClient[Any, Any],
                                                                lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "default"})
    lookup.template("team-a", "default", {})
    response = await call(http_manual, "/mutate-pods", review(pod()))
    assert response["allowed"] is False and response["status"]["code"] == 403
    message = response["status"]["message"]
    assert "label the pod with accelstack.io/gpr" in message and "automatic GPRs are disabled" in message
    assert lookup.created == []


async def test_unlabelled_pod_refused_without_a_default_template(http: TestClient[Any, Any]) -> None:
    response = await call(http, "/mutate-pods", review(pod()))
    assert response["allowed"] is False and response["status"]["code"] == 403
    assert "label the pod with accelstack.io/gpr" in response["status"]["message"]
    assert "accelstack.io/default-template" in response["status"]["message"]


async def test_unlabelled_pod_refused_when_the_default_template_is_missing(http: TestClient[Any, Any],
                                                                           lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "gone"})
    response = await call(http, "/mutate-pods", review(pod()))
    assert response["allowed"] is False
    assert "no GPRTemplate team-a/gone" in response["status"]["message"]


async def test_unlabelled_pod_refused_when_the_template_is_invalid(http: TestClient[Any, Any],
                                                                   lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "bad"})
    lookup.template("team-a", "bad", {"priority": 0})
    response = await call(http, "/mutate-pods", review(pod()))
    assert response["allowed"] is False and "spec.priority" in response["status"]["message"]


async def test_fraction_template_makes_no_gpr_on_a_cluster(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "quarter"})
    lookup.template("team-a", "quarter", {"milliPerDevice": 250})
    for gpus in (1, 2):
        response = await call(http, "/mutate-pods", review(pod(gpus=gpus)))
        assert response["allowed"] is False
        assert "fractions of a device are not supported on a cluster" in response["status"]["message"]
        assert "time-slicing replicas" in response["status"]["message"]
    assert lookup.created == []


async def test_fractional_gpr_is_refused_at_admission_with_the_reason(http: TestClient[Any, Any]) -> None:
    """The controller could never serve it (InvalidSpec after it was stored): refused before it is stored."""
    response = await call(http, "/validate-gprs", review(gpr_obj({"milliPerDevice": 250}),
                                                         resource="gpuprovisioningrequests"))
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert response["status"]["message"].startswith("spec.milliPerDevice: fractions of a device are not supported")
    response = await call(http, "/validate-gprs", review(gpr_obj({"milliPerDevice": 1000, "devicesPerNode": 2}),
                                                         resource="gpuprovisioningrequests"))
    assert response["allowed"] is True


async def test_pod_refused_when_its_gpr_has_another_resource(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.gpr("team-a", "nr1", {"resource": "neureality.com/nr1"})
    response = await call(http, "/mutate-pods", review(pod(labels={"accelstack.io/gpr": "nr1"})))
    assert response["allowed"] is False
    assert response["status"]["message"] == ("the pod requests nvidia.com/gpu but GPR team-a/nr1 reserves "
                                             "neureality.com/nr1")


async def test_pod_refused_when_it_asks_more_than_its_gpr_reserves(http: TestClient[Any, Any],
                                                                   lookup: MemoryLookup) -> None:
    lookup.gpr("team-a", "small", {"devicesPerNode": 1})
    response = await call(http, "/mutate-pods", review(pod(gpus=4, labels={"accelstack.io/gpr": "small"})))
    assert response["allowed"] is False and "reserves 1 per node" in response["status"]["message"]


async def test_pod_refused_when_it_asks_for_two_managed_resources(http: TestClient[Any, Any]) -> None:
    p = pod(labels={"accelstack.io/gpr": "x"})
    p["spec"]["containers"][0]["resources"]["limits"]["neureality.com/nr1"] = "1"
    response = await call(http, "/mutate-pods", review(p))
    assert response["allowed"] is False and "only one managed resource" in response["status"]["message"]


async def test_pod_refused_with_a_fractional_extended_resource(http: TestClient[Any, Any]) -> None:
    p = pod(labels={"accelstack.io/gpr": "x"})
    p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "500m"
    response = await call(http, "/mutate-pods", review(p))
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert "whole" in response["status"]["message"]


async def test_pod_refused_with_a_label_that_is_not_a_name(http: TestClient[Any, Any]) -> None:
    response = await call(http, "/mutate-pods", review(pod(labels={"accelstack.io/gpr": "Not_A_Name"})))
    assert response["allowed"] is False and response["status"]["code"] == 422


async def test_lookup_failure_refuses_instead_of_failing(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.fail = True
    response = await call(http, "/mutate-pods", review(pod()))
    assert response["allowed"] is False and response["status"]["code"] == 503
    assert "API server unreachable" in response["status"]["message"]
    # a labelled pod only loses the GPR check (a warning), it is still gated
    p = pod(labels={"accelstack.io/gpr": "t"})
    response = await call(http, "/mutate-pods", review(p))
    assert gates(patched(p, response)) == ["accelstack.io/gpr"] and "could not check" in response["warnings"][0]


# ---- malformed requests: HTTP 400 (413 for size), never a 500 ------------------------------------------------
async def bad(http: TestClient[Any, Any], data: Any, path: str = "/mutate-pods", status: int = 400) -> str:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    r = await http.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert r.status == status, await r.text()
    body = await r.json()
    assert body["kind"] == "Status" and body["code"] == status
    return str(body["message"])


async def test_malformed_not_json(http: TestClient[Any, Any]) -> None:
    assert "not JSON" in await bad(http, b"{not json")


async def test_malformed_not_utf8(http: TestClient[Any, Any]) -> None:
    assert "not JSON" in await bad(http, b"\xff\xfe\x00")


async def test_malformed_json_array(http: TestClient[Any, Any]) -> None:
    assert "must be an AdmissionReview object, got list" in await bad(http, [1, 2])


async def test_malformed_wrong_api_version(http: TestClient[Any, Any]) -> None:
    body = review(pod())
    body["apiVersion"] = "admission.k8s.io/v1beta1"
    assert "want apiVersion admission.k8s.io/v1" in await bad(http, body)


async def test_malformed_missing_request(http: TestClient[Any, Any]) -> None:
    assert "request: must be an object" in await bad(http, {"apiVersion": "admission.k8s.io/v1",
                                                             "kind": "AdmissionReview"})


async def test_malformed_uid_missing(http: TestClient[Any, Any]) -> None:
    body = review(pod())
    del body["request"]["uid"]
    assert "request.uid" in await bad(http, body)


async def test_malformed_uid_not_a_string(http: TestClient[Any, Any]) -> None:
    body = review(pod())
    body["request"]["uid"] = 42
    assert "request.uid" in await bad(http, body)


async def test_malformed_operation(http: TestClient[Any, Any]) -> None:
    body = review(pod())
    body["request"]["operation"] = "PATCH"
    assert "request.operation" in await bad(http, body)


async def test_malformed_wrong_resource_for_the_endpoint(http: TestClient[Any, Any]) -> None:
    assert "admits pods" in await bad(http, review({"metadata": {"name": "g"}, "spec": {}},
                                                   resource="gpuprovisioningrequests"))
    assert "admits gpuprovisioningrequests" in await bad(http, review(pod()), path="/validate-gprs")


async def test_malformed_object_not_a_map(http: TestClient[Any, Any]) -> None:
    body = review(pod())
    body["request"]["object"] = "a pod"
    assert "request.object: must be an object" in await bad(http, body)


async def test_malformed_object_missing_on_create(http: TestClient[Any, Any]) -> None:
    body = review(pod())
    body["request"]["object"] = None
    assert "request.object: required for CREATE" in await bad(http, body)


async def test_malformed_pod_spec_not_a_map(http: TestClient[Any, Any]) -> None:
    p = pod()
    p["spec"] = ["containers"]
    assert "request.object.spec: must be an object" in await bad(http, review(p))


async def test_malformed_containers_not_a_list(http: TestClient[Any, Any]) -> None:
    p = pod()
    p["spec"]["containers"] = {"name": "main"}
    assert "spec.containers: must be a list of objects" in await bad(http, review(p))


async def test_malformed_limits_not_a_map(http: TestClient[Any, Any]) -> None:
    p = pod()
    p["spec"]["containers"][0]["resources"] = {"limits": ["nvidia.com/gpu"]}
    assert "requests and limits must be maps" in await bad(http, review(p))


async def test_malformed_labels_not_a_map(http: TestClient[Any, Any]) -> None:
    p = pod()
    p["metadata"]["labels"] = ["accelstack.io/gpr"]
    assert "metadata.labels: must be a map" in await bad(http, review(p))


async def test_malformed_dry_run_not_a_boolean(http: TestClient[Any, Any]) -> None:
    body = review(pod())
    body["request"]["dryRun"] = "yes"
    assert "request.dryRun" in await bad(http, body)


async def test_malformed_gpr_metadata(http: TestClient[Any, Any]) -> None:
    body = review({"metadata": "g", "spec": {}}, resource="gpuprovisioningrequests")
    assert "metadata: must be an object" in await bad(http, body, path="/validate-gprs")


async def test_body_over_the_limit_is_413(lookup: MemoryLookup) -> None:
    small = await serve(Webhook(lookup, max_body=2048))
    try:
        p = pod(labels={"accelstack.io/gpr": "x"})
        p["metadata"]["annotations"] = {"big": "x" * 4096}
        assert "over the size limit of 2048" in await bad(small, review(p), status=413)
        # chunked, without a Content-Length: the limit holds while streaming
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield b" " * 1024

        r = await small.post("/mutate-pods", data=chunks())
        assert r.status == 413
    finally:
        await small.close()


async def test_other_methods_are_405(http: TestClient[Any, Any]) -> None:
    assert (await http.get("/mutate-pods")).status == 405


# ---- GPR validation ------------------------------------------------------------------------------------------
def gpr_obj(spec: dict[str, Any], name: str = "g") -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": name, "namespace": "team-a"}, "spec": spec}


async def validate(http: TestClient[Any, Any], spec: dict[str, Any], operation: str = "CREATE",
                   old: dict[str, Any] | None = None) -> dict[str, Any]:
    return await call(http, "/validate-gprs", review(gpr_obj(spec), resource="gpuprovisioningrequests",
                                                     operation=operation, old=old))


async def test_valid_gpr_is_allowed(http: TestClient[Any, Any]) -> None:
    assert (await validate(http, {"devicesPerNode": 4, "nodeCount": 2, "priority": 300}))["allowed"] is True


async def test_gpr_spec_error_is_denied_with_the_field(http: TestClient[Any, Any]) -> None:
    response = await validate(http, {"priority": 0})
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert response["status"]["message"] == "spec.priority: must be 1..300, got 0"


async def test_gpr_priority_outside_the_namespace_range(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/priority-range": "1-200"})
    assert (await validate(http, {"priority": 200}))["allowed"] is True
    response = await validate(http, {"priority": 250})
    assert response["allowed"] is False and response["status"]["code"] == 403
    assert response["status"]["message"].startswith("spec.priority: 250 is outside 1-200")


async def test_gpr_denied_when_the_priority_range_annotation_is_broken(http: TestClient[Any, Any],
                                                                       lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/priority-range": "high"})
    response = await validate(http, {})
    assert response["allowed"] is False and "is not LOW-HIGH" in response["status"]["message"]


async def test_gpr_exit_duration_limit(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/max-exit-duration": "24h"})
    assert (await validate(http, {"exitDuration": "23h59m"}))["allowed"] is True
    response = await validate(http, {"exitDuration": "25h"})
    assert response["allowed"] is False
    assert response["status"]["message"].startswith("spec.exitDuration: 25h0m0s is over 24h0m0s")
    response = await validate(http, {})
    assert response["allowed"] is False
    assert response["status"]["message"].startswith("spec.exitDuration: required in namespace team-a")


async def test_gpr_denied_when_the_exit_duration_annotation_is_broken(http: TestClient[Any, Any],
                                                                      lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/max-exit-duration": "1 day"})
    response = await validate(http, {"exitDuration": "1h"})
    assert response["allowed"] is False and "is not a duration" in response["status"]["message"]


async def test_gpr_count_limit_counts_unfinished_gprs(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/max-gprs": "2"})
    lookup.gpr("team-a", "a", {}, phase="Running")
    lookup.gpr("team-a", "done", {}, phase="Complete")
    lookup.gpr("team-a", "gone", {}, phase="Cancelled")
    lookup.gpr("other", "b", {})
    assert (await validate(http, {}))["allowed"] is True  # 1 unfinished + this one = 2
    lookup.gpr("team-a", "c", {}, phase="Failed")  # may be requeued: counts
    response = await validate(http, {})
    assert response["allowed"] is False
    assert "already has 2 unfinished GPRs, the most it allows is 2" in response["status"]["message"]


async def test_gpr_count_limit_is_read_from_the_informer_view_without_listing(lookup: MemoryLookup) -> None:
    """With the informer's view the namespace's count costs no API call (a burst of automatic GPRs in a limited
    namespace listed it once per GPR): the same phases count, the GPR being judged and other namespaces do not."""
    from scheduler_extender.objects.cluster import ClusterView

    def gpr_in(ns: str, name: str, phase: str | None) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": ns, "uid": f"u-{ns}-{name}"}, "spec": {"devicesPerNode": 1},
                "status": {"phase": phase} if phase else {}}

    lookup.namespace("team-a", **{"accelstack.io/max-gprs": "3"})
    view = ClusterView()
    view.sync_gprs([gpr_in("team-a", "a", "Running"), gpr_in("team-a", "q", None), gpr_in("team-a", "done", "Complete"),
                    gpr_in("team-a", "gone", "Cancelled"), gpr_in("team-a", "g", "Queued"),  # g: the one judged
                    gpr_in("team-ab", "x", "Running"), gpr_in("other", "b", "Running")])

    async def no_list(namespace: str) -> list[dict[str, Any]]:
        raise AssertionError("listed the namespace")

    lookup.list_gprs = no_list  # type: ignore[method-assign]
    http = await serve(Webhook(lookup, clock=lambda: NOW, view=view))
    try:
        assert (await validate(http, {}))["allowed"] is True  # a, q + this one = 3
        view.on_gpr("ADDED", gpr_in("team-a", "f", "Failed"))  # may be requeued: counts
        response = await validate(http, {})
        assert response["allowed"] is False
        assert "already has 3 unfinished GPRs, the most it allows is 3" in response["status"]["message"]
    finally:
        await http.close()


async def test_gpr_denied_when_the_count_annotation_is_broken(http: TestClient[Any, Any],
                                                              lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/max-gprs": "ten"})
    response = await validate(http, {})
    assert response["allowed"] is False and "is not a whole number" in response["status"]["message"]


async def test_gpr_update_checks_only_spec_changes(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    old = gpr_obj({"priority": 250})
    lookup.namespace("team-a", **{"accelstack.io/priority-range": "1-200", "accelstack.io/max-gprs": "0"})
    # a limit set after the GPR was made does not block metadata changes (e.g. removing a finalizer)
    assert (await validate(http, {"priority": 250}, operation="UPDATE", old=old))["allowed"] is True
    response = await validate(http, {"priority": 260}, operation="UPDATE", old=old)
    assert response["allowed"] is False and "outside 1-200" in response["status"]["message"]
    # the count limit applies to creation only
    assert (await validate(http, {"priority": 150}, operation="UPDATE", old=old))["allowed"] is True


async def test_gpr_delete_is_allowed(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/max-gprs": "0"})
    body = review(None, resource="gpuprovisioningrequests", operation="DELETE", old=gpr_obj({}))
    assert (await call(http, "/validate-gprs", body))["allowed"] is True


async def test_gpr_lookup_failure_is_denied_not_a_500(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.fail = True
    response = await validate(http, {})
    assert response["allowed"] is False and response["status"]["code"] == 503


# ---- KubeLookup on the API-server peer (kubernetes_asyncio over real HTTP) ------------------------------------
@pytest.fixture
async def peer() -> AsyncIterator[APIServerPeer]:
    p = APIServerPeer()
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def kube_lookup(peer: APIServerPeer) -> AsyncIterator[KubeLookup]:
    async with connected(peer.url, field_manager="accelstack-extender") as kube:
        yield KubeLookup(Kube(kube))


async def seed(peer: APIServerPeer) -> None:
    await peer.put_object(NS_RES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": "team-a", "annotations": {"accelstack.io/default-template": "default",
                                          "accelstack.io/max-gprs": "1"}}})
    await peer.put_object(TEMPLATES, {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate",
                                      "metadata": {"name": "default", "namespace": "team-a"},
                                      "spec": {"priority": 20, "exitDuration": "1h"}})


async def test_kube_lookup_reads_and_writes_through_the_api(peer: APIServerPeer, kube_lookup: KubeLookup) -> None:
    await seed(peer)
    ns = await kube_lookup.get_namespace("team-a")
    assert ns is not None and ns["metadata"]["annotations"]["accelstack.io/max-gprs"] == "1"
    assert await kube_lookup.get_namespace("nope") is None
    template = await kube_lookup.get_template("team-a", "default")
    assert template is not None and template["spec"]["priority"] == 20
    assert await kube_lookup.get_template("team-a", "nope") is None
    assert await kube_lookup.list_gprs("team-a") == []
    stored = await kube_lookup.create_gpr("team-a", gpr_obj({"priority": 5}))
    assert stored["metadata"]["resourceVersion"] and peer.get(GPRS, "team-a", "g") is not None
    with pytest.raises(AlreadyExists):
        await kube_lookup.create_gpr("team-a", gpr_obj({"priority": 5}))
    assert [g["metadata"]["name"] for g in await kube_lookup.list_gprs("team-a")] == ["g"]
    assert await kube_lookup.list_gprs("other") == []
    assert ("GET", "/api/v1/namespaces/team-a") in peer.requests
    assert (await kube_lookup.get_gpr("team-a", "g") or {})["spec"]["priority"] == 5
    assert await kube_lookup.get_gpr("team-a", "nope") is None
    # a burst of pod creations reads the namespace and the template once per TTL, not once per pod
    before = peer.requests.count(("GET", "/api/v1/namespaces/team-a"))
    for _ in range(5):
        await kube_lookup.get_namespace("team-a")
        await kube_lookup.get_template("team-a", "default")
    assert peer.requests.count(("GET", "/api/v1/namespaces/team-a")) == before


async def test_kube_lookup_never_answers_a_binding_list_older_than_the_documented_5_s(
        peer: APIServerPeer, kube_lookup: KubeLookup) -> None:
    """docs/workspaces.md promises the webhook's cache is 5 s: a binding created 6 s after the list was read
    chooses the next pod's template (the defaults answered a list up to 60 s old), while between 2.5 and 5 s a
    caller is answered at once and the list read again behind it."""
    clock = [0.0]
    lookup = KubeLookup(kube_lookup.kube, clock=lambda: clock[0])
    lists = lambda: peer.count("GET", "gprtemplatebindings")  # noqa: E731
    assert await lookup.list_bindings() == [] and lists() == 1
    clock[0] = 2.0
    assert await lookup.list_bindings() == [] and lists() == 1
    await peer.put_object("apis/accelstack.io/v1alpha1/gprtemplatebindings", {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplateBinding",
        "metadata": {"name": "b", "namespace": "team-a"}, "spec": {"template": "default"}})
    clock[0] = 3.0  # past the refresh point: the old list at once, one read behind it
    assert await lookup.list_bindings() == []
    await wait_until(lambda: not lookup._reading)
    assert lists() == 2 and [b["metadata"]["name"] for b in await lookup.list_bindings()] == ["b"]
    await peer.delete_object("apis/accelstack.io/v1alpha1/gprtemplatebindings", "team-a", "b")
    clock[0] = 9.1  # 6.1 s after the last read: never answered, the caller waits for a fresh list
    assert await lookup.list_bindings() == [] and lists() == 3


async def test_kube_lookup_reads_once_for_a_burst_of_concurrent_misses(peer: APIServerPeer,
                                                                      kube_lookup: KubeLookup) -> None:
    """200 pod creations at once (the API server's default mutating in-flight limit) that all miss the cache
    make one GET of the template, not one each; a caller that leaves (its webhook call cancelled) takes no one
    else's answer with it; once the TTL has passed, one read again. A GPR is read afresh each time, but
    concurrent reads of it are shared too."""
    import asyncio

    await seed(peer)
    slow = peer.inject("GET", "gprtemplates", delay=0.2)
    gets = lambda: peer.count("GET", "gprtemplates")  # noqa: E731
    first = asyncio.ensure_future(kube_lookup.get_template("team-a", "default"))
    await asyncio.sleep(0.05)
    answers = asyncio.gather(*(kube_lookup.get_template("team-a", "default") for _ in range(199)))
    first.cancel()
    assert all(t is not None and t["spec"]["priority"] == 20 for t in await answers)
    assert gets() == 1
    slow.remove()
    clock = [0.0]
    fresh = KubeLookup(kube_lookup.kube, ttl=5.0, clock=lambda: clock[0], max_stale=60.0)
    await asyncio.gather(*(fresh.get_template("team-a", "default") for _ in range(50)))
    clock[0] = 4.9
    await asyncio.gather(*(fresh.get_template("team-a", "default") for _ in range(50)))
    assert gets() == 2
    # past the TTL: answered at once with what was read, while one read runs again behind (a burst of pod
    # creations never waits on a refresh, nor ties up the client's connections with one read per request)
    clock[0] = 5.1
    with peer.inject("GET", "gprtemplates", delay=0.3):
        stale = await asyncio.gather(*(fresh.get_template("team-a", "default") for _ in range(50)))
        assert all(t is not None for t in stale)
        assert fresh._reading  # the one read again still under way: the answers did not wait for it
        await wait_until(lambda: not fresh._reading)
    assert gets() == 3
    template = peer.get("apis/accelstack.io/v1alpha1/gprtemplates", "team-a", "default")
    assert template is not None
    template["spec"]["priority"] = 30
    await peer.put_object("apis/accelstack.io/v1alpha1/gprtemplates", template, event="MODIFIED")
    clock[0] = 10.2  # the value read at 5.1 has passed its TTL: answered once more, and read again
    assert (await fresh.get_template("team-a", "default"))["spec"]["priority"] == 20  # type: ignore[index]
    await wait_until(lambda: not fresh._reading)
    assert (await fresh.get_template("team-a", "default"))["spec"]["priority"] == 30  # type: ignore[index]
    assert gets() == 4
    clock[0] = 100.0  # past max_stale: callers wait for the read
    assert (await fresh.get_template("team-a", "default"))["spec"]["priority"] == 30  # type: ignore[index]
    assert gets() == 5
    # a GPR is not kept (its phase matters now) but a Job's pods arriving together read it once
    await peer.put_object(GPRS, gpr_obj({"priority": 5}))
    reads = lambda: peer.count("GET", "gpuprovisioningrequests")  # noqa: E731
    with peer.inject("GET", "gpuprovisioningrequests", delay=0.2):
        found = await asyncio.gather(*(fresh.get_gpr("team-a", "g") for _ in range(100)))
    assert all(g is not None and g["spec"]["priority"] == 5 for g in found) and reads() == 1
    assert await fresh.get_gpr("team-a", "g") is not None and reads() == 2
    assert await fresh.get_gpr("team-a", "nope") is None


async def test_kube_lookup_shares_a_failed_read_and_keeps_nothing_of_it(peer: APIServerPeer,
                                                                      kube_lookup: KubeLookup) -> None:
    """An API error on the read a burst shares reaches every caller (each webhook call refuses as before) and is
    not kept: the next call reads again and gets the template once the API server answers."""
    import asyncio

    from kubeapi import ApiError

    await seed(peer)
    with peer.inject("GET", "gprtemplates", status=403, delay=0.1):
        outcomes = await asyncio.gather(*(kube_lookup.get_template("team-a", "default") for _ in range(20)),
                                        return_exceptions=True)
    assert all(isinstance(o, ApiError) and o.status == 403 for o in outcomes)
    assert peer.count("GET", "gprtemplates") == 1
    template = await kube_lookup.get_template("team-a", "default")
    assert template is not None and template["spec"]["priority"] == 20
    assert peer.count("GET", "gprtemplates") == 2


async def test_kube_lookup_errors_surface(peer: APIServerPeer, kube_lookup: KubeLookup) -> None:
    await peer.stop()  # the API server goes away
    webhook = Webhook(kube_lookup)
    http = await serve(webhook)
    try:
        response = await call(http, "/validate-gprs", review(gpr_obj({}), resource="gpuprovisioningrequests"))
        assert response["allowed"] is False and response["status"]["code"] == 503
    finally:
        await http.close()


async def test_webhook_on_the_api_server_makes_the_gpr_and_then_enforces_the_count(
        peer: APIServerPeer, kube_lookup: KubeLookup) -> None:
    await seed(peer)
    http = await serve(Webhook(kube_lookup, clock=lambda: NOW))
    try:
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "etl", "uid": "u-1"}
        p = pod(gpus=1, ownerReferences=[owner])
        out = patched(p, await call(http, "/mutate-pods", review(p)))
        assert out["metadata"]["labels"] == {"accelstack.io/gpr": "etl"} and gates(out) == ["accelstack.io/gpr"]
        stored = peer.get(GPRS, "team-a", "etl")
        assert stored is not None and stored["spec"]["priority"] == 20 and stored["spec"]["exitDuration"] == "1h"
        assert stored["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        # the namespace allows one unfinished GPR: a second is refused through the validating webhook
        response = await call(http, "/validate-gprs", review(gpr_obj({}, name="second"),
                                                             resource="gpuprovisioningrequests"))
        assert response["allowed"] is False and "most it allows is 1" in response["status"]["message"]
        # once the first completes, there is room again
        stored["status"] = {"phase": "Complete"}
        await peer.put_object(GPRS, stored, "MODIFIED")
        response = await call(http, "/validate-gprs", review(gpr_obj({}, name="second"),
                                                             resource="gpuprovisioningrequests"))
        assert response["allowed"] is True
    finally:
        await http.close()


async def test_auto_gpr_name_is_shortened_to_a_label_value(http: TestClient[Any, Any], lookup: MemoryLookup) -> None:
    lookup.namespace("team-a", **{"accelstack.io/default-template": "default"})
    lookup.template("team-a", "default", {})
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "a-very-long-deployment-name-" * 3 + "5d8f7c9b4",
             "uid": "u"}
    out = patched(pod(ownerReferences=[owner]), await call(http, "/mutate-pods", review(pod(ownerReferences=[owner]))))
    name = out["metadata"]["labels"]["accelstack.io/gpr"]
    assert len(name) <= 63 and re.fullmatch(r"a-very-long-deployment-name-a-very-long-deployment-name-[0-9a-f]{6}", name)
    assert lookup.created[0]["metadata"]["name"] == name
    assert lookup.created[0]["metadata"]["annotations"][CREATED_FOR_ANNOTATION] == f"ReplicaSet/{owner['name']}"


async def test_pod_refused_with_a_label_longer_than_a_label_value(http: TestClient[Any, Any]) -> None:
    response = await call(http, "/mutate-pods", review(pod(labels={"accelstack.io/gpr": "g" * 64})))
    assert response["allowed"] is False and "at most 63 characters" in response["status"]["message"]


async def test_a_bug_in_a_lookup_is_a_refusal_not_a_500(lookup: MemoryLookup) -> None:
    class Broken(MemoryLookup):
        async def get_namespace(self, name: str) -> dict[str, Any] | None:
            raise KeyError("bug")

    http = await serve(Webhook(Broken()))
    try:
        response = await call(http, "/validate-gprs", review(gpr_obj({}), resource="gpuprovisioningrequests"))
        assert response["allowed"] is False and response["status"]["code"] == 500
        assert "KeyError" in response["status"]["message"]
    finally:
        await http.close()


# ---- pods of an admitted GPR: straight to the reserved nodes, no gate, no API call ---------------------------
async def test_a_pod_of_an_admitted_gpr_is_narrowed_to_its_nodes_instead_of_gated(lookup: MemoryLookup) -> None:
    from scheduler_extender.objects.cluster import ClusterView

    view = ClusterView()
    view.sync_gprs([
        {"metadata": {"name": "t", "namespace": "team-a", "uid": "u-t"}, "spec": {"devicesPerNode": 2},
         "status": {"phase": "Running", "reservation": [{"node": "n2", "devices": 2}, {"node": "n1", "devices": 2}]}},
        {"metadata": {"name": "q", "namespace": "team-a", "uid": "u-q"}, "spec": {"devicesPerNode": 2},
         "status": {"phase": "Queued"}}])
    for name in ("n1", "n2"):
        view.on_node("ADDED", {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": f"host-{name}",
                                                                     "zone": "a"}},
                               "status": {"allocatable": {"nvidia.com/gpu": "4"}}})
    http = await serve(Webhook(lookup, clock=lambda: NOW, view=view))
    lookup.fail = True  # the informer view answers: the API server is not asked
    try:
        own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
        p = pod(labels={"accelstack.io/gpr": "t"}, namespace="team-a")
        p["spec"]["affinity"] = own
        response = await call(http, "/mutate-pods", review(p))
        out = patched(p, response)
        assert response["allowed"] and not out["spec"].get("schedulingGates")
        # the user's term gains the reserved nodes' hostname labels (a node field selector takes only one name)
        assert out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"] == [{"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]},
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["host-n1", "host-n2"]}]}]
        assert not affinity_errors(out["spec"])  # what the API server validates after the mutating webhooks
        bare = pod(labels={"accelstack.io/gpr": "t"}, namespace="team-a")
        out = patched(bare, await call(http, "/mutate-pods", review(bare)))
        assert out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"] == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]}
                                     for n in ("n1", "n2")]
        assert not affinity_errors(out["spec"])
        queued = pod(labels={"accelstack.io/gpr": "q"}, namespace="team-a")
        response = await call(http, "/mutate-pods", review(queued))
        assert gates(patched(queued, response)) == ["accelstack.io/gpr"]  # not admitted: held at the gate
        # a pod that can run on none of the reserved nodes: held at the gate, not narrowed to them (its GPR is
        # moved to where it can run by the controller, or says why not)
        elsewhere = pod(labels={"accelstack.io/gpr": "t"}, namespace="team-a")
        elsewhere["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "host-n9"}
        out = patched(elsewhere, await call(http, "/mutate-pods", review(elsewhere)))
        assert gates(out) == ["accelstack.io/gpr"] and "affinity" not in out["spec"]
        # one of them will do
        one = pod(labels={"accelstack.io/gpr": "t"}, namespace="team-a")
        one["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "host-n2"}
        out = patched(one, await call(http, "/mutate-pods", review(one)))
        assert not gates(out) and out["spec"]["affinity"]
        # both reserved nodes cordoned for a while: the lifecycle's taint passes, the pod is narrowed all the same
        for name in ("n1", "n2"):
            view.on_node("MODIFIED", {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": f"host-{name}",
                                                                          "zone": "a"}},
                                      "spec": {"taints": [{"key": "node.kubernetes.io/unschedulable",
                                                           "effect": "NoSchedule"}]},
                                      "status": {"allocatable": {"nvidia.com/gpu": "4"}}})
        cordoned = pod(labels={"accelstack.io/gpr": "t"}, namespace="team-a")
        out = patched(cordoned, await call(http, "/mutate-pods", review(cordoned)))
        assert not gates(out) and out["spec"]["affinity"]
        too_big = pod(labels={"accelstack.io/gpr": "t"}, namespace="team-a", gpus=4)
        response = await call(http, "/mutate-pods", review(too_big))
        assert response["allowed"] is False and "reserves 2 per node" in response["status"]["message"]
        # nodes of 8 cores, 7 of n1's and 6 of n2's requested by pods already bound there (one asks for no device):
        # a pod that asks for 3 cores fits neither (NodeResourcesFit would keep it Pending), so it is held at the
        # gate; one that asks for 2 goes straight to them
        for name in ("n1", "n2"):
            view.on_node("MODIFIED", {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": f"host-{name}"}},
                                      "status": {"allocatable": {"nvidia.com/gpu": "4", "cpu": "8",
                                                                 "memory": "64Gi"}}})
        for name, node, cores in (("web", "n1", "7"), ("etl", "n2", "6")):
            view.on_pod("ADDED", {"metadata": {"name": name, "namespace": "x", "uid": name},
                                  "spec": {"nodeName": node, "containers": [
                                      {"name": "c", "resources": {"requests": {"cpu": cores}}}]},
                                  "status": {"phase": "Running"}})
        for cores, held in (("3", True), ("2", False)):
            hungry = pod(labels={"accelstack.io/gpr": "t"}, namespace="team-a")
            hungry["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cores}
            out = patched(hungry, await call(http, "/mutate-pods", review(hungry)))
            assert (gates(out) == ["accelstack.io/gpr"]) is held and ("affinity" in out["spec"]) is not held, cores
    finally:
        await http.close()
