"""The Workspace and GPRTemplateBinding CRDs, checked the way the API server applies them (the pipeline of
test_crds: structural rules, defaults, the OpenAPI schema with strict fields, CEL with cel-python): the examples
pass, broken specs fail with the messages a user reads; the controller's ClusterRole holds what the built-in role
templates grant (it cannot create Roles granting more, having no 'escalate')."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_extender.objects import workspaces as wsp
from tests.extender.test_crds import CEL, admit, crd, examples, schema_of, structural_problems

ROOT = Path(__file__).resolve().parents[2] / "manifests"
WS, TB = wsp.WORKSPACE_PLURAL, wsp.BINDING_PLURAL


@pytest.mark.parametrize(("plural", "kind", "short", "scope"), [(WS, "Workspace", "ws", "Cluster"),
                                                                 (TB, "GPRTemplateBinding", "gprtb", "Namespaced")])
def test_crd_names_structure_and_columns(plural: str, kind: str, short: str, scope: str) -> None:
    c = crd(plural)
    assert c["metadata"]["name"] == f"{plural}.accelstack.io" and c["spec"]["scope"] == scope
    names = c["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == (
        kind, plural, [short], ["accelstack"])
    (version,) = c["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    schema = version["schema"]["openAPIV3Schema"]
    assert structural_problems(schema) == []
    for column in version["additionalPrinterColumns"]:  # every column names a field the schema has
        path = column["jsonPath"].split("[")[0]
        if path.startswith(".metadata."):
            continue
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]
    rules: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        rules.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
        for child in (node.get("properties") or {}).values():
            walk(child)
        if isinstance(node.get("items"), dict):
            walk(node["items"])

    walk(schema)
    assert rules
    for rule in rules:
        CEL.compile(rule)


def test_workspace_has_a_status_subresource_with_the_contract_fields() -> None:
    (version,) = crd(WS)["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"namespaces", "members", "usage", "gprs", "conditions", "observedGeneration"} <= set(status)
    assert set(status["usage"]["items"]["properties"]) == {"resource", "model", "max", "inUse", "reserved", "queued"}


def test_examples_are_accepted_and_the_controller_reads_them() -> None:
    (ws,) = examples("Workspace")
    stored, errors = admit(WS, ws)
    assert errors == []
    parsed = wsp.parse_workspace(stored)
    assert parsed.error == "" and parsed.namespaces == ("vision", "vision-dev") and len(parsed.access) == 4
    assert parsed.policy.priority_range == (1, 200) and parsed.policy.max_exit_s == 86400
    (binding,) = examples("GPRTemplateBinding")
    stored, errors = admit(TB, binding)
    assert errors == [] and stored["spec"]["weight"] == 10
    unweighted = copy.deepcopy(binding)
    del unweighted["spec"]["weight"]
    assert admit(TB, unweighted)[0]["spec"]["weight"] == 0  # defaulted
    (templates,) = [d for d in yaml.safe_load_all((ROOT / "examples" / "workspace.yaml").read_text())
                    if d["kind"] == "ConfigMap"]
    rules, problems = wsp.parse_templates(templates)
    assert problems == {} and rules["viewer"] == wsp.DEFAULT_TEMPLATES["viewer"]


def ws(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": "w"},
            "spec": {"namespaces": ["a"], **spec}}


@pytest.mark.parametrize(("spec", "message"), [
    ({"access": [{"kind": "User", "name": "bob", "namespace": "a", "role": "admin"}]},
     ".access[0].namespace: only a ServiceAccount subject has a namespace"),
    ({"access": [{"kind": "ServiceAccount", "name": "CI_Bot", "role": "member"}]},
     ".access[0].name: a ServiceAccount name must be a DNS subdomain"),
    ({"access": [{"kind": "User", "name": "bob", "role": "owner"}]}, "access.0.role: 'owner' is not one of"),
    ({"policy": {"priorityRange": {"min": 50, "max": 10}}},
     ".policy.priorityRange: priorityRange.min must not be above priorityRange.max"),
    ({"policy": {"devices": [{"resource": "nvidia.com/gpu", "max": 4}, {"resource": "nvidia.com/gpu", "max": 8}]}},
     ".policy.devices: one entry per resource and model"),
    ({"policy": {"devices": [{"resource": "nvidia.com/gpu", "max": -1}]}}, "policy.devices.0.max: -1 is less than"),
    ({"policy": {"maxExitDuration": "0s"}}, ".policy.maxExitDuration: maxExitDuration must be positive"),
    ({"policy": {"maxIdleTimeout": "a while"}}, "policy.maxIdleTimeout: 'a while' does not match"),
    ({"policy": {"maxGPRs": 0}}, "policy.maxGPRs: 0 is less than the minimum of 1"),
    ({"defaultTemplate": {"namespace": "elsewhere", "name": "t"}},
     ".defaultTemplate.namespace: defaultTemplate.namespace must be one of spec.namespaces"),
    ({"namespaces": ["Team_A"]}, "namespaces.0: 'Team_A' does not match"),
    ({"namespaces": ["a", "a"]}, "has non-unique elements"),
    ({"quota": 3}, "Additional properties are not allowed ('quota' was unexpected)"),
])
def test_bad_workspace_specs_are_refused_with_a_readable_message(spec: dict[str, Any], message: str) -> None:
    _, errors = admit(WS, ws(**spec))
    assert any(message in e for e in errors), errors


def tb(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplateBinding",
            "metadata": {"name": "b", "namespace": "a"}, "spec": {"template": "t", **spec}}


@pytest.mark.parametrize(("spec", "message"), [
    ({"workloadSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]}},
     "operators In and NotIn need values; Exists and DoesNotExist take none"),
    ({"workloadSelector": {"matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]}},
     "operators In and NotIn need values"),
    ({"workloadSelector": {"matchExpressions": [{"key": "app", "operator": "Matches", "values": ["x"]}]}},
     "'Matches' is not one of"),
    ({"weight": 5000}, "weight: 5000 is greater than the maximum of 1000"),
    ({"namespaces": []}, "namespaces: [] should be non-empty"),
    ({"template": ""}, "template: '' should be non-empty"),
])
def test_bad_binding_specs_are_refused_with_a_readable_message(spec: dict[str, Any], message: str) -> None:
    _, errors = admit(TB, tb(**spec))
    assert any(message in e for e in errors), errors
    assert admit(TB, tb())[1] == []


def test_the_schema_and_the_controller_agree_on_workspace_policies() -> None:
    """What the schema accepts the controller can use, and a policy the controller refuses the schema refuses."""
    good = ws(policy={"priorityRange": {"min": 1, "max": 1}, "maxGPRs": 1, "maxExitDuration": "1.5h",
                      "maxIdleTimeout": "90s", "devices": [{"resource": "neureality.com/nr1", "max": 0}]})
    assert admit(WS, good)[1] == []
    assert wsp.parse_workspace(good).error == ""
    for bad in ({"priorityRange": {"min": 9, "max": 1}}, {"maxExitDuration": "soon"},
                {"devices": [{"resource": "nvidia.com/gpu", "max": 1}] * 2}):
        assert admit(WS, ws(policy=bad))[1] != []
        with pytest.raises(wsp.PolicyError):
            wsp.parse_policy(bad)


def test_the_controller_role_holds_what_the_role_templates_grant_and_cannot_escalate() -> None:
    objects = list(yaml.safe_load_all((ROOT / "extender" / "rbac.yaml").read_text()))
    (role,) = [o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == wsp.MANAGED_BY]
    held = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}
    for template in wsp.DEFAULT_TEMPLATES.values():
        for rule in template:
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        assert (g, r, v) in held, (g, r, v)
    assert not {v for _, _, v in held} & {"escalate", "bind", "impersonate", "*"}
    assert not [r for _, r, _ in held if r == "*"]
    assert ("", "namespaces", "delete") not in held  # it never deletes a namespace
    (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding" and o["roleRef"]["name"] == wsp.MANAGED_BY]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "accelstack-extender",
                                    "namespace": "accelstack-system"}]


def test_the_printer_ready_column_reads_the_ready_condition() -> None:
    (version,) = crd(WS)["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert schema_of(WS)["properties"]["status"]["properties"]["conditions"]["items"]["required"] == ["type", "status"]
