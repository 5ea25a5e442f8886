"""The accelstack-scheduler profile: its KubeSchedulerConfiguration uses exactly the upstream field names
(k8s.io/kube-scheduler/config/v1, UPSTREAM.md section D), points at the extender's Service and routes, and the
second scheduler's Deployment and RBAC hang together (config mount, CA mount, lease, least privilege)."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_extender.admission.webhook import Webhook
from scheduler_extender.objects.gpr_codec import parse_duration

ROOT = Path(__file__).resolve().parents[2] / "manifests"

# k8s.io/kube-scheduler/config/v1 JSON names.
EXTENDER_KEYS = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb", "enableHTTPS",
                 "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable"}
TLS_KEYS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}
MANAGED_RESOURCE_KEYS = {"name", "ignoredByScheduler"}
CONFIG_KEYS = {"apiVersion", "kind", "parallelism", "leaderElection", "clientConnection", "healthzBindAddress",
               "metricsBindAddress", "enableProfiling", "enableContentionProfiling", "percentageOfNodesToScore",
               "podInitialBackoffSeconds", "podMaxBackoffSeconds", "profiles", "extenders", "delayCacheUntilActive"}
LEADER_ELECTION_KEYS = {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock",
                        "resourceName", "resourceNamespace"}
PROFILE_KEYS = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}


def unknown_keys(config: dict[str, Any]) -> list[str]:
    """Every key of the configuration that is not an upstream field name, as a path."""
    found = [k for k in config if k not in CONFIG_KEYS]
    found += [f"leaderElection.{k}" for k in config.get("leaderElection") or {} if k not in LEADER_ELECTION_KEYS]
    for i, profile in enumerate(config.get("profiles") or []):
        found += [f"profiles[{i}].{k}" for k in profile if k not in PROFILE_KEYS]
    for i, ext in enumerate(config.get("extenders") or []):
        found += [f"extenders[{i}].{k}" for k in ext if k not in EXTENDER_KEYS]
        found += [f"extenders[{i}].tlsConfig.{k}" for k in ext.get("tlsConfig") or {} if k not in TLS_KEYS]
        for j, res in enumerate(ext.get("managedResources") or []):
            found += [f"extenders[{i}].managedResources[{j}].{k}" for k in res if k not in MANAGED_RESOURCE_KEYS]
    return found


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "scheduler" / name).read_text()) if d]


def config() -> dict[str, Any]:
    (cm,) = docs("configmap.yaml")
    parsed: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return parsed


def deployment() -> dict[str, Any]:
    (d,) = docs("deployment.yaml")
    return d


def test_configuration_uses_only_upstream_field_names() -> None:
    cfg = config()
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1" and cfg["kind"] == "KubeSchedulerConfiguration"
    assert unknown_keys(cfg) == []


@pytest.mark.parametrize(("where", "key"), [
    ((), "extender"), (("extenders", 0), "nodeCacheCapabel"), (("extenders", 0), "httptimeout"),
    (("extenders", 0, "tlsConfig"), "ca"), (("extenders", 0, "managedResources", 0), "ignored"),
    (("profiles", 0), "extenders"), (("leaderElection",), "leaseName"),
])
def test_unknown_keys_are_rejected(where: tuple[Any, ...], key: str) -> None:
    cfg = copy.deepcopy(config())
    node: Any = cfg
    for part in where:
        node = node[part]
    node[key] = True
    assert len(unknown_keys(cfg)) == 1 and unknown_keys(cfg)[0].endswith(key)


def test_the_extender() -> None:
    cfg = config()
    assert [p["schedulerName"] for p in cfg["profiles"]] == ["accelstack-scheduler"]
    (ext,) = cfg["extenders"]
    # the verbs go to the replica that binds (--ledger=memory); the certificate is the extender's Service name
    assert ext["urlPrefix"] == "https://accelstack-binder.accelstack-system.svc:8444/scheduler"
    assert ext["tlsConfig"]["serverName"] == "accelstack-extender.accelstack-system.svc"
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["preemptVerb"]) == ("filter", "prioritize", "preempt")
    # kube-scheduler binds (to the one node the filter offers a pod of a GPR and claims for it): no bind verb
    assert "bindVerb" not in ext
    # its client limit raised from the default 50/100, which held binding alone to ~52 pods/s
    assert cfg["clientConnection"] == {"qps": 500, "burst": 1000}
    assert ext["weight"] == 1 and isinstance(ext["weight"], int)
    assert ext["enableHTTPS"] is True and ext["tlsConfig"].get("insecure") is not True
    assert ext["tlsConfig"]["caFile"] == "/etc/accelstack/extender-ca/ca.crt"
    assert parse_duration(ext["httpTimeout"]) == 5.0
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is False
    assert ext["managedResources"] == [{"name": "nvidia.com/gpu", "ignoredByScheduler": False},
                                       {"name": "neureality.com/nr1", "ignoredByScheduler": False}]
    # the same resources the admission webhook manages by default
    assert tuple(r["name"] for r in ext["managedResources"]) == inspect.signature(Webhook).parameters["resources"].default


def test_the_extender_url_is_the_binder_service() -> None:
    """The verbs go to the Service that selects the replica labelled as the binder (the extender's pods, that label
    added), on its verbs port; TLS is checked against the extender Service's name, which its certificate carries."""
    (ext,) = config()["extenders"]
    services = {d["metadata"]["name"]: d for d in yaml.safe_load_all((ROOT / "extender" / "service.yaml").read_text())
                if d}
    binder, extender = services["accelstack-binder"], services["accelstack-extender"]
    host = f"{binder['metadata']['name']}.accelstack-system.svc"
    (port,) = [p for p in binder["spec"]["ports"]]
    assert ext["urlPrefix"] == f"https://{host}:{port['port']}/scheduler" and port["targetPort"] == "scheduler"
    assert binder["spec"]["selector"] == {**extender["spec"]["selector"], "accelstack.io/binder": "true"}
    assert ext["tlsConfig"]["serverName"] == f"{extender['metadata']['name']}.accelstack-system.svc"
    (certificate,) = [d for d in yaml.safe_load_all((ROOT / "extender" / "certificate.yaml").read_text())
                      if d and d["metadata"]["name"] == "accelstack-extender"]
    assert ext["tlsConfig"]["serverName"] in certificate["spec"]["dnsNames"]


def test_deployment_mounts_the_config_and_the_ca() -> None:
    d = deployment()
    pod = d["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    (flag,) = [a for a in container["command"] if a.startswith("--config=")]
    config_path = Path(flag.split("=", 1)[1])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["config"]["mountPath"] == str(config_path.parent)
    (cm,) = docs("configmap.yaml")
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert config_path.name in cm["data"]
    (ext,) = config()["extenders"]
    ca = Path(ext["tlsConfig"]["caFile"])
    assert mounts["extender-ca"]["mountPath"] == str(ca.parent)
    assert volumes["extender-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": ca.name}]  # not the key
    assert d["metadata"]["namespace"] == cm["metadata"]["namespace"] == "accelstack-system"
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True


def test_rbac_is_the_builtin_scheduler_roles_and_its_own_lease() -> None:
    objects = docs("rbac.yaml")
    (sa,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    assert deployment()["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    subject = {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}
    cluster = {o["roleRef"]["name"] for o in objects if o["kind"] == "ClusterRoleBinding" and subject in o["subjects"]}
    assert cluster == {"system:kube-scheduler", "system:volume-scheduler"}
    assert not [o for o in objects if o["kind"] == "ClusterRole"]  # nothing beyond the built-in roles
    election = config()["leaderElection"]
    assert election["leaderElect"] is True and election["resourceLock"] == "leases"
    (role,) = [o for o in objects if o["kind"] == "Role"]
    assert role["metadata"]["namespace"] == election["resourceNamespace"]
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "resourceNames": [election["resourceName"]], "verbs": ["get", "update"]}]
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and rule["resources"] == ["leases"]
    bindings = {(o["metadata"]["namespace"], o["roleRef"]["name"]) for o in objects if o["kind"] == "RoleBinding"
                and subject in o["subjects"]}
    assert bindings == {(election["resourceNamespace"], role["metadata"]["name"]),
                        ("kube-system", "extension-apiserver-authentication-reader")}


def test_kustomization_lists_every_file() -> None:
    kustomization = yaml.safe_load((ROOT / "scheduler" / "kustomization.yaml").read_text())
    files = {p.name for p in (ROOT / "scheduler").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert "namespace" not in kustomization  # would move the kube-system binding
