"""Many clusters, faults (issue 40.5) on the shared three-server world (tests/realcluster/mc_world.py).

- **A member's API server down** for longer than ``--lost-after``: its agent cannot see its own cluster, so it stops
  vouching for it (no heartbeat; ``/readyz`` 503 naming its informers) and the hub marks it Lost on the hub's clock.
  A GPR that had started there is reported Lost and never placed twice; an unstarted, unpinned one is placed on the
  other member. Once the API server is back the member is Ready again, the started GPR's pod was never touched, and
  the agent deletes its stale copy of the moved GPR: nothing runs twice.
- **The same GPR name made directly on two members** (no hub involved): each member admits its own; the hub counts
  both in the members' inventories and holds no dispatch for either; a hub GPR of that name pinned to one of them
  is refused there with ``NameTaken`` and touches neither member's GPR.
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

from tests.realcluster.controlplane import Process
from tests.realcluster.mc_world import (
    HUB_NS,
    LOST_AFTER,
    World,
    cluster,
    condition,
    dispatches,
    hub_status,
    member_gpr,
    namespace,
    not_ready,
    ready_with,
    reserved,
)
from tests.realcluster.objects import GPRS, gpr, wait_for

NS = "mcfaults"
SECONDS: dict[str, float] = {}


def _lost(w: World, name: str) -> bool:
    return condition(cluster(w.hub, name), "Lost").get("status") == "True"


def test_a_members_api_server_down_lost_started_gprs_reported_unstarted_moved_nothing_twice(mc_world: World) -> None:
    w = mc_world
    a, b = w.members["member-a"], w.members["member-b"]
    started = time.monotonic()
    for plane in (w.hub, a.cp, b.cp):
        namespace(plane, NS)
    # a started GPR on member-b (pinned there, its pod Running) and an unstarted, unpinned one also on member-b
    w.hub.create(HUB_NS.format(ns=NS), gpr("started", devices=8, clusterName="member-b", models=["H100"]))
    wait_for("started Admitted on member-b", lambda: hub_status(w, NS, "started", phase="Admitted",
                                                                cluster="member-b"), timeout=60)
    b.cp.create(f"api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "started-0", "labels": {"accelstack.io/gpr": "started"}},
        "spec": {"nodeName": "b-h100", "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                                       "resources": {"requests": {"nvidia.com/gpu": "8"},
                                                                     "limits": {"nvidia.com/gpu": "8"}}}]}})
    b.cp.patch(f"api/v1/namespaces/{NS}/pods/started-0/status", {"status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}], "startTime": "2026-01-01T00:00:00Z"}})
    wait_for("started Running on the hub", lambda: hub_status(w, NS, "started", phase="Running"), timeout=60)
    a.cp.create(GPRS.format(ns=NS), gpr("filler", devices=8, models=["A100"]))  # member-a's A100s taken for now
    wait_for("member-a's A100s reserved on the hub", lambda: reserved(w.hub, "member-a", "A100") == 8, timeout=30)
    w.hub.create(HUB_NS.format(ns=NS), gpr("unstarted", devices=8, models=["A100"]))
    wait_for("unstarted Admitted on member-b", lambda: hub_status(w, NS, "unstarted", phase="Admitted",
                                                                  cluster="member-b"), timeout=60)
    a.cp.delete(f"{GPRS.format(ns=NS)}/filler")
    wait_for("member-a's A100s free on the hub", lambda: reserved(w.hub, "member-a", "A100") == 0, timeout=30)

    # ---- member-b's API server down past --lost-after --------------------------------------------------------
    b.cp.procs["kube-apiserver"].stop()
    down_at = time.monotonic()
    try:
        body = wait_for("member-b's agent not ready", partial(not_ready, b), timeout=30)
        # its own informers named, the hub not (the hub answers)
        assert body.startswith("not ready: nodes: ") and body.count("\n") == 1 and ", hub: " not in body, body
        wait_for("member-b Lost on the hub", partial(_lost, w, "member-b"), timeout=60)
        assert time.monotonic() - down_at >= LOST_AFTER - 0.6  # judged on the hub's clock, not before
        moved = wait_for("unstarted placed on member-a", lambda: hub_status(
            w, NS, "unstarted", phase="Admitted", cluster="member-a"), timeout=60)
        assert "taken off member-b (Lost) where it was Admitted" in condition({"status": moved}, "Replaced")["message"]
        lost = wait_for("started reported Lost", lambda: hub_status(w, NS, "started", reason="ClusterLost"),
                        timeout=30)
        assert (lost["phase"], lost["cluster"]) == ("Running", "member-b"), lost
        assert f"{NS}.started" not in dispatches(w, "member-a") and member_gpr(a, NS, "started") == {}
        assert not _lost(w, "member-a")
        assert b.agent is not None and b.agent.proc is not None and b.agent.proc.poll() is None  # no crash loop
    finally:
        SECONDS["member API server down"] = time.monotonic() - down_at
        b.cp.procs["kube-apiserver"] = Process("kube-apiserver", b.cp.apiserver_args, b.cp.dir / "kube-apiserver.log")
        b.cp.wait_ready()

    # ---- back: Ready, the started GPR where it was, the moved one's stale copy deleted -----------------------
    wait_for("member-b Ready again", lambda: ready_with(w.hub, "member-b", 16), timeout=60)
    def started_back() -> dict[str, Any] | None:
        s = hub_status(w, NS, "started", phase="Running", cluster="member-b")
        return s if s is not None and not condition({"status": s}, "Lost") else None

    wait_for("started Running on member-b, not Lost", started_back, timeout=60)
    wait_for("member-b's stale copy of unstarted deleted", lambda: member_gpr(b, NS, "unstarted") == {}, timeout=60)
    assert b.cp.get(f"api/v1/namespaces/{NS}/pods/started-0") is not None  # never touched
    assert member_gpr(a, NS, "unstarted")["status"]["phase"] == "Admitted"
    assert dispatches(w, "member-b").count(f"{NS}.started") == 1 and f"{NS}.unstarted" not in dispatches(w, "member-b")
    b.cp.delete(f"api/v1/namespaces/{NS}/pods/started-0", force=True)
    w.clean((NS, "started"), (NS, "unstarted"))
    SECONDS["test"] = time.monotonic() - started
    print(f"\nmulticluster member-down seconds: {json.dumps({k: round(v, 1) for k, v in SECONDS.items()})}")


def test_the_same_gpr_name_made_directly_on_two_members(mc_world: World) -> None:
    w = mc_world
    a, b = w.members["member-a"], w.members["member-b"]
    for plane in (w.hub, a.cp, b.cp):
        namespace(plane, NS)
    for m in (a, b):
        m.cp.create(GPRS.format(ns=NS), gpr("twin", devices=8, models=["H100"]))
    for m in (a, b):
        wait_for(f"twin Admitted on {m.name}", partial(lambda m: (member_gpr(m, NS, "twin").get("status") or {}).get(
            "phase") == "Admitted", m), timeout=60)
        wait_for(f"{m.name}'s H100s reserved on the hub", partial(lambda m: reserved(w.hub, m.name, "H100") == 8, m),
                 timeout=30)
    assert all(f"{NS}.twin" not in dispatches(w, n) for n in w.members)  # the hub made nothing of them
    uids = {m.name: member_gpr(m, NS, "twin")["metadata"]["uid"] for m in (a, b)}
    # a hub GPR of that very name, pinned to member-a: refused there, neither member's GPR touched
    w.hub.create(HUB_NS.format(ns=NS), gpr("twin", devices=1, clusterName="member-a"))
    refused = wait_for("NameTaken on the hub", lambda: hub_status(w, NS, "twin", reason="NameTaken"), timeout=60)
    assert "already has a GPR" in refused["message"], refused
    assert {m.name: member_gpr(m, NS, "twin")["metadata"]["uid"] for m in (a, b)} == uids
    assert all((member_gpr(m, NS, "twin").get("status") or {}).get("phase") == "Admitted" for m in (a, b))
    w.hub.delete(f"{HUB_NS.format(ns=NS)}/twin")
    wait_for("the refused dispatch gone", lambda: f"{NS}.twin" not in dispatches(w, "member-a"), timeout=60)
    assert member_gpr(a, NS, "twin")["metadata"]["uid"] == uids["member-a"]  # still not touched
    for m in (a, b):
        m.cp.delete(f"{GPRS.format(ns=NS)}/twin")
        wait_for(f"{m.name}'s H100s free on the hub", partial(lambda m: reserved(w.hub, m.name, "H100") == 0, m),
                 timeout=30)
