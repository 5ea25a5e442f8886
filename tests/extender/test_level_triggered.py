"""The GPR controller is level-triggered: what it decides is derived from the API objects at each pass, so node
changes, restarts and new leaders change nothing, names can be reused, edits are taken, devices held outside
GPRs are respected, and an eviction is not done until the victim's pods are gone (issue #10, points 1-3, 8, 9)."""

from __future__ import annotations

import copy
import time
from typing import Any

import orjson

from scheduler_extender.objects.ledger import LEDGER_ANNOTATION
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, pod, stack, wait_until
from tests.extender.test_controller import FAST, GPRS, seed_nodes, set_phase, status

PODS = "api/v1/pods"
NODES = "api/v1/nodes"


class Clock:
    """The controller's clock (leader election keeps real time): tests move it past backoffs and timeouts."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


async def recreate_stack_after(peer: APIServerPeer, **kwargs: Any) -> Any:
    return stack(peer, **{**FAST, **kwargs})


async def test_a_failed_gpr_stays_failed_across_node_changes_and_new_leaders() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer)
    await peer.put_object(GPRS, gpr("once", phase=None, devices=2, requeueOnFailure=False))
    await peer.put_object(PODS, pod("once-0", 2, gpr="once", gated=True))
    async with stack(peer, **FAST):
        await wait_until(lambda: status(peer, "once").get("phase") == "Admitted")
        node_name = status(peer, "once")["reservedNodes"][0]
        await set_phase(peer, "once-0", "Failed", node_name)
        await wait_until(lambda: status(peer, "once").get("phase") == "Failed")
        assert status(peer, "once")["failures"] == 1
        await peer.put_object("api/v1/nodes", node("n9", gpus=8))  # a node is added ...
        await peer.delete_object("api/v1/nodes", "", "n1")  # ... and one removed
        await peer.put_object(PODS, pod("once-1", 2, gpr="once", gated=True))  # its Job makes a new pod
        await wait_until(lambda: "n9" in {n for n in _cluster_nodes(peer)})
    async with stack(peer, **FAST):  # a new leader starts from the API server's state
        await wait_until(lambda: status(peer, "once").get("phase") == "Failed", timeout=3)
        await _stays(lambda: status(peer, "once").get("phase") == "Failed" and status(peer, "once")["failures"] == 1)
        assert peer.get(PODS, "default", "once-1")["spec"].get("schedulingGates")  # type: ignore[index]
    await peer.stop()


def _cluster_nodes(peer: APIServerPeer) -> list[str]:
    return [name for (r, _, name) in peer.objects if r == "api/v1/nodes"]


async def _stays(predicate: Any, seconds: float = 1.0, what: Any = None) -> None:
    import asyncio

    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        assert predicate(), what() if what else ""
        await asyncio.sleep(0.05)


async def test_devices_held_outside_gprs_are_not_given_to_a_gpr() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer)  # n0, n1: 4 GPUs each
    # a workload that was running before accelstack (no GPR, no ledger entry) holds 3 GPUs of n0
    await peer.put_object(PODS, pod("legacy", 3, node_name="n0", phase="Running"))
    # best fit would pack a 2-GPU GPR onto the fuller node if it did not know about that pod
    await peer.put_object(GPRS, gpr("two", phase=None, devices=2))
    async with stack(peer, **FAST) as (_, server):
        await wait_until(lambda: status(peer, "two").get("phase") == "Admitted")
        assert status(peer, "two")["reservedNodes"] == ["n1"]
        # and a pod still terminating keeps its devices until it is gone
        await peer.put_object(PODS, pod("leaving", 4, node_name="n1", phase="Running"))
        obj = peer.get(PODS, "default", "leaving")
        assert obj is not None
        obj["metadata"]["deletionTimestamp"] = "2026-11-30T00:00:00Z"
        await peer.put_object(PODS, obj, "MODIFIED")
        # (watches of different kinds are not ordered: let the pod's change arrive before the GPR)
        await wait_until(lambda: any(p.terminating for p in server.view.pods.values()))
        await peer.put_object(GPRS, gpr("one", phase=None, devices=2))  # n0 has 1 free, n1 none while it leaves
        await _stays(lambda: status(peer, "one").get("phase", "Queued") == "Queued", what=lambda: status(peer, "one"))
        await peer.delete_object(PODS, "default", "leaving")
        await wait_until(lambda: status(peer, "one").get("phase") == "Admitted")
    await peer.stop()


async def test_a_reused_name_is_a_new_gpr_and_spec_edits_are_taken() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)
    await peer.put_object(GPRS, gpr("job", phase=None, devices=4))
    await peer.put_object(PODS, pod("job-0", 4, gpr="job", gated=True))
    async with stack(peer, **FAST):
        await wait_until(lambda: status(peer, "job").get("phase") == "Admitted")
        await set_phase(peer, "job-0", "Succeeded", "n0")
        await wait_until(lambda: status(peer, "job").get("phase") == "Complete")
        # the Job is deleted and applied again: same GPR name, new object
        await peer.delete_object(GPRS, "default", "job")
        await peer.delete_object(PODS, "default", "job-0")
        await peer.put_object(GPRS, gpr("job", phase=None, devices=4))
        await peer.put_object(PODS, pod("job-0", 4, gpr="job", gated=True))
        await wait_until(lambda: status(peer, "job").get("phase") == "Admitted")
        await wait_until(lambda: not peer.get(PODS, "default", "job-0")["spec"].get("schedulingGates"))  # type: ignore[index]
        # two GPRs wait behind it; raising the later one's priority moves it to the front
        await peer.put_object(GPRS, gpr("first", phase=None, devices=4, priority=100))
        await peer.put_object(GPRS, gpr("second", phase=None, devices=4, priority=100))
        await wait_until(lambda: status(peer, "second").get("queuePosition") == 2)
        edited = peer.get(GPRS, "default", "second")
        assert edited is not None
        edited["spec"]["priority"] = 300
        edited["metadata"]["generation"] = 2
        await peer.put_object(GPRS, edited, "MODIFIED")
        await wait_until(lambda: status(peer, "second").get("queuePosition") == 1
                         and status(peer, "second").get("observedGeneration") == 2
                         and status(peer, "first").get("queuePosition") == 2)
    await peer.stop()


async def test_life_cycle_across_two_replicas_is_the_same_as_on_one() -> None:
    """Admit, run, fail, requeue with backoff, fail again past the retry limit, recreate the name, edit the
    priority — with the leader changing in between each step."""
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)
    clock = Clock()
    opts = {"clock": clock}
    await peer.put_object(GPRS, gpr("retry", phase=None, devices=4, requeueOnFailure=True, retryLimit=1))
    await peer.put_object(PODS, pod("retry-0", 4, gpr="retry", gated=True))
    async with stack(peer, **FAST, **opts):
        await wait_until(lambda: status(peer, "retry").get("phase") == "Admitted")
        await set_phase(peer, "retry-0", "Running", "n0")
        await wait_until(lambda: status(peer, "retry").get("phase") == "Running")
        await set_phase(peer, "retry-0", "Failed", at=clock())
        await wait_until(lambda: status(peer, "retry").get("phase") == "Queued")
    st = status(peer, "retry")
    assert st["failures"] == 1 and st["nextRetryTime"] and st["reason"] == "Backoff" and "after failure 1" in st["message"]
    await peer.delete_object(PODS, "default", "retry-0")
    await peer.put_object(PODS, pod("retry-1", 4, gpr="retry", gated=True))
    async with stack(peer, **FAST, **opts):  # a new leader honours the recorded backoff
        await _stays(lambda: status(peer, "retry").get("phase") == "Queued"
                     and status(peer, "retry").get("nextRetryTime") == st["nextRetryTime"])
        clock.offset += 61  # the first backoff is 60 s
        await wait_until(lambda: status(peer, "retry").get("phase") == "Admitted")
        assert "nextRetryTime" not in status(peer, "retry")
        await set_phase(peer, "retry-1", "Failed", "n0", at=clock())
        await wait_until(lambda: status(peer, "retry").get("phase") == "Failed")
    assert status(peer, "retry")["failures"] == 2  # past retryLimit 1: final
    async with stack(peer, **FAST, **opts):
        clock.offset += 7200
        await _stays(lambda: status(peer, "retry").get("phase") == "Failed" and status(peer, "retry")["failures"] == 2)
        await peer.delete_object(GPRS, "default", "retry")
        await peer.put_object(GPRS, gpr("retry", phase=None, devices=4, priority=50))
        await wait_until(lambda: status(peer, "retry").get("phase") == "Admitted")
        assert status(peer, "retry")["failures"] == 0
    await peer.stop()


async def test_an_admitted_gpr_whose_pods_never_start_ends_at_its_idle_timeout() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)
    clock = Clock()
    await peer.put_object(GPRS, gpr("idle", phase=None, devices=4, idleTimeout="60s", enforceIdleTimeout=True,
                                    exitDuration="24h"))
    async with stack(peer, **FAST, clock=clock):
        await wait_until(lambda: status(peer, "idle").get("phase") == "Admitted")
        clock.offset += 61
        await wait_until(lambda: status(peer, "idle").get("phase") == "Complete")
        assert status(peer, "idle")["reason"] == "IdleTimeout"
    await peer.stop()


OWN_TERMS = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}]}]}}}


async def relabel(peer: APIServerPeer, hostnames: dict[str, str | None]) -> None:
    """Set (or, with None, remove) the nodes' kubernetes.io/hostname labels."""
    for n, hostname in hostnames.items():
        obj = copy.deepcopy(peer.get(NODES, "", n))
        assert obj is not None
        labels = obj["metadata"]["labels"]
        if hostname is None:
            labels.pop("kubernetes.io/hostname", None)
        else:
            labels["kubernetes.io/hostname"] = hostname
        await peer.put_object(NODES, obj, "MODIFIED")


async def test_ungating_narrows_the_pod_to_its_reserved_nodes_after_the_status_is_written() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 3)
    # a hostname label need not be the node's name (cloud nodes)
    await relabel(peer, {n: f"ip-10-0-0-{n[1:]}" for n in ("n0", "n1", "n2")})
    own = copy.deepcopy(OWN_TERMS)
    p = pod("w-0", 2, gpr="w", gated=True)
    p["spec"]["affinity"] = own
    await peer.put_object(PODS, p)
    await peer.put_object(PODS, pod("w-1", 2, gpr="w", gated=True))
    await peer.put_object(GPRS, gpr("w", phase=None, devices=2, nodes=2))
    async with stack(peer, **FAST):
        await wait_until(lambda: not peer.get(PODS, "default", "w-0")["spec"].get("schedulingGates"))  # type: ignore[index]
        reserved = sorted(status(peer, "w")["reservedNodes"])
        assert status(peer, "w")["phase"] == "Admitted" and len(reserved) == 2
        terms = peer.get(PODS, "default", "w-0")["spec"]["affinity"]["nodeAffinity"][  # type: ignore[index]
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        # the user's own term is kept (a gated pod's terms may only gain requirements), narrowed to the reserved
        # nodes by their hostname labels: a node field selector takes one name, and two nodes are two names
        hostnames = sorted(peer.get(NODES, "", n)["metadata"]["labels"]["kubernetes.io/hostname"]  # type: ignore[index]
                           for n in reserved)
        assert terms == [{"matchExpressions": [
            *own["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
                "matchExpressions"],
            {"key": "kubernetes.io/hostname", "operator": "In", "values": hostnames}]}]
        await wait_until(lambda: not peer.get(PODS, "default", "w-1")["spec"].get("schedulingGates"))  # type: ignore[index]
        other = peer.get(PODS, "default", "w-1")["spec"]["affinity"]  # type: ignore[index]
        # no term of its own: a term per reserved node, which kube-scheduler's NodeAffinity PreFilter reads as
        # "only these nodes"
        assert other == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]} for n in reserved]}}}
        refused = [r for r in peer.log if r.plural == "pods" and r.verb == "patch" and r.status != 200]
        assert not refused, refused
    await peer.stop()


async def test_a_pod_of_its_own_terms_on_nodes_without_a_hostname_label_is_ungated_unnarrowed() -> None:
    """Without the nodes' hostname labels the reservation cannot be named inside the user's terms: the gate is
    lifted all the same (filter keeps the pod on its reservation), never a patch the API server refuses."""
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 2)
    await relabel(peer, {"n0": None, "n1": None})
    own = copy.deepcopy(OWN_TERMS)
    p = pod("w-0", 2, gpr="w", gated=True)
    p["spec"]["affinity"] = own
    await peer.put_object(PODS, p)
    await peer.put_object(GPRS, gpr("w", phase=None, devices=2, nodes=2))
    async with stack(peer, **FAST):
        await wait_until(lambda: not peer.get(PODS, "default", "w-0")["spec"].get("schedulingGates"))  # type: ignore[index]
        assert peer.get(PODS, "default", "w-0")["spec"]["affinity"] == own  # type: ignore[index]
        refused = [r for r in peer.log if r.plural == "pods" and r.verb == "patch" and r.status != 200]
        assert not refused, refused
    await peer.stop()


async def test_an_unreadable_ledger_neither_evicts_nor_receives_work() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 2)
    await peer.put_object(GPRS, gpr("busy", phase=None, devices=2))
    await peer.put_object(PODS, pod("busy-0", 2, gpr="busy", gated=True))
    async with stack(peer, **FAST) as (_, server):
        await wait_until(lambda: status(peer, "busy").get("phase") == "Admitted")
        held = status(peer, "busy")["reservedNodes"][0]
        other = "n1" if held == "n0" else "n0"
        await set_phase(peer, "busy-0", "Running", held)
        await wait_until(lambda: status(peer, "busy").get("phase") == "Running")
        for name in (held, other):  # a hand edit (or a newer accelstack) leaves ledgers this one cannot read
            obj = peer.get("api/v1/nodes", "", name)
            assert obj is not None
            obj["metadata"].setdefault("annotations", {})[LEDGER_ANNOTATION] = (
                "{not json" if name == held else orjson.dumps({"v": 99, "pods": {}}).decode())
            await peer.put_object("api/v1/nodes", obj, "MODIFIED")
        # (watches of different kinds are not ordered: let the nodes' change arrive before the GPR)
        await wait_until(lambda: all(n.ledger_error for n in server.view.nodes.values()))
        await peer.put_object(GPRS, gpr("new", phase=None, devices=1))
        await _stays(lambda: status(peer, "busy").get("phase") == "Running"
                     and status(peer, "new").get("phase", "Queued") == "Queued",
                     what=lambda: (status(peer, "busy"), status(peer, "new")))
        assert peer.evicted == []
        annotations = peer.get("api/v1/nodes", "", held)["metadata"]["annotations"]  # type: ignore[index]
        assert annotations[LEDGER_ANNOTATION] == "{not json"  # never overwritten
    await peer.stop()


async def test_auto_gprs_whose_pod_never_came_are_deleted() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)
    orphan = gpr("orphan", phase=None, devices=1)
    orphan["metadata"]["labels"] = {"accelstack.io/auto-gpr": "true"}
    used = gpr("used", phase=None, devices=1)
    used["metadata"]["labels"] = {"accelstack.io/auto-gpr": "true"}
    mine = gpr("mine", phase=None, devices=1)  # made by a user: never deleted by the controller
    for obj in (orphan, used, mine):
        await peer.put_object(GPRS, obj)
    await peer.put_object(PODS, pod("used-0", 1, gpr="used", gated=True))
    async with stack(peer, **FAST, orphan_grace=0.0):
        await wait_until(lambda: peer.get(GPRS, "default", "orphan") is None)
        await _stays(lambda: peer.get(GPRS, "default", "used") is not None
                     and peer.get(GPRS, "default", "mine") is not None, 0.5)
    await peer.stop()


async def test_an_ungated_pod_narrowed_to_a_reservation_its_gpr_lost_is_evicted() -> None:
    """Node affinity can only be narrowed: a pod that was ungated for a reservation its GPR no longer holds
    (requeued, failed) could never be placed; it is evicted so its owner makes a new, gated one."""
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)
    await peer.put_object(GPRS, gpr("big", phase=None, devices=4, priority=200))  # takes the only node
    await peer.put_object(GPRS, gpr("late", phase="Queued", devices=4))
    stranded = pod("late-0", 4, gpr="late")
    stranded["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gone"]}]}]}}}
    waiting = pod("late-1", 4, gpr="late", gated=True)  # still at the gate: it waits, untouched
    mine = pod("other", 4)  # not ours: never touched
    for p in (stranded, waiting, mine):
        await peer.put_object(PODS, p)
    async with stack(peer, **FAST):
        await wait_until(lambda: "default/late-0" in peer.evicted)
        await _stays(lambda: "default/late-1" not in peer.evicted and "default/other" not in peer.evicted, 0.5)
    await peer.stop()


def test_a_relist_never_takes_back_a_newer_version_this_controller_holds() -> None:
    """A list served while the controller stored an admission carries the GPR as it was before: taken as is, the
    GPR's nodes would look free to the next pass and be given to another GPR (two reservations on one node)."""
    from scheduler_extender.controller.gpr_controller import GPRController
    from scheduler_extender.objects.cluster import ClusterView

    ctl = GPRController(None, ClusterView())  # type: ignore[arg-type]  # informer callbacks only: no API calls

    def version(name: str, uid: str, rv: int, phase: str | None, reservation: dict[str, int] | None = None
                ) -> dict[str, Any]:
        obj = gpr(name, phase=phase, devices=4, reservation=reservation)
        obj["metadata"].update(uid=uid, resourceVersion=str(rv))
        return obj

    ctl.sync_gprs([version("x", "uid-x", 10, None), version("y", "uid-y", 11, None)])
    admitted = version("x", "uid-x", 20, "Admitted", {"n0": 4})
    ctl.on_gpr("MODIFIED", admitted)  # its own status write, as the controller stores it
    # the relist: x as it was at resourceVersion 10, y newer than held, z new; w was deleted meanwhile
    ctl.sync_gprs([version("x", "uid-x", 10, None), version("y", "uid-y", 25, None), version("z", "uid-z", 26, None)])
    assert ctl.objects["uid-x"] is admitted
    assert ctl.objects["uid-y"]["metadata"]["resourceVersion"] == "25"
    assert set(ctl.objects) == {"uid-x", "uid-y", "uid-z"}
    ctl.sync_gprs([version("y", "uid-y", 25, None)])  # x deleted: gone, whatever version was held
    assert set(ctl.objects) == {"uid-y"} and ctl._uids == {"default/y": "uid-y"}


async def test_a_gpr_deleted_while_its_status_was_written_is_not_brought_back() -> None:
    """The DELETED event reaches the controller before its status write's answer: the answer must not put the GPR
    back in the view (no event would remove it; its devices would look reserved until a relist)."""
    from scheduler_extender.controller.gpr_controller import GPRController
    from scheduler_extender.objects.cluster import ClusterView

    obj = gpr("x", phase="Queued", devices=4)
    obj["metadata"].update(uid="uid-x", resourceVersion="10")

    class DeletedMeanwhile:
        async def replace_gpr_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
            ctl.on_gpr("DELETED", obj)
            return {**body, "metadata": {**body["metadata"], "resourceVersion": "11"}}

    ctl = GPRController(DeletedMeanwhile(), ClusterView())  # type: ignore[arg-type]
    ctl.on_gpr("ADDED", obj)
    assert await ctl._write("uid-x", {"phase": "Admitted", "reservation": {"n0": 4}})
    assert ctl.objects == {} and ctl._uids == {}


async def test_nodes_are_given_to_a_gpr_only_once_the_status_that_frees_them_is_stored() -> None:
    """A pass that sees a GPR finish gives its node to the next one. Were the admission stored while the
    finished GPR's status write fails, the API objects would say both hold the node, and every later pass
    (built from those objects) would have to judge one of them lost."""
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer, 1)  # n0: 4 GPUs
    await peer.put_object(GPRS, gpr("first", phase=None, devices=4, priority=200))
    await peer.put_object(PODS, pod("first-0", 4, gpr="first", gated=True))
    await peer.put_object(GPRS, gpr("next", phase=None, devices=4, priority=100))
    async with stack(peer, **FAST):
        await wait_until(lambda: status(peer, "first").get("phase") == "Admitted")
        await set_phase(peer, "first-0", "Running", "n0")
        await wait_until(lambda: status(peer, "first").get("phase") == "Running")
        fault = peer.inject("PUT", "gpuprovisioningrequests", name="first", subresource="status", status=500)
        await set_phase(peer, "first-0", "Succeeded", "n0")
        await wait_until(lambda: fault.hits >= 3)  # the pass decided, and keeps deciding, that first is done
        await _stays(lambda: status(peer, "next").get("phase", "Queued") == "Queued", 0.5,
                     what=lambda: (status(peer, "first"), status(peer, "next")))
        fault.remove()
        await wait_until(lambda: status(peer, "next").get("phase") == "Admitted")
        assert status(peer, "first")["phase"] == "Complete"
        assert not status(peer, "next").get("failures")
    await peer.stop()


async def test_a_new_leader_reads_the_gprs_afresh_before_its_first_pass() -> None:
    """The last leader admitted x onto n0 just before it stepped down; this replica's watch has not brought that
    yet (a broken watch relisting with backoff). Its first pass must not see x queued and give n0 to y."""
    import asyncio

    from kubernetes_asyncio import client as k8s

    from kubeapi import KubeClient
    from scheduler_extender.controller.gpr_controller import GPRController
    from scheduler_extender.objects.cluster import ClusterView
    from scheduler_extender.objects.kube import Kube

    peer = APIServerPeer()
    await peer.start()
    n0 = await peer.put_object("api/v1/nodes", node("n0", gpus=4))
    x = await peer.put_object(GPRS, gpr("x", phase=None, devices=4, priority=100))
    y = await peer.put_object(GPRS, gpr("y", phase=None, devices=4, priority=200))
    gone = await peer.put_object(GPRS, gpr("gone", phase=None, devices=1))
    view = ClusterView()
    view.sync_nodes([n0])
    api = k8s.ApiClient(k8s.Configuration(host=peer.url))
    ctl = GPRController(Kube(KubeClient(api, field_manager="accelstack-controller")), view, resync=0.05)
    ctl.sync_gprs([x, y, gone])  # what its watch brought
    admitted = {**x, "status": {"phase": "Admitted", "reservation": [{"node": "n0", "devices": 4}],
                                "observedGeneration": 1}}
    await peer.put_object(GPRS, admitted, "MODIFIED")  # the last leader's final write
    await peer.delete_object(GPRS, "default", "gone")
    peer.inject("GET", "gpuprovisioningrequests", verb="list", status=503, times=2)  # and the API server struggles
    stop = asyncio.Event()
    term = asyncio.create_task(ctl.run(stop))
    try:
        await wait_until(lambda: ctl.passes >= 3)
        assert status(peer, "y").get("phase", "Queued") == "Queued", status(peer, "y")
        assert status(peer, "x")["phase"] == "Admitted"
        assert {o["metadata"]["name"] for o in ctl.objects.values()} == {"x", "y"}
    finally:
        stop.set()
        await term
        await api.close()
        await peer.stop()


async def test_a_gpr_moving_nodes_frees_them_before_another_is_given_them() -> None:
    """One pass requeues an Evicting GPR whose pods are gone and places it elsewhere (its write frees n0 and takes
    n1) and gives n0 to another GPR. Were the second write stored while the first failed, the stored statuses
    would reserve n0 twice; it waits until the move is stored."""
    peer = APIServerPeer()
    await peer.start()
    await peer.put_object(NODES, node("n0", gpus=4, labels={"nvidia.com/gpu.product": "H100"}))
    await peer.put_object(NODES, node("n1", gpus=4, labels={"nvidia.com/gpu.product": "A100"}))
    mover = gpr("mover", phase="Evicting", reservation={"n0": 4}, devices=4, priority=50, exitDuration="1h")
    mover["status"].update(evictions=1, admittedAt="2026-12-02T00:00:00Z")
    await peer.put_object(GPRS, mover)
    await peer.put_object(GPRS, gpr("hi", phase=None, devices=4, priority=250, models=["H100"]))
    fault = peer.inject("PUT", "gpuprovisioningrequests", name="mover", subresource="status", status=500)
    async with stack(peer, **FAST):
        await wait_until(lambda: fault.hits >= 3)  # the move was tried, pass after pass, and failed
        assert status(peer, "mover")["phase"] == "Evicting"
        assert status(peer, "hi").get("phase") != "Admitted"  # n0 is not given while the mover's status holds it
        fault.remove()
        await wait_until(lambda: status(peer, "hi").get("phase") == "Admitted")
        assert status(peer, "hi")["reservedNodes"] == ["n0"]
        assert status(peer, "mover")["phase"] == "Admitted" and status(peer, "mover")["reservedNodes"] == ["n1"]
    # never, in the API server's history, were n0's devices reserved twice
    holding: dict[str, dict[str, int]] = {}
    for _, resource, kind, obj in peer.events:
        if resource == GPRS and kind != "DELETED":
            st = obj.get("status") or {}
            holding[obj["metadata"]["name"]] = ({r["node"]: r["devices"] for r in st.get("reservation") or []}
                                                if st.get("phase") in ("Admitted", "Running", "Evicting") else {})
            on_n0 = sum(h.get("n0", 0) for h in holding.values())
            assert on_n0 <= 4, holding
    await peer.stop()


async def test_a_status_write_answered_500_but_stored_is_read_back_before_the_next_pass() -> None:
    """The API server stores an admission and answers 500 (or no answer comes). Planned from the version the write
    replaced, the next pass would see the GPR queued and could give its nodes to another GPR before the watch
    brings the stored one (the whole-path fault test once stored two reservations on one node that way): the
    controller reads the GPR back at once."""
    from kubernetes_asyncio import client as k8s

    from kubeapi import KubeClient
    from scheduler_extender.controller.gpr_controller import GPRController
    from scheduler_extender.objects.cluster import ClusterView
    from scheduler_extender.objects.kube import Kube

    peer = APIServerPeer()
    await peer.start()
    n0 = await peer.put_object("api/v1/nodes", node("n0", gpus=4))
    x = await peer.put_object(GPRS, gpr("x", phase=None, devices=4))
    view = ClusterView()
    view.sync_nodes([n0])
    api = k8s.ApiClient(k8s.Configuration(host=peer.url))
    ctl = GPRController(Kube(KubeClient(api, field_manager="accelstack-controller")), view, resync=0.05)
    ctl.sync_gprs([x])  # no informer runs: only what the controller reads itself reaches it
    fault = peer.inject("PUT", "gpuprovisioningrequests", subresource="status", status=500, lands=True, times=1)
    try:
        await ctl.reconcile()
        assert fault.hits == 1 and status(peer, "x")["phase"] == "Admitted"  # stored, answered 500
        held = next(iter(ctl.objects.values()))
        assert held["status"]["phase"] == "Admitted", held.get("status")  # read back: what the next pass plans from
    finally:
        await api.close()
        await peer.stop()
