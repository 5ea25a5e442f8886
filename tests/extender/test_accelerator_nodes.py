"""Detection of accelerator nodes and the AcceleratorNode plan, as pure functions over Node objects."""

from __future__ import annotations

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
        [("Detected", "True", "FeatureLabels"), ("Managed", "False", "NoDevicePlugin")]


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
