"""GPRs across clusters, the pure parts (scheduler_extender/multicluster/placement.py): the dispatch's name and
objects, picking the member, mirroring statuses both ways, and what a Lost member's GPRs become."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler_extender.multicluster.placement import (
    ORIGIN,
    Demand,
    Placed,
    demand_of,
    dispatch_name,
    dispatch_object,
    made_for,
    member_object,
    mirror,
    mirror_differs,
    on_lost,
    origin_of,
    origin_status,
    pick,
    waiting_status,
)

NOW = "2026-12-01T10:00:00Z"
GPU = "nvidia.com/gpu"


def row(model: str = "H100", nodes: int = 2, capacity: int = 16, allocatable: int = 16, allocated: int = 0,
        reserved: int = 0, unhealthy: int = 0, queued: int = 0, resource: str = GPU) -> dict[str, Any]:
    return {"resource": resource, "model": model, "nodes": nodes, "capacity": capacity, "allocatable": allocatable,
            "allocated": allocated, "reserved": reserved, "unhealthy": unhealthy, "queued": queued}


def member(*rows: dict[str, Any], ready: bool = True, lost: bool = False) -> dict[str, Any]:
    return {"status": {"inventory": list(rows), "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"},
        {"type": "Lost", "status": "True" if lost else "False"}]}}


def want(devices: int = 8, nodes: int = 1, models: tuple[str, ...] = ()) -> Demand:
    return Demand(GPU, models, devices, nodes)


def origin(ns: str = "team-a", name: str = "train", uid: str = "u-1", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name, "uid": uid},
            "spec": {"resource": GPU, "devicesPerNode": 8, "nodeCount": 1, **spec}}


# ---- names and objects ------------------------------------------------------------------------------------------
def test_the_dispatch_name_is_deterministic_short_and_distinct() -> None:
    assert dispatch_name("team-a", "train") == "team-a.train"
    long_a, long_b = dispatch_name("n" * 40, "x" * 40), dispatch_name("n" * 40, "x" * 39 + "y")
    assert len(long_a) <= 63 and len(long_b) <= 63 and long_a != long_b
    assert long_a == dispatch_name("n" * 40, "x" * 40)  # the same origin, the same name: a second create is a 409
    # a dot cannot be in a namespace, so moving the dot makes another name
    assert dispatch_name("a", "b-c") != dispatch_name("a-b", "c")
    edge = dispatch_name("a" * 50, "-" * 20)
    assert edge[-11] == "-" and edge[:-11][-1] not in "-."


def test_dispatch_and_member_copies_carry_the_origin_and_drop_cluster_name() -> None:
    o = origin(clusterName="member-a", priority=150)
    d = dispatch_object(o, "member-a")
    assert d["metadata"]["namespace"] == "accelstack-member-member-a"
    assert d["metadata"]["name"] == "team-a.train" and origin_of(d) == ("team-a", "train", "u-1")
    assert d["spec"]["clusterName"] == "member-a" and d["spec"]["priority"] == 150
    m = member_object(d)
    assert m is not None
    assert (m["metadata"]["namespace"], m["metadata"]["name"]) == ("team-a", "train")
    assert "clusterName" not in m["spec"] and m["spec"]["priority"] == 150
    assert m["metadata"]["annotations"][ORIGIN] == "hub/team-a/train/u-1"
    assert made_for(m, d)
    # the same name from a newer origin (deleted and made again on the hub), or a member user's own GPR: not ours
    assert not made_for(m, dispatch_object(origin(uid="u-2"), "member-a"))
    assert not made_for({"metadata": {"name": "train", "namespace": "team-a"}}, d)
    assert member_object({"metadata": {"name": "x", "labels": {}}, "spec": {}}) is None


# ---- picking -----------------------------------------------------------------------------------------------------
def test_free_now_beats_a_shorter_queue_and_the_message_says_why() -> None:
    clusters = {"member-a": member(row(allocated=16)),  # full, nothing queued
                "member-b": member(row(allocated=8, queued=16))}  # 8 free, a queue
    choice = pick(want(8), clusters)
    assert (choice.cluster, choice.reason) == ("member-b", "EarliestStart")
    assert choice.message.startswith("member-b: 8 free nvidia.com/gpu now, 16 queued (free now)")
    assert "member-a: 0 free nvidia.com/gpu now" in choice.message


def test_among_members_not_free_the_least_queued_per_device_wins() -> None:
    clusters = {"member-a": member(row(allocated=16, queued=16)),  # 1 queued per device
                "member-b": member(row(nodes=4, capacity=32, allocatable=32, allocated=32, queued=16))}  # 0.5
    choice = pick(want(8), clusters)
    assert choice.cluster == "member-b" and "least queued per device" in choice.message


def test_ties_go_by_name_and_reserved_or_unhealthy_devices_are_not_free() -> None:
    same = row(allocated=8)
    assert pick(want(8), {"member-b": member(same), "member-a": member(same)}).cluster == "member-a"
    clusters = {"member-a": member(row(reserved=16)), "member-b": member(row(unhealthy=16, allocatable=16)),
                "member-c": member(row(allocated=8))}
    assert pick(want(8), clusters).cluster == "member-c"


def test_models_and_node_size_decide_which_rows_count() -> None:
    clusters = {"member-a": member(row(model="A100")), "member-b": member(row(model="H100", allocated=16))}
    assert pick(want(8, models=("H100",)), clusters).cluster == "member-b"  # A100 free, but not acceptable
    assert pick(want(8), clusters).cluster == "member-a"  # any model: A100 free now
    small = {"member-a": member(row(nodes=4, capacity=16, allocatable=16))}  # 4 per node
    assert pick(want(8), small).reason == "Unschedulable"


def test_a_gpr_bigger_than_every_member_is_unschedulable_with_the_sizes() -> None:
    choice = pick(want(8, nodes=4), {"member-a": member(row()), "member-b": member(row(capacity=8, nodes=1,
                                                                                         allocatable=8))})
    assert (choice.cluster, choice.reason) == ("", "Unschedulable")
    assert choice.message == ("needs 4 x 8 nvidia.com/gpu, more than any Ready member has: member-a: 16 usable; "
                              "member-b: 8 usable")


def test_lost_or_not_ready_members_are_skipped_and_none_ready_says_so() -> None:
    clusters = {"member-a": member(row(), ready=False, lost=True), "member-b": member(row(allocated=16))}
    assert pick(want(8), clusters).cluster == "member-b"
    assert pick(want(8), clusters, exclude=["member-b"]).reason == "NoClusterReady"
    none = pick(want(8), {})
    assert none.reason == "NoClusterReady" and "no member cluster joined" in none.message


def test_demand_of_reads_the_spec_with_defaults() -> None:
    assert demand_of({}) == Demand(GPU, (), 1, 1)
    assert demand_of({"resource": "neureality.com/nr1", "devicesPerNode": 4, "nodeCount": 2, "models": ["x"]}) == \
        Demand("neureality.com/nr1", ("x",), 4, 2)


# ---- statuses ----------------------------------------------------------------------------------------------------
def test_the_member_status_is_mirrored_and_a_vanished_field_is_nulled() -> None:
    member_status = {"phase": "Admitted", "reason": "", "reservation": [{"node": "a-1", "devices": 8}],
                     "reservedNodes": ["a-1"], "failures": 0, "observedGeneration": 1,
                     "conditions": [{"type": "Admitted", "status": "True"}]}
    before = {"phase": "Queued", "queuePosition": 2, "estimatedStart": NOW}
    patch = mirror(member_status, before, NOW)
    assert patch["phase"] == "Admitted" and patch["reservation"] == [{"node": "a-1", "devices": 8}]
    assert patch["queuePosition"] is None and patch["estimatedStart"] is None  # gone on the member: gone here
    assert "failures" not in patch and "observedGeneration" not in patch  # the member's own counters stay there
    assert mirror_differs(before, patch)
    assert not mirror_differs({k: v for k, v in patch.items() if v is not None}, patch)


def test_an_agent_problem_is_a_queued_status_with_its_condition() -> None:
    patch = mirror({}, {}, NOW, ("NamespaceMissing", "NamespaceMissing", "namespace team-a does not exist"))
    assert (patch["phase"], patch["reason"]) == ("Queued", "NamespaceMissing")
    assert patch["conditions"] == [{"type": "NamespaceMissing", "status": "True", "reason": "NamespaceMissing",
                                    "message": "namespace team-a does not exist", "lastTransitionTime": NOW}]
    # solved: the condition is gone with the next mirror
    assert mirror({"phase": "Queued"}, patch, NOW)["conditions"] is None


def test_the_origin_shows_the_dispatch_status_the_cluster_and_placed() -> None:
    placed = Placed("member-a", "Pinned", "spec.clusterName: member-a")
    first = origin_status(None, {}, placed, NOW)
    assert (first["phase"], first["reason"], first["cluster"]) == ("Queued", "Dispatched", "member-a")
    assert first["conditions"] == [{"type": "Placed", "status": "True", "reason": "Pinned",
                                    "message": "spec.clusterName: member-a", "lastTransitionTime": NOW}]
    later = origin_status({"phase": "Running", "reservation": [{"node": "a-1", "devices": 8}],
                           "conditions": [{"type": "Running", "status": "True"},
                                          {"type": "Placed", "status": "False"}]},  # not the member's to say
                          first, placed, "2026-12-01T11:00:00Z")
    assert later["phase"] == "Running" and later["reason"] is None
    assert [c["type"] for c in later["conditions"]] == ["Running", "Placed"]
    assert later["conditions"][1]["lastTransitionTime"] == NOW  # kept while it stays True
    lost = origin_status({"phase": "Running"}, later, placed, NOW, lost="member-a is Lost")
    assert lost["reason"] == "ClusterLost" and lost["phase"] == "Running"
    assert {"type": "Lost", "status": "True", "reason": "ClusterLost", "message": "member-a is Lost",
            "lastTransitionTime": NOW} in lost["conditions"]
    waiting = waiting_status("Unschedulable", "too big", later, NOW)
    assert (waiting["phase"], waiting["reason"], waiting["reservation"]) == ("Queued", "Unschedulable", None)
    assert waiting["conditions"][0]["status"] == "False"


# ---- a Lost member -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("phase", "pinned", "action"), [
    ("", False, "replace"), ("Queued", False, "replace"), ("Admitted", False, "replace"),
    ("Running", False, "lost"), ("Evicting", False, "lost"),
    ("Queued", True, "lost"),  # pinned there: never moved, reported
    ("Complete", False, "keep"), ("Failed", True, "keep"), ("Cancelled", False, "keep"),
])
def test_what_a_lost_members_gpr_becomes(phase: str, pinned: bool, action: str) -> None:
    assert on_lost(phase, pinned) == action


def test_one_pass_spreads_a_burst_instead_of_sending_it_all_to_the_member_that_looked_best() -> None:
    """The inventories do not change within a pass: without counting what the pass already sent, every GPR of a
    demand went to the one member that looked best before any of them went (3,617 of 10,000 to one of 20)."""
    from scheduler_extender.multicluster.placement import Placer

    clusters = {"a": member(row()), "b": member(row()), "c": member(row(capacity=8, allocatable=8, nodes=1))}
    alone = [pick(want(), clusters).cluster for _ in range(6)]
    assert alone == ["a"] * 6  # each pick on its own sees the same inventories
    placer = Placer(clusters)
    got = [placer.pick(want()).cluster for _ in range(6)]
    # free now first (by the least queued per device, what this pass sent counting as queued), then the least
    # queued per device: a, b, c while each has 8 free, then a and b's last 8, then a tie by name
    assert got == ["a", "b", "c", "a", "b", "a"], got
    assert placer.pick(want(), exclude=["a", "b"]).cluster == "c"
    # a choice names at most four other members and counts the rest
    many = {f"m{i:02d}": member(row()) for i in range(8)}
    message = Placer(many).pick(want()).message
    assert message.endswith("; 3 more") and message.count(": ") == 5, message
