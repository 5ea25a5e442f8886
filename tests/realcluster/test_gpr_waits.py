"""GPR waits a team can trust, on the real API server and controller (issue 35 points 1, 2 and 4)."""

from __future__ import annotations

import time

from scheduler_extender.objects.gpr_codec import parse_time
from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import GPRS, admitted, events_for, gpr, gpr_status, pod, wait_for
from tests.realcluster.stack import Stack

MODEL = "nvidia.com/gpu.product"
OUTSIDE = "kube-system"  # the pod webhook is not called there: a GPU pod bound without any GPR, as another
# scheduler or a nodeName would bind it


def squat(cp: ControlPlane, name: str, node: str, gpus: int = 8) -> str:
    """A pod holding ``gpus`` of ``node`` outside any GPR, with no end; returns its path (delete it after)."""
    try:  # this control plane runs no service-account controller
        cp.create(f"api/v1/namespaces/{OUTSIDE}/serviceaccounts", {"metadata": {"name": "default"}})
    except ApiCallError as exc:
        if exc.status != 409:
            raise
    cp.create(f"api/v1/namespaces/{OUTSIDE}/pods", pod(name, gpus=gpus, scheduler="default-scheduler", nodeName=node))
    return f"api/v1/namespaces/{OUTSIDE}/pods/{name}"


def test_a_stuck_head_does_not_block_a_gpr_for_another_model(cp: ControlPlane, stack: Stack, ns: str,
                                                              nodes: Nodes) -> None:
    """Issue 35.1: a 1x8 GPR whose only node is held by a non-GPR pod with no end heads its level; a 1x8 GPR of
    the same level for another GPU model, with free nodes of that model, is Admitted there anyway (before: Queued
    behind the head for as long as the pod ran). The head stays Queued: its node is still taken."""
    a0 = nodes.add("a0", gpus=8, labels={MODEL: "A100"})
    h = [nodes.add(f"h{i}", gpus=8, labels={MODEL: "H100"}) for i in range(2)]
    held = squat(cp, f"{ns}-squatter", a0)
    try:
        cp.create(GPRS.format(ns=ns), gpr("a-stuck", devices=8, models=["A100"]))
        wait_for("the head Queued", lambda: gpr_status(cp, ns, "a-stuck").get("phase") == "Queued")
        cp.create(GPRS.format(ns=ns), gpr("b-other-model", devices=8, models=["H100"]))
        status = wait_for("the other model's GPR admitted", lambda: admitted(cp, ns, "b-other-model"), timeout=30)
        assert {r["node"] for r in status["reservation"]} <= set(h)
        assert gpr_status(cp, ns, "a-stuck").get("phase") == "Queued"  # still: its node is taken
        # issue 35.4: it says why, with what it needs and how many of its nodes have that free (before: reason '')
        stuck = wait_for("the capacity reason", lambda: (lambda s: s if s.get("reason") == "InsufficientCapacity"
                                                         else None)(gpr_status(cp, ns, "a-stuck")), timeout=30)
        assert "; InsufficientCapacity: needs 1 node(s) x 8 nvidia.com/gpu (A100); 0 of 1 fitting nodes have 8 free" \
            in stuck["message"], stuck
    finally:
        cp.api("DELETE", held, {"gracePeriodSeconds": 0})


def test_a_reservation_taken_by_a_pod_outside_any_gpr_is_requeued_with_an_event(cp: ControlPlane, stack: Stack,
                                                                                ns: str, nodes: Nodes) -> None:
    """Issue 35.2: an Admitted GPR (no pod of it started) whose node is then filled by a pod bound outside any GPR
    (nodeName) no longer fits there: it gives the reservation back with a reason and an Event, and is admitted on
    the other node once that one is free (before: it stayed Admitted on the full node, 8 allocated and 8 reserved
    at once)."""
    first = nodes.add("n0", gpus=8)
    cp.create(GPRS.format(ns=ns), gpr("train", devices=8))
    status = wait_for("the GPR admitted", lambda: admitted(cp, ns, "train"))
    taken = status["reservation"][0]["node"]
    assert taken == first
    held = squat(cp, f"{ns}-nodename", taken)
    try:
        queued = wait_for("the GPR requeued", lambda: (lambda s: s if s.get("phase") == "Queued" else None)(
            gpr_status(cp, ns, "train")), timeout=30)
        assert "ReservationTaken" in str(queued.get("reason")) and taken in str(queued.get("reason"))
        # the controller writes a pass's Events after its status writes: the Event may land a moment later
        events = wait_for("the Requeued Event", lambda: [e for e in events_for(cp, ns, "train")
                                                        if e.get("reason") == "Requeued"], timeout=10)
        assert "ReservationTaken" in events[0]["message"], events
        other = nodes.add("n1", gpus=8)
        again = wait_for("the GPR admitted on the free node", lambda: admitted(cp, ns, "train"), timeout=30)
        assert [r["node"] for r in again["reservation"]] == [other]
    finally:
        cp.api("DELETE", held, {"gracePeriodSeconds": 0})


def test_a_quota_held_gpr_says_which_quota_and_unschedulable_clears_once_it_fits(cp: ControlPlane, stack: Stack,
                                                                                 ns: str, nodes: Nodes) -> None:
    """Issue 35.4: a GPR held by its workspace's quota has reason WorkspaceQuota and an Event naming the workspace,
    its use and its limit (before: reason "" while devices were free); a GPR too big for the cluster says
    Unschedulable, and once it would fit (a node joins) the reason goes though it still waits (before: it stuck)."""
    ws = "apis/accelstack.io/v1alpha1/workspaces"
    nodes.add("q0", gpus=8)
    cp.create(ws, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ns},
                   "spec": {"namespaces": [ns], "policy": {"devices": [{"resource": "nvidia.com/gpu", "max": 1}]}}})
    held = squat(cp, f"{ns}-later", f"{ns}-q1")  # bound to a node that joins later: it is full when it does
    try:
        def in_force() -> bool:
            return ((cp.get(f"{ws}/{ns}") or {}).get("status") or {}).get("observedGeneration") is not None

        wait_for("the workspace seen", in_force, timeout=30)
        cp.create(GPRS.format(ns=ns), gpr("first"))
        wait_for("the first GPR admitted", lambda: admitted(cp, ns, "first"))
        cp.create(GPRS.format(ns=ns), gpr("second"))
        status = wait_for("the quota reason", lambda: (lambda s: s if s.get("reason") == "WorkspaceQuota" else None)(
            gpr_status(cp, ns, "second")), timeout=30)
        assert status["phase"] == "Queued"
        said = wait_for("the quota Event", lambda: [e for e in events_for(cp, ns, "second")
                                                    if e.get("reason") == "WorkspaceQuota"], timeout=30)
        assert f"workspace {ns}" in said[0]["message"] and "1 of 1 devices in use" in said[0]["message"], said

        other = f"{ns}-b"
        cp.create("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
        try:
            cp.create(GPRS.format(ns=other), gpr("big", devices=8, nodes=2))
            wait_for("Unschedulable", lambda: gpr_status(cp, other, "big").get("reason") == "Unschedulable")
            nodes.add("q1", gpus=8)
            cleared = wait_for("the reason cleared", lambda: (lambda s: s if s.get("reason") != "Unschedulable"
                                                              else None)(gpr_status(cp, other, "big")), timeout=30)
            assert cleared["phase"] == "Queued"  # q1 is full: it waits, but not as if it could never fit
            told = wait_for("the capacity reason", lambda: (lambda s: s if s.get("reason") == "InsufficientCapacity"
                                                            else None)(gpr_status(cp, other, "big")), timeout=30)
            assert "needs 2 node(s) x 8 nvidia.com/gpu" in told["message"], told
            # quota-held: estimated when its workspace's holder is predicted to end (an hour: the prior), not now
            second = wait_for("its estimate", lambda: (lambda s: s if s.get("estimatedStart") else None)(
                gpr_status(cp, ns, "second")), timeout=30)
            when = parse_time(second["estimatedStart"])
            assert when is not None and when > time.time() + 600, second
        finally:
            cp.delete(GPRS.format(ns=other))
            cp.delete(f"api/v1/namespaces/{other}")
    finally:
        cp.api("DELETE", held, {"gracePeriodSeconds": 0})
        cp.delete(f"{ws}/{ns}")


def test_every_queued_gpr_of_a_sweep_says_why_past_the_ones_a_pass_looks_at(cp: ControlPlane, stack: Stack, ns: str,
                                                                            nodes: Nodes) -> None:
    """Issue 35.4 at the size of a real sweep: a pass looks at nine GPRs a workspace's quota holds, and at nine
    the cluster cannot place, then stops. A sweep of twelve 1-GPU GPRs into a workspace at its 1-GPU quota, and
    one of twelve 8-GPU GPRs where no node has eight free: every one of them Queued with a reason and an Event
    (before: the last three of each had reason '', as if just created), WorkspaceQuota for the first sweep
    (each estimated after the one ahead of it: the quota lets one run at a time), BehindBlockedGPRs past the
    ninth for the second (with an estimate)."""
    ws = "apis/accelstack.io/v1alpha1/workspaces"
    nodes.add("s0", gpus=8)
    cp.create(ws, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ns},
                   "spec": {"namespaces": [ns], "policy": {"devices": [{"resource": "nvidia.com/gpu", "max": 1}]}}})
    other = f"{ns}-big"
    cp.create("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    try:
        wait_for("the workspace seen", lambda: ((cp.get(f"{ws}/{ns}") or {}).get("status") or {}).get(
            "observedGeneration") is not None, timeout=30)
        cp.create(GPRS.format(ns=ns), gpr("first"))
        wait_for("the first GPR admitted", lambda: admitted(cp, ns, "first"))
        sweep = [f"sweep-{i:02d}" for i in range(12)]
        big = [f"big-{i:02d}" for i in range(12)]
        for name in sweep:
            cp.create(GPRS.format(ns=ns), gpr(name, exitDuration="1h"))
        for name in big:
            cp.create(GPRS.format(ns=other), gpr(name, devices=8, exitDuration="1h"))

        def reasons(namespace: str, names: list[str]) -> dict[str, str] | None:
            got = {n: gpr_status(cp, namespace, n) for n in names}
            if all(s.get("phase") == "Queued" and s.get("reason") for s in got.values()):
                return {n: s["reason"] for n, s in got.items()}
            return None

        held = wait_for("a reason for every GPR of the sweep", lambda: reasons(ns, sweep), timeout=60)
        assert set(held.values()) == {"WorkspaceQuota"}, held
        def estimates() -> list[float] | None:
            got = [parse_time(gpr_status(cp, ns, n).get("estimatedStart")) for n in sweep]
            return [t for t in got if t is not None] if all(t is not None for t in got) else None

        starts = wait_for("an estimate for every GPR of the sweep", estimates, timeout=30)
        assert starts == sorted(starts) and starts[0] > time.time() + 600, starts  # one at a time, hours ahead
        waiting = wait_for("a reason for every big GPR", lambda: reasons(other, big), timeout=60)
        behind = sorted(n for n, r in waiting.items() if r == "BehindBlockedGPRs")
        assert len(behind) == 3 and set(waiting.values()) == {"InsufficientCapacity", "BehindBlockedGPRs"}, waiting
        last = wait_for("its estimate (refreshed every 5 s here)", lambda: (lambda s: s if s.get("estimatedStart")
                                                                            else None)(gpr_status(cp, other, behind[-1])),
                        timeout=30)
        assert "; BehindBlockedGPRs: behind 9 GPRs that wait for devices" in last["message"], last
        told = wait_for("its Event", lambda: [e for e in events_for(cp, other, behind[-1])
                                              if e.get("reason") == "BehindBlockedGPRs"], timeout=30)
        assert told[0]["message"].startswith("behind 9 GPRs that wait for devices"), told
        assert wait_for("the last of the sweep's Event", lambda: [e for e in events_for(cp, ns, sweep[-1])
                                                                  if e.get("reason") == "WorkspaceQuota"], timeout=30)
    finally:
        cp.delete(GPRS.format(ns=other))
        cp.delete(f"api/v1/namespaces/{other}")
        cp.delete(f"{ws}/{ns}")
