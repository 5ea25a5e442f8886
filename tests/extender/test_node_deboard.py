"""Deboarding a node (issue 39.4), the pure decisions: the deboard request and the grace, the Node patch (taint,
labels, compare-and-swap), the AcceleratorNode's status while deboarding, and the GPR pass on a tainted node."""

from __future__ import annotations

import time
from typing import Any

import pytest

from scheduler_extender.controller.gpr_pass import plan_pass
from scheduler_extender.controller.pass_cache import PassCache
from scheduler_extender.controller.pass_types import PassConfig, Snapshot
from scheduler_extender.objects import accelerator_nodes as an
from scheduler_extender.objects.cluster import GPU, node_view, pod_view
from scheduler_extender.objects.gpr_codec import rfc3339
from tests.extender.harness import gpr, node, pod


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("10m", 600), ("1h30m", 5400), ("0s", 0), ("45", 45)])
def test_grace_reads_go_style_durations(text: str, seconds: float) -> None:
    assert an.parse_grace(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "10x", "-5s", "8d", "200h"])
def test_a_bad_grace_is_one_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|longer than 7 days"):
        an.parse_grace(text)


def _obj(deboard: dict[str, Any] | None, uid: str = "n-uid") -> dict[str, Any]:
    return {"metadata": {"name": "g1", "uid": "an-uid", "generation": 1,
                         "ownerReferences": [{"kind": "Node", "name": "g1", "uid": uid}]},
            "spec": {"deboard": deboard} if deboard else {}}


def test_the_node_patch_taints_with_the_deadline_keeps_other_taints_and_removes_labels_only_when_deboarded() -> None:
    nd = node("g1", gpus=2, labels={"nvidia.com/gpu.present": "true", "accelstack.io/gpu-node": "true", "pool": "a"},
              taints=[{"key": "other", "effect": "NoSchedule"}])
    nd["metadata"]["resourceVersion"] = "41"
    want = an.Deboard(60, 1000.2)
    patch = an.node_patch(nd, want, deboarded=False)
    assert patch == {"spec": {"taints": [{"key": "other", "effect": "NoSchedule"},
                                         {"key": an.DEBOARD_TAINT, "value": "1061", "effect": "NoSchedule"}]},
                     "metadata": {"resourceVersion": "41"}}
    nd["spec"]["taints"] = patch["spec"]["taints"]
    assert an.node_patch(nd, want, deboarded=False) is None  # level-triggered: nothing more to do
    # only the landing label: GPU feature discovery's labels are not accelstack's to remove
    assert an.node_patch(nd, want, deboarded=True) == {
        "metadata": {"labels": {"accelstack.io/gpu-node": None}, "resourceVersion": "41"}}
    # withdrawn (--abort): the taint goes, other taints stay
    assert an.node_patch(nd, None, deboarded=False) == {
        "spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}, "metadata": {"resourceVersion": "41"}}
    assert an.deboard_until(nd["spec"]["taints"]) == 1061
    assert an.deboard_until([{"key": an.DEBOARD_TAINT, "value": "soon"}]) == float("inf")
    assert an.deboard_until([]) is None


def test_the_status_says_deboarding_with_progress_then_deboarded() -> None:
    nd = node("g1", gpus=2)
    nd["metadata"]["uid"] = "n-uid"
    d = an.detect(nd)
    assert d is not None
    now = time.time()
    obj = _obj({"grace": "1m", "requestedAt": rfc3339(now)})
    holder = an.Holder("ml", "train-0", "train", GPU, 2)
    bits = {"g1": an.NodeBits("n-uid", None, ("accelstack.io/gpu-node",))}
    status = an.plan({"g1": d}, {"g1": [holder]}, {"g1": obj}, rfc3339(now), bits).statuses["g1"]
    assert (status["phase"], status["reason"]) == ("Deboarding", "Tainting")
    bits["g1"] = an.NodeBits("n-uid", "1", ("accelstack.io/gpu-node",))
    status = an.plan({"g1": d}, {"g1": [holder]}, {"g1": obj}, rfc3339(now), bits).statuses["g1"]
    assert (status["phase"], status["reason"]) == ("Deboarding", "GracePeriod")
    assert status["deboard"]["podsLeft"] == 1 and status["deboard"]["gprsLeft"] == 1
    assert status["deboard"]["pods"] == ["ml/train-0"]
    late = rfc3339(now + 120)
    status = an.plan({"g1": d}, {"g1": [holder]}, {"g1": obj}, late, bits).statuses["g1"]
    assert status["reason"] == "EvictionPending" and "PodDisruptionBudget" in status["conditions"][-1]["message"]
    status = an.plan({"g1": d}, {}, {"g1": obj}, late, bits).statuses["g1"]
    assert (status["phase"], status["reason"]) == ("Deboarding", "RemovingLabels")
    # labels gone, and with them the evidence: the object stays while its node does
    bits["g1"] = an.NodeBits("n-uid", "1", ())
    p = an.plan({}, {}, {"g1": {**obj, "status": status}}, late, bits)
    assert not p.delete and p.statuses["g1"]["phase"] == "Deboarded"
    assert p.statuses["g1"]["deboard"]["podsLeft"] == 0
    # the node deleted: the object goes (as for any node); a request withdrawn: detection alone decides
    assert an.plan({}, {}, {"g1": {**obj, "status": status}}, late, {}).delete == [("g1", "an-uid")]
    plain = an.plan({"g1": d}, {}, {"g1": {**_obj(None), "status": status}}, late, bits).statuses["g1"]
    assert plain["phase"] == "Detected"  # no plugin of accelstack's serves it: not onboarded again unasked
    assert "deboard" not in plain and all(c["type"] != "Deboarding" for c in plain["conditions"])


def test_the_pass_requeues_an_unstarted_reservation_at_once_and_drains_running_work_after_the_grace() -> None:
    """On a node tainted for deboarding: nothing new is placed, an Admitted GPR none of whose pods is bound is
    placed again elsewhere (reason NodeDeboarding, no failure), a Running GPR keeps its devices until the grace
    ends and then goes Evicting (its pods evicted by the controller's Eviction API path), reason NodeDeboarding."""
    now = time.time()

    def world(until: float) -> Snapshot:
        out = node("n0", gpus=4, taints=[{"key": an.DEBOARD_TAINT, "value": str(int(until)),
                                          "effect": "NoSchedule"}])
        nodes = {"n0": node_view(out, (GPU,)), "n1": node_view(node("n1", gpus=4), (GPU,))}
        gprs = {}
        for i, (name, phase, devices) in enumerate((("run", "Running", 2), ("adm", "Admitted", 2))):
            obj = gpr(name, phase=phase, devices=devices, reservation={"n0": devices}, exitDuration="1h")
            obj["metadata"].update(uid=f"u-{name}", resourceVersion=str(i + 1),
                                   creationTimestamp=f"2026-11-30T00:00:0{i}Z")
            obj["status"]["admittedAt"] = rfc3339(now - 30)
            if phase == "Running":
                obj["status"]["startedAt"] = rfc3339(now - 20)
            gprs[f"u-{name}"] = obj
        running = pod_view(pod("run-0", 2, gpr="run", uid="p-run", node_name="n0", phase="Running"), (GPU,))
        gated = pod_view(pod("adm-0", 2, gpr="adm", uid="p-adm"), (GPU,))
        assert running is not None and gated is not None
        return Snapshot(now, nodes, {running.uid: running, gated.uid: gated}, gprs)

    plan = plan_pass(world(now + 60), PassConfig(), PassCache())
    written = {w.key: w.status for w in plan.writes}
    assert written["default/adm"]["phase"] == "Admitted"
    assert written["default/adm"]["reservation"] == [{"node": "n1", "devices": 2}]
    assert written["default/adm"].get("failures", 0) == 0
    assert any(e.kind == "requeued" and e.gpr == "default/adm" and "NodeDeboarding" in e.detail
               for _, e in plan.events)
    assert "default/run" not in written or written["default/run"]["phase"] == "Running"

    plan = plan_pass(world(now - 1), PassConfig(), PassCache())
    written = {w.key: w.status for w in plan.writes}
    assert (written["default/run"]["phase"], written["default/run"]["reason"]) == ("Evicting", "NodeDeboarding")
    assert [e.pod.name for e in plan.evictions] == ["run-0"]
