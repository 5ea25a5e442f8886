"""The shipped manifests, applied to a real API server as a platform team applies them.

``kubectl kustomize manifests/base`` renders what ``kubectl apply -k`` would send. What a loopback control plane
cannot take is left out, by kind, and said here: cert-manager's ``Certificate``/``Issuer`` and the Prometheus
Operator's ``ServiceMonitor``/``PodMonitor``/``PrometheusRule`` (their CRDs are not installed; the tests issue the
extender's certificate from the fixture's CA instead), and the workloads (``Deployment``/``DaemonSet``: there are
no kubelets; the tests run the same processes with the same ServiceAccounts). Everything else — namespaces,
CRDs, every ServiceAccount, Role, ClusterRole and binding, priority classes, NetworkPolicies, PDBs, ConfigMaps,
the ValidatingAdmissionPolicy and the webhook configurations — goes in unchanged, except the webhooks'
``clientConfig`` (service → the URL of the extender under test, caBundle → the fixture's CA).
"""

from __future__ import annotations

import base64
import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.realcluster.controlplane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = {"Certificate", "Issuer", "ServiceMonitor", "PodMonitor", "PrometheusRule", "Deployment", "DaemonSet"}
WEBHOOK_KINDS = {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}


def render(overlay: str = "manifests/base") -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k OVERLAY`` would create (a copy: callers change them)."""
    return copy.deepcopy(_rendered(overlay))


@functools.cache
def _rendered(overlay: str) -> list[dict[str, Any]]:
    """``kubectl kustomize`` once per overlay and run (about a second each; many tests and fixtures render)."""
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / overlay)], check=True, capture_output=True,
                         text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def pick(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj.get("kind") == kind and obj["metadata"]["name"] == name:
            return copy.deepcopy(obj)
    raise LookupError(f"the shipped manifests have no {kind} {name}")


def webhooks_to(objects: list[dict[str, Any]], base_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """The shipped webhook configurations with only their clientConfig pointed at ``base_url`` (service path
    kept) and the CA bundle set."""
    out = []
    for obj in objects:
        if obj.get("kind") not in WEBHOOK_KINDS:
            continue
        obj = copy.deepcopy(obj)
        obj["metadata"].get("annotations", {}).pop("cert-manager.io/inject-ca-from", None)
        for hook in obj["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": base_url.rstrip("/") + path,
                                    "caBundle": base64.b64encode(ca_pem).decode()}
        out.append(obj)
    return out


def install(cp: ControlPlane, objects: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Apply the shipped objects the loopback control plane can hold (not the webhooks: they need a running
    extender, :func:`webhooks_to`). CRDs first, and wait until they are served."""
    objects = objects if objects is not None else render()
    keep = [o for o in objects if o.get("kind") not in LEFT_OUT | WEBHOOK_KINDS]
    crds = [o for o in keep if o["kind"] == "CustomResourceDefinition"]
    cp.apply(crds)
    for crd in crds:
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
    cp.apply([o for o in keep if o["kind"] == "Namespace"])
    cp.apply([o for o in keep if o["kind"] not in {"CustomResourceDefinition", "Namespace"}])
    return objects
