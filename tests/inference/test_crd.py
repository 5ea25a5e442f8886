"""The InferenceEndpoint CRD, checked the way the API server applies it (structural schema, defaulting, schema
validation with unknown fields refused, CEL rules): the examples pass, broken endpoints are refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from inference.names import GROUP, KIND, PLURAL, VERSION
from tests.extender.test_crds import admit, crd, examples, structural_problems


def ie(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"models": ["llama-3-8b"], "template": {"image": "registry.example.com/vllm:0.6"},
                            "accelerator": {"resource": "nvidia.com/gpu"}}
    base.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": "llm", "namespace": "team-a"},
            "spec": base}


def test_crd_names_structure_and_columns() -> None:
    c = crd(PLURAL)
    assert c["metadata"]["name"] == f"{PLURAL}.{GROUP}" and c["spec"]["scope"] == "Namespaced"
    names = c["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == (
        KIND, PLURAL, ["ie"], ["accelstack"])
    (version,) = c["spec"]["versions"]
    assert version["name"] == VERSION and version["subresources"] == {"status": {}}
    assert structural_problems(version["schema"]["openAPIV3Schema"]) == []
    columns = [col["name"] for col in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Models", "Accelerator", "Ready", "Desired", "Burst"] and "Age" in columns


def test_defaults() -> None:
    stored, errors = admit(PLURAL, ie())
    assert errors == []
    spec = stored["spec"]
    assert spec["replicas"] == {"min": 1, "max": 1} and spec["accelerator"]["count"] == 1
    assert spec["template"]["port"] == 8000
    assert spec["autoscaling"]["targetInflightPerReplica"] == 8
    assert spec["gateway"] == {"maxInflightPerReplica": 64, "maxQueue": 256}
    assert spec["gpr"] == {"preemptible": False}


def test_examples_are_admitted() -> None:
    found = examples(KIND)
    assert found, "manifests/examples has an InferenceEndpoint"
    for obj in found:
        assert admit(PLURAL, obj)[1] == [], obj["metadata"]["name"]


@pytest.mark.parametrize(("spec", "message"), [
    ({"models": []}, "should be non-empty"),
    ({"models": ["a", "a"]}, "non-unique"),
    ({"models": ["bad model"]}, "does not match"),
    ({"accelerator": {"resource": "amd.com/gpu"}}, "is not one of"),
    ({"accelerator": {"resource": "nvidia.com/gpu", "count": 0}}, "less than the minimum"),
    ({"replicas": {"min": 3, "max": 2}}, "replicas.min must not exceed replicas.max"),
    ({"replicas": {"min": 0, "max": 2}}, "less than the minimum"),
    ({"gpr": {"priority": 100, "template": "t"}}, "gpr.priority or gpr.template, not both"),
    ({"burst": {"accelerator": {"resource": "nvidia.com/gpu"}, "maxReplicas": 2}},
     "a burst pool needs another accelerator"),
    ({"burst": {"accelerator": {"resource": "neureality.com/nr1"}}}, "'maxReplicas' is a required property"),
    ({"template": {"image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}},
     "put the accelerator in spec.accelerator"),
    ({"template": {"command": ["x"]}}, "'image' is a required property"),
    ({"access": {"namespaces": ["Team_B"]}}, "does not match"),
    ({"access": {"apiKeys": ["team-b/app/x"]}}, "does not match"),
    ({"surprise": True}, "Additional properties are not allowed"),
    ({"autoscaling": {"targetQueueSeconds": "2s"}}, "does not match"),
])
def test_broken_specs_are_refused(spec: dict[str, Any], message: str) -> None:
    _, errors = admit(PLURAL, ie(**spec))
    assert errors and any(message in e for e in errors), errors


def test_burst_on_the_same_accelerator_with_another_priority_is_fine() -> None:
    obj = ie(burst={"accelerator": {"resource": "nvidia.com/gpu"}, "maxReplicas": 2, "gprPriority": 50})
    assert admit(PLURAL, obj)[1] == []
    other = copy.deepcopy(obj)
    other["spec"]["burst"] = {"accelerator": {"resource": "neureality.com/nr1", "count": 2}, "maxReplicas": 4}
    assert admit(PLURAL, other)[1] == []
