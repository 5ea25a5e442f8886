"""Workspace, template and binding endpoints against the API-server peer: the five verbs, the same RBAC checks
as every REST call (TokenReview + SubjectAccessReview on the Kubernetes resource), shape errors as 400 naming
the field, API-server answers passed on (404, 409)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.portal.cluster import ADMIN, BINDINGS, NOBODY, TEMPLATES, VIEWER, WORKSPACES
from tests.portal.test_rest_views import seeded

ROOT = Path(__file__).resolve().parents[2]


async def call(http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str],
               body: Any = None) -> tuple[int, Any]:
    async with http.request(method, url, headers=headers, json=body) as r:
        return r.status, await r.json()


async def test_workspace_create_get_update_list_delete() -> None:
    async with seeded() as (peer, base, http):
        url = f"{base}/api/v1/workspaces"
        spec = {"namespaces": ["team-c"], "access": [{"kind": "Group", "name": "team-c", "role": "member"}],
                "policy": {"maxGPRs": 4}}
        status, made = await call(http, "POST", url, ADMIN, {"name": "team-c", "spec": spec})
        assert status == 201 and made["kind"] == "Workspace" and made["spec"] == spec
        assert peer.get(WORKSPACES, "", "team-c") is not None
        status, got = await call(http, "GET", f"{url}/team-c", ADMIN)
        assert status == 200 and got["metadata"]["uid"] == made["metadata"]["uid"]
        status, listed = await call(http, "GET", url, ADMIN)
        assert sorted(i["metadata"]["name"] for i in listed["items"]) == ["team-a", "team-c"]
        status, updated = await call(http, "PUT", f"{url}/team-c", ADMIN,
                                     {"spec": {**spec, "policy": {"maxGPRs": 8}}})
        assert status == 200 and updated["spec"]["policy"] == {"maxGPRs": 8}
        stale = {"metadata": {"resourceVersion": made["metadata"]["resourceVersion"]}, "spec": spec}
        status, body = await call(http, "PUT", f"{url}/team-c", ADMIN, stale)
        assert status == 409 and "modified" in body["error"]
        status, body = await call(http, "POST", url, ADMIN, {"name": "team-c", "spec": spec})
        assert status == 409 and "already exists" in body["error"]
        status, _ = await call(http, "DELETE", f"{url}/team-c", ADMIN)
        assert status == 200 and peer.get(WORKSPACES, "", "team-c") is None
        status, body = await call(http, "GET", f"{url}/team-c", ADMIN)
        assert status == 404 and body["error"].endswith('"team-c" not found') and "404" not in body["error"], body
        status, body = await call(http, "PUT", f"{url}/team-c", ADMIN, {"spec": spec})
        assert status == 404 and "404" not in body["error"] and "NotFound" not in body["error"], body


async def test_templates_and_bindings_in_a_namespace() -> None:
    async with seeded() as (peer, base, http):
        url = f"{base}/api/v1/templates"
        status, _ = await call(http, "POST", url, ADMIN, {"namespace": "team-b", "name": "big", "spec": {
            "description": "a whole H100 server", "devicesPerNode": 8, "exitDuration": "8h"}})
        assert status == 201 and peer.get(TEMPLATES, "team-b", "big") is not None
        status, listed = await call(http, "GET", f"{url}?namespace=team-b", ADMIN)
        assert [i["metadata"]["name"] for i in listed["items"]] == ["big"]
        status, listed = await call(http, "GET", url, ADMIN)
        assert sorted(i["metadata"]["name"] for i in listed["items"]) == ["big", "small-gpu"]
        status, updated = await call(http, "PUT", f"{url}/team-b/big", ADMIN, {"spec": {"devicesPerNode": 4}})
        assert status == 200 and updated["spec"] == {"devicesPerNode": 4}
        status, body = await call(http, "POST", f"{base}/api/v1/templatebindings", ADMIN, {
            "metadata": {"namespace": "team-b", "name": "big-jobs", "labels": {"owner": "ops"}},
            "spec": {"template": "big", "namespaces": ["team-b"],
                     "workloadSelector": {"matchLabels": {"size": "big"}}, "weight": 5}})
        assert status == 201 and body["metadata"]["labels"] == {"owner": "ops"}
        assert peer.get(BINDINGS, "team-b", "big-jobs")["spec"]["weight"] == 5  # type: ignore[index]
        status, _ = await call(http, "DELETE", f"{base}/api/v1/templatebindings/team-b/big-jobs", ADMIN)
        assert status == 200 and peer.get(BINDINGS, "team-b", "big-jobs") is None
        status, _ = await call(http, "DELETE", f"{url}/team-b/big", ADMIN)
        assert status == 200


@pytest.mark.parametrize(("path", "body", "message"), [
    ("workspaces", {"spec": {}}, "name: required string"),
    ("workspaces", {"name": "Team_A", "spec": {}}, "'Team_A' is not a valid name"),
    ("workspaces", {"name": "w", "spec": {"namespaces": "team-a"}}, "spec.namespaces: must be a list"),
    ("workspaces", {"name": "w", "spec": {"access": [{"kind": "Robot", "name": "r", "role": "admin"}]}},
     "spec.access[0].kind: must be one of User, Group, ServiceAccount"),
    ("workspaces", {"name": "w", "spec": {"access": [{"kind": "User", "name": "a", "role": "owner"}]}},
     "spec.access[0].role: must be one of admin, member, viewer"),
    ("workspaces", {"name": "w", "spec": {"access": [{"kind": "ServiceAccount", "name": "a", "role": "admin"}]}},
     "spec.access[0].namespace (a ServiceAccount's namespace): required string"),
    ("workspaces", {"name": "w", "spec": {"policy": {"maxGPRs": 0}}}, "spec.policy.maxGPRs: want a whole number"),
    ("workspaces", {"name": "w", "spec": {"policy": {"maxExitDuration": "forever"}}},
     "spec.policy.maxExitDuration: 'forever' is not a duration"),
    ("workspaces", {"name": "w", "spec": {"defaultTemplate": {"name": "t"}}},
     "spec.defaultTemplate.namespace: required string"),
    ("templates", {"name": "t", "spec": {}}, "namespace: required string"),
    ("templates", {"name": "t", "namespace": "team-a", "spec": {"devicesPerNode": 0}}, "devicesPerNode"),
    ("templatebindings", {"name": "b", "namespace": "team-a", "spec": {}}, "spec.template: required string"),
    ("templatebindings", {"name": "b", "namespace": "team-a", "spec": {"template": "t", "weight": "high"}},
     "spec.weight: must be an integer"),
    ("templates", [1], "body must be a JSON object"),
])
async def test_bad_bodies_are_400_naming_the_field(path: str, body: Any, message: str) -> None:
    async with seeded() as (peer, base, http):
        before = len(peer.objects)
        status, answer = await call(http, "POST", f"{base}/api/v1/{path}", ADMIN, body)
        assert status == 400 and message in answer["error"], answer
        assert len(peer.objects) == before


async def test_every_verb_is_authorised_like_the_kubernetes_resource() -> None:
    async with seeded() as (peer, base, http):
        peer.grants.add(("bob", "list", "accelstack.io", "gprtemplates", "team-b"))
        cases: list[tuple[str, str, Any, str]] = [("GET", "workspaces", None, "bob may not list workspaces"),
                 ("POST", "workspaces", {"name": "x", "spec": {}}, "bob may not create workspaces"),
                 ("GET", "workspaces/team-a", None, "bob may not get workspaces"),
                 ("PUT", "workspaces/team-a", {"spec": {}}, "bob may not update workspaces"),
                 ("DELETE", "workspaces/team-a", None, "bob may not delete workspaces"),
                 ("GET", "templates", None, "bob may not list gprtemplates"),
                 ("GET", "templates?namespace=team-a", None, "list gprtemplates in namespace team-a"),
                 ("DELETE", "templates/team-a/small-gpu", None, "delete gprtemplates in namespace team-a"),
                 ("GET", "templatebindings/team-a/notebooks", None, "get gprtemplatebindings in namespace team-a"),
                 ("POST", "templatebindings", {"name": "b", "namespace": "team-b", "spec": {"template": "t"}},
                  "create gprtemplatebindings in namespace team-b")]
        for method, path, body, message in cases:
            status, answer = await call(http, method, f"{base}/api/v1/{path}", VIEWER, body)
            assert status == 403 and message in answer["error"], (method, path, answer)
        status, answer = await call(http, "GET", f"{base}/api/v1/templates?namespace=team-b", VIEWER)
        assert status == 200 and answer["items"] == []
        status, answer = await call(http, "POST", f"{base}/api/v1/workspaces", {}, {"name": "x", "spec": {}})
        assert status == 401
        status, answer = await call(http, "DELETE", f"{base}/api/v1/workspaces/team-a", NOBODY)
        assert status == 403 and peer.get(WORKSPACES, "", "team-a") is not None


async def test_every_call_the_rest_api_makes_is_allowed_by_the_shipped_rbac() -> None:
    from tests.inference.test_inference_manifests import allowed, request_verb

    docs = list(yaml.safe_load_all((ROOT / "manifests" / "extender" / "rbac.yaml").read_text()))
    rules = [rule for d in docs if d["kind"] == "ClusterRole" for rule in d["rules"]]
    async with seeded() as (peer, base, http):
        for kind, body, one in (
                ("workspaces", {"name": "w", "spec": {}}, "w"),
                ("templates", {"name": "t", "namespace": "team-a", "spec": {"devicesPerNode": 1}}, "team-a/t"),
                ("templatebindings", {"name": "b", "namespace": "team-a", "spec": {"template": "t"}}, "team-a/b")):
            assert (await call(http, "POST", f"{base}/api/v1/{kind}", ADMIN, body))[0] == 201
            assert (await call(http, "GET", f"{base}/api/v1/{kind}", ADMIN))[0] == 200
            assert (await call(http, "PUT", f"{base}/api/v1/{kind}/{one}", ADMIN, body))[0] == 200
            assert (await call(http, "DELETE", f"{base}/api/v1/{kind}/{one}", ADMIN))[0] == 200
        for path in ("queue?workspace=team-a", "gprs/team-a/finetune/events", "inventory?summary=1", "health"):
            assert (await call(http, "GET", f"{base}/api/v1/{path}", ADMIN))[0] == 200
        seen = set()
        for method, path in peer.requests:
            group, resource, verb = request_verb(method, path)
            if resource in ("tokenreviews", "subjectaccessreviews"):
                continue  # system:auth-delegator, bound in the same file
            assert allowed(rules, group, resource, verb), f"{method} {path}: {verb} {group or 'core'}/{resource}"
            seen.add((resource, verb))
        assert {("workspaces", "update"), ("gprtemplatebindings", "delete"), ("events", "list"),
                ("namespaces", "list")} <= seen


async def test_a_member_reads_its_own_workspaces_and_whoami_says_where_it_may_create() -> None:
    """Issue 35.5: Workspaces are cluster-scoped and member roles namespaced, so a member's ``get workspaces``
    is denied by RBAC; the REST API answers it for workspaces in whose namespaces it may list GPRs."""
    async with seeded() as (peer, base, http):
        peer.tokens["dave-token"] = {"username": "dave", "groups": ["team-a"]}
        for verb in ("list", "get", "create"):
            peer.grants.add(("dave", verb, "accelstack.io", "gpuprovisioningrequests", "team-a-dev"))
        dave = {"Authorization": "Bearer dave-token"}
        status, got = await call(http, "GET", f"{base}/api/v1/workspaces/team-a", dave)
        assert status == 200 and got["status"]["usage"][0]["max"] == 16
        status, listed = await call(http, "GET", f"{base}/api/v1/workspaces", dave)
        assert status == 200 and [i["metadata"]["name"] for i in listed["items"]] == ["team-a"]
        status, queue = await call(http, "GET", f"{base}/api/v1/queue?workspace=team-a", dave)
        assert status == 403  # team-a itself is not readable to dave: the queue stays RBAC's answer
        status, queue = await call(http, "GET", f"{base}/api/v1/queue?namespace=team-a-dev", dave)
        assert status == 200 and [r["name"] for r in queue["items"]] == ["exp"]
        status, me = await call(http, "GET", f"{base}/api/v1/whoami", dave)
        assert me["allowed"]["workspaces"] and me["allowed"]["createGPR"] and me["createGPRIn"] == ["team-a-dev"]
        assert me["workspaces"] == [{"name": "team-a", "namespaces": ["team-a", "team-a-dev"]}]
        # not a member: the same 403 whether the workspace exists or not, and for the list
        for path in ("workspaces/team-a", "workspaces/nope", "workspaces"):
            status, answer = await call(http, "GET", f"{base}/api/v1/{path}", VIEWER)
            assert status == 403 and "bob may not" in answer["error"]
        status, me = await call(http, "GET", f"{base}/api/v1/whoami", VIEWER)
        assert not me["allowed"]["workspaces"] and not me["allowed"]["createGPR"] and me["createGPRIn"] == []
        # writes stay RBAC's alone
        status, _ = await call(http, "DELETE", f"{base}/api/v1/workspaces/team-a", dave)
        assert status == 403 and peer.get(WORKSPACES, "", "team-a") is not None
