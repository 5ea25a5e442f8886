"""The hub's dispatcher (scheduler_extender/multicluster/dispatch.py) against a fake API server: the choice is
recorded (over the very object it read) before the dispatch is created, a pass over an unchanged world writes
nothing, a dispatch whose origin is gone is deleted, and a Lost member's never-started GPR is moved (old dispatch
deleted first) while a Running one is only reported."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from kubeapi import AlreadyExists, Conflict, Forbidden, NotFound, Resource
from kubeapi.metrics import api_metrics
from scheduler_extender.multicluster.dispatch import Dispatcher

NOW = 1_796_018_400.0


class FakeHub:
    """GPRs by (namespace, name); a status patch carrying metadata.resourceVersion is refused when it is stale."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.metrics = api_metrics()
        self.rv = 1
        self.forbidden: set[str] = set()  # namespaces where the hub's rights are gone (`cluster leave` took them)

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(obj)

    async def create(self, res: Resource, body: dict[str, Any], namespace: str | None = None) -> Any:
        key = (str(namespace), body["metadata"]["name"])
        self.calls.append(("create", *key))
        if key in self.objects:
            raise AlreadyExists(409, "AlreadyExists", "exists")
        obj = copy.deepcopy(body)
        obj["metadata"].update(namespace=namespace, uid=f"uid-{key[1]}")
        self.objects[key] = obj
        return self._bump(obj)

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    subresource: str | None = None) -> Any:
        key = (str(namespace), name)
        self.calls.append(("patch-status", *key))
        obj = self.objects.get(key)
        if obj is None:
            raise NotFound(404, "NotFound", name)
        want = (body.get("metadata") or {}).get("resourceVersion")
        if want is not None and want != obj["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "the object has been modified")
        status = obj.setdefault("status", {})
        for k, v in body["status"].items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        return self._bump(obj)

    async def delete(self, res: Resource, name: str, namespace: str | None = None, *, uid: str | None = None) -> Any:
        key = (str(namespace), name)
        self.calls.append(("delete", *key))
        if namespace in self.forbidden:
            raise Forbidden(403, "Forbidden", f"cannot delete resource gpuprovisioningrequests in {namespace}")
        if key not in self.objects:
            raise NotFound(404, "NotFound", name)
        del self.objects[key]
        return {}


def member(ready: bool = True, free: int = 8) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"},
                                      {"type": "Lost", "status": "False" if ready else "True"}],
                       "inventory": [{"resource": "nvidia.com/gpu", "model": "H100", "nodes": 1, "capacity": 8,
                                      "allocatable": 8, "allocated": 8 - free, "reserved": 0, "unhealthy": 0,
                                      "queued": 0}]}}


def setup(clusters: dict[str, dict[str, Any]]) -> tuple[FakeHub, Dispatcher]:
    hub = FakeHub()
    d = Dispatcher(hub, lambda: clusters, wall=lambda: NOW)  # type: ignore[arg-type]
    return hub, d


def origin(hub: FakeHub, d: Dispatcher, name: str = "train", **spec: Any) -> dict[str, Any]:
    obj = {"metadata": {"name": name, "namespace": "team-a", "uid": "o-1"},
           "spec": {"resource": "nvidia.com/gpu", "devicesPerNode": 8, "nodeCount": 1, **spec}}
    hub.objects[("team-a", name)] = obj
    stored = hub._bump(obj)
    d._on_gpr("ADDED", stored)
    return stored


def watch_all(hub: FakeHub, d: Dispatcher) -> None:
    """What the informer brings: every stored object as it is now."""
    d._sync([copy.deepcopy(o) for o in hub.objects.values()])


def test_the_choice_is_recorded_before_the_dispatch_and_an_unchanged_world_writes_nothing() -> None:
    hub, d = setup({"member-a": member(free=0), "member-b": member(free=8)})
    origin(hub, d)
    asyncio.run(d.pass_once())
    assert hub.calls == [("patch-status", "team-a", "train"), ("create", "accelstack-member-member-b", "team-a.train")]
    status = hub.objects[("team-a", "train")]["status"]
    assert status["cluster"] == "member-b" and status["reason"] == "Dispatched"
    assert status["conditions"][0]["reason"] == "EarliestStart"
    dispatch = hub.objects[("accelstack-member-member-b", "team-a.train")]
    assert dispatch["metadata"]["labels"]["accelstack.io/origin-uid"] == "o-1"
    hub.calls.clear()
    watch_all(hub, d)
    asyncio.run(d.pass_once())
    assert hub.calls == []  # recorded once: no second pick, no second create


def test_a_waiting_gpr_is_written_again_only_when_its_reason_changes() -> None:
    """Too big for every member: Unschedulable, with each member's usable devices in the message. A member's
    capacity change alone does not rewrite it (with 1,000 such GPRs that was 1,000 writes in the placing pass per
    change); no member Ready is another reason and is written; a member that can take it gets it."""
    clusters = {"member-a": member(), "member-b": member()}
    hub, d = setup(clusters)
    origin(hub, d, nodeCount=3)
    asyncio.run(d.pass_once())
    status = hub.objects[("team-a", "train")]["status"]
    assert (status["phase"], status["reason"]) == ("Queued", "Unschedulable")
    assert "member-a: 8 usable" in status["message"]
    clusters["member-a"]["status"]["inventory"][0].update(capacity=16, allocatable=16, nodes=2)
    watch_all(hub, d)
    hub.calls.clear()
    asyncio.run(d.pass_once())
    assert hub.calls == []
    clusters["member-a"], clusters["member-b"] = member(ready=False), member(ready=False)
    asyncio.run(d.pass_once())
    assert hub.calls == [("patch-status", "team-a", "train")]
    assert hub.objects[("team-a", "train")]["status"]["reason"] == "NoClusterReady"
    watch_all(hub, d)
    big = member()
    big["status"]["inventory"][0].update(nodes=3, capacity=24, allocatable=24)
    clusters["member-a"] = big
    asyncio.run(d.pass_once())
    assert hub.objects[("team-a", "train")]["status"]["cluster"] == "member-a"


def test_a_pass_looks_again_only_at_origins_whose_objects_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes come on every event (each member's heartbeat): a placed origin whose object, dispatch and member's
    Lost state are as the last pass left them is skipped; its dispatch's new status is mirrored at once; a Lost
    member's origin is looked at every pass; and every ``resync`` all of them are looked at again."""
    clock = [NOW]
    clusters = {"member-a": member(), "member-b": member()}
    hub = FakeHub()
    d = Dispatcher(hub, lambda: clusters, wall=lambda: clock[0])  # type: ignore[arg-type]
    origin(hub, d, clusterName="member-a")  # pinned: it stays on member-a when that is Lost
    asyncio.run(d.pass_once())
    watch_all(hub, d)
    looked: list[str] = []
    real_one = Dispatcher._one

    async def one(self: Dispatcher, o: dict[str, Any], *args: Any) -> None:
        looked.append(o["metadata"]["name"])
        await real_one(self, o, *args)

    monkeypatch.setattr(Dispatcher, "_one", one)
    asyncio.run(d.pass_once())  # the first pass that finds nothing to do for it
    looked.clear()
    asyncio.run(d.pass_once())
    assert looked == []
    key = ("accelstack-member-member-a", "team-a.train")
    hub.objects[key]["status"] = {"phase": "Admitted", "reason": "Admitted", "message": "reserved"}
    hub._bump(hub.objects[key])
    watch_all(hub, d)
    hub.calls.clear()
    asyncio.run(d.pass_once())
    assert looked == ["train"] and hub.calls == [("patch-status", "team-a", "train")]
    assert hub.objects[("team-a", "train")]["status"]["phase"] == "Admitted"
    watch_all(hub, d)
    asyncio.run(d.pass_once())
    looked.clear()
    clock[0] += d.resync
    asyncio.run(d.pass_once())
    assert looked == ["train"]  # resync: looked at again
    clusters["member-a"] = member(ready=False)
    looked.clear()
    asyncio.run(d.pass_once())
    asyncio.run(d.pass_once())
    assert looked == ["train", "train"]  # its member Lost: every pass
    assert hub.objects[("team-a", "train")]["status"]["reason"] == "ClusterLost"


def test_a_decision_on_a_stale_copy_is_refused_and_creates_nothing() -> None:
    hub, d = setup({"member-b": member()})
    stale = origin(hub, d)
    hub._bump(hub.objects[("team-a", "train")])  # the stored object moved on; the informer has not seen it
    d._on_gpr("MODIFIED", stale)
    asyncio.run(d.pass_once())
    assert hub.calls == [("patch-status", "team-a", "train")]
    assert "status" not in hub.objects[("team-a", "train")]


def test_the_dispatch_of_a_deleted_origin_is_deleted() -> None:
    hub, d = setup({"member-b": member()})
    origin(hub, d)
    asyncio.run(d.pass_once())
    del hub.objects[("team-a", "train")]
    watch_all(hub, d)
    hub.calls.clear()
    asyncio.run(d.pass_once())
    assert hub.calls == [("delete", "accelstack-member-member-b", "team-a.train")]


def run_on_a(phase: str, pinned: bool = False, left: bool = False) -> tuple[FakeHub, dict[str, dict[str, Any]],
                                                                          Dispatcher]:
    clusters = {"member-a": member(), "member-b": member()}
    hub, d = setup(clusters)
    origin(hub, d, **({"clusterName": "member-a"} if pinned else {}))
    asyncio.run(d.pass_once())  # a tie: member-a by name
    assert hub.objects[("team-a", "train")]["status"]["cluster"] == "member-a"
    hub.objects[("accelstack-member-member-a", "team-a.train")]["status"] = {"phase": phase}  # the agent mirrored
    watch_all(hub, d)
    asyncio.run(d.pass_once())
    assert hub.objects[("team-a", "train")]["status"]["phase"] == phase
    if left:  # `cluster leave`: the Cluster and its hub namespace (the dispatch with it) are gone
        del clusters["member-a"]
        del hub.objects[("accelstack-member-member-a", "team-a.train")]
    else:
        clusters["member-a"] = member(ready=False)
    watch_all(hub, d)
    hub.calls.clear()
    asyncio.run(d.pass_once())
    return hub, clusters, d


def test_a_never_started_gpr_leaves_a_lost_member_old_dispatch_first() -> None:
    hub, _, _ = run_on_a("Admitted")
    assert hub.calls == [("delete", "accelstack-member-member-a", "team-a.train"),
                         ("patch-status", "team-a", "train"),
                         ("create", "accelstack-member-member-b", "team-a.train")]
    status = hub.objects[("team-a", "train")]["status"]
    assert status["cluster"] == "member-b"
    replaced = next(c for c in status["conditions"] if c["type"] == "Replaced")
    assert replaced["message"].startswith("taken off member-a (Lost) where it was Admitted")


def test_a_member_that_left_is_lost_at_once_its_unstarted_gprs_move_the_others_are_reported() -> None:
    """Before, a GPR whose member left (its Cluster deleted) was mirrored as 'Queued, Dispatched' while the hub
    tried every pass to create a dispatch in the deleted namespace."""
    hub, _, _ = run_on_a("Admitted", left=True)
    assert hub.calls == [("patch-status", "team-a", "train"), ("create", "accelstack-member-member-b", "team-a.train")]
    status = hub.objects[("team-a", "train")]["status"]
    replaced = next(c for c in status["conditions"] if c["type"] == "Replaced")
    assert replaced["message"].startswith("taken off member-a (left the hub) where it was Admitted"), replaced
    for phase, pinned in (("Running", False), ("Admitted", True)):
        hub, clusters, d = run_on_a(phase, pinned, left=True)
        assert [c[0] for c in hub.calls] == ["patch-status"], (phase, hub.calls)
        status = hub.objects[("team-a", "train")]["status"]
        assert (status["cluster"], status["phase"], status["reason"]) == ("member-a", phase, "ClusterLost")
        assert "member-a has left the hub (its Cluster is gone)" in status["message"], status
        # it joins again: the dispatch is made again in its new namespace and the Lost goes once it mirrors
        clusters["member-a"] = member()
        hub.calls.clear()
        asyncio.run(d.pass_once())
        assert ("create", "accelstack-member-member-a", "team-a.train") in hub.calls, hub.calls


def test_a_running_or_pinned_gpr_on_a_lost_member_is_reported_never_duplicated() -> None:
    for phase, pinned in (("Running", False), ("Queued", True)):
        hub, _, _ = run_on_a(phase, pinned)
        assert [c[0] for c in hub.calls] == ["patch-status"], (phase, hub.calls)
        status = hub.objects[("team-a", "train")]["status"]
        assert (status["cluster"], status["phase"], status["reason"]) == ("member-a", phase, "ClusterLost")
        assert not any(k[0] == "accelstack-member-member-b" for k in hub.objects)


def test_a_member_that_left_before_the_hub_could_delete_its_dispatch_does_not_hold_the_gpr_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`cluster leave` deletes the Cluster, then the hub's Role and RoleBinding in the member's hub namespace, then
    the namespace. A hub that got to the GPR after the RoleBinding was gone was refused the old dispatch's delete
    (403) and retried it every pass, the GPR held back for as long as the namespace took to go (for ever with no
    namespace controller: seen in the real-cluster rejoin test under load). The namespace takes the dispatch with it
    and the member's agent is gone: the GPR moves at once, and the refused delete is not tried again every pass."""
    clusters = {"member-a": member(), "member-b": member()}
    hub, d = setup(clusters)
    origin(hub, d)
    asyncio.run(d.pass_once())
    assert hub.objects[("team-a", "train")]["status"]["cluster"] == "member-a"
    hub.objects[("accelstack-member-member-a", "team-a.train")]["status"] = {"phase": "Admitted"}
    watch_all(hub, d)
    asyncio.run(d.pass_once())
    del clusters["member-a"]  # left; its namespace is being deleted, the dispatch still in it, our rights gone
    hub.forbidden.add("accelstack-member-member-a")
    watch_all(hub, d)
    hub.calls.clear()
    with caplog.at_level("INFO", logger="accelstack.hub"):
        asyncio.run(d.pass_once())
    assert hub.calls == [("delete", "accelstack-member-member-a", "team-a.train"),
                         ("patch-status", "team-a", "train"),
                         ("create", "accelstack-member-member-b", "team-a.train")], hub.calls
    status = hub.objects[("team-a", "train")]["status"]
    assert status["cluster"] == "member-b"
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "retrying" in r.getMessage()]
    hub.calls.clear()
    caplog.clear()
    watch_all(hub, d)  # the informer still lists the old dispatch until its namespace is gone
    with caplog.at_level("INFO", logger="accelstack.hub"):
        asyncio.run(d.pass_once())
        asyncio.run(d.pass_once())
    assert hub.calls.count(("delete", "accelstack-member-member-a", "team-a.train")) <= 1, hub.calls
    assert not [r for r in caplog.records if r.levelname == "WARNING"], [r.getMessage() for r in caplog.records]
    # a Lost member (not left) that refuses is still an error: the GPR is not moved past a dispatch that may run
    hub2, d2 = setup(lost := {"member-a": member(), "member-b": member()})
    origin(hub2, d2)
    asyncio.run(d2.pass_once())
    lost["member-a"] = member(ready=False)
    hub2.forbidden.add("accelstack-member-member-a")
    watch_all(hub2, d2)
    asyncio.run(d2.pass_once())
    assert hub2.objects[("team-a", "train")]["status"]["cluster"] == "member-a"
    assert ("accelstack-member-member-b", "team-a.train") not in hub2.objects
