"""Workspace kubeconfigs (scheduler_extender/multicluster/kubeconfig.py, api/kubeconfig.py): the pure parts (who
gets which role, the expiry's bounds, the accounts a member copy gets, the agent's refusals, the kubeconfig), then
the hub's issuer and the agent's minter against fake API servers (the token reaches the caller only: not the
request ConfigMap, not a log; both objects deleted after; refusals and a silent agent one line each), then the
REST route: the token reviewed before anything, one-line errors, no-store."""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import yaml

from kubeapi import AlreadyExists, NotFound, Resource
from kubeapi.metrics import api_metrics
from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.kubeconfig import KubeconfigAPI
from scheduler_extender.multicluster.kubeconfig import (
    REQUEST_LABEL,
    KubeconfigError,
    KubeconfigIssuer,
    KubeconfigMinter,
    Request,
    account_name,
    kubeconfig_text,
    member_check,
    parse_expiry,
    parse_request,
    refusal_status,
    request_object,
    role_for,
    with_accounts,
)
from service.http_listener import serve_app

TOKEN = "eyJ.member-token-must-not-leak.sig"
WS: dict[str, Any] = {"metadata": {"name": "team", "uid": "ws-uid"},
      "spec": {"clusters": ["member-a"], "namespaces": ["team-a", "team-b"],
               "access": [{"kind": "User", "name": "alice", "role": "admin"},
                          {"kind": "Group", "name": "ml", "role": "member"},
                          {"kind": "User", "name": "carol", "role": "viewer"},
                          {"kind": "ServiceAccount", "name": "ci", "role": "viewer"}]}}


# ---- pure parts -------------------------------------------------------------------------------------------------
def test_expiry_is_10_minutes_to_24_hours_default_1_hour() -> None:
    assert parse_expiry("") == 3600 and parse_expiry("10m") == 600 and parse_expiry("24h") == 86400
    assert parse_expiry("900") == 900 and parse_expiry("1200s") == 1200
    for bad, why in (("5m", "between 10m and 24h"), ("25h", "between 10m and 24h"), ("1d", "a duration like"),
                     ("-1h", "a duration like"), ("1h30m", "a duration like")):
        with pytest.raises(ValueError, match=why):
            parse_expiry(bad)


def test_the_highest_role_the_access_rules_give_decides_and_others_get_none() -> None:
    assert role_for(WS, "alice", ["ml"]) == "admin"  # admin beats the group's member
    assert role_for(WS, "dave", ["ml", "other"]) == "member"
    assert role_for(WS, "carol", []) == "viewer"
    assert role_for(WS, "system:serviceaccount:team-b:ci", []) == "viewer"  # a rule without namespace: any of them
    assert role_for(WS, "system:serviceaccount:other:ci", []) is None
    assert role_for(WS, "bob", ["devs"]) is None
    assert role_for({"spec": {}}, "alice", []) is None


def test_a_member_copy_gets_one_account_per_role_used_in_the_first_namespace() -> None:
    spec = with_accounts(WS["spec"])
    added = spec["access"][len(WS["spec"]["access"]):]
    assert added == [{"kind": "ServiceAccount", "name": f"accelstack-workspace-{r}", "namespace": "team-a", "role": r}
                     for r in ("admin", "member", "viewer")]
    assert with_accounts(spec) == spec  # given twice: nothing added again
    only_viewer = {"namespaces": ["x"], "access": [{"kind": "User", "name": "u", "role": "viewer"}]}
    assert [a["name"] for a in with_accounts(only_viewer)["access"]] == ["u", "accelstack-workspace-viewer"]
    assert with_accounts({"access": WS["spec"]["access"]}) == {"access": WS["spec"]["access"]}  # no namespace
    assert WS["spec"]["access"][-1]["name"] == "ci"  # the input is not changed


def member_ws(ready: bool = True, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": "team", "labels": {"accelstack.io/from-hub": "true", **labels}},
            "spec": with_accounts({k: v for k, v in WS["spec"].items() if k != "clusters"}),
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "message": "namespace team-a: creating"}],
                       "namespaces": [{"name": "team-a", "ready": ready}]}}


def test_the_agent_refuses_in_one_line_what_its_member_cannot_serve() -> None:
    req = Request("kubeconfig-1", "uid-1", "team", "member", "team-a", 3600, "alice")
    assert member_check(member_ws(), req) == ""
    assert member_check(None, req).startswith("NotFound: this member has no workspace team")
    theirs = member_ws()
    theirs["metadata"]["labels"] = {}
    assert member_check(theirs, req).startswith("NotFound: workspace team on this member was not sent by the hub")
    assert member_check(member_ws(), Request("k", "u", "team", "member", "team-b", 600, "a")).startswith("NotFound")
    assert member_check(member_ws(ready=False), req) == \
        "NotReady: workspace team is not Ready on this member: namespace team-a: creating"
    old = member_ws()
    old["spec"]["access"] = WS["spec"]["access"]  # a copy made before the accounts: not yet
    assert "no member ServiceAccount" in member_check(old, req)
    assert refusal_status("NotFound: x") == 404 and refusal_status("NotReady: x") == 409
    assert refusal_status("Refused: x") == 409
    bad = request_object("member-a", "team", "owner", "team-a", 3600, "alice", "kubeconfig-2")
    assert parse_request(bad) == "Refused: role 'owner' is not admin, member or viewer"
    short = request_object("member-a", "team", "member", "team-a", 60, "alice", "kubeconfig-3")
    assert parse_request(short) == "Refused: expiry: between 10m and 24h, got '60'"


def test_the_kubeconfig_names_the_member_its_ca_the_token_and_the_first_namespace() -> None:
    text = kubeconfig_text("member-a", "team", "https://a:6443", "Q0E=", TOKEN, "team-a", account_name("member"))
    config = yaml.safe_load(text)
    context = config["contexts"][0]["context"]
    assert config["current-context"] == config["contexts"][0]["name"] == "team@member-a"
    assert config["clusters"][0]["cluster"] == {"server": "https://a:6443", "certificate-authority-data": "Q0E="}
    assert context == {"cluster": "member-a", "user": "team-accelstack-workspace-member@member-a",
                       "namespace": "team-a"}
    assert config["users"][0]["user"] == {"token": TOKEN}


# ---- the issuer and the minter, against fake API servers --------------------------------------------------------
class Fake:
    """Objects by (plural, namespace, name); TokenRequests recorded and answered with :data:`TOKEN`."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, ...]] = []
        self.tokens: list[tuple[str, str, int]] = []
        self.metrics = api_metrics()
        self.n = 0

    def put(self, plural: str, obj: dict[str, Any], namespace: str = "") -> dict[str, Any]:
        self.n += 1
        obj = copy.deepcopy(obj)
        obj["metadata"] = {**obj["metadata"], "namespace": namespace, "uid": obj["metadata"].get("uid") or
                           f"uid-{self.n}", "creationTimestamp": obj["metadata"].get("creationTimestamp") or
                           "2026-12-04T02:00:00Z"}
        self.objects[(plural, namespace, obj["metadata"]["name"])] = obj
        return copy.deepcopy(obj)

    async def create(self, res: Resource, body: dict[str, Any], namespace: str | None = None,
                     subresource: str | None = None, name: str | None = None) -> Any:
        if subresource == "token":
            self.calls.append(("token", namespace or "", name or ""))
            if (res.plural, namespace or "", name) not in self.objects:
                raise NotFound(404, "NotFound", f"serviceaccounts {name!r} not found")
            self.tokens.append((namespace or "", name or "", body["spec"]["expirationSeconds"]))
            return {"status": {"token": TOKEN}}
        key = (res.plural, namespace or "", body["metadata"]["name"])
        self.calls.append(("create", *key))
        if key in self.objects:
            raise AlreadyExists(409, "AlreadyExists", "exists")
        return self.put(res.plural, body, namespace or "")

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> Any:
        obj = self.objects.get((res.plural, namespace or "", name))
        if obj is None:
            raise NotFound(404, "NotFound", name)
        return copy.deepcopy(obj)

    async def list(self, res: Resource, namespace: str | None = None, *, label_selector: str = "") -> Any:
        return [copy.deepcopy(o) for (p, ns, _), o in self.objects.items() if p == res.plural and ns == namespace
                and label_selector in (o["metadata"].get("labels") or {})], "1"

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None) -> Any:
        obj = self.objects[(res.plural, namespace or "", name)]
        obj.setdefault("data", {}).update(body["data"])
        self.calls.append(("patch", res.plural, namespace or "", name))
        return copy.deepcopy(obj)

    async def delete(self, res: Resource, name: str, namespace: str | None = None) -> Any:
        self.calls.append(("delete", res.plural, namespace or "", name))
        if self.objects.pop((res.plural, namespace or "", name), None) is None:
            raise NotFound(404, "NotFound", name)
        return {}


HUB_NS = "accelstack-member-member-a"
CLUSTER_A = {"metadata": {"name": "member-a"},
             "spec": {"labels": {}, "apiServer": {"url": "https://member-a:6443", "caBundle": "Q0E="}},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def world(agent: bool = True, ready: bool = True) -> tuple[Fake, Fake, KubeconfigIssuer, KubeconfigMinter,
                                                           dict[str, Any]]:
    hub, member = Fake(), Fake()
    hub.put("workspaces", WS)
    member.put("workspaces", member_ws(ready))
    member.put("serviceaccounts", {"metadata": {"name": "accelstack-workspace-member"}}, "team-a")
    clusters: dict[str, Any] = {"member-a": CLUSTER_A, "member-b": {**CLUSTER_A, "metadata": {"name": "member-b"}}}
    issuer = KubeconfigIssuer(hub, lambda: clusters, wait=5.0 if agent else 0.05, poll=0.005)  # type: ignore[arg-type]
    minter = KubeconfigMinter(member, hub, HUB_NS)  # type: ignore[arg-type]
    return hub, member, issuer, minter, clusters


async def with_agent(hub: Fake, minter: KubeconfigMinter, call: Any) -> Any:
    """``call`` while the agent answers each request ConfigMap as it appears (its informer, by hand)."""
    async def agent() -> None:
        while True:
            for (plural, ns, _), cm in list(hub.objects.items()):
                if plural == "configmaps" and ns == HUB_NS:
                    minter._on_request("ADDED", copy.deepcopy(cm))
            await minter.pass_once()
            await asyncio.sleep(0.002)

    task = asyncio.create_task(agent())
    try:
        return await call
    finally:
        task.cancel()


async def test_a_listed_user_gets_the_members_token_of_its_role_and_nothing_is_left(
        caplog: pytest.LogCaptureFixture) -> None:
    hub, member, issuer, minter, _ = world()
    caplog.set_level(logging.DEBUG)
    answer = await with_agent(hub, minter, issuer.issue("team", "member-a", "dave", ["ml"], 1800))
    assert {k: v for k, v in answer.items() if k != "kubeconfig"} == {
        "workspace": "team", "cluster": "member-a", "namespace": "team-a", "role": "member",
        "serviceAccount": "accelstack-workspace-member", "expirySeconds": 1800}
    config = yaml.safe_load(answer["kubeconfig"])
    assert config["users"][0]["user"]["token"] == TOKEN
    assert config["clusters"][0]["cluster"]["server"] == "https://member-a:6443"
    # the member made it, for the role's account in the first namespace, with the expiry asked
    assert member.tokens == [("team-a", "accelstack-workspace-member", 1800)]
    # the request carried no token, the agent's answer was a Secret, and both are gone
    made = [c for c in hub.calls if c[0] == "create"]
    assert [c[1] for c in made] == ["configmaps", "secrets"]
    assert not [k for k in hub.objects if k[0] in ("configmaps", "secrets")]
    assert TOKEN not in caplog.text and base64.b64encode(TOKEN.encode()).decode() not in caplog.text
    assert "workspace kubeconfig token made" in caplog.text and "workspace kubeconfig issued" in caplog.text


async def test_refusals_are_one_line_each_and_ask_nothing_of_the_member_first() -> None:
    hub, member, issuer, minter, clusters = world()

    async def refused(*args: Any) -> tuple[int, str]:
        with pytest.raises(KubeconfigError) as info:
            await with_agent(hub, minter, issuer.issue(*args))
        return info.value.status, info.value.message

    assert await refused("team", "member-a", "bob", ["devs"], 3600) == \
        (403, "bob is not in the access rules of workspace team")
    assert await refused("nope", "member-a", "alice", [], 3600) == \
        (403, "alice is not in the access rules of workspace nope")  # a name not confirmed to outsiders
    assert await refused("team", "member-b", "alice", [], 3600) == (404, "workspace team is not on cluster member-b")
    hub.objects[("workspaces", "", "team")]["spec"]["clusters"] = ["member-a", "member-c"]
    assert await refused("team", "member-c", "alice", [], 3600) == \
        (404, "no member cluster 'member-c' has joined the hub")
    clusters["member-a"] = {**CLUSTER_A, "spec": {"labels": {}}}
    assert await refused("team", "member-a", "alice", [], 3600) == \
        (409, "cluster member-a has no spec.apiServer (run cluster join again)")
    clusters["member-a"] = {**CLUSTER_A, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert (await refused("team", "member-a", "alice", [], 3600))[0] == 409
    assert not [c for c in hub.calls if c[0] == "create"] and member.tokens == []
    # the agent's refusals: the member has no admin account (alice is admin) -> 404; not Ready there -> 409
    clusters["member-a"] = CLUSTER_A
    status, message = await refused("team", "member-a", "alice", [], 3600)
    assert status == 404 and message == "cluster member-a: NotFound: no ServiceAccount accelstack-workspace-admin " \
                                        "in team-a on this member yet"
    member.objects[("workspaces", "", "team")] = member_ws(ready=False)
    status, message = await refused("team", "member-a", "dave", ["ml"], 3600)
    assert status == 409 and message.startswith("cluster member-a: NotReady: workspace team is not Ready")
    assert member.tokens == [] and not [k for k in hub.objects if k[0] in ("configmaps", "secrets")]


async def test_a_silent_agent_is_a_504_and_its_request_is_deleted() -> None:
    hub, _, issuer, _, _ = world(agent=False)
    with pytest.raises(KubeconfigError) as info:
        await issuer.issue("team", "member-a", "dave", ["ml"], 3600)
    assert (info.value.status, info.value.message) == (504, "cluster member-a's agent did not answer within 0.05s")
    assert not [k for k in hub.objects if k[0] == "configmaps"]


async def test_stale_requests_and_their_secrets_are_swept_by_the_next_request() -> None:
    hub, _, issuer, _, _ = world()
    old = request_object("member-a", "team", "member", "team-a", 3600, "dave", "kubeconfig-old")
    old["metadata"]["creationTimestamp"] = "2026-12-04T01:00:00Z"
    hub.put("configmaps", old, HUB_NS)
    hub.put("secrets", {"metadata": {"name": "kubeconfig-old", "labels": {REQUEST_LABEL: "true"}}}, HUB_NS)
    fresh = request_object("member-a", "team", "member", "team-a", 3600, "dave", "kubeconfig-new")
    fresh["metadata"]["creationTimestamp"] = "2026-12-04T01:59:30Z"
    hub.put("configmaps", fresh, HUB_NS)
    issuer.clock = lambda: 1796349600.0  # 2026-12-04T02:00:00Z
    assert await issuer.sweep(HUB_NS) == 1
    assert sorted(k[2] for k in hub.objects if k[0] in ("configmaps", "secrets")) == ["kubeconfig-new"]


async def test_the_agent_mints_nothing_for_a_request_the_hub_already_gave_up() -> None:
    hub, member, _, minter, _ = world()
    cm = hub.put("configmaps", request_object("member-a", "team", "member", "team-a", 3600, "dave", "kubeconfig-x"),
                 HUB_NS)
    minter._on_request("ADDED", cm)
    del hub.objects[("configmaps", HUB_NS, "kubeconfig-x")]  # deleted; the agent's informer has not seen it yet
    await minter.pass_once()
    assert member.tokens == [] and not [k for k in hub.objects if k[0] == "secrets"]
    again = hub.put("configmaps", {**cm, "metadata": {**cm["metadata"], "uid": "another"}}, HUB_NS)  # same name
    assert again["metadata"]["uid"] != cm["metadata"]["uid"]
    minter.done.clear()
    await minter.pass_once()  # the informer's copy is the old one: its UID is not the one on the hub
    assert member.tokens == []


# ---- the REST route ---------------------------------------------------------------------------------------------
class Kube:
    async def token_review(self, token: str) -> dict[str, Any]:
        users = {"dave-token": {"username": "dave", "groups": ["ml"]}, "bob-token": {"username": "bob"}}
        return {"authenticated": True, "user": users[token]} if token in users else {"authenticated": False}


class Issuer:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def issue(self, workspace: str, cluster: str, user: str, groups: list[str], expiry: int) -> Any:
        self.calls.append((workspace, cluster, user, groups, expiry))
        if user == "bob":
            raise KubeconfigError(403, "bob is not in the access rules of workspace team")
        return {"kubeconfig": "apiVersion: v1\n", "workspace": workspace}


@asynccontextmanager
async def api() -> AsyncIterator[tuple[str, Issuer]]:
    issuer = Issuer()
    app = aiohttp.web.Application()
    app.add_routes(KubeconfigAPI(issuer, Authorizer(Kube()), parse_expiry,  # type: ignore[arg-type]
                                 KubeconfigError).routes())
    runner, port = await serve_app(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}/api/v1/workspaces", issuer
    finally:
        await runner.cleanup()


async def post(http: aiohttp.ClientSession, url: str, token: str = "") -> tuple[int, Any, str]:
    async with http.post(url, headers={"Authorization": f"Bearer {token}"} if token else {}) as r:
        return r.status, await r.json(), r.headers.get("Cache-Control", "")


async def test_the_route_reviews_the_token_first_and_answers_one_line() -> None:
    async with api() as (base, issuer), aiohttp.ClientSession() as http:
        assert (await post(http, f"{base}/team/kubeconfig?cluster=member-a"))[0] == 401
        assert (await post(http, f"{base}/team/kubeconfig?cluster=member-a", "forged"))[0] == 401
        assert issuer.calls == []
        status, body, _ = await post(http, f"{base}/team/kubeconfig", "dave-token")
        assert (status, body) == (400, {"error": "cluster: required (the member cluster the kubeconfig is for)"})
        status, body, _ = await post(http, f"{base}/team/kubeconfig?cluster=member-a&expiry=48h", "dave-token")
        assert (status, body) == (400, {"error": "expiry: between 10m and 24h, got '48h'"})
        status, body, _ = await post(http, f"{base}/team/kubeconfig?cluster=member-a", "bob-token")
        assert (status, body) == (403, {"error": "bob is not in the access rules of workspace team"})
        status, body, cache = await post(http, f"{base}/team/kubeconfig?cluster=member-a&expiry=2h", "dave-token")
        assert status == 200 and body["kubeconfig"] == "apiVersion: v1\n" and cache == "no-store"
        assert issuer.calls[-1] == ("team", "member-a", "dave", ["ml"], 7200)
