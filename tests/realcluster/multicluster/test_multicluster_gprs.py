"""Many clusters, step 2 (issue 40.3): GPRs made on the hub run on a member, on three real API servers.

A fresh hub (no GPR controller runs there: only ``accelstack-hub``, under the shipped ``manifests/hub``
ServiceAccount) and two members, each with the product's own extender (webhooks) and GPR controller (``Stack``),
joined with the real ``kubectl accelstack cluster join``; each agent runs with the hub kubeconfig join stored in
its member (the real, scoped token). A pinned GPR is admitted by member-a's controller and its phase and
reservation come back to the hub; an unpinned one goes to the member with free GPUs and says why; the same name
in two hub namespaces makes two member GPRs; deleting a hub GPR deletes the member's; a missing namespace is
reported. Then member-a's agent stops: past ``--lost-after`` its never-started GPR is placed on member-b, its
Running one is reported Lost and is not duplicated, and when the agent comes back it drops the moved copy. A hub
Workspace listing both members is made there by each member's own workspace controller (namespace, Role) and
shows both in status.clusters; dropping member-b deletes its Workspace, never its namespace. Faults (40.5): the
hub's API server down past ``--lost-after`` (members keep admitting, agents 503 naming the hub, status catches up,
nothing judged Lost or moved), and member-a's hub ServiceAccount deleted (one log line, 503, no crash, Lost, member-b
untouched; join again makes it Ready).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from tests.realcluster.controlplane import Process
from tests.realcluster.mc_world import (
    HUB_NS,
    LOST_AFTER,
    SYSTEM,
    WORKSPACES,
    Member,
    World,
    cluster,
    condition,
    dispatches,
    hub_gpr,
    hub_status,
    member_gpr,
    namespace,
    not_ready,
    ready_with,
    readyz,
    reserved,
)
from tests.realcluster.objects import GPRS, gpr, wait_for
from tests.realcluster.stack import Product

SECONDS: dict[str, float] = {}
MADE = (("team-a", "pinned"), ("team-b", "pinned"), ("team-a", "moves"), ("team-c", "nowhere"))


@pytest.fixture(scope="module")
def world(mc_world: World) -> Iterator[World]:
    """The shared world; this module's GPRs (and its started pod) are deleted when it ends."""
    yield mc_world
    a = mc_world.members["member-a"]
    a.cp.delete("api/v1/namespaces/team-a/pods/pinned-0", force=True)
    mc_world.clean(*[k for k in MADE if hub_gpr(mc_world, *k)])


def test_hub_gprs_are_placed_admitted_by_members_mirrored_deleted_and_moved_off_a_lost_member(world: World) -> None:
    w = world
    a, b = w.members["member-a"], w.members["member-b"]
    started = time.monotonic()
    wait_for("both members Ready with 16 GPUs", lambda: ready_with(w.hub, "member-a", 16)
             and ready_with(w.hub, "member-b", 16), timeout=60)
    # ---- the GPR rights, with the real tokens join issued -------------------------------------------------------
    g, own, other = "gpuprovisioningrequests.accelstack.io", "accelstack-member-member-a", "accelstack-member-member-b"
    token_a = a.hub_kubeconfig()
    assert w.hub.can_i(token_a, "watch", g, namespace=own) and w.hub.can_i(token_a, "patch", g, namespace=own,
                                                                              subresource="status")
    for verb in ("create", "update", "delete"):  # the spec and the life of a dispatch are the hub's
        assert not w.hub.can_i(token_a, verb, g, namespace=own), verb
    for verb, ns in (("list", other), ("patch", other), ("list", "team-a"), ("list", "")):
        assert not w.hub.can_i(token_a, verb, g, namespace=ns or None), (verb, ns)
    agent_kc = a.cp.sa_kubeconfig(SYSTEM, "accelstack-member-agent")
    assert a.cp.can_i(agent_kc, "create", g, namespace="team-a") and a.cp.can_i(agent_kc, "delete", g,
                                                                                namespace="team-a")
    assert not a.cp.can_i(agent_kc, "patch", g, namespace="team-a", subresource="status")
    assert not a.cp.can_i(agent_kc, "create", "namespaces")
    hub_kc = w.hub.sa_kubeconfig(SYSTEM, "accelstack-hub")
    # Secrets: only get/delete in member namespaces (the workspace kubeconfig answers), never list, nowhere else
    assert w.hub.can_i(hub_kc, "create", g, namespace=own) and not w.hub.can_i(hub_kc, "list", "secrets",
                                                                                namespace=own)
    assert not w.hub.can_i(hub_kc, "get", "secrets", namespace=SYSTEM)
    # its writes are the per-member Role's: nothing created, patched or deleted outside the member namespaces
    for verb, what in (("create", g), ("delete", g), ("create", "configmaps"), ("patch", "configmaps"),
                       ("delete", "configmaps")):
        assert w.hub.can_i(hub_kc, verb, what, namespace=own), (verb, what)
        for ns in ("team-a", SYSTEM, "kube-system"):
            assert not w.hub.can_i(hub_kc, verb, what, namespace=ns), (verb, what, ns)
    for ns in ("team-a", "team-b"):
        for cp in (w.hub, a.cp, b.cp):
            namespace(cp, ns)
    namespace(w.hub, "team-c")  # on the hub only

    # ---- pinned: member-a's own controller admits it; phase and reservation come back to the hub -------------
    w.hub.create(HUB_NS.format(ns="team-a"), gpr("pinned", devices=8, clusterName="member-a", models=["H100"]))
    status = wait_for("the pinned GPR Admitted on member-a, seen on the hub",
                      lambda: hub_status(w, "team-a", "pinned", phase="Admitted", cluster="member-a"), timeout=60)
    assert status["reservation"] == [{"node": "a-h100", "devices": 8}]
    assert condition({"status": status}, "Placed") == {**condition({"status": status}, "Placed"), "status": "True",
                                                       "reason": "Pinned", "message": "spec.clusterName: member-a"}
    copy = member_gpr(a, "team-a", "pinned")
    assert "clusterName" not in copy["spec"] and copy["status"]["phase"] == "Admitted"
    origin_uid = hub_gpr(w, "team-a", "pinned")["metadata"]["uid"]
    assert copy["metadata"]["annotations"]["accelstack.io/origin"] == f"hub/team-a/pinned/{origin_uid}"
    assert member_gpr(b, "team-a", "pinned") == {}
    assert dispatches(w, "member-a") == ["team-a.pinned"] and dispatches(w, "member-b") == []

    # ---- unpinned: member-a's H100s are reserved, so it goes to member-b, which has them free -----------------
    wait_for("member-a's reservation on the hub", lambda: reserved(w.hub, "member-a", "H100") == 8, timeout=30)
    w.hub.create(HUB_NS.format(ns="team-a"), gpr("auto", devices=8, models=["H100"]))
    status = wait_for("the unpinned GPR Admitted on member-b",
                      lambda: hub_status(w, "team-a", "auto", phase="Admitted", cluster="member-b"), timeout=60)
    placed = condition({"status": status}, "Placed")
    assert placed["reason"] == "EarliestStart", placed
    assert placed["message"].startswith("member-b: 8 free nvidia.com/gpu now (free now); member-a: 0 free"), placed
    assert status["reservation"] == [{"node": "b-h100", "devices": 8}]

    # ---- the same name in two hub namespaces: two member GPRs, no clash; the second waits in member-a's queue --
    w.hub.create(HUB_NS.format(ns="team-b"), gpr("pinned", devices=8, clusterName="member-a", models=["H100"]))
    status = wait_for("team-b/pinned Queued on member-a with a position",
                      lambda: hub_status(w, "team-b", "pinned", phase="Queued", cluster="member-a", queuePosition=1),
                      timeout=60)
    assert member_gpr(a, "team-b", "pinned")["status"]["phase"] == "Queued"
    assert member_gpr(a, "team-a", "pinned")["status"]["phase"] == "Admitted"  # untouched
    assert dispatches(w, "member-a") == ["team-a.pinned", "team-b.pinned"]

    # ---- a namespace the member lacks: reported, never created by the agent -----------------------------------
    w.hub.create(HUB_NS.format(ns="team-c"), gpr("nowhere", devices=1, clusterName="member-b"))
    status = wait_for("NamespaceMissing on the hub", lambda: hub_status(w, "team-c", "nowhere",
                                                                        reason="NamespaceMissing"), timeout=60)
    assert "namespace team-c does not exist" in status["message"]
    assert b.cp.get("api/v1/namespaces/team-c") is None

    # ---- deleting the hub GPR deletes the dispatch and then the member's GPR -----------------------------------
    w.hub.delete(f"{HUB_NS.format(ns='team-a')}/auto")
    wait_for("team-a/auto gone from member-b", lambda: member_gpr(b, "team-a", "auto") == {}, timeout=60)
    assert "team-a.auto" not in dispatches(w, "member-b")

    # ---- a started GPR and a never-started one on member-a --------------------------------------------------
    a.cp.create("api/v1/namespaces/team-a/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pinned-0", "labels": {"accelstack.io/gpr": "pinned"}},
        "spec": {"nodeName": "a-h100", "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                                       "resources": {"requests": {"nvidia.com/gpu": "8"},
                                                                     "limits": {"nvidia.com/gpu": "8"}}}]}})
    a.cp.patch("api/v1/namespaces/team-a/pods/pinned-0/status", {"status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}], "startTime": "2026-01-01T00:00:00Z"}})
    wait_for("team-a/pinned Running on the hub", lambda: hub_status(w, "team-a", "pinned", phase="Running"),
             timeout=60)
    # A100 on both members, all free: a tie, so member-a by name; Admitted there, never started
    w.hub.create(HUB_NS.format(ns="team-a"), gpr("moves", devices=8, models=["A100"]))
    wait_for("team-a/moves Admitted on member-a",
             lambda: hub_status(w, "team-a", "moves", phase="Admitted", cluster="member-a"), timeout=60)

    # ---- member-a's agent stops: Lost; the never-started GPR moves, the Running one is reported Lost ---------
    assert a.agent is not None and a.agent.stop() == 0
    lost_at = time.monotonic()
    moved = wait_for("team-a/moves Admitted on member-b", lambda: hub_status(
        w, "team-a", "moves", phase="Admitted", cluster="member-b"), timeout=60)
    assert time.monotonic() - lost_at >= LOST_AFTER - 0.6  # not before the member is Lost
    replaced = condition({"status": moved}, "Replaced")
    assert replaced["status"] == "True" and "taken off member-a (Lost) where it was Admitted" in replaced["message"]
    assert moved["reservation"] == [{"node": "b-a100", "devices": 8}]
    assert dispatches(w, "member-a") == ["team-a.pinned", "team-b.pinned"]  # the old dispatch deleted first
    running = wait_for("team-a/pinned reported Lost", lambda: hub_status(w, "team-a", "pinned", reason="ClusterLost"),
                       timeout=30)
    assert running["phase"] == "Running" and running["cluster"] == "member-a"
    assert condition({"status": running}, "Lost")["status"] == "True"
    pinned_b = wait_for("team-b/pinned (pinned, queued) reported Lost, not moved",
                        lambda: hub_status(w, "team-b", "pinned", reason="ClusterLost"), timeout=30)
    assert pinned_b["cluster"] == "member-a"
    # never duplicated: nothing of the started or the pinned GPR on member-b, or in its hub namespace
    assert dispatches(w, "member-b") == ["team-a.moves", "team-c.nowhere"]
    assert member_gpr(b, "team-a", "pinned") == {} and member_gpr(b, "team-b", "pinned") == {}

    # ---- member-a's agent back: its copy of the moved GPR is deleted (its dispatch is gone), Lost cleared -----
    a.start_agent()
    wait_for("member-a's copy of team-a/moves deleted", lambda: member_gpr(a, "team-a", "moves") == {}, timeout=60)
    def running_not_lost() -> dict[str, Any] | None:
        s = hub_status(w, "team-a", "pinned", phase="Running")
        return s if s is not None and not condition({"status": s}, "Lost") else None

    back = wait_for("team-a/pinned Running again, not Lost", running_not_lost, timeout=60)
    assert back["cluster"] == "member-a"
    assert member_gpr(a, "team-a", "pinned")["status"]["phase"] == "Running"
    SECONDS["test body"] = time.monotonic() - started
    print(f"\nmulticluster GPR seconds: {json.dumps({k: round(v, 1) for k, v in SECONDS.items()})}")


# ---- Workspaces across clusters (issue 40.2): in the same world, no other plane started -------------------------
def member_workspace(m: Member, name: str) -> dict[str, Any]:
    return m.cp.get(f"{WORKSPACES}/{name}") or {}


def clusters_status(w: World, name: str) -> list[dict[str, Any]]:
    return list(((w.hub.get(f"{WORKSPACES}/{name}") or {}).get("status") or {}).get("clusters") or [])


def test_a_hub_workspace_is_made_by_each_listed_members_controller_and_leaves_a_dropped_member(world: World) -> None:
    w = world
    a, b = w.members["member-a"], w.members["member-b"]
    started = time.monotonic()
    # ---- the new rights, with the real tokens join issued --------------------------------------------------------
    own, other = "accelstack-member-member-a", "accelstack-member-member-b"
    token_a = a.hub_kubeconfig()
    assert w.hub.can_i(token_a, "watch", "configmaps", namespace=own) and w.hub.can_i(token_a, "patch", "configmaps",
                                                                                        namespace=own)
    for verb, ns in (("create", own), ("delete", own), ("list", other), ("get", "team-a"), ("list", "")):
        assert not w.hub.can_i(token_a, verb, "configmaps", namespace=ns or None), (verb, ns)
    assert not w.hub.can_i(token_a, "list", "workspaces.accelstack.io")
    agent_kc = a.cp.sa_kubeconfig(SYSTEM, "accelstack-member-agent")
    assert a.cp.can_i(agent_kc, "create", "workspaces.accelstack.io") and a.cp.can_i(
        agent_kc, "delete", "workspaces.accelstack.io")
    assert not a.cp.can_i(agent_kc, "patch", "workspaces.accelstack.io", subresource="status")
    assert not a.cp.can_i(agent_kc, "create", "namespaces") and not a.cp.can_i(agent_kc, "create", "roles",
                                                                                namespace="team-a")

    # ---- a hub workspace listing both members: each member's own controller makes its namespace and Role -----
    w.hub.create(WORKSPACES, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
                              "metadata": {"name": "span"},
                              "spec": {"namespaces": ["span-ns"], "clusters": ["member-a", "member-b"],
                                       "access": [{"kind": "User", "name": "alice", "role": "admin"}]}})
    uid = w.hub.get(f"{WORKSPACES}/span")["metadata"]["uid"]  # type: ignore[index]
    for m in (a, b):
        made = wait_for(f"span-ns made on {m.name}", partial(m.cp.get, "api/v1/namespaces/span-ns"), timeout=60)
        assert made["metadata"]["labels"]["accelstack.io/workspace"] == "span"
        copy = member_workspace(m, "span")
        assert copy["metadata"]["annotations"]["accelstack.io/origin"] == f"hub/span/{uid}"
        assert "clusters" not in copy["spec"] and copy["spec"]["namespaces"] == ["span-ns"]
        wait_for(f"the admin Role in span-ns on {m.name}", partial(m.cp.get,
            "apis/rbac.authorization.k8s.io/v1/namespaces/span-ns/roles/accelstack-workspace-admin"), timeout=60)

    def both_ready() -> list[dict[str, Any]] | None:
        rows = clusters_status(w, "span")
        return rows if len(rows) == 2 and all(r.get("ready") for r in rows) else None

    rows = wait_for("both members ready in the hub workspace's status", both_ready, timeout=60)
    assert [(r["name"], r["namespaces"]) for r in rows] == [("member-a", ["span-ns"]), ("member-b", ["span-ns"])]
    assert w.hub.get("api/v1/namespaces/span-ns") is None  # the hub makes nothing but carriers there

    # ---- member-b dropped: its Workspace goes (the namespace stays), member-a's stays ----------------------------
    a_uid = member_workspace(a, "span")["metadata"]["uid"]
    w.hub.patch(f"{WORKSPACES}/span", {"spec": {"clusters": ["member-a"]}})
    wait_for("member-b's Workspace deleted", lambda: member_workspace(b, "span") == {}, timeout=60)
    assert b.cp.get("api/v1/namespaces/span-ns") is not None  # never a namespace
    assert member_workspace(a, "span")["metadata"]["uid"] == a_uid
    wait_for("the hub status shows member-a only", lambda: [r["name"] for r in clusters_status(w, "span")]
             == ["member-a"], timeout=60)
    w.hub.delete(f"{WORKSPACES}/span")  # the shared world as it was: member-a's copy goes too
    wait_for("member-a's Workspace deleted", lambda: member_workspace(a, "span") == {}, timeout=60)
    SECONDS["workspace test body"] = time.monotonic() - started
    print(f"\nmulticluster workspace seconds: {json.dumps({k: round(v, 1) for k, v in SECONDS.items()})}")


# ---- Faults (issue 40.5): in the same world, no other plane started ---------------------------------------------
def heartbeat(w: World, name: str) -> str:
    return str((cluster(w.hub, name).get("status") or {}).get("lastHeartbeatTime") or "")


def log_lines(p: Product | None, after: int = 0) -> list[dict[str, Any]]:
    """The JSON lines a product process logged past byte ``after``."""
    assert p is not None
    text = p.log.read_bytes()[after:].decode(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_the_hub_down_members_keep_admitting_say_so_and_catch_up_without_a_false_lost(world: World) -> None:
    """The hub's API server down for longer than --lost-after: each member's own controller still admits a GPR
    made there, each agent's /readyz says 503 naming the hub in one line, and once the hub is back the Clusters'
    heartbeats move and they are Ready with no restart; the hub never judges a member Lost for its own outage,
    so a GPR it placed before (Admitted, not started) stays where it is."""
    w = world
    a, b = w.members["member-a"], w.members["member-b"]
    started = time.monotonic()
    before = {n: heartbeat(w, n) for n in w.members}
    moves = hub_status(w, "team-a", "moves", phase="Admitted", cluster="member-b")
    assert moves is not None, hub_gpr(w, "team-a", "moves")
    was_dispatched = {n: dispatches(w, n) for n in w.members}
    hub_log = w.hub_proc.log.stat().st_size if w.hub_proc is not None else 0
    w.hub.procs["kube-apiserver"].stop()
    down_at = time.monotonic()
    try:
        b.cp.create(GPRS.format(ns="team-a"), gpr("local", devices=8, models=["H100"]))
        wait_for("team-a/local Admitted by member-b's own controller, the hub down", lambda: (
            member_gpr(b, "team-a", "local").get("status") or {}).get("phase") == "Admitted", timeout=60)
        for m in (a, b):
            body = wait_for(f"{m.name}'s agent not ready", partial(not_ready, m), timeout=30)
            assert body.startswith("not ready: ") and "hub: " in body and body.count("\n") == 1, body
            assert m.agent is not None and m.agent.proc is not None and m.agent.proc.poll() is None
        # down past --lost-after by the hub's clock, so a stale verdict would say Lost
        time.sleep(max(0.0, LOST_AFTER + 1.0 - (time.monotonic() - down_at)))
    finally:
        w.hub.procs["kube-apiserver"] = Process("kube-apiserver", w.hub.apiserver_args,
                                                w.hub.dir / "kube-apiserver.log")
        w.hub.wait_ready()
    SECONDS["hub down"] = time.monotonic() - down_at
    def caught_up(n: str) -> bool:
        return heartbeat(w, n) != before[n] and condition(cluster(w.hub, n), "Ready").get("status") == "True"

    for n in w.members:
        wait_for(f"{n}'s heartbeat moves and it is Ready", partial(caught_up, n), timeout=60)
    for m in (a, b):
        wait_for(f"{m.name}'s agent ready again", partial(lambda m: readyz(m)[0] == 200, m), timeout=30)
    assert member_gpr(b, "team-a", "local")["status"]["phase"] == "Admitted"
    # never judged Lost for the hub's own outage: nothing moved, nothing logged as a Ready change
    assert hub_status(w, "team-a", "moves", phase="Admitted", cluster="member-b") is not None
    assert {n: dispatches(w, n) for n in w.members} == was_dispatched
    flips = [r for r in log_lines(w.hub_proc, hub_log) if r.get("msg") == "cluster Ready changed"]
    assert flips == [], flips
    b.cp.delete(f"{GPRS.format(ns='team-a')}/local")
    SECONDS["hub-down test body"] = time.monotonic() - started
    print(f"\nmulticluster fault seconds: {json.dumps({k: round(v, 1) for k, v in SECONDS.items()})}")


def test_a_members_revoked_credentials_one_line_not_ready_no_crash_lost_and_the_other_untouched(world: World) -> None:
    """Member-a's hub ServiceAccount deleted (every token join issued for it dies): its agent logs the refusal once,
    /readyz says 503 naming the hub, it keeps running (no crash loop) and deletes nothing of its own; its Cluster
    goes Lost after --lost-after while member-b stays Ready with its heartbeat moving and its GPRs where they were.
    Joining again issues a new token: the agent restarted with it is Ready."""
    w = world
    a, b = w.members["member-a"], w.members["member-b"]
    started = time.monotonic()
    assert a.agent is not None and a.agent.proc is not None
    pid, agent_log = a.agent.proc.pid, a.agent.log.stat().st_size
    b_dispatched, b_gprs = dispatches(w, "member-b"), sorted(
        o["metadata"]["name"] for o in b.cp.api("GET", GPRS.format(ns="team-a"))["items"])
    w.hub.delete("api/v1/namespaces/accelstack-member-member-a/serviceaccounts/member-agent")
    revoked_at = time.monotonic()
    body = wait_for("member-a's agent not ready", partial(not_ready, a), timeout=30)
    assert body.startswith("not ready: ") and "hub: " in body and body.count("\n") == 1, body
    wait_for("member-a Lost on the hub", lambda: condition(cluster(w.hub, "member-a"), "Lost").get("status")
             == "True", timeout=60)
    assert time.monotonic() - revoked_at >= LOST_AFTER - 0.6
    beat = heartbeat(w, "member-b")
    wait_for("member-b's heartbeat still moves", lambda: heartbeat(w, "member-b") != beat, timeout=30)
    assert condition(cluster(w.hub, "member-b"), "Ready").get("status") == "True"
    assert dispatches(w, "member-b") == b_dispatched
    assert sorted(o["metadata"]["name"] for o in b.cp.api("GET", GPRS.format(ns="team-a"))["items"]) == b_gprs
    time.sleep(1.0)  # a few more refused retries: still the same process, nothing of its own deleted
    assert a.agent.proc.poll() is None and a.agent.proc.pid == pid
    assert member_gpr(a, "team-a", "pinned")["status"]["phase"] == "Running"
    assert member_gpr(a, "team-b", "pinned") != {}
    problems = [r for r in log_lines(a.agent, agent_log) if r.get("level") in ("warning", "error")]
    print("\nagent lines after the revocation:", json.dumps(problems)[:3000])
    refused = [r for r in problems if r.get("msg", "").startswith("cannot write the Cluster status")]
    assert len(refused) == 1 and "401" in refused[0].get("error", ""), problems
    assert not [r for r in problems if r.get("level") == "error"], problems
    SECONDS["revoked test body"] = time.monotonic() - started

    # ---- join again: a new ServiceAccount and token; the agent restarted with it is Ready ------------------------
    res = w.join("member-a")
    assert res.returncode == 0, res.stderr
    assert "hub: ServiceAccount member-agent in accelstack-member-member-a: created" in res.stdout, res.stdout
    a.agent.stop()
    a.start_agent()
    wait_for("member-a Ready again", lambda: condition(cluster(w.hub, "member-a"), "Ready").get("status") == "True",
             timeout=60)
    SECONDS["revoked test body, with the rejoin"] = time.monotonic() - started
    print(f"\nmulticluster fault seconds: {json.dumps({k: round(v, 1) for k, v in SECONDS.items()})}")
