"""Bare pods admitted at once without a GPR (``accelstack-extender --auto-gpr-direct``): when no GPR of the
resource waits and the namespace's template asks for no more than one node's free devices, is not preemptible and
no quota counts GPRs, the webhook pins the pod to a node with free devices instead of creating a GPR and gating the
pod (a GPR's create and status write cost kube-apiserver 7.4 ms a pod, docs/performance.md). The node's devices
are the pod's from the answer on: the next admissions count them (packing a node, then the next), the filter and
the controller's passes count them on that node before the pod is bound, and the controller needs no pass for such
a pod while nothing waits. Whenever any condition fails, a GPR is made and the pod gated, as without the flag."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from scheduler_extender.admission.webhook import Webhook, handed_over
from scheduler_extender.cmd import extender as extender_cmd
from scheduler_extender.cmd.server import direct_as_pinned
from scheduler_extender.controller.gpr_pass import plan_pass
from scheduler_extender.controller.pass_cache import PassCache
from scheduler_extender.controller.pass_types import PassConfig, Snapshot
from scheduler_extender.objects.cluster import DIRECT_LABEL, GPU, ClusterView, node_view, pod_view
from service.flags import UsageError
from tests.extender.harness import gpr, node
from tests.extender.test_webhook import MemoryLookup
from tests.extender.test_workspace_admission import join, workspace

NS = "team-a"
TEMPLATE = {"resource": GPU, "devicesPerNode": 1, "nodeCount": 1, "priority": 100, "exitDuration": "4h",
            "preemptible": False}


def cluster(nodes: int = 3, gpus: int = 8) -> ClusterView:
    view = ClusterView(ledger="memory")
    view.sync_nodes([node(f"n{i}", gpus=gpus) for i in range(nodes)])
    view.sync_gprs([])
    view.sync_pods([])
    return view


def lookup_with(template: dict[str, Any] | None = None, **annotations: str) -> MemoryLookup:
    lookup = MemoryLookup()
    lookup.namespace(NS, **{"accelstack.io/default-template": "one", **annotations})
    lookup.template(NS, "one", dict(TEMPLATE if template is None else template))
    return lookup


def bare(name: str, gpus: int = 1, cpu: str = "", **meta: Any) -> dict[str, Any]:
    requests = {GPU: str(gpus), **({"cpu": cpu} if cpu else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, **meta},
            "spec": {"containers": [{"name": "c", "resources": {"requests": requests, "limits": {GPU: str(gpus)}}}]}}


def apply(obj: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """``obj`` after the add operations of a JSON patch (all the webhook answers with)."""
    out = json.loads(json.dumps(obj))
    for op in patch:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        at = out
        for part in parents:
            at = at[int(part)] if isinstance(at, list) else at[part]
        if isinstance(at, list):
            at.append(op["value"]) if last == "-" else at.insert(int(last), op["value"])
        else:
            at[last] = op["value"]
    return out


def admit(hook: Webhook, obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the answer, the pod as stored: patched and given a UID)."""
    req = {"uid": f"review-{obj['metadata']['name']}", "operation": "CREATE", "namespace": NS, "object": obj}
    answer = asyncio.run(hook._mutate_pod(req))["response"]
    assert answer["allowed"], answer
    stored = apply(obj, json.loads(base64.b64decode(answer.get("patch") or "W10=")))
    stored["metadata"]["uid"] = f"uid-{obj['metadata']['name']}"
    return answer, stored


def pinned_to(obj: dict[str, Any]) -> str:
    terms = obj["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert len(terms) == 1 and terms[0]["matchFields"][0]["key"] == "metadata.name", terms
    (name,) = terms[0]["matchFields"][0]["values"]
    return str(name)


def webhook(lookup: MemoryLookup, view: ClusterView, *, direct: bool = True, pin: bool = True,
            registry: CollectorRegistry | None = None) -> Webhook:
    return Webhook(lookup, auto_gpr=True, auto_gpr_direct=direct, view=view, pin=lambda: pin,  # type: ignore[arg-type]
                   registry=registry or CollectorRegistry())


def test_a_bare_pod_is_admitted_at_once_with_no_gpr_and_the_nodes_are_packed_one_by_one() -> None:
    view, lookup = cluster(), lookup_with()
    registry = CollectorRegistry()
    hook = webhook(lookup, view, registry=registry)
    answer, stored = admit(hook, bare("p0"))
    assert lookup.created == []  # no GPR object
    assert stored["metadata"]["labels"] == {DIRECT_LABEL: "true"}
    assert stored["metadata"]["annotations"] == {"accelstack.io/default-template": "one"}
    assert "schedulingGates" not in stored["spec"]
    assert stored["spec"]["activeDeadlineSeconds"] == 4 * 3600  # the template's exitDuration, kept by the kubelet
    assert pinned_to(stored) == "n0"
    assert any("without a GPR" in w and "n0" in w for w in answer.get("warnings", []))
    # eight one-GPU pods fill n0 (the pins ahead count), the ninth goes to n1; a 4-GPU pod then fits on n1 too
    nodes = [pinned_to(admit(hook, bare(f"p{i}"))[1]) for i in range(1, 9)]
    assert nodes == ["n0"] * 7 + ["n1"]
    assert view.pinned_share("n0", "", GPU) == 8
    assert pinned_to(admit(hook, bare("big", gpus=4))[1]) == "n1"
    assert lookup.created == []
    assert registry.get_sample_value("accelstack_webhook_bare_pods_total", {"how": "admitted"}) == 10


def test_the_cpu_of_pods_admitted_at_once_counts_on_their_node_before_they_are_bound() -> None:
    """kube-scheduler counts a pod's CPU on its node only once it is bound: pods pinned to a node by devices alone
    could be more than its CPU holds, and would wait there for ever (a pinned pod goes nowhere else). The nodes
    have 8 CPUs: two 3-CPU pods on n0, the third on n1, seen or not, bound or not."""
    view, lookup = cluster(nodes=2), lookup_with()
    hook = webhook(lookup, view)
    first = [admit(hook, bare(f"p{i}", cpu="3"))[1] for i in range(2)]
    assert [pinned_to(p) for p in first] == ["n0", "n0"]
    view.on_pod("ADDED", first[0])  # seen, waiting: counted from the pod now, not from the pin ahead
    assert pinned_to(admit(hook, bare("p2", cpu="3"))[1]) == "n1"
    bound = json.loads(json.dumps(first[0]))
    bound["spec"]["nodeName"] = "n0"
    view.on_pod("MODIFIED", bound)  # bound: the host count has it now
    assert view.host_used["n0"][0] == 3000 and view.pinned_host("n0") == (3000, 0)  # the other one, ahead
    assert pinned_to(admit(hook, bare("p3", cpu="5"))[1]) == "n1"  # 3 + 5: n1 is full now
    assert pinned_to(admit(hook, bare("p4", cpu="2"))[1]) == "n0"  # 3 bound + 3 waiting + 2 = 8, no more
    _, stored = admit(hook, bare("p5", cpu="1"))  # no CPU left on either: a GPR is made
    assert stored["metadata"]["labels"] == {"accelstack.io/gpr": "p5"}


def test_nodes_replaced_by_as_many_others_are_looked_at() -> None:
    """The webhook keeps the nodes in name order between calls: two nodes deleted and two others made (the same
    count) must not leave it looking at the old ones."""
    view, lookup = cluster(nodes=2), lookup_with()
    hook = webhook(lookup, view)
    assert pinned_to(admit(hook, bare("p"))[1]) == "n0"
    for name in ("n0", "n1"):
        view.on_node("DELETED", node(name, gpus=8))
    for name in ("m0", "m1"):
        view.on_node("ADDED", node(name, gpus=8))
    assert pinned_to(admit(hook, bare("q"))[1]) == "m0"


def test_a_pod_of_its_own_deadline_keeps_the_shorter_one() -> None:
    view, lookup = cluster(), lookup_with()
    obj = bare("short")
    obj["spec"]["activeDeadlineSeconds"] = 60
    _, stored = admit(webhook(lookup, view), obj)
    assert stored["spec"]["activeDeadlineSeconds"] == 60
    _, stored = admit(webhook(lookup_with({k: v for k, v in TEMPLATE.items() if k != "exitDuration"}), cluster()),
                      bare("open"))
    assert "activeDeadlineSeconds" not in stored["spec"]


def case_waiting(view: ClusterView, lookup: MemoryLookup) -> None:
    view.on_gpr("ADDED", gpr("queued", phase="Queued", namespace="other"))


def case_full(view: ClusterView, lookup: MemoryLookup) -> None:
    hook = webhook(lookup_with(), view)
    for i in range(3):
        admit(hook, bare(f"fill{i}", gpus=8))


def case_quota(view: ClusterView, lookup: MemoryLookup) -> None:
    lookup.workspaces["ws"] = workspace("ws", [NS], {"devices": [{"resource": GPU, "max": 100}]})
    join(lookup, NS, "ws", **{"accelstack.io/default-template": "one"})


@pytest.mark.parametrize("why, change", [
    ("a GPR of the resource waits", case_waiting),
    ("no node has the devices free", case_full),
    ("the template is preemptible", lambda v, lk: lk.template(NS, "one", {**TEMPLATE, "preemptible": True})),
    ("the template asks for two nodes", lambda v, lk: lk.template(NS, "one", {**TEMPLATE, "nodeCount": 2})),
    ("the template retries on failure", lambda v, lk: lk.template(NS, "one", {**TEMPLATE, "requeueOnFailure": True})),
    ("the namespace limits its GPRs", lambda v, lk: lk.namespace(
        NS, **{"accelstack.io/default-template": "one", "accelstack.io/max-gprs": "5"})),
    ("its workspace has a device quota", case_quota),
    ("the flag is off", "off"),
])
def test_whenever_a_gpr_would_add_something_one_is_made_and_the_pod_gated(why: str, change: Any) -> None:
    view, lookup = cluster(), lookup_with()
    if callable(change):
        change(view, lookup)
    hook = webhook(lookup, view, direct=change != "off")
    _, stored = admit(hook, bare("p"))
    assert [g["metadata"]["name"] for g in lookup.created] == ["p"], why
    assert stored["metadata"]["labels"] == {"accelstack.io/gpr": "p"}, why
    assert stored["spec"]["schedulingGates"] == [{"name": "accelstack.io/gpr"}], why
    assert "affinity" not in stored["spec"], why


def test_gprs_that_wait_for_a_quota_a_backoff_or_a_bigger_cluster_do_not_hold_bare_pods_back() -> None:
    """The controller admits others past a GPR held by its workspace's quota, backing off or too big for the
    cluster: so does the webhook. One that waits for devices (or was not looked at yet) holds them back."""
    view, lookup = cluster(), lookup_with()
    hook = webhook(lookup, view)
    for i, reason in enumerate(("WorkspaceQuota", "ModelQuota", "Unschedulable", "Backoff")):
        obj = gpr(f"q{i}", phase="Queued", namespace="other")
        obj["status"]["reason"] = reason
        view.on_gpr("ADDED", obj)
    _, stored = admit(hook, bare("p"))
    assert stored["metadata"]["labels"] == {DIRECT_LABEL: "true"} and lookup.created == []
    obj = gpr("q0", phase="Queued", namespace="other")
    obj["status"]["reason"] = "InsufficientCapacity"
    view.on_gpr("MODIFIED", obj)
    _, stored = admit(hook, bare("p2"))
    assert stored["metadata"]["labels"] == {"accelstack.io/gpr": "p2"}


def test_a_pod_gated_by_another_system_gets_a_gpr() -> None:
    view, lookup = cluster(), lookup_with()
    obj = bare("p")
    obj["spec"]["schedulingGates"] = [{"name": "example.com/quota"}]
    _, stored = admit(webhook(lookup, view), obj)
    assert stored["metadata"]["labels"] == {"accelstack.io/gpr": "p"}
    assert {g["name"] for g in stored["spec"]["schedulingGates"]} == {"example.com/quota", "accelstack.io/gpr"}


def test_called_again_for_a_pod_it_admitted_the_same_node_and_no_second_pin() -> None:
    view, lookup = cluster(), lookup_with()
    hook = webhook(lookup, view)
    _, stored = admit(hook, bare("p"))
    again = dict(stored, metadata={k: v for k, v in stored["metadata"].items() if k != "uid"})
    _, twice = admit(hook, again)
    assert pinned_to(twice) == pinned_to(stored) == "n0"
    assert view.pinned_share("n0", "", GPU) == 1
    # a pod that arrives carrying the label and a pin no admission gave is judged afresh like any other
    forged = bare("forged", gpus=8, labels={DIRECT_LABEL: "true"})
    forged["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}]}}}
    _, stored = admit(hook, forged)
    assert pinned_to(stored) == "n2" and view.pinned_share("n2", "", GPU) == 8  # it got a pin of its own
    full = bare("late", gpus=8, labels={DIRECT_LABEL: "true"})
    full["spec"]["affinity"] = forged["spec"]["affinity"]
    _, stored = admit(hook, full)  # n2 is taken now: a GPR is made for it
    assert stored["metadata"]["labels"]["accelstack.io/gpr"] == "late"
    assert pod_view(stored, (GPU,)).direct is False  # type: ignore[union-attr]


def test_the_view_counts_a_pod_admitted_at_once_on_its_node_until_it_is_bound_there() -> None:
    view, lookup = cluster(nodes=1), lookup_with()
    hook = webhook(lookup, view)
    _, stored = admit(hook, bare("p", gpus=3))
    assert view.pinned_share("n0", "", GPU) == 3  # ahead of the pod
    view.on_pod("ADDED", stored)
    assert view.pinned_share("n0", "", GPU) == 3 and not view.pins_ahead  # the pod's own, not the pin's too
    bound = json.loads(json.dumps(stored))
    bound["spec"]["nodeName"] = "n0"
    view.on_pod("MODIFIED", bound)
    assert view.pinned_share("n0", "", GPU) == 0 and view.nodes["n0"].used[GPU] == 3
    # five left on n0: a 6-GPU pod finds none and gets a GPR
    _, stored = admit(hook, bare("six", gpus=6))
    assert stored["metadata"]["labels"] == {"accelstack.io/gpr": "six"}


def test_the_controller_counts_a_pod_admitted_at_once_on_its_node_before_it_is_bound() -> None:
    """A GPR that arrives after the pod's admission, before its bind, is not given the pod's devices (a warm pass
    plans what a cold one plans)."""
    view, lookup = cluster(nodes=1, gpus=2), lookup_with()
    _, stored = admit(webhook(lookup, view), bare("p"))
    pod = pod_view(stored, (GPU,))
    assert pod is not None and pod.direct and pod.place == "n0" and not pod.node
    nodes = {"n0": node_view(node("n0", gpus=2), (GPU,))}
    now, warm = time.time(), PassCache()
    plan_pass(Snapshot(now, nodes, {}, {}), PassConfig(), warm)
    obj = gpr("g", phase=None, devices=2, namespace="other")
    obj["metadata"].update(uid="ug", resourceVersion="7", creationTimestamp="2026-11-30T00:00:00Z")
    a = plan_pass(Snapshot(now + 1, nodes, {pod.uid: pod}, {"ug": obj}), PassConfig(), warm)
    b = plan_pass(Snapshot(now + 1, nodes, {pod.uid: pod}, {"ug": obj}), PassConfig(), PassCache())
    assert [w.status["phase"] for w in a.writes] == [w.status["phase"] for w in b.writes] == ["Queued"]
    gone = plan_pass(Snapshot(now + 2, nodes, {}, {"ug": obj}), PassConfig(), warm)  # the pod deleted
    assert [w.status["phase"] for w in gone.writes] == ["Admitted"]


def test_the_controller_needs_no_pass_for_a_pod_admitted_at_once_while_nothing_waits() -> None:
    view, lookup = cluster(), lookup_with()
    _, stored = admit(webhook(lookup, view), bare("p"))
    new = pod_view(stored, (GPU,))
    bound = json.loads(json.dumps(stored))
    bound["spec"]["nodeName"] = "n0"
    on_node = pod_view(bound, (GPU,))
    assert direct_as_pinned(view, None, new) and direct_as_pinned(view, new, on_node)
    elsewhere = json.loads(json.dumps(bound))
    elsewhere["spec"]["nodeName"] = "n1"
    assert not direct_as_pinned(view, new, pod_view(elsewhere, (GPU,)))
    ended = json.loads(json.dumps(bound))
    ended["status"] = {"phase": "Succeeded"}
    assert not direct_as_pinned(view, on_node, pod_view(ended, (GPU,)))  # devices given back: a pass
    view.on_gpr("ADDED", gpr("held", phase="Admitted", reservation={"n0": 1}, namespace="other"))
    assert not direct_as_pinned(view, None, new)  # a GPR holds devices on its node
    view.on_gpr("ADDED", gpr("held", phase="Admitted", reservation={"n2": 1}, namespace="other"))
    assert direct_as_pinned(view, None, new)
    view.on_gpr("ADDED", gpr("queued", phase="Queued", namespace="other"))
    assert not direct_as_pinned(view, None, new)  # a GPR waits: its estimate may move
    view.on_gpr("DELETED", gpr("queued", phase="Queued", namespace="other"))
    assert not view.waiting and direct_as_pinned(view, None, new)


def test_the_flag_needs_auto_gpr_and_the_memory_ledger_and_no_require_gpr() -> None:
    with pytest.raises(UsageError, match="--auto-gpr-direct: needs --auto-gpr=true"):
        extender_cmd.parse(["--auto-gpr-direct=true"], environ={})
    with pytest.raises(UsageError, match="--auto-gpr-direct: needs --ledger=memory"):
        extender_cmd.parse(["--auto-gpr=true", "--auto-gpr-direct=true", "--insecure-verbs=true"], environ={})
    with pytest.raises(UsageError, match="--require-gpr=true refuses"):
        extender_cmd.parse(["--auto-gpr=true", "--auto-gpr-direct=true", "--ledger=memory", "--require-gpr=true",
                            "--insecure-verbs=true"], environ={})
    opts = extender_cmd.parse(["--auto-gpr=true", "--auto-gpr-direct=true", "--ledger=memory",
                               "--insecure-verbs=true"], environ={})
    assert opts["auto_gpr_direct"] is True


class PodLookup(MemoryLookup):
    """MemoryLookup with the pods the binder reads afresh and patches (JSON patches applied as the API server
    applies the add, replace and test ops; merge patches of labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.patches: list[tuple[str, Any]] = []

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return json.loads(json.dumps(self.pods[(namespace, name)])) if (namespace, name) in self.pods else None

    async def patch_pod(self, namespace: str, name: str, patch: Any) -> None:
        self.patches.append((name, patch))
        obj = self.pods[(namespace, name)]
        if isinstance(patch, list):
            for op in patch:
                if op["op"] == "test":
                    *parents, last = op["path"].split("/")[1:]
                    at = obj
                    for part in parents:
                        at = at[part]
                    assert at.get(last) == op["value"], op
            obj = apply(obj, [op for op in patch if op["op"] == "add"])
            for op in patch:
                if op["op"] == "replace":
                    *parents, last = [p.replace("~1", "/") for p in op["path"].split("/")[1:]]
                    at = obj
                    for part in parents:
                        at = at[part]
                    at[last] = op["value"]
        else:
            labels = obj["metadata"].setdefault("labels", {})
            for key, value in patch["metadata"]["labels"].items():
                if value is None:
                    labels.pop(key, None)
                else:
                    labels[key] = value
        self.pods[(namespace, name)] = obj


def handed(lookup: PodLookup, view: ClusterView, name: str, seen: bool = True) -> dict[str, Any]:
    """A pod the replica that does not answer the verbs held for the binder, stored, and (``seen``) in the binder's
    view."""
    _, stored = admit(webhook(lookup, cluster(), pin=False), bare(name))
    lookup.pods[(NS, name)] = stored
    if seen:
        view.on_pod("ADDED", stored)
    return stored


def test_a_replica_that_does_not_answer_the_verbs_holds_the_pod_at_the_gate_for_the_one_that_does() -> None:
    """Its view lacks the binder's pins, so it pins nothing: with a node free in its view the pod is labelled
    pending and gated (no GPR); called again for it, it leaves it so."""
    view, lookup = cluster(), lookup_with()
    registry = CollectorRegistry()
    other = webhook(lookup, view, pin=False, registry=registry)
    answer, stored = admit(other, bare("p"))
    assert lookup.created == [] and handed_over(stored)
    assert stored["metadata"]["labels"] == {DIRECT_LABEL: "pending"}
    assert stored["spec"]["schedulingGates"] == [{"name": "accelstack.io/gpr"}]
    assert "affinity" not in stored["spec"] and stored["spec"]["activeDeadlineSeconds"] == 4 * 3600
    assert not view.pins_ahead and any("pins it to a node" in w for w in answer["warnings"])
    assert registry.get_sample_value("accelstack_webhook_bare_pods_total", {"how": "held"}) == 1
    again = dict(stored, metadata={k: v for k, v in stored["metadata"].items() if k != "uid"})
    req = {"uid": "again", "operation": "CREATE", "namespace": NS, "object": again}
    assert "patch" not in asyncio.run(other._mutate_pod(req))["response"]
    view.on_gpr("ADDED", gpr("queued", phase="Queued", namespace="other"))  # something waits: a GPR, as ever
    _, stored = admit(other, bare("q"))
    assert stored["metadata"]["labels"] == {"accelstack.io/gpr": "q"}


def test_the_binder_admits_a_handed_over_pod_at_once_or_gives_it_a_gpr() -> None:
    lookup = PodLookup()
    lookup.namespace(NS, **{"accelstack.io/default-template": "one"})
    lookup.template(NS, "one", dict(TEMPLATE))
    view, registry = cluster(), CollectorRegistry()
    binder = webhook(lookup, view, registry=registry)
    stored = handed(lookup, view, "p")
    assert asyncio.run(binder._hand_off(stored["metadata"]["uid"], NS, "p")) is True
    now = lookup.pods[(NS, "p")]
    assert now["metadata"]["labels"] == {DIRECT_LABEL: "true"} and now["spec"]["schedulingGates"] == []
    assert pinned_to(now) == "n0" and view.pinned_share("n0", "", GPU) == 1 and lookup.created == []
    # something waits now: the next one gets a GPR (made, the pod relabelled, still gated for the controller)
    view.on_gpr("ADDED", gpr("queued", phase="Queued", namespace="other"))
    stored = handed(lookup, view, "q")
    assert asyncio.run(binder._hand_off(stored["metadata"]["uid"], NS, "q")) is True
    assert [registry.get_sample_value("accelstack_webhook_bare_pods_total", {"how": how})
            for how in ("handed-admitted", "handed-gpr")] == [1, 1]
    now = lookup.pods[(NS, "q")]
    assert now["metadata"]["labels"] == {"accelstack.io/gpr": "q"} and [g["metadata"]["name"] for g in lookup.created] == ["q"]
    assert now["spec"]["schedulingGates"] == [{"name": "accelstack.io/gpr"}]
    # gone, or settled by another: nothing to do
    assert asyncio.run(binder._hand_off("no-such-uid", NS, "q")) is True


def test_a_handed_over_pod_seen_pinned_ends_its_pin_ahead() -> None:
    """The binder's patch pins a pod its view had seen unpinned (held at the gate): when the view sees it pinned,
    the pin ahead the binder gave it ends, or its devices would count twice for the pin's 30 s."""
    lookup = PodLookup()
    lookup.namespace(NS, **{"accelstack.io/default-template": "one"})
    lookup.template(NS, "one", dict(TEMPLATE))
    view = cluster()
    stored = handed(lookup, view, "p")
    assert asyncio.run(webhook(lookup, view)._hand_off(stored["metadata"]["uid"], NS, "p")) is True
    assert view.pinned_share("n0", "", GPU) == 1 and view.pins_ahead  # ahead of the event
    view.on_pod("MODIFIED", lookup.pods[(NS, "p")])
    assert view.pinned_share("n0", "", GPU) == 1 and not view.pins_ahead  # the pod's own now, once
    assert view.pinned_host("n0") == view._direct_host.get("n0", (0, 0))


def test_the_binders_loop_admits_what_is_handed_over_only_while_it_answers_the_verbs() -> None:
    lookup = PodLookup()
    lookup.namespace(NS, **{"accelstack.io/default-template": "one"})
    lookup.template(NS, "one", dict(TEMPLATE))
    view, binding = cluster(), [False]
    binder = Webhook(lookup, auto_gpr=True, auto_gpr_direct=True, view=view,  # type: ignore[arg-type]
                     pin=lambda: binding[0])
    first = handed(lookup, view, "p")  # in the view before the loop starts (as a relist brings it)
    second = handed(lookup, view, "q", seen=False)

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(binder.hand_offs(stop, every=0.05))
        await asyncio.sleep(0.2)
        assert lookup.patches == []  # not the binder: it waits
        binding[0] = True
        for _ in range(100):
            if lookup.patches:
                break
            await asyncio.sleep(0.02)
        view.on_pod("ADDED", second)
        binder.on_pod("ADDED", second)  # an event wakes it
        for _ in range(100):
            if len(lookup.patches) == 2:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # its view still shows them pending (no informer here): read afresh, left alone
        stop.set()
        await task

    asyncio.run(run())
    assert [name for name, _ in lookup.patches] == ["p", "q"], lookup.patches  # each patched once
    assert all(lookup.pods[(NS, n)]["metadata"]["labels"] == {DIRECT_LABEL: "true"} for n in ("p", "q"))
    assert first["metadata"]["uid"] != second["metadata"]["uid"]
