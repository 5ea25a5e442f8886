"""The Cluster's pure parts: a member's inventory summary from its Nodes, AcceleratorNodes and GPRs, and the
hub's Ready/Lost judgement on its own clock, whatever the member's clock says."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler_extender.multicluster.clusters import (
    accelerator_allocated,
    check_name,
    hub_part_differs,
    hub_status,
    inventory,
    judge,
    micro_time,
    parse_label,
    summarize_gpr,
    summarize_node,
)

GPU, NR1 = "nvidia.com/gpu", "neureality.com/nr1"
HOUR = 3600.0


def node(name: str, *, gpus: int = 0, alloc: int | None = None, nr1: int = 0, model: str = "H100",
         sick: bool = False, ready: bool = True) -> dict[str, Any]:
    cap = {**({GPU: str(gpus)} if gpus else {}), **({NR1: str(nr1)} if nr1 else {}), "cpu": "32"}
    allocatable = dict(cap)
    if alloc is not None:
        allocatable[GPU] = str(alloc)
    conditions = [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}]
    if sick:
        conditions.append({"type": "GPUUnhealthy", "status": "True", "reason": "XID79"})
    labels = {"nvidia.com/gpu.product": model} if gpus else {"accelstack.io/nr1.product": "NR1-S"}
    return {"metadata": {"name": name, "labels": labels}, "spec": {},
            "status": {"capacity": cap, "allocatable": allocatable, "conditions": conditions}}


def gpr(name: str, phase: str, *, devices: int = 1, nodes: int = 1, models: list[str] | None = None,
        reservation: list[dict[str, Any]] | None = None, resource: str = GPU) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team"},
            "spec": {"resource": resource, "devicesPerNode": devices, "nodeCount": nodes, "models": models or []},
            "status": {"phase": phase, "reservation": reservation or []}}


def test_summary_per_resource_and_model() -> None:
    nodes = {n["metadata"]["name"]: s for n in [
        node("a", gpus=8), node("b", gpus=8, alloc=6), node("c", gpus=4, model="A100", sick=True),
        node("d", gpus=8, ready=False), node("r", nr1=4), {"metadata": {"name": "cpu-only"}, "status": {
            "capacity": {"cpu": "4"}, "allocatable": {"cpu": "4"}}}]
        if (s := summarize_node(n)) is not None}
    assert "cpu-only" not in nodes  # a node without accelerators is not counted
    allocated = {h[0]: h[1:] for h in [accelerator_allocated(
        {"metadata": {"name": "a"}, "status": {"resource": GPU, "allocated": 5}})] if h}
    gprs = [summarize_gpr(g) for g in [
        gpr("run", "Running", devices=2, reservation=[{"node": "a", "devices": 2}]),
        gpr("adm", "Admitted", devices=3, reservation=[{"node": "b", "devices": 3}]),
        gpr("q1", "Queued", devices=4, nodes=2, models=["H100"]),
        gpr("q2", "Queued", devices=1, models=["H100", "A100"]),
        gpr("done", "Complete", devices=8, reservation=[{"node": "a", "devices": 8}])]]
    out = inventory(nodes, allocated, gprs)
    rows = {(i["resource"], i["model"]): i for i in out["inventory"]}
    h100 = rows[(GPU, "H100")]
    # a, b and the not-Ready d: capacity 24, allocatable 22 (b gives 6 of 8); unhealthy: b's 2 + d's 8
    assert (h100["nodes"], h100["capacity"], h100["allocatable"], h100["unhealthy"]) == (3, 24, 22, 10)
    assert h100["allocated"] == 5  # a's AcceleratorNode; b and d have neither an AcceleratorNode nor a ledger
    assert h100["reserved"] == 5  # Running on a (2) + Admitted on b (3); a Complete GPR holds nothing
    assert h100["queued"] == 8  # q1: 4 x 2 nodes, naming H100 alone
    assert rows[(GPU, "*")]["queued"] == 1  # q2 takes either model
    assert rows[(GPU, "A100")]["unhealthy"] == 4  # GPUUnhealthy: all its devices
    assert rows[(NR1, "NR1-S")]["allocatable"] == 4
    assert out["devices"] == {"gpuAllocatable": 26, "gpuAllocated": 5, "nr1Allocatable": 4, "nr1Allocated": 0}
    assert out["nodes"] == 5


def test_a_member_clock_a_day_off_changes_nothing() -> None:
    """Only the hub's clock judges: a member whose clock is a day behind or ahead is Ready while its heartbeat
    value changes and Lost once the hub saw no change for lost_after, the same as one whose clock is right."""
    lost_after, hub_now = 60.0, 1_800_000_000.0
    for skew in (-24 * HOUR, 0.0, +24 * HOUR):
        status: dict[str, Any] = {"lastHeartbeatTime": micro_time(hub_now + skew)}
        v = judge(status, hub_now, lost_after)
        assert v.ready and v.observed_at == hub_now, skew
        status |= hub_status(status, v, hub_now)
        assert status["observedHeartbeatTime"] == micro_time(hub_now)  # the hub's clock, never the member's
        # 59 s later on the hub, no new heartbeat: still Ready; at 60 s: Lost
        assert judge(status, hub_now + 59, lost_after).ready
        lost = judge(status, hub_now + 60, lost_after)
        assert (lost.ready, lost.reason) == (False, "HeartbeatMissed")
        status |= hub_status(status, lost, hub_now + 60)
        assert {c["type"]: c["status"] for c in status["conditions"]} == {"Ready": "False", "Lost": "True"}
        # a new heartbeat (any new value, even an older time on the member's clock) is Ready again at once
        status["lastHeartbeatTime"] = micro_time(hub_now + skew - 5)
        back = judge(status, hub_now + 61, lost_after)
        assert back.ready and back.observed_at == hub_now + 61


def test_the_hub_writes_nothing_when_nothing_changed() -> None:
    """Level-triggered: a restarted hub reading the status it wrote reaches the same verdict and part."""
    now = 1_800_000_000.0
    status: dict[str, Any] = {"lastHeartbeatTime": "2020-01-01T00:00:00.000001Z"}
    status |= hub_status(status, judge(status, now, 60), now)
    for later in (now + 1, now + 30, now + 59):
        assert not hub_part_differs(status, hub_status(status, judge(status, later, 60), later))
    flipped = hub_status(status, judge(status, now + 61, 60), now + 61)
    assert hub_part_differs(status, flipped)
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    status |= flipped
    assert {c["type"]: c for c in status["conditions"]}["Ready"]["lastTransitionTime"] != ready["lastTransitionTime"] \
        or ready["lastTransitionTime"][:19] == micro_time(now + 61)[:19]


def test_no_heartbeat_yet_is_not_ready_and_not_lost() -> None:
    v = judge({}, 1e9, 60)
    assert (v.ready, v.reason, v.observed_at) == (False, "NoHeartbeat", None)
    part = hub_status({}, v, 1e9)
    assert {c["type"]: c["status"] for c in part["conditions"]} == {"Ready": "False", "Lost": "False"}
    assert "observedHeartbeatTime" not in part


@pytest.mark.parametrize("bad", ["", "A", "-a", "a" * 46, "a_b", "a.b"])
def test_bad_cluster_names(bad: str) -> None:
    with pytest.raises(ValueError, match="DNS label"):
        check_name(bad)


def test_labels() -> None:
    assert parse_label("region=eu-west") == ("region", "eu-west")
    assert parse_label("topology.kubernetes.io/zone=a") == ("topology.kubernetes.io/zone", "a")
    for bad, why in (("region", "key=value"), ("=x", "not a label key"), ("Bad Prefix/x=1", "not a label key"),
                     ("a=b c", "not a label value"), ("a=" + "x" * 64, "not a label value")):
        with pytest.raises(ValueError, match=why):
            parse_label(bad)
