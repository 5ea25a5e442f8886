"""Workspaces across clusters (scheduler_extender/multicluster/workspaces.py): the carrier and the member's copy as
pure functions, then the hub's dispatcher and the agent's follower against a fake API server: carriers for the
listed members only, removed with the member or the workspace, status.clusters from the agents' answers, no write
over an unchanged world; the agent creates, updates and deletes only its own copies, reports a name it did not
make, and deletes nothing while its view of the hub is not fresh."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from kubeapi import AlreadyExists, NotFound, Resource
from kubeapi.metrics import api_metrics
from scheduler_extender.multicluster.workspaces import (
    WORKSPACE_DISPATCH,
    WorkspaceDispatcher,
    WorkspaceFollower,
    carrier_object,
    carrier_status,
    clusters_of,
    hub_clusters_status,
    label_value,
    made_by_agent,
    member_shares,
    member_verdict,
    member_workspace,
)
from scheduler_extender.objects.selectors import selector_matches
from scheduler_extender.objects.workspaces import parse_policy

SPEC: dict[str, Any] = {"namespaces": ["team-a"], "access": [{"kind": "User", "name": "alice", "role": "admin"}]}
# the member's copy: the kubeconfig ServiceAccount of the role used added (multicluster/kubeconfig.py)
MEMBER_SPEC = {**SPEC, "access": [*SPEC["access"], {"kind": "ServiceAccount", "name": "accelstack-workspace-admin",
                                                    "namespace": "team-a", "role": "admin"}]}


def workspace(name: str = "team", clusters: list[str] | None = None, uid: str = "ws-uid") -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": name, "uid": uid},
            "spec": {**SPEC, "clusters": clusters or []}}


class FakeApi:
    """Objects by (plural, namespace, name); merge patches of data and status; DELETE with a UID precondition."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str, str]] = []
        self.metrics = api_metrics()
        self.n = 0

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{self.n}")
        obj["metadata"]["resourceVersion"] = str(self.n)
        self.objects[(plural, str(obj["metadata"].get("namespace") or ""), obj["metadata"]["name"])] = obj
        return copy.deepcopy(obj)

    async def create(self, res: Resource, body: dict[str, Any], namespace: str | None = None) -> Any:
        key = (res.plural, namespace or "", body["metadata"]["name"])
        self.calls.append(("create", *key))
        if key in self.objects:
            raise AlreadyExists(409, "AlreadyExists", "exists")
        return self.put(res.plural, {**body, "metadata": {**body["metadata"], "namespace": namespace or ""}})

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> Any:
        obj = self.objects.get((res.plural, namespace or "", name))
        if obj is None:
            raise NotFound(404, "NotFound", name)
        return copy.deepcopy(obj)

    async def replace(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None) -> Any:
        self.calls.append(("replace", res.plural, namespace or "", name))
        return self.put(res.plural, body)

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    subresource: str | None = None) -> Any:
        key = (res.plural, namespace or "", name)
        self.calls.append(("patch", *key))
        obj = self.objects.get(key)
        if obj is None:
            raise NotFound(404, "NotFound", name)
        for part, value in body.items():
            obj.setdefault(part, {}).update(value)
        return self.put(res.plural, obj)

    async def delete(self, res: Resource, name: str, namespace: str | None = None, *, uid: str | None = None) -> Any:
        key = (res.plural, namespace or "", name)
        self.calls.append(("delete", *key))
        if key not in self.objects:
            raise NotFound(404, "NotFound", name)
        assert uid == self.objects[key]["metadata"]["uid"]
        return self.objects.pop(key)

    def of(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (p, ns, _), o in sorted(self.objects.items())
                if p == plural and (namespace is None or ns == namespace)]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- pure parts -------------------------------------------------------------------------------------------------
def test_a_member_gets_the_spec_without_clusters_and_its_origin() -> None:
    carrier = carrier_object(workspace(clusters=["member-a", "member-b"]), "member-a")
    assert carrier["metadata"]["namespace"] == "accelstack-member-member-a"
    assert carrier["metadata"]["labels"][WORKSPACE_DISPATCH] == "team"
    copy_ = member_workspace(carrier)
    assert copy_ is not None and copy_["spec"] == MEMBER_SPEC  # clusters is the hub's
    assert copy_["metadata"]["annotations"]["accelstack.io/origin"] == "hub/team/ws-uid"
    assert made_by_agent(copy_) and not made_by_agent({"metadata": {"name": "team"}})
    assert member_workspace({"metadata": {"name": "x"}, "data": {"spec": "not json"}}) is None
    long = "w" * 200
    assert len(label_value(long)) <= 63 and label_value(long) != label_value("w" * 199)


def test_status_rows_per_listed_member() -> None:
    ws = workspace(clusters=["member-a", "member-b", "gone"])
    answered = {**carrier_object(ws, "member-a")}
    answered["data"] = {**answered["data"], "status": json.dumps(member_verdict({
        "namespaces": [{"name": "team-a", "ready": True}],
        "usage": [{"resource": "nvidia.com/gpu", "max": 8, "inUse": 2}],
        "conditions": [{"type": "Ready", "status": "True", "message": "1 namespace"}]}))}
    rows = hub_clusters_status(ws, {"member-a": answered, "member-b": carrier_object(ws, "member-b")},
                               lambda c: c != "gone")
    assert rows == [
        {"name": "member-a", "ready": True, "namespaces": ["team-a"],
         "usage": [{"resource": "nvidia.com/gpu", "max": 8, "inUse": 2}], "message": "1 namespace"},
        {"name": "member-b", "ready": False, "namespaces": [], "usage": [],
         "message": "the member's agent has not answered yet"},
        {"name": "gone", "ready": False, "namespaces": [], "usage": [],
         "message": "ClusterNotFound: no member cluster 'gone' has joined the hub"}]


# ---- the hub ----------------------------------------------------------------------------------------------------
def test_the_hub_carries_to_listed_members_only_and_removes_what_is_no_longer_listed() -> None:
    api = FakeApi()
    ws = api.put("workspaces", workspace(clusters=["member-a", "member-b"]))
    other = api.put("workspaces", workspace("solo"))  # no clusters: nothing carried, no status written
    hub = WorkspaceDispatcher(api, lambda: {"member-a": {}, "member-b": {}})  # type: ignore[arg-type]
    hub._sync_workspaces([ws, other])
    run(hub.pass_once())
    assert [(c[0], c[2]) for c in api.calls if c[1] == "configmaps"] == [
        ("create", "accelstack-member-member-a"), ("create", "accelstack-member-member-b")]
    rows = api.objects[("workspaces", "", "team")]["status"]["clusters"]
    assert [r["name"] for r in rows] == ["member-a", "member-b"] and not any(r["ready"] for r in rows)
    assert "status" not in api.objects[("workspaces", "", "solo")]
    # an unchanged world writes nothing
    hub._sync_workspaces(api.of("workspaces"))
    hub._sync_carriers(api.of("configmaps"))
    api.calls.clear()
    run(hub.pass_once())
    assert api.calls == []
    # member-b dropped: its carrier goes, member-a's stays; the status has one row
    ws = api.objects[("workspaces", "", "team")]
    ws["spec"]["clusters"] = ["member-a"]
    hub._on_workspace("MODIFIED", copy.deepcopy(ws))
    run(hub.pass_once())
    assert [o["metadata"]["namespace"] for o in api.of("configmaps")] == ["accelstack-member-member-a"]
    assert [r["name"] for r in api.objects[("workspaces", "", "team")]["status"]["clusters"]] == ["member-a"]
    # the workspace deleted: every carrier goes
    hub._on_workspace("DELETED", ws)
    run(hub.pass_once())
    assert api.of("configmaps") == []


# ---- the member's agent -----------------------------------------------------------------------------------------
def follower(hub: FakeApi, member: FakeApi) -> WorkspaceFollower:
    f = WorkspaceFollower(member, hub, "accelstack-member-member-a")  # type: ignore[arg-type]
    f.hub_informer.synced.set()
    f.hub_informer.healthy = True
    return f


def test_the_agent_creates_updates_answers_and_deletes_only_its_own_copy() -> None:
    hub, member = FakeApi(), FakeApi()
    carrier = hub.put("configmaps", carrier_object(workspace(clusters=["member-a"]), "member-a"))
    f = follower(hub, member)
    f._sync_carriers([carrier])
    f._sync_mine([])
    run(f.pass_once())
    made = member.objects[("workspaces", "", "team")]
    assert made["spec"] == MEMBER_SPEC and made_by_agent(made)
    answer = carrier_status(hub.objects[("configmaps", "accelstack-member-member-a", "team")])
    assert answer is not None and answer["ready"] is False
    # the member's controller made the namespace: the verdict goes back
    made["status"] = {"namespaces": [{"name": "team-a", "ready": True}],
                      "conditions": [{"type": "Ready", "status": "True", "message": "ok"}]}
    f._sync_mine(member.of("workspaces"))
    f._sync_carriers(hub.of("configmaps"))
    run(f.pass_once())
    answer = carrier_status(hub.objects[("configmaps", "accelstack-member-member-a", "team")])
    assert answer == {"ready": True, "namespaces": ["team-a"], "usage": [], "message": "ok"}
    # a changed spec on the hub reaches the member's copy
    spec = {**SPEC, "namespaces": ["team-a", "team-b"]}
    hub.objects[("configmaps", "accelstack-member-member-a", "team")]["data"]["spec"] = json.dumps(spec)
    f._sync_carriers(hub.of("configmaps"))
    run(f.pass_once())
    assert member.objects[("workspaces", "", "team")]["spec"] == {**spec, "access": MEMBER_SPEC["access"]}
    # the hub's view is not fresh: nothing deleted; once it is, the copy goes (and a foreign Workspace stays)
    member.put("workspaces", {"metadata": {"name": "theirs"}, "spec": SPEC})
    f._sync_mine(member.of("workspaces"))
    f._sync_carriers([])
    f.hub_informer.healthy = False
    run(f.pass_once())
    assert ("workspaces", "", "team") in member.objects
    f.hub_informer.healthy = True
    run(f.pass_once())
    assert [o["metadata"]["name"] for o in member.of("workspaces")] == ["theirs"]


def test_a_workspace_the_agent_did_not_make_is_reported_not_touched() -> None:
    hub, member = FakeApi(), FakeApi()
    member.put("workspaces", {"metadata": {"name": "team"}, "spec": {"namespaces": ["mine"]}})
    carrier = hub.put("configmaps", carrier_object(workspace(clusters=["member-a"]), "member-a"))
    f = follower(hub, member)
    f._sync_carriers([carrier])
    f._sync_mine([])
    run(f.pass_once())
    assert member.objects[("workspaces", "", "team")]["spec"] == {"namespaces": ["mine"]}
    answer = carrier_status(hub.objects[("configmaps", "accelstack-member-member-a", "team")])
    assert answer is not None and answer["message"].startswith("NameTaken: ")


# ---- the label selector and shares of a limit (issue 40.2, the rest) --------------------------------------------
def cluster(name: str, lost: bool = False, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"labels": labels},
            "status": {"conditions": [{"type": "Lost", "status": "True" if lost else "False"}]}}


def test_the_selector_matches_cluster_labels_and_adds_to_the_names() -> None:
    labels = {"region": "eu", "provider": "gcp"}
    assert selector_matches({}, labels) and not selector_matches(None, labels)
    assert selector_matches({"matchLabels": {"region": "eu"}}, labels)
    assert not selector_matches({"matchLabels": {"region": "us"}}, labels)
    assert selector_matches({"matchExpressions": [{"key": "region", "operator": "In", "values": ["eu", "us"]}]},
                            labels)
    assert not selector_matches({"matchExpressions": [{"key": "provider", "operator": "NotIn", "values": ["gcp"]}]},
                                labels)
    assert selector_matches({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"},
                                                  {"key": "region", "operator": "Exists"}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "region", "operator": "Bogus"}]}, labels)
    ws = workspace(clusters=["member-c"])
    ws["spec"]["clusterSelector"] = {"matchLabels": {"region": "eu"}}
    members = {"member-b": cluster("member-b", region="eu"), "member-a": cluster("member-a", region="eu"),
               "member-c": cluster("member-c", region="us"), "member-d": cluster("member-d")}
    assert clusters_of(ws, members) == ["member-c", "member-a", "member-b"]
    assert clusters_of(ws) == ["member-c"]


def test_a_relabelled_cluster_gains_and_loses_the_workspace_never_a_namespace() -> None:
    api = FakeApi()
    ws = workspace(clusters=[])
    ws["spec"]["clusterSelector"] = {"matchLabels": {"team": "x"}}
    ws = api.put("workspaces", ws)
    members = {"member-a": cluster("member-a", team="x"), "member-b": cluster("member-b")}
    hub = WorkspaceDispatcher(api, lambda: members)  # type: ignore[arg-type]
    hub._sync_workspaces([ws])
    run(hub.pass_once())
    assert [o["metadata"]["namespace"] for o in api.of("configmaps")] == ["accelstack-member-member-a"]
    carried = member_workspace(api.of("configmaps")[0])
    assert carried is not None and "clusterSelector" not in carried["spec"]
    members["member-a"] = cluster("member-a")  # a loses the label, b gains it
    members["member-b"] = cluster("member-b", team="x")
    run(hub.pass_once())
    assert [o["metadata"]["namespace"] for o in api.of("configmaps")] == ["accelstack-member-member-b"]
    assert [r["name"] for r in api.objects[("workspaces", "", "team")]["status"]["clusters"]] == ["member-b"]
    assert not [c for c in api.calls if c[1] == "namespaces"]


def answer(api: FakeApi, member: str, enforced: int, held: int = 0, queued: int = 0) -> None:
    """The member's agent reports its copy's usage row for nvidia.com/gpu."""
    obj = api.objects[("configmaps", f"accelstack-member-{member}", "team")]
    obj["data"]["status"] = json.dumps({"ready": True, "namespaces": ["team-a"], "message": "ok", "usage": [
        {"resource": "nvidia.com/gpu", "model": "", "max": enforced, "inUse": held, "reserved": 0,
         "queued": queued}]})


def shares_now(api: FakeApi) -> dict[str, int]:
    out = {}
    for o in api.of("configmaps"):
        spec = json.loads(o["data"]["spec"])
        (entry,) = spec["policy"]["devices"]
        assert entry["sharedMax"] == 8
        out[o["metadata"]["namespace"][len("accelstack-member-"):]] = entry["max"]
    return out


def split_limit(api: FakeApi) -> tuple[WorkspaceDispatcher, dict[str, dict[str, Any]]]:
    """A workspace of 8 GPUs on member-a and member-b, the hub's first pass made (4 each); the hub, the Clusters."""
    ws = workspace(clusters=["member-a", "member-b"])
    ws["spec"]["policy"] = {"devices": [{"resource": "nvidia.com/gpu", "max": 8}]}
    ws = api.put("workspaces", ws)
    members = {"member-a": cluster("member-a"), "member-b": cluster("member-b")}
    hub = WorkspaceDispatcher(api, lambda: members)  # type: ignore[arg-type]
    hub._sync_workspaces([ws])
    run(hub.pass_once())
    return hub, members


def test_the_hub_splits_a_limit_and_moves_it_only_after_the_member_acknowledges() -> None:
    api = FakeApi()
    hub, members = split_limit(api)
    assert shares_now(api) == {"member-a": 4, "member-b": 4}  # idle: even, never 8 each
    answer(api, "member-a", 4, queued=8)
    answer(api, "member-b", 4)
    hub._sync_carriers(api.of("configmaps"))
    run(hub.pass_once())
    assert shares_now(api) == {"member-a": 4, "member-b": 0}  # b lowered; a waits for b's acknowledgement
    run(hub.pass_once())
    assert shares_now(api) == {"member-a": 4, "member-b": 0}
    answer(api, "member-b", 0)
    hub._sync_carriers(api.of("configmaps"))
    run(hub.pass_once())
    assert shares_now(api) == {"member-a": 8, "member-b": 0}
    status = api.objects[("workspaces", "", "team")]["status"]
    assert [r.get("shares") for r in status["clusters"]] == [
        [{"resource": "nvidia.com/gpu", "model": "", "max": 8}], [{"resource": "nvidia.com/gpu", "model": "", "max": 0}]]
    assert status["usage"] == [{"resource": "nvidia.com/gpu", "model": "", "max": 8, "inUse": 0, "reserved": 0,
                                "queued": 8}]
    # a Lost member keeps what it committed
    answer(api, "member-a", 8, held=8)
    members["member-a"] = cluster("member-a", lost=True)
    answer(api, "member-b", 0, queued=8)
    hub._sync_carriers(api.of("configmaps"))
    run(hub.pass_once())
    assert shares_now(api) == {"member-a": 8, "member-b": 0}


class AgentAnswersFirst(FakeApi):
    """A hub patch of a carrier whose answer reaches the hub after the agent's reply to it: the agent writes the
    carrier's status (a later resourceVersion) and the hub's informer delivers that event, then the patch returns."""

    def __init__(self) -> None:
        super().__init__()
        self.reply: Any = None  # (hub, member, enforced) to answer with while the next patch is in flight

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    subresource: str | None = None) -> Any:
        written = await super().patch(res, name, body, namespace, subresource)
        if self.reply is not None and res.plural == "configmaps":
            hub, member, enforced = self.reply
            self.reply = None
            answer(self, member, enforced)
            hub._on_carrier("MODIFIED", self.put("configmaps", self.objects[(
                "configmaps", f"accelstack-member-{member}", "team")]))
        return written


def test_a_patch_answer_older_than_the_watch_does_not_hide_the_members_reply() -> None:
    """The hub lowers member-a's share; member-a acknowledges before the hub has read its patch's answer. The
    older answer must not replace the reply in the hub's view: member-b's share then moves (it stalled for good)."""
    api = AgentAnswersFirst()
    hub, _ = split_limit(api)
    answer(api, "member-a", 4, held=4)
    answer(api, "member-b", 4, queued=8)
    hub._sync_carriers(api.of("configmaps"))
    run(hub.pass_once())  # a holds 4, b queues 8: 4 each, nothing moves
    answer(api, "member-a", 4, held=0)  # a's GPR gone
    hub._sync_carriers(api.of("configmaps"))
    api.reply = (hub, "member-a", 0)  # a acknowledges 0 while the hub's patch lowering it is in flight
    run(hub.pass_once())
    assert shares_now(api)["member-a"] == 0 and api.reply is None
    assert json.loads(hub.carriers[("member-a", "team")]["data"]["status"])["usage"][0]["max"] == 0
    run(hub.pass_once())
    assert shares_now(api) == {"member-a": 0, "member-b": 8}


def test_one_member_gets_the_limit_whole_as_before() -> None:
    ws = workspace(clusters=["member-a"])
    ws["spec"]["policy"] = {"devices": [{"resource": "nvidia.com/gpu", "max": 8}]}
    assert member_shares(ws, ["member-a"], {}, lambda c: True) == {}
    copy_ = member_workspace(carrier_object(ws, "member-a"))
    assert copy_ is not None and copy_["spec"]["policy"]["devices"] == [{"resource": "nvidia.com/gpu", "max": 8}]


def test_a_member_copy_refuses_only_what_the_whole_limit_never_allows() -> None:
    policy = parse_policy({"devices": [{"resource": "nvidia.com/gpu", "max": 0, "sharedMax": 8}]})
    assert policy.devices[0].max == 0 and policy.devices[0].limit == 8


def test_the_crd_refuses_a_bad_selector_in_one_line() -> None:
    from tests.extender.test_crds import admit

    def errors(selector: dict[str, Any]) -> list[str]:
        ws = workspace(clusters=["member-a"])
        del ws["metadata"]["uid"]
        ws["spec"]["clusterSelector"] = selector
        return admit("workspaces", ws)[1]

    assert errors({"matchLabels": {"region": "eu"},
                   "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]},
                                        {"key": "gpu", "operator": "Exists"}]}) == []
    assert errors({}) == []
    (bad,) = errors({"matchExpressions": [{"key": "tier", "operator": "In"}]})
    assert "In and NotIn need values" in bad and "\n" not in bad
    (bad,) = errors({"matchExpressions": [{"key": "tier", "operator": "Exists", "values": ["a"]}]})
    assert "Exists and DoesNotExist take none" in bad
    assert any("operator" in e for e in errors({"matchExpressions": [{"key": "tier", "operator": "Is"}]}))
    (bad,) = errors({"matchLabels": {"bad key!": "x"}})
    assert "every key is a label key" in bad
    assert errors({"matchLabels": {"region": "not a value"}})
