"""Detection of accelerator nodes and the AcceleratorNode plan, as pure functions over Node objects."""

from __future__ import annotations

import json
from typing import Any

import pytest

from device_plugin import labeller
from scheduler_extender.objects import accelerator_nodes as an

NOW = "2026-03-01T10:00:00Z"


def node(name: str = "n1", *, labels: dict[str, str] | None = None, capacity: dict[str, str] | None = None,
         plugin_labels: tuple[str, ...] = (), uid: str = "uid-1") -> dict[str, Any]:
    """A Node; ``plugin_labels``: label keys whose managedFields entry is accelstack's device plugin's."""
    managed = [{"manager": "kubelet", "operation": "Update",
                "fieldsV1": {"f:metadata": {"f:labels": {"f:kubernetes.io/hostname": {}}}}}]
    if plugin_labels:
        managed.append({"manager": labeller.FIELD_MANAGER, "operation": "Update",
                        "fieldsV1": {"f:metadata": {"f:labels": {f"f:{k}": {} for k in plugin_labels}}}})
    return {"metadata": {"name": name, "uid": uid, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                         "managedFields": managed},
            "status": {"capacity": {"cpu": "32", **(capacity or {})}, "allocatable": {"cpu": "32", **(capacity or {})}}}


GFD = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
       "nvidia.com/gpu.count": "8"}


def test_constants_match_the_device_plugin_labeller() -> None:
    assert an.PLUGIN_MANAGER == labeller.FIELD_MANAGER
    assert tuple(p for ps in an.PLUGIN_PREFIXES.values() for p in ps) == labeller.OWNED_PREFIXES


def test_a_cpu_node_is_not_an_accelerator_node() -> None:
    assert an.detect(node(labels={"feature.node.kubernetes.io/pci-8086.present": "true"})) is None
    # accelstack's plugin on a node without GPUs writes gpu.present=false: still not one
    assert an.detect(node(labels={"nvidia.com/gpu.present": "false"},
                          plugin_labels=("nvidia.com/gpu.present",))) is None


def test_gfd_labels_only_detected_with_no_device_plugin() -> None:
    d = an.detect(node(labels=GFD))
    assert d is not None
    assert (d.resource, d.phase, d.managed_by, d.devices, d.model, d.ours) == \
        ("nvidia.com/gpu", "Detected", an.BY_NONE, 8, "NVIDIA-H100-80GB-HBM3", False)
    assert d.evidence == ("label nvidia.com/gpu.present=true", "label nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
                          "label nvidia.com/gpu.count=8")
    status = an.desired_status(d, (), 1, {}, NOW)
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == \
        [("Detected", "True", "FeatureLabels"), ("Managed", "False", "NoDevicePlugin"),
         ("Onboarded", "False", "NotRequested")]
    assert status["phase"] == "Detected" and "onboard" not in status


@pytest.mark.parametrize("key", ["feature.node.kubernetes.io/pci-10de.present",
                                 "feature.node.kubernetes.io/pci-0302_10de.present"])
def test_nfd_pci_label_only(key: str) -> None:
    d = an.detect(node(labels={key: "true"}))
    assert d is not None and (d.resource, d.phase, d.managed_by, d.devices) == ("nvidia.com/gpu", "Detected",
                                                                               an.BY_NONE, 0)
    assert d.evidence == (f"label {key}=true",)
    assert an.desired_status(d, (), 1, {}, NOW)["conditions"][0]["reason"] == "PCILabels"
    assert an.detect(node(labels={key: "false"})) is None


def test_another_plugins_gpus_are_detected_not_managed() -> None:
    # NVIDIA's device plugin + GFD: the same label names accelstack writes, but written by another manager
    d = an.detect(node(labels=GFD, capacity={"nvidia.com/gpu": "8"}))
    assert d is not None and (d.phase, d.managed_by, d.devices) == ("Detected", an.BY_OTHER, 8)
    assert d.evidence[0] == "nvidia.com/gpu advertised (capacity 8, allocatable 8)"
    status = an.desired_status(d, (), 1, {}, NOW)
    assert (status["reason"], status["conditions"][1]["status"]) == ("OtherDevicePlugin", "False")
    assert status["conditions"][0]["reason"] == "ResourceAdvertised"


def test_our_plugins_labels_and_the_resource_make_it_managed() -> None:
    d = an.detect(node(labels=GFD, capacity={"nvidia.com/gpu": "16"}, plugin_labels=tuple(GFD)))
    assert d is not None and (d.phase, d.managed_by, d.devices, d.ours) == ("Managed", an.BY_ACCELSTACK, 16, True)
    assert "nvidia.com/gpu labels written by accelstack-device-plugin" in d.evidence
    status = an.desired_status(d, (), 1, {}, NOW)
    assert status["conditions"][1] == {"type": "Managed", "status": "True", "reason": "AccelstackDevicePlugin",
                                       "message": status["conditions"][1]["message"], "lastTransitionTime": NOW}
    # labelled by our plugin, resource not (yet) advertised: not managed
    d = an.detect(node(labels=GFD, plugin_labels=tuple(GFD)))
    assert d is not None and (d.phase, d.managed_by) == ("Detected", an.BY_NONE)
    assert "not registered" in an.desired_status(d, (), 1, {}, NOW)["conditions"][1]["message"]


def test_an_nr1_node() -> None:
    nr1 = {"accelstack.io/nr1.count": "4", "accelstack.io/nr1.product": "NR1-M"}
    d = an.detect(node(labels=nr1, capacity={"neureality.com/nr1": "4"}, plugin_labels=tuple(nr1)))
    assert d is not None and (d.resource, d.phase, d.managed_by, d.devices, d.model) == \
        ("neureality.com/nr1", "Managed", an.BY_ACCELSTACK, 4, "NR1-M")
    # NFD's PCI label of the configured NR1 vendor, and only of a configured one
    labels = {"feature.node.kubernetes.io/pci-1e2d.present": "true"}
    assert an.detect(node(labels=labels)) is None
    d = an.detect(node(labels=labels), [an.vendor_id("0x1E2D")])
    assert d is not None and (d.resource, d.phase, d.managed_by) == ("neureality.com/nr1", "Detected", an.BY_NONE)
    # another plugin's NR1 resource
    d = an.detect(node(capacity={"neureality.com/nr1": "2"}))
    assert d is not None and (d.resource, d.managed_by) == ("neureality.com/nr1", an.BY_OTHER)


def test_vendor_id_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="not a PCI vendor ID like 0x1e2d: 'xyz'"):
        an.vendor_id("xyz")


def test_plan_creates_writes_on_change_only_and_deletes() -> None:
    d = an.detect(node("a", labels=GFD, capacity={"nvidia.com/gpu": "8"}))
    assert d is not None
    holders = {"a": [an.Holder("team", "p1", "g1", "nvidia.com/gpu", 2), an.Holder("team", "p0", "", "nvidia.com/gpu", 1)]}
    first = an.plan({"a": d}, holders, {}, NOW)
    assert [o["metadata"]["name"] for o in first.create] == ["a"]
    assert first.create[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    status = first.statuses["a"]
    assert (status["allocated"], status["holderCount"], status["deviceCount"]) == (3, 2, 8)
    assert status["holders"][0] == {"namespace": "team", "name": "p0", "resource": "nvidia.com/gpu", "count": 1}
    stored = {"a": {"metadata": {"name": "a", "uid": "an-1", "generation": 1,
                                 "ownerReferences": [{"kind": "Node", "uid": "uid-1"}]}, "status": status}}
    # the same world a minute later (a restarted leader): nothing to write, the transition times kept
    again = an.plan({"a": d}, holders, stored, "2026-03-01T10:01:00Z")
    assert again.writes == 0
    # a holder ends: one status write, the conditions' times kept
    after = an.plan({"a": d}, {"a": holders["a"][:1]}, stored, "2026-03-01T10:02:00Z")
    assert list(after.statuses) == ["a"] and after.statuses["a"]["allocated"] == 2
    assert {c["lastTransitionTime"] for c in after.statuses["a"]["conditions"]} == {NOW}
    # the node gone -> deleted; a new node of the same name (another UID) -> the old object deleted first
    assert an.plan({}, {}, stored, NOW).delete == [("a", "an-1")]
    renewed = an.detect(node("a", labels=GFD, uid="uid-2"))
    assert renewed is not None
    swap = an.plan({"a": renewed}, {}, stored, NOW)
    assert (swap.delete, swap.create) == ([("a", "an-1")], [])


# ---- onboarding ---------------------------------------------------------------------------------------------------
def onboarding_node(*, label: bool = True, ours: bool = True, other: bool = False, npd: bool = True,
                    podres: dict[str, Any] | str | None = None, gpus: int = 8) -> dict[str, Any]:
    """A GPU node at some step of onboarding: landing label, who advertises the GPUs, NPD's condition, the device
    plugin's pod-resources report."""
    labels = {**GFD, **({"accelstack.io/gpu-node": "true"} if label else {})}
    n = node("g", labels=labels, capacity={"nvidia.com/gpu": str(gpus)} if (ours or other) else None,
             plugin_labels=("nvidia.com/gpu.product", "nvidia.com/gpu.count") if ours else ())
    if npd:
        n["status"]["conditions"] = [{"type": "Ready", "status": "True"},
                                     {"type": "GPUUnhealthy", "status": "False", "reason": "NoGPUProblem"}]
    if podres is not None:
        n["metadata"]["annotations"] = {an.POD_RESOURCES_KEY["nvidia.com/gpu"]: podres if isinstance(podres, str) else json.dumps(podres)}
    return n


def report(in_use: int = 2, unknown: int = 0, devices: int = 8) -> dict[str, Any]:
    return {"resource": "nvidia.com/gpu", "devices": devices, "inUse": in_use, "unknownIDs": unknown,
            "observedAt": NOW}


HOLDERS = [an.Holder("team", "p0", "", "nvidia.com/gpu", 2)]


def step(n: dict[str, Any], allocated: int = 2, onboarded: bool = False) -> tuple[int, str]:
    d = an.detect(n)
    assert d is not None
    number, reason, message = an.onboard_step(d, allocated, onboarded)
    assert message
    return number, reason


def test_onboarding_steps_in_order_each_waiting_for_what_it_names() -> None:
    assert step(onboarding_node(label=False, ours=False, other=True)) == (1, "Labelling")
    assert step(onboarding_node(ours=False, other=True)) == (2, "WaitingForDevicePlugin")
    assert step(onboarding_node(ours=False)) == (2, "WaitingForDevicePlugin")
    assert step(onboarding_node(npd=False, podres=report())) == (3, "WaitingForNodeProblemDetector")
    assert step(onboarding_node()) == (4, "WaitingForPodResources")
    assert step(onboarding_node(podres={"resource": "nvidia.com/gpu", "error": "socket not found"})) == \
        (4, "PodResourcesUnreadable")
    assert step(onboarding_node(podres="{not json")) == (4, "PodResourcesUnreadable")
    assert step(onboarding_node(podres={"resource": "nvidia.com/gpu"})) == (4, "PodResourcesUnreadable")
    assert step(onboarding_node(podres=report(unknown=2))) == (5, "DeviceIDsDiffer")
    assert step(onboarding_node(podres=report(in_use=3))) == (5, "InventoryMismatch")
    assert step(onboarding_node(podres=report())) == (0, "Onboarded")
    # once onboarded, pods coming and going faster than the plugin reports do not send it back to Onboarding;
    # losing the plugin does
    assert step(onboarding_node(podres=report(in_use=5)), onboarded=True) == (0, "Onboarded")
    assert step(onboarding_node(ours=False), onboarded=True) == (2, "WaitingForDevicePlugin")


def test_why_a_node_is_onboarded() -> None:
    other = an.detect(onboarding_node(label=False, ours=False, other=True))
    assert other is not None and an.onboard_why(other, None) == ""  # another plugin's node: only on request
    asked = {"spec": {"onboard": {"requestedAt": NOW}}}
    assert an.onboard_why(other, asked) == "requested"
    deboarding = {"spec": {"onboard": {"requestedAt": NOW}, "deboard": {"grace": "1m", "requestedAt": NOW}}}
    assert an.onboard_why(other, deboarding) == ""
    labelled = an.detect(onboarding_node(ours=False, other=True))
    assert labelled is not None and an.onboard_why(labelled, None) == "label"
    ours = an.detect(onboarding_node(label=False))
    assert ours is not None and an.onboard_why(ours, None) == "accelstack"
    pick = an.parse_selector("pool=a100,!frozen")
    chosen = onboarding_node(label=False, ours=False, other=True)
    chosen["metadata"]["labels"]["pool"] = "a100"
    d = an.detect(chosen, selector=pick)
    assert d is not None and an.onboard_why(d, None) == "selector"
    chosen["metadata"]["labels"]["frozen"] = "yes"
    d = an.detect(chosen, selector=pick)
    assert d is not None and an.onboard_why(d, None) == ""


def test_selector_errors_name_the_part_and_empty_selects_nothing() -> None:
    assert an.parse_selector("")({"a": "b"}) is False
    assert an.parse_selector("a!=b")({}) is True and an.parse_selector("a==b")({"a": "b"}) is True
    for bad in ("a in (b)", "=b", "a=b c", "!"):
        with pytest.raises(ValueError, match="not a label selector"):
            an.parse_selector(bad)


def test_plan_labels_then_onboarding_then_managed_and_failed_after_the_timeout() -> None:
    asked = {"metadata": {"name": "g", "uid": "an-1", "generation": 2,
                          "ownerReferences": [{"kind": "Node", "uid": "uid-1"}]},
             "spec": {"onboard": {"requestedAt": NOW}}, "status": {}}
    d = an.detect(onboarding_node(label=False, ours=False, other=True))
    assert d is not None
    first = an.plan({"g": d}, {"g": HOLDERS}, {"g": asked}, NOW)
    assert first.label == {"g": "accelstack.io/gpu-node"}
    st = first.statuses["g"]
    assert (st["phase"], st["reason"], st["onboard"]) == (
        "Onboarding", "Labelling", {"since": NOW, "by": "requested", "step": "1/5 Labelling"})
    # labelled, the other plugin still there: the step says so; 16 minutes on: Failed, with the same reason
    d = an.detect(onboarding_node(ours=False, other=True))
    assert d is not None
    asked["status"] = st
    waiting = an.plan({"g": d}, {"g": HOLDERS}, {"g": asked}, "2026-03-01T10:05:00Z")
    assert not waiting.label
    st = waiting.statuses["g"]
    assert (st["phase"], st["reason"], st["onboard"]["since"]) == ("Onboarding", "WaitingForDevicePlugin", NOW)
    assert "another device plugin" in next(c["message"] for c in st["conditions"] if c["type"] == "Onboarded")
    asked["status"] = st
    late = an.plan({"g": d}, {"g": HOLDERS}, {"g": asked}, "2026-03-01T10:16:00Z").statuses["g"]
    assert (late["phase"], late["reason"]) == ("Failed", "WaitingForDevicePlugin")
    # everything agrees: Managed, even after the timeout, and the onboarding's span kept in status.onboard
    d = an.detect(onboarding_node(podres=report()))
    assert d is not None
    asked["status"] = late
    done = an.plan({"g": d}, {"g": HOLDERS}, {"g": asked}, "2026-03-01T10:17:00Z").statuses["g"]
    assert (done["phase"], done["reason"], done["onboard"]) == (
        "Managed", "Onboarded", {"since": NOW, "by": "requested", "completedAt": "2026-03-01T10:17:00Z"})
    asked["status"] = done
    assert an.plan({"g": d}, {"g": HOLDERS}, {"g": asked}, "2026-03-01T10:18:00Z").writes == 0


def test_the_plugins_report_marks_a_brownfield_node_as_served_by_accelstack() -> None:
    """On a node GPU feature discovery labelled, accelstack's labeller writes the same values: the API server
    records no change and so no ownership, and the labels alone never say accelstack. Its pod-resources report
    (only its plugin writes it) does."""
    labelled_only = an.detect(onboarding_node(ours=False, other=True))
    assert labelled_only is not None and labelled_only.managed_by == an.BY_OTHER
    reported = an.detect(onboarding_node(ours=False, other=True, podres=report()))
    assert reported is not None and (reported.managed_by, reported.ours) == (an.BY_ACCELSTACK, True)
    assert "nvidia.com/gpu pod-resources view reported by accelstack's device plugin (accelstack.io/pod-resources)" \
        in reported.evidence
    # a report of another resource says nothing about this one; the NR1 plugin's report has its own key
    other = an.detect(onboarding_node(ours=False, other=True, podres={**report(), "resource": "neureality.com/nr1"}))
    assert other is not None and other.managed_by == an.BY_OTHER
    nr1 = node("m", capacity={"neureality.com/nr1": "4"}, labels={"accelstack.io/nr1-node": "true"})
    nr1["metadata"]["annotations"] = {"accelstack.io/pod-resources-nr1": json.dumps(
        {"resource": "neureality.com/nr1", "devices": 4, "inUse": 0, "unknownIDs": 0})}
    nr1["status"]["conditions"] = [{"type": "NR1Unhealthy", "status": "False"}]
    d = an.detect(nr1)
    assert d is not None and d.managed_by == an.BY_ACCELSTACK and an.onboard_step(d, 0, False)[1] == "Onboarded"


def test_pods_are_adopted_only_when_asked_and_once_managed() -> None:
    d = an.detect(onboarding_node(podres=report()))
    assert d is not None
    holders = [an.Holder("ml", "train-0", "", "nvidia.com/gpu", 2), an.Holder("ml", "mine", "g", "nvidia.com/gpu", 1)]
    asked = {"spec": {"onboard": {"requestedAt": NOW, "adoptPods": True}}}
    assert an.to_adopt(d, holders, asked, {"phase": "Managed"}) == holders[:1]  # a GPR's pod is not adopted again
    assert an.to_adopt(d, holders, asked, {"phase": "Onboarding"}) == []  # not before the node is Managed
    assert an.to_adopt(d, holders, {"spec": {"onboard": {"requestedAt": NOW}}}, {"phase": "Managed"}) == []
    gpr = an.adopted_gpr(holders[0], "g")
    assert (gpr["metadata"]["name"], gpr["metadata"]["namespace"], gpr["spec"]) == (
        "train-0", "ml", {"resource": "nvidia.com/gpu", "devicesPerNode": 2, "nodeCount": 1})
    assert gpr["metadata"]["labels"] == {"accelstack.io/auto-gpr": "true", an.ADOPTED_LABEL: "g"}
    long = "p" * 80
    assert len(an.adopted_name(long)) == 63 and an.adopted_name(long) != an.adopted_name(long[:-1] + "q")


def test_a_status_that_moves_only_its_holders_is_usage_only() -> None:
    d = an.detect(node(labels=GFD))
    assert d is not None
    before = an.desired_status(d, (), 1, {}, NOW)
    held = an.desired_status(d, [an.Holder("team-a", "p0", "", "nvidia.com/gpu", 2)], 1, before, NOW)
    assert held["allocated"] == 2 and an.usage_only(before, held)
    assert not an.usage_only({}, held)  # the first status is no mere usage change
    moved = {**held, "phase": "Managed"}
    assert not an.usage_only(before, moved)
    later = an.desired_status(d, [an.Holder("team-a", "p0", "", "nvidia.com/gpu", 2)], 1, before,
                              "2026-03-01T11:00:00Z")
    assert an.usage_only(before, later)  # a condition's lastTransitionTime alone changes nothing


async def test_holder_only_writes_are_paced_and_the_rest_follow() -> None:
    """A burst of binds over many nodes: status writes that change only the holders go at --node-usage-qps (the
    burst first), a phase change is never held back, and the controller asks for the pass that writes the rest."""
    import asyncio
    import types

    from kubeapi.client import api_metrics
    from scheduler_extender.controller.accelerator_nodes import AcceleratorNodeController
    from scheduler_extender.objects.cluster import ClusterView

    d = an.detect(node(labels=GFD))
    assert d is not None
    now = [1000.0]
    kube: Any = types.SimpleNamespace(client=types.SimpleNamespace(metrics=api_metrics(None)))  # never called here
    ctl = AcceleratorNodeController(kube, ClusterView(("nvidia.com/gpu",)),
                                    min_interval=0.05, usage_qps=20, usage_burst=3, clock=lambda: now[0])
    idle = an.desired_status(d, (), 1, {}, NOW)
    for i in range(8):
        ctl.objects[f"n{i}"] = {"metadata": {"name": f"n{i}"}, "status": idle}
    holder = [an.Holder("team-a", "p", "", "nvidia.com/gpu", 1)]
    statuses = {f"n{i}": an.desired_status(d, holder, 1, idle, NOW) for i in range(7)}
    statuses["n7"] = {**idle, "phase": "Failed"}
    first = ctl._paced(statuses)
    assert sorted(first) == ["n0", "n1", "n2", "n7"]  # the burst (3) in name order, and the phase change
    assert ctl._paced(statuses).keys() == {"n7"}  # no token left at the same instant
    now[0] += 0.1  # two tokens at 20/s
    assert sorted(ctl._paced({n: s for n, s in statuses.items() if n not in first})) == ["n3", "n4"]
    await asyncio.wait_for(ctl.poke.wait(), 5)  # the pass for the rest is asked for
    unlimited = AcceleratorNodeController(kube, ClusterView(("nvidia.com/gpu",)), usage_qps=0)
    unlimited.objects = dict(ctl.objects)
    assert unlimited._paced(statuses).keys() == statuses.keys()


class _Writes:
    """The API calls an AcceleratorNodeController makes, each answered as the API server would (a new
    resourceVersion); ``calls`` records (verb, name)."""

    def __init__(self) -> None:
        from kubeapi.client import api_metrics

        self.metrics = api_metrics(None)
        self.calls: list[tuple[str, str]] = []
        self.statuses: dict[str, dict[str, Any]] = {}  # the last status written, by name
        self.rv = 100

    def _answer(self, verb: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((verb, name))
        self.rv += 1
        meta = {**(body.get("metadata") or {}), "name": name, "resourceVersion": str(self.rv)}
        meta.setdefault("uid", f"an-{name}")
        return {**body, "metadata": meta}

    async def create(self, resource: Any, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        return self._answer("create", body["metadata"]["name"], body)

    async def replace(self, resource: Any, name: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.statuses[name] = body["status"]
        return self._answer("status", name, body)

    async def patch(self, resource: Any, name: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        return self._answer("patch", name, body)

    async def delete(self, resource: Any, name: str, **_: Any) -> None:
        self.calls.append(("delete", name))


def _gpu_pod(uid: str, node_name: str, gpus: int) -> dict[str, Any]:
    return {"metadata": {"name": uid, "namespace": "team-a", "uid": uid},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {
                "requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": "Running"}}


async def test_a_pass_on_a_change_plans_only_the_nodes_it_touched_and_writes_what_a_full_pass_would() -> None:
    """At 5,000 nodes a pass over every node for each bind was most of the controller's CPU: a pass asked for by a
    change plans the nodes the change touched (and those whose status waits on the clock), a relist or the resync
    plans them all, and what it writes for a node is what a pass over every node writes."""
    import types

    from scheduler_extender.controller.accelerator_nodes import AcceleratorNodeController
    from scheduler_extender.objects.cluster import ClusterView

    now = [1_772_359_200.0]  # NOW
    view = ClusterView(("nvidia.com/gpu",))

    def controller() -> tuple[AcceleratorNodeController, _Writes]:
        writes = _Writes()
        ctl = AcceleratorNodeController(types.SimpleNamespace(client=writes), view,  # type: ignore[arg-type]
                                        resync=3600, usage_qps=0, clock=lambda: now[0])
        return ctl, writes

    ctl, writes = controller()
    names = [f"g{i:02d}" for i in range(40)]
    for i, name in enumerate(names):
        ctl.on_node("ADDED", node(name, labels=GFD, uid=f"uid-{i}"))
    await ctl.reconcile()  # the first pass: every node, one create and one status each
    assert ctl.planned == 40 and sorted(v for v, _ in writes.calls) == ["create"] * 40 + ["status"] * 40
    for name in names:  # the writes come back through the watch: planned again, nothing to write
        ctl._on_object("MODIFIED", ctl.objects[name])
    writes.calls.clear()
    await ctl.reconcile()
    assert ctl.planned == 80 and writes.calls == []

    # a pod bound on g07: the next pass plans g07 alone and writes its holders
    view.on_pod("ADDED", _gpu_pod("p1", "g07", 2))
    ctl.pod_changed(None, view.pods["p1"])
    await ctl.reconcile()
    assert ctl.planned == 81 and writes.calls == [("status", "g07")]
    assert ctl.objects["g07"]["status"]["allocated"] == 2
    # what a controller with no marks (a new leader: a pass over every node) writes from the same objects
    fresh, fresh_writes = controller()
    fresh.detected, fresh.nodes, fresh.objects = dict(ctl.detected), dict(ctl.nodes), dict(ctl.objects)
    view.on_pod("ADDED", _gpu_pod("p2", "g31", 1))
    ctl.pod_changed(None, view.pods["p2"])
    writes.calls.clear()
    await ctl.reconcile()
    await fresh.reconcile()
    assert fresh.planned == 40 and fresh_writes.calls == writes.calls == [("status", "g31")]
    assert fresh_writes.statuses["g31"] == writes.statuses["g31"] and writes.statuses["g31"]["allocated"] == 1

    # a pod moving from one node to another marks both
    writes.calls.clear()
    old = view.pods["p2"]
    view.on_pod("MODIFIED", _gpu_pod("p2", "g32", 1))
    ctl.pod_changed(old, view.pods["p2"])
    await ctl.reconcile()
    assert sorted(writes.calls) == [("status", "g31"), ("status", "g32")]

    # a relist of the pods (a new table): the next pass plans every node
    before = ctl.planned
    view.pods = dict(view.pods)
    await ctl.reconcile()
    assert ctl.planned == before + 40
    # so does a new leader term's first pass (another replica may have written meanwhile)
    import asyncio

    stop = asyncio.Event()
    stop.set()
    await ctl.run(stop)  # a term that begins and ends at once
    before = ctl.planned
    await ctl.reconcile()
    assert ctl.planned == before + 40

    # a write that failed is planned again by the next pass, whatever asked for it
    from kubeapi import ApiError

    async def refuse(*_: Any, **__: Any) -> dict[str, Any]:
        raise ApiError(500, "InternalError", "etcd is away")

    gone = view.pods["p1"]
    view.on_pod("DELETED", _gpu_pod("p1", "g07", 2))
    ctl.pod_changed(gone, None)
    saved = writes.replace
    writes.replace = refuse  # type: ignore[method-assign]
    await ctl.reconcile()
    writes.replace = saved  # type: ignore[method-assign]
    assert ctl.objects["g07"]["status"]["allocated"] == 2  # not written
    writes.calls.clear()
    before = ctl.planned
    await ctl.reconcile()  # the next pass, whatever asks for it (here: none but the failure's mark)
    assert ctl.planned == before + 1 and writes.calls == [("status", "g07")]
    assert ctl.objects["g07"]["status"]["allocated"] == 0


async def test_a_node_onboarding_is_planned_by_every_pass_so_its_timeout_is_not_missed() -> None:
    """A status that waits on the clock (onboarding past its timeout) is decided by any pass, not only one over
    every node: a pass asked for by another node's change writes its Failed."""
    import types

    from scheduler_extender.controller.accelerator_nodes import AcceleratorNodeController
    from scheduler_extender.objects.cluster import ClusterView

    now = [1_772_359_200.0]  # NOW
    writes = _Writes()
    ctl = AcceleratorNodeController(types.SimpleNamespace(client=writes), ClusterView(("nvidia.com/gpu",)),  # type: ignore[arg-type]
                                    resync=3600, usage_qps=0, clock=lambda: now[0])
    ctl.on_node("ADDED", onboarding_node(ours=False, other=True))  # "g": waiting for our device plugin
    ctl.on_node("ADDED", node("h", labels=GFD, uid="uid-h"))
    ctl.objects["g"] = {"metadata": {"name": "g", "uid": "an-1", "resourceVersion": "5",
                                     "ownerReferences": [{"kind": "Node", "uid": "uid-1"}]},
                        "spec": {"onboard": {"requestedAt": NOW}}, "status": {}}
    await ctl.reconcile()
    assert writes.statuses["g"]["phase"] == "Onboarding"
    writes.calls.clear()
    await ctl.reconcile()
    assert writes.calls == []  # nothing changed
    now[0] += 16 * 60  # past the 15-minute onboarding timeout; then an unrelated node changes
    ctl.on_node("MODIFIED", node("h", labels={**GFD, "nvidia.com/gpu.count": "4"}, uid="uid-h"))
    before = ctl.planned
    await ctl.reconcile()
    assert ctl.planned == before + 2  # "h" and "g", not every node
    assert writes.statuses["g"]["phase"] == "Failed"
