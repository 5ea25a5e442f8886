"""Every manifest object validates against the Kubernetes schemas of the oldest and newest versions supported;
the device-plugin ConfigMap's configs load with the plugin's own config loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from device_plugin.config import ConfigError, load

ROOT = Path(__file__).resolve().parent.parent / "manifests"
OLDEST, NEWEST = "1.30.0", "1.37.0"  # 1.30: ValidatingAdmissionPolicy v1 and service-account node binding
# Custom resources of other projects (schemas not in kubernetes-validate); checked by their own tests.
EXTERNAL_GROUPS = ("k8s.cni.cncf.io/", "monitoring.coreos.com/", "accelstack.io/", "cert-manager.io/")


def objects() -> list[tuple[str, int, dict[str, Any]]]:
    found = []
    for path in sorted(ROOT.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or "charts" in path.parts:
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                found.append((str(path.relative_to(ROOT)), i, doc))
    return found


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_objects_validate_against_kubernetes_schemas(version: str) -> None:
    checked = 0
    for where, index, obj in objects():
        if obj.get("apiVersion", "").startswith(EXTERNAL_GROUPS):
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} #{index} ({obj.get('kind')}) is invalid for Kubernetes {version}: {exc.message}")
        checked += 1
    assert checked >= 8


def test_device_plugin_daemonsets_follow_the_kubelet_rules() -> None:
    for name in ("daemonset-nvidia.yaml", "daemonset-nr1.yaml"):
        ds = yaml.safe_load((ROOT / "device-plugin" / name).read_text())
        pod = ds["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == "system-node-critical"
        volumes = {v["name"]: v for v in pod["volumes"]}
        # the directory, not the socket: a kubelet restart re-creates kubelet.sock with a new inode
        assert volumes["device-plugins"]["hostPath"] == {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}
        container = pod["containers"][0]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        assert any(t["key"] == "accelstack.io/unhealthy" for t in pod["tolerations"])


def test_configmap_configs_load_with_the_plugin(tmp_path: Path) -> None:
    cm = yaml.safe_load((ROOT / "device-plugin" / "configmap.yaml").read_text())
    (tmp_path / "nvidia.yaml").write_text(cm["data"]["nvidia.yaml"])
    config, _ = load(["--config-file", str(tmp_path / "nvidia.yaml")], environ={})
    assert config["nvidia.enabled"] and not config["nr1.enabled"]
    (tmp_path / "nr1.yaml").write_text(cm["data"]["nr1.yaml"])
    with pytest.raises(ConfigError, match=r"nr1\.vendorIDs: required"):  # the operator must set it: documented
        load(["--config-file", str(tmp_path / "nr1.yaml")], environ={})
    config, _ = load(["--config-file", str(tmp_path / "nr1.yaml"), "--nr1-vendor-ids", "0x1e2d"], environ={})
    assert config["nr1.enabled"] and not config["nvidia.enabled"]


def test_every_service_account_has_a_row_in_the_security_table() -> None:
    """docs/security.md's table of what each account can and cannot do (checked against the real API server by
    tests/realcluster/test_rbac_table.py) names every ServiceAccount the manifests ship, and nothing else."""
    from tests.realcluster.test_rbac_table import doc_table

    shipped = {f"{obj['metadata'].get('namespace') or _namespace_of(where)}/{obj['metadata']['name']}"
               for where, _, obj in objects() if obj.get("kind") == "ServiceAccount" and "examples" not in where
               and where.split("/")[0] not in MULTICLUSTER}
    assert set(doc_table()) == shipped


MULTICLUSTER = ("hub", "member")  # not in manifests/base: their table is docs/security.md's "Accounts of many clusters"


def test_multicluster_accounts_have_a_row_of_their_own() -> None:
    text = (ROOT.parent / "docs/security.md").read_text().split("### Accounts of many clusters", 1)[1]
    rows = {line.split("|")[1].strip().strip("`") for line in text.split("\n### ", 1)[0].splitlines()
            if line.startswith("| `")}
    shipped = {f"{obj['metadata'].get('namespace')}/{obj['metadata']['name']}" for where, _, obj in objects()
               if obj.get("kind") == "ServiceAccount" and where.split("/")[0] in MULTICLUSTER}
    assert rows == shipped


def _namespace_of(where: str) -> str:
    """The namespace a kustomization gives the objects of a manifests folder (ServiceAccounts carry none)."""
    kustomization = yaml.safe_load((ROOT / Path(where).parent / "kustomization.yaml").read_text())
    return str(kustomization.get("namespace") or "")
