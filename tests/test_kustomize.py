"""Every kustomize overlay builds with kubectl, its objects validate against the Kubernetes schemas of the oldest
and newest supported versions, and its references hold together (service accounts, namespaces, bindings)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.realcluster.shipped import render

ROOT = Path(__file__).resolve().parent.parent / "manifests"
OVERLAYS = ["base", "overlays/gpu", "overlays/nr1", "overlays/full"]
EXTERNAL = ("monitoring.coreos.com/", "cert-manager.io/", "k8s.cni.cncf.io/", "accelstack.io/")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "CustomResourceDefinition",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration",
                  "ValidatingWebhookConfiguration"}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is missing (scripts/system-deps.sh installs Debian's kubernetes-client as root)")
    out = subprocess.run([path, "version", "--client"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"v1\.(\d+)", out)
    if match is None or int(match.group(1)) < 24:
        pytest.skip(f"kubectl too old for these kustomizations (needs >= 1.24): {out.strip()[:80]}")
    return path


def build(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects, built once per run by ``kubectl kustomize`` (a copy: each test may change them)."""
    kubectl()
    return render(f"manifests/{overlay}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_validates(overlay: str) -> None:
    objects = build(overlay)
    assert len(objects) > 30
    for version in ("1.30.0", "1.37.0"):
        for obj in objects:
            if obj["apiVersion"].startswith(EXTERNAL):
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_hold_together(overlay: str) -> None:
    objects = build(overlay)
    namespaces = {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects if o["kind"] == "ServiceAccount"}
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in meta, f"{obj['kind']}/{meta['name']} is cluster-scoped"
            continue
        assert meta.get("namespace") in namespaces | {"kube-system"}, f"{obj['kind']}/{meta['name']}: {meta.get('namespace')}"
        pod = (obj.get("spec") or {}).get("template", {}).get("spec")
        if pod is not None:
            account = pod.get("serviceAccountName", "default")
            assert (meta["namespace"], account) in accounts, f"{obj['kind']}/{meta['name']} uses missing SA {account}"
        if obj["kind"] in ("RoleBinding",):
            for subject in obj["subjects"]:
                if subject["kind"] == "ServiceAccount":
                    assert (subject["namespace"], subject["name"]) in accounts
    for obj in objects:
        if obj["kind"] == "ClusterRoleBinding":
            for subject in obj["subjects"]:
                if subject["kind"] == "ServiceAccount":
                    assert (subject["namespace"], subject["name"]) in accounts, obj["metadata"]["name"]
    system = next(o for o in objects if o["kind"] == "Namespace" and o["metadata"]["name"] == "accelstack-system")
    assert system["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_overlays_select_their_accelerators() -> None:
    names = {overlay: {o["metadata"]["name"] for o in build(overlay) if o["kind"] == "DaemonSet"} for overlay in OVERLAYS}
    assert "accelstack-device-plugin-nr1" not in names["overlays/gpu"] and "accelstack-nr1-cni" not in names["overlays/gpu"]
    assert "accelstack-device-plugin-nvidia" in names["overlays/gpu"]
    assert "accelstack-device-plugin-nvidia" not in names["overlays/nr1"] and "accelstack-nr1-cni" in names["overlays/nr1"]
    assert names["base"] == names["overlays/full"]
