"""The inference manifests: RBAC without wildcards (tests/inference/test_operator_api.py checks that every request
the operator makes is allowed), Pod Security "restricted", and the Prometheus Adapter rules serve the metric
names the operator's autoscalers ask for (test_prometheus.py evaluates them on a real Prometheus)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from inference.operator.objects import INFLIGHT_METRIC, QUEUE_METRIC

ROOT = Path(__file__).resolve().parents[2] / "manifests" / "inference"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / name).read_text()) if d]


def rules_of(role: str) -> list[dict[str, Any]]:
    return next(d for d in docs("rbac.yaml") if d["kind"] == "ClusterRole" and d["metadata"]["name"] == role)["rules"]


def allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def request_verb(method: str, path_qs: str) -> tuple[str, str, str]:
    """(API group, resource[/subresource], verb) of a REST request, as the API server's authorizer sees it."""
    path, _, query = path_qs.partition("?")
    parts = [p for p in path.split("/") if p]
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {"GET": "get" if named else ("watch" if "watch=true" in query else "list"), "POST": "create",
            "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
    return group, resource, verb


def test_request_verb_mapping() -> None:
    assert request_verb("GET", "/apis/apps/v1/deployments?watch=true&x=1") == ("apps", "deployments", "watch")
    assert request_verb("PUT", "/apis/accelstack.io/v1alpha1/namespaces/a/inferenceendpoints/x/status") == (
        "accelstack.io", "inferenceendpoints/status", "update")
    assert request_verb("DELETE", "/api/v1/namespaces/a/pods/p") == ("", "pods", "delete")


def test_operator_role_has_no_wildcards_and_no_secrets() -> None:
    rules = rules_of("accelstack-inference-operator")
    assert not any("*" in r["verbs"] or "*" in r["resources"] or "*" in r["apiGroups"] for r in rules)
    assert not allowed(rules, "", "secrets", "get") and not allowed(rules, "", "pods", "create")
    assert not any("deletecollection" in r["verbs"] for r in rules)
    # patch only on pods (a gated replica pointed at its GPR, issue 35.6b), nothing else
    assert [r["resources"] for r in rules if "patch" in r["verbs"]] == [["pods"]]
    # what it writes it can also read (its informers), and the endpoints themselves only through /status
    assert allowed(rules, "accelstack.io", "inferenceendpoints/status", "update")
    assert not allowed(rules, "accelstack.io", "inferenceendpoints", "update")


def test_gateway_role_only_reads_and_reviews_tokens() -> None:
    rules = rules_of("accelstack-gateway")
    writes = [(r["apiGroups"], r["resources"], v) for r in rules for v in r["verbs"] if v not in ("get", "list", "watch")]
    assert writes == [(["authentication.k8s.io"], ["tokenreviews"], "create")]
    for group, resource in (("accelstack.io", "inferenceendpoints"), ("discovery.k8s.io", "endpointslices")):
        assert allowed(rules, group, resource, "watch")
    # Secrets (API keys) never cluster-wide: only through RoleBindings, in exactly the --key-namespaces it reads
    assert not allowed(rules, "", "secrets", "list") and not allowed(rules, "", "secrets", "get")
    assert rules_of("accelstack-gateway-api-keys") == [{"apiGroups": [""], "resources": ["secrets"],
                                                        "verbs": ["list", "watch"]}]
    bound = [d for d in docs("rbac.yaml") if d["kind"].endswith("Binding")
             and d["roleRef"]["name"] == "accelstack-gateway-api-keys"]
    assert bound and all(d["kind"] == "RoleBinding" for d in bound)
    (deployment,) = [d for d in docs("gateway.yaml") if d["kind"] == "Deployment"]
    args = dict(a.removeprefix("--").split("=", 1) for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert sorted(args["key-namespaces"].split(",")) == sorted(d["metadata"]["namespace"] for d in bound)


def test_pod_security_restricted() -> None:
    for name in ("gateway.yaml", "operator.yaml"):
        (deployment,) = [d for d in docs(name) if d["kind"] == "Deployment"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not any(k in pod for k in ("hostNetwork", "hostPID", "hostIPC", "volumes"))
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
            assert ctx["readOnlyRootFilesystem"] is True and "privileged" not in ctx
            assert "limits" in container["resources"] and container["readinessProbe"]


def test_gateway_grace_period_covers_drain_and_shutdown() -> None:
    (deployment,) = [d for d in docs("gateway.yaml") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    args = dict(a.removeprefix("--").split("=", 1) for a in pod["containers"][0]["args"])
    assert pod["terminationGracePeriodSeconds"] > float(args["drain-seconds"]) + float(args["shutdown-timeout"])


def adapter_config() -> dict[str, Any]:
    (cm,) = docs("prometheus-adapter.yaml")
    config: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return config


def test_adapter_rules_shape_and_names() -> None:
    config = adapter_config()
    assert set(config) <= {"rules", "externalRules", "resourceRules"}
    names = {}
    for kind in ("rules", "externalRules"):
        for rule in config[kind]:
            assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}, rule
            assert set(rule["name"]) == {"matches", "as"}
            assert "<<.LabelMatchers>>" in rule["metricsQuery"]
            names[rule["name"]["as"]] = kind
    assert names == {INFLIGHT_METRIC: "rules", QUEUE_METRIC: "externalRules"}
    (custom,) = config["rules"]
    assert custom["resources"]["overrides"] == {"replica_namespace": {"resource": "namespace"},
                                                "replica_pod": {"resource": "pod"}}
    assert "<<.GroupBy>>" in custom["metricsQuery"] and "<<.Series>>" in custom["metricsQuery"]
