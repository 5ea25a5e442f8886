"""GPRs are reserved only where their pods' CPU and memory requests fit (issue #10: the cluster is the truth).

kube-scheduler's NodeResourcesFit keeps a pod off a node whose allocatable CPU or memory the pods bound there
already request, accelstack's or not. A GPR reserved on such a node holds devices its pods can never use (narrowed
to the reservation, they wait Pending until the GPR's idle timeout or exitDuration). So the controller counts,
per node, what every live bound pod requests and what the unbound pods of the GPRs holding it will request, and
places a queued GPR only where its pods at the gate fit; an Admitted GPR whose pods came after it and do not fit
its nodes goes elsewhere before any of them runs."""

from __future__ import annotations

import time
from typing import Any

from scheduler_extender.controller.gpr_pass import plan_pass
from scheduler_extender.controller.host_use import host_need
from scheduler_extender.controller.pass_cache import PassCache
from scheduler_extender.controller.pass_types import PassConfig, Plan, Snapshot
from scheduler_extender.objects.cluster import GPU, ClusterView
from scheduler_extender.objects.gpr_codec import rfc3339
from tests.extender.harness import gpr, node, pod


def cpu_pod(name: str, gpus: int, cpu: str, *, memory: str = "1Gi", **kw: Any) -> dict[str, Any]:
    p = pod(name, gpus, uid=kw.pop("uid", name), **kw)
    p["spec"]["containers"][0]["resources"]["requests"].update(cpu=cpu, memory=memory)
    if not gpus:
        del p["spec"]["containers"][0]["resources"]["limits"][GPU]
        del p["spec"]["containers"][0]["resources"]["requests"][GPU]
    return p


def big_node(name: str, gpus: int = 8, cpu: str = "32", memory: str = "256Gi") -> dict[str, Any]:
    obj = node(name, gpus)
    alloc = {**obj["status"]["allocatable"], "cpu": cpu, "memory": memory}
    obj["status"]["allocatable"] = obj["status"]["capacity"] = alloc
    return obj


def queued(name: str, index: int, devices: int = 1, **status: Any) -> dict[str, Any]:
    obj = gpr(name, phase=None, devices=devices, exitDuration="1h")
    obj["metadata"].update(uid=f"u-{name}", resourceVersion=str(index + 1),
                           creationTimestamp=f"2026-11-30T00:{index // 60:02d}:{index % 60:02d}Z")
    if status:
        obj["status"] = status
    return obj


def run(nodes: list[dict[str, Any]], pods: list[dict[str, Any]], gprs: list[dict[str, Any]]) -> Plan:
    """One pass over the objects as the controller's informers hold them (ClusterView: every pod's CPU and memory
    counted on its node, whether it asks for a device or not)."""
    view = ClusterView((GPU,))
    view.sync_nodes(nodes)
    view.sync_pods(pods)
    snap = Snapshot(time.time(), dict(view.nodes), dict(view.pods), {g["metadata"]["uid"]: g for g in gprs},
                    {}, dict(view.host_used))
    return plan_pass(snap, PassConfig(), PassCache())


def reserved(plan: Plan) -> dict[str, list[str]]:
    return {w.key: [r["node"] for r in w.status.get("reservation") or []] for w in plan.writes
            if w.status.get("phase") == "Admitted"}


def test_a_gpr_goes_where_its_pods_cpu_fits_not_only_where_its_devices_do() -> None:
    """``busy`` has the fewest free GPUs (best fit would take it) but its CPU is nearly all requested: by a pod
    with GPUs outside any GPR and by a web server that asks for no device at all."""
    nodes = [big_node("busy"), big_node("idle")]
    others = [cpu_pod("train", 4, "4", node_name="busy", phase="Running"),
              cpu_pod("web", 0, "24", node_name="busy", phase="Running")]
    big = run(nodes, [*others, cpu_pod("g-0", 1, "8", gpr="g", gated=True)], [queued("g", 0)])
    assert reserved(big) == {"default/g": ["idle"]}
    # a pod that fits the 4 cores left still packs onto the busy node
    small = run(nodes, [*others, cpu_pod("g-0", 1, "3", gpr="g", gated=True)], [queued("g", 0)])
    assert reserved(small) == {"default/g": ["busy"]}
    # memory counts the same way (2 of the 256 GiB are requested already)
    hungry = run(nodes, [*others, cpu_pod("g-0", 1, "1", memory="255Gi", gpr="g", gated=True)], [queued("g", 0)])
    assert reserved(hungry) == {"default/g": ["idle"]}
    # a web server that finished gives its CPU back
    done = [others[0], cpu_pod("web", 0, "24", node_name="busy", phase="Succeeded")]
    assert reserved(run(nodes, [*done, cpu_pod("g-0", 1, "8", gpr="g", gated=True)], [queued("g", 0)])) == \
        {"default/g": ["busy"]}


def test_gprs_admitted_in_one_pass_share_a_nodes_cpu_without_overcommitting_it() -> None:
    """Ten one-GPU GPRs whose pods ask for 10 of a node's 32 cores: three fit a node, whatever its free GPUs."""
    nodes = [big_node(f"n{i}") for i in range(4)]
    gprs = [queued(f"g{i}", i) for i in range(10)]
    pods = [cpu_pod(f"g{i}-0", 1, "10", gpr=f"g{i}", gated=True) for i in range(10)]
    placed = reserved(run(nodes, pods, gprs))
    assert len(placed) == 10
    per_node: dict[str, int] = {}
    for names in placed.values():
        for n in names:
            per_node[n] = per_node.get(n, 0) + 1
    assert max(per_node.values()) == 3, per_node


def test_the_cpu_an_admitted_gprs_unbound_pods_will_ask_for_is_kept_for_them() -> None:
    """``a`` holds n0 and its pods wait at the gate (and one was let go, not yet bound): what they will request
    stays theirs, so ``b`` (asking for 20 of the 32 cores) goes to n1 though n0 has more GPUs in use."""
    nodes = [big_node("n0"), big_node("n1", gpus=8)]
    a = queued("a", 0, devices=4, phase="Admitted", reservation=[{"node": "n0", "devices": 4}],
               admittedAt=rfc3339(time.time() - 5))
    pods = [cpu_pod(f"a-{i}", 1, "4", gpr="a", gated=i < 2) for i in range(3)]
    pods.append(cpu_pod("a-3", 1, "4", gpr="a", node_name="n0", phase="Running"))
    plan = run(nodes, [*pods, cpu_pod("b-0", 1, "20", gpr="b", gated=True)], [a, queued("b", 1)])
    assert reserved(plan).get("default/b") == ["n1"]
    # once all of a's pods are bound, what they request is counted once (as bound pods), not twice
    bound = [cpu_pod(f"a-{i}", 1, "4", gpr="a", node_name="n0", phase="Running") for i in range(4)]
    plan = run(nodes, [*bound, cpu_pod("b-0", 1, "16", gpr="b", gated=True)], [a, queued("b", 1)])
    assert reserved(plan).get("default/b") == ["n0"]


def test_an_admitted_gpr_whose_later_pods_do_not_fit_its_node_goes_elsewhere_before_any_runs() -> None:
    """Admitted from its spec alone (its Job came later) onto a node whose CPU other pods took: given back and
    placed again, with no failure counted; once a pod of it runs there, it stays."""
    nodes = [big_node("busy"), big_node("idle")]
    early = queued("early", 0, phase="Admitted", reservation=[{"node": "busy", "devices": 1}],
                   admittedAt=rfc3339(time.time() - 5))
    web = cpu_pod("web", 0, "30", node_name="busy", phase="Running")
    plan = run(nodes, [web, cpu_pod("early-0", 1, "8", gpr="early", gated=True)], [early])
    written = {w.key: w.status for w in plan.writes}
    assert written["default/early"]["phase"] == "Admitted", written
    assert [r["node"] for r in written["default/early"]["reservation"]] == ["idle"]
    assert not written["default/early"].get("failures")
    assert any(e.kind == "requeued" and "CPU or memory" in e.detail for _, e in plan.events)
    # its pods fit where it is: nothing moves
    plan = run(nodes, [web, cpu_pod("early-0", 1, "2", gpr="early", gated=True)], [early])
    assert reserved(plan).get("default/early", ["busy"]) == ["busy"]
    assert not any(e.kind == "requeued" for _, e in plan.events)
    # one of its pods runs there already: it keeps its node
    ran = cpu_pod("early-1", 1, "1", gpr="early", node_name="busy", phase="Running")
    plan = run(nodes, [web, ran, cpu_pod("early-0", 1, "8", gpr="early", gated=True)], [early])
    assert reserved(plan).get("default/early", ["busy"]) == ["busy"]
    assert not any(e.kind == "requeued" for _, e in plan.events)


def test_a_node_that_states_no_cpu_is_no_limit_and_a_pod_too_big_for_every_node_waits() -> None:
    bare = node("bare", gpus=8)
    del bare["status"]["allocatable"]["cpu"], bare["status"]["allocatable"]["memory"]
    plan = run([bare], [cpu_pod("g-0", 1, "500", gpr="g", gated=True)], [queued("g", 0)])
    assert reserved(plan) == {"default/g": ["bare"]}
    plan = run([big_node("n0")], [cpu_pod("g-0", 1, "64", gpr="g", gated=True)], [queued("g", 0)])
    assert reserved(plan) == {}
    assert {w.key: w.status["phase"] for w in plan.writes} == {"default/g": "Queued"}
    cannot = [c for c in plan.writes[0].status["conditions"] if c["type"] == "PodsCannotRun"]
    assert cannot and "64000m CPU" in cannot[0]["message"] and "at most 32000m CPU" in cannot[0]["message"], cannot


def test_a_gprs_need_per_node_is_its_largest_pods_spread_evenly() -> None:
    from scheduler_extender.core.gpr import GPR
    from scheduler_extender.objects.cluster import pod_view

    def views(*cpus: str, ended: int = 0, gpus: int = 1) -> list[Any]:
        out = []
        for i, c in enumerate(cpus):
            v = pod_view(cpu_pod(f"p{i}", gpus, c, phase="Succeeded" if i < ended else "Pending"), (GPU,))
            assert v is not None
            out.append(v)
        return out

    assert host_need(views("1", "2", "3", "4"), GPR("g", devices_per_node=4)) == (10_000, 4096)
    # two a node: the two largest
    assert host_need(views("1", "2", "3", "4"), GPR("g", devices_per_node=2, node_count=2)) == (7000, 2048)
    # three on two nodes: two on one of them
    assert host_need(views("1", "2", "3"), GPR("g", devices_per_node=2, node_count=2)) == (5000, 2048)
    # a pod that ended needs nothing
    assert host_need(views("8", "2", ended=1), GPR("g", devices_per_node=2)) == (2000, 1024)
    # more pods than the node's devices take at once (a Job's parallelism above the GPR): as many as they take
    assert host_need(views("1", "2", "3", "4"), GPR("g", devices_per_node=2)) == (7000, 2048)
    assert host_need(views("1", "2", "3", "4", gpus=2), GPR("g", devices_per_node=4)) == (7000, 2048)
    assert host_need([], GPR("g", node_count=3)) == (0, 0)


def test_evicting_a_lower_priority_gpr_frees_the_cpu_its_pods_hold() -> None:
    """``low``'s pod holds 4 of n0's GPUs and 28 of its 32 cores; ``high`` asks for the 4 free GPUs and 16 cores:
    only evicting ``low`` makes room, and the eviction plan must count the CPU its pod gives back."""
    nodes = [big_node("n0")]
    low = queued("low", 0, devices=4, phase="Running", reservation=[{"node": "n0", "devices": 4}],
                 admittedAt=rfc3339(time.time() - 600), startedAt=rfc3339(time.time() - 590))
    low["spec"].update(priority=50, preemptible=True)
    high = queued("high", 1, devices=4)
    high["spec"].update(priority=250, enableEviction=True)
    pods = [cpu_pod("low-0", 4, "28", gpr="low", node_name="n0", phase="Running"),
            cpu_pod("high-0", 4, "16", gpr="high", gated=True)]
    plan = run(nodes, pods, [low, high])
    written = {w.key: w.status.get("phase") for w in plan.writes}
    assert written.get("default/low") == "Evicting", written
    assert [e.pod.name for e in plan.evictions] == ["low-0"]
    # a pod that fits beside it: no eviction
    pods[1] = cpu_pod("high-0", 4, "4", gpr="high", gated=True)
    plan = run(nodes, pods, [low, high])
    assert reserved(plan).get("default/high") == ["n0"] and not plan.evictions


def test_a_queued_gpr_waiting_only_for_cpu_says_so() -> None:
    """n0's GPUs are free but a web server requests 30 of its 32 cores: the GPR waits, and its status says it is
    the CPU, not the devices; once the web server is gone it is admitted and the condition goes."""
    nodes = [big_node("n0")]
    web = cpu_pod("web", 0, "30", node_name="n0", phase="Running")
    plan = run(nodes, [web, cpu_pod("g-0", 1, "8", gpr="g", gated=True)], [queued("g", 0)])
    status = {w.key: w.status for w in plan.writes}["default/g"]
    assert status["phase"] == "Queued"
    cannot = [c for c in status["conditions"] if c["type"] == "PodsCannotRun"]
    assert cannot and cannot[0]["reason"] == "InsufficientHostResources" and "8000m CPU" in cannot[0]["message"]
    # the devices are what is missing (another pod holds them all): not the CPU's fault, nothing said
    hog = cpu_pod("hog", 8, "1", node_name="n0", phase="Running")
    plan = run(nodes, [hog, cpu_pod("g-0", 1, "8", gpr="g", gated=True)], [queued("g", 0)])
    status = {w.key: w.status for w in plan.writes}["default/g"]
    assert not [c for c in status.get("conditions") or [] if c["type"] == "PodsCannotRun"], status
    done = cpu_pod("web", 0, "30", node_name="n0", phase="Succeeded")
    assert reserved(run(nodes, [done, cpu_pod("g-0", 1, "8", gpr="g", gated=True)], [queued("g", 0)])) == \
        {"default/g": ["n0"]}
