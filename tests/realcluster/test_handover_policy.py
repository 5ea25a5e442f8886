"""The device plugin's pod-resources annotation (``device_plugin/handover.py``) through the shipped
ValidatingAdmissionPolicy, with the API server's real CEL: the labeller, with a real token of the plugin's
ServiceAccount bound to its node, writes ``accelstack.io/pod-resources`` (and rewrites it only when more than
``observedAt`` changed); every other annotation stays refused, as ``test_labeller_policy.py`` checks for the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from device_plugin.handover import ANNOTATION, NR1_ANNOTATION, Report
from device_plugin.labeller import NodeLabeller
from kubeapi import ApiError
from kubeapi.client import KubeClient
from kubeapi.resources import NODES
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.test_labeller_policy import (  # noqa: F401  (fixtures)
    NO_METADATA,
    annotations_of,
    kube_a,
    refused_by_policy,
    two_nodes,
)


async def test_the_pod_resources_annotation_is_written_only_on_its_own_node_and_only_on_change(
        cp: ControlPlane, two_nodes: tuple[str, str, Path], kube_a: KubeClient) -> None:  # noqa: F811
    a, b, _ = two_nodes
    value = {ANNOTATION: Report("nvidia.com/gpu", 8, 6, 0, observed_at="2026-12-03T22:00:00Z").to_json(),
             NR1_ANNOTATION: Report("neureality.com/nr1", 4, error="boom", observed_at="2026-12-03T22:00:00Z")
             .to_json()}
    labeller = NodeLabeller(kube_a, a, lambda: {"accelstack.io/nr1.count": "4"}, interval=3600,
                            annotations=lambda: value)
    await labeller.reconcile()
    got = annotations_of(cp, a)
    assert json.loads(got[ANNOTATION]) == {"resource": "nvidia.com/gpu", "devices": 8, "inUse": 6, "unknownIDs": 0,
                                           "observedAt": "2026-12-03T22:00:00Z"}
    assert json.loads(got[NR1_ANNOTATION])["error"] == "boom"
    assert labeller.annotation_patches == 1
    # a later observation with the same counts: not written
    value[ANNOTATION] = Report("nvidia.com/gpu", 8, 6, 0, observed_at="2026-12-03T22:05:00Z").to_json()
    await labeller.reconcile()
    assert labeller.annotation_patches == 1
    assert json.loads(annotations_of(cp, a)[ANNOTATION])["observedAt"] == "2026-12-03T22:00:00Z"
    value[ANNOTATION] = Report("nvidia.com/gpu", 8, 7, 1, observed_at="2026-12-03T22:06:00Z").to_json()
    await labeller.reconcile()
    assert json.loads(annotations_of(cp, a)[ANNOTATION])["unknownIDs"] == 1 and labeller.annotation_patches == 2
    # removing its own annotation is allowed too (the key is the plugin's); any other annotation is still refused
    await kube_a.patch(NODES, a, {"metadata": {"annotations": {NR1_ANNOTATION: None}}}, patch_type="strategic")
    assert NR1_ANNOTATION not in annotations_of(cp, a)
    with pytest.raises(ApiError) as err:
        await kube_a.patch(NODES, a, {"metadata": {"annotations": {ANNOTATION: "{}", "example.com/note": "x"}}},
                           patch_type="strategic")
    refused_by_policy(err.value, NO_METADATA)
    with pytest.raises(ApiError) as err:  # another node's, even the plugin's own key
        await kube_a.patch(NODES, b, {"metadata": {"annotations": {ANNOTATION: "{}"}}}, patch_type="strategic")
    assert err.value.status == 422 and ANNOTATION not in annotations_of(cp, b)
