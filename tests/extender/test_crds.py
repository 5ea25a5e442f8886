"""The CRDs' schemas, checked the way the API server applies them: structural-schema rules, defaulting, the
OpenAPI v3 schema as JSON Schema (jsonschema, strict field validation: unknown fields are errors) and the CEL
rules (cel-python, with ``oldSelf`` for transition rules on update), with the pieces of tests/crd_schema.py that
the API-server peer applies to every write too. The examples pass; broken objects fail; and the CRD and
``gpr_resource.from_object`` agree on every case."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_extender.core.gpr import GPR, Phase
from scheduler_extender.objects.gpr_codec import (
    GPR_KIND,
    GPR_PLURAL,
    GROUP,
    MAX_DURATION,
    SPEC_DURATION_PATTERN,
    SPEC_FIELDS,
    TEMPLATE_KIND,
    TEMPLATE_PLURAL,
    VERSION,
    SpecError,
    cluster_refusal,
    from_object,
    status_body,
    template_spec,
)
from tests.crd_schema import CEL, apply_defaults, cel_failures, structural_problems, validator

ROOT = Path(__file__).resolve().parents[2] / "manifests"
NOW = 1_796_018_400.0


def crd(plural: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / f"{plural}.{GROUP}.yaml").read_text())


def schema_of(plural: str) -> dict[str, Any]:
    (version,) = crd(plural)["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


# ---- the API server's pipeline, in small (tests/crd_schema.py, which the API-server peer applies too) ----------
def cel_errors(node: dict[str, Any], value: Any, old: Any, path: str) -> list[str]:
    """The rules that do not hold, as ``<path><fieldPath>: <message>`` (an evaluation error adds its text)."""
    errors = []
    for failure in cel_failures(node, value, old):
        message = failure.rule.get("message", failure.rule["rule"])
        if failure.error is not None:
            message = f"{message} ({failure.error})"
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in failure.path)
        errors.append(f"{path}{where}{failure.rule.get('fieldPath', '')}: {message}")
    return errors


def admit(plural: str, obj: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Default, then validate (schema, then CEL when the schema passes): -> (stored object, errors)."""
    schema = schema_of(plural)
    stored = apply_defaults(schema, copy.deepcopy(obj))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '/'}: {e.message}"
              for e in validator(schema).iter_errors(stored)]
    if not errors:
        errors = cel_errors(schema, stored, old, "")
    return stored, errors


def examples(kind: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == kind]
    return found


def gpr(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": GPR_KIND, "metadata": {"name": "x", "namespace": "team-a"},
            "spec": spec}


# ---- the CRDs themselves ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("plural", "kind", "short"), [(GPR_PLURAL, GPR_KIND, "gpr"),
                                                        (TEMPLATE_PLURAL, TEMPLATE_KIND, "gprt")])
def test_crd_names_and_structure(plural: str, kind: str, short: str) -> None:
    c = crd(plural)
    assert c["apiVersion"] == "apiextensions.k8s.io/v1" and c["kind"] == "CustomResourceDefinition"
    assert c["metadata"]["name"] == f"{plural}.{GROUP}"
    assert c["spec"]["group"] == GROUP and c["spec"]["scope"] == "Namespaced"
    names = c["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (kind, plural, [short])
    assert names["categories"] == ["accelstack"]
    (version,) = c["spec"]["versions"]
    assert version["name"] == VERSION and version["served"] and version["storage"]
    assert structural_problems(version["schema"]["openAPIV3Schema"]) == []
    spec_props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    # clusterName, workload: the GPR's on a hub only (docs/multicluster.md); a cluster's own codec refuses them
    assert set(spec_props) - {"description", "clusterName", "workload"} == set(SPEC_FIELDS)
    for rule_holder in ("exitDuration", "idleTimeout"):
        assert spec_props[rule_holder]["pattern"] == SPEC_DURATION_PATTERN
        rules = [r["rule"] for r in spec_props[rule_holder]["x-kubernetes-validations"]]
        assert f"duration(self) <= duration('{MAX_DURATION}')" in rules  # the bound parse_duration applies


def test_gpr_crd_status_subresource_and_printer_columns() -> None:
    (version,) = crd(GPR_PLURAL)["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Priority": ".spec.priority", "Devices": ".spec.devicesPerNode",
                       "Nodes": ".spec.nodeCount", "Queue": ".status.queuePosition",
                       "Est. Start": ".status.estimatedStart", "Earliest": ".status.estimatedStartRange.earliest",
                       "Latest": ".status.estimatedStartRange.latest", "Resource": ".spec.resource",
                       "Reason": ".status.reason", "Age": ".metadata.creationTimestamp"}
    schema = version["schema"]["openAPIV3Schema"]
    for path in columns.values():  # every column points at a field the schema has (metadata is the API server's)
        if path.startswith(".metadata."):
            continue
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]


def test_structural_check_catches_problems() -> None:  # the checker itself can fail
    assert structural_problems({"type": "object", "properties": {"a": {"minimum": 1}}}) == [".a: no type"]
    assert structural_problems({"type": "integer", "minimum": 1, "default": 0})[0].startswith("/: default")


def test_every_cel_rule_compiles() -> None:
    def rules(node: dict[str, Any]) -> list[str]:
        found = [r["rule"] for r in node.get("x-kubernetes-validations", [])]
        for child in (node.get("properties") or {}).values():
            found += rules(child)
        return found

    for plural in (GPR_PLURAL, TEMPLATE_PLURAL):
        found = rules(schema_of(plural))
        assert len(found) >= 4
        for rule in found:
            CEL.compile(rule)


# ---- examples ------------------------------------------------------------------------------------------------
def test_example_gprs_are_accepted_and_defaulted() -> None:
    found = examples(GPR_KIND)
    assert len(found) >= 3
    for obj in found:
        stored, errors = admit(GPR_PLURAL, obj)
        assert errors == [], (obj["metadata"]["name"], errors)
        assert {"priority", "devicesPerNode", "nodeCount", "milliPerDevice", "preemptible"} <= set(stored["spec"])
        from_object(stored, NOW)


def test_example_templates_are_accepted_and_make_valid_gprs() -> None:
    found = examples(TEMPLATE_KIND)
    assert found
    for obj in found:
        assert admit(TEMPLATE_PLURAL, obj)[1] == []
        stored, errors = admit(GPR_PLURAL, gpr(template_spec(obj)))
        assert errors == []
        from_object(stored, NOW)


def test_example_workloads_link_to_example_gprs() -> None:
    names = {(g["metadata"]["namespace"], g["metadata"]["name"]) for g in examples(GPR_KIND)}
    linked = 0
    for kind in ("Pod", "Job"):
        for obj in examples(kind):
            pod_meta = obj["metadata"] if kind == "Pod" else obj["spec"]["template"]["metadata"]
            pod_spec = obj["spec"] if kind == "Pod" else obj["spec"]["template"]["spec"]
            assert (obj["metadata"]["namespace"], pod_meta["labels"]["accelstack.io/gpr"]) in names
            assert pod_spec["schedulerName"] == "accelstack-scheduler"
            linked += 1
    assert linked >= 3


def test_empty_spec_gets_the_same_defaults_as_the_core() -> None:
    stored, errors = admit(GPR_PLURAL, gpr({}))
    assert errors == []
    assert stored["spec"] == {"resource": "nvidia.com/gpu", "devicesPerNode": 1, "milliPerDevice": 1000,
                              "nodeCount": 1, "priority": 100, "enforceIdleTimeout": False, "enableEviction": False,
                              "preemptible": True, "requeueOnFailure": False, "retryLimit": 3}
    a, b = from_object(stored, NOW), from_object(gpr({}), NOW)
    assert a == b
    # spec itself is defaulted when absent
    no_spec = gpr({})
    del no_spec["spec"]
    stored, errors = admit(GPR_PLURAL, no_spec)
    assert errors == [] and stored["spec"]["priority"] == 100


# ---- broken objects: the CRD and from_object both refuse, with the field named --------------------------------
BROKEN = [
    ({"priority": 0}, "priority", "spec.priority"),
    ({"priority": 301}, "priority", "spec.priority"),
    ({"priority": "high"}, "priority", "spec.priority"),
    ({"devicesPerNode": 0}, "devicesPerNode", "spec.devicesPerNode"),
    ({"devicesPerNode": "2"}, "devicesPerNode", "spec.devicesPerNode"),
    ({"milliPerDevice": 0}, "milliPerDevice", "spec.milliPerDevice"),
    ({"milliPerDevice": 1001}, "milliPerDevice", "spec.milliPerDevice"),
    ({"milliPerDevice": 500, "devicesPerNode": 2}, "requires devicesPerNode == 1", "spec.milliPerDevice"),
    ({"nodeCount": 0}, "nodeCount", "spec.nodeCount"),
    ({"resource": "amd.com/gpu"}, "resource", "spec.resource"),
    ({"models": [""]}, "models", "spec.models"),
    ({"models": "A100"}, "models", "spec.models"),
    ({"models": ["m"] * 33}, "models", "spec.models"),
    ({"memoryPerDeviceMiB": -1}, "memoryPerDeviceMiB", "spec.memoryPerDeviceMiB"),
    ({"exitDuration": "1d"}, "exitDuration", "spec.exitDuration"),
    ({"exitDuration": "-1h"}, "exitDuration", "spec.exitDuration"),
    ({"exitDuration": "0s"}, "exitDuration must be positive", "spec.exitDuration"),
    ({"exitDuration": 3600}, "exitDuration", "spec.exitDuration"),
    ({"idleTimeout": "0h0m"}, "idleTimeout must be positive", "spec.idleTimeout"),
    ({"exitDuration": "999999999h"}, "exitDuration", "spec.exitDuration"),  # past any CEL duration
    ({"exitDuration": "2562047h1s"}, "exitDuration must be at most 2562047h", "spec.exitDuration"),
    ({"idleTimeout": "2562048h"}, "idleTimeout must be at most 2562047h", "spec.idleTimeout"),
    ({"enforceIdleTimeout": True}, "enforceIdleTimeout requires idleTimeout", "spec.enforceIdleTimeout"),
    ({"enableEviction": "yes"}, "enableEviction", "spec.enableEviction"),
    ({"preemptible": 1}, "preemptible", "spec.preemptible"),
    ({"retryLimit": -1}, "retryLimit", "spec.retryLimit"),
    ({"gpus": 2}, "gpus", "spec.gpus"),
]


@pytest.mark.parametrize(("spec", "crd_says", "core_says"), BROKEN)
def test_broken_gprs_are_refused_by_both(spec: dict[str, Any], crd_says: str, core_says: str) -> None:
    _, errors = admit(GPR_PLURAL, gpr(spec))
    assert errors, spec
    assert any(crd_says in e for e in errors), errors
    with pytest.raises(SpecError) as info:
        from_object(gpr(spec), NOW)
    assert str(info.value).startswith(core_says + ":")


@pytest.mark.parametrize(("spec", "crd_says"), [(s, c) for s, c, _ in BROKEN if c != "gpus"])
def test_broken_templates_are_refused(spec: dict[str, Any], crd_says: str) -> None:
    template = {"apiVersion": f"{GROUP}/{VERSION}", "kind": TEMPLATE_KIND,
                "metadata": {"name": "t", "namespace": "team-a"}, "spec": spec}
    _, errors = admit(TEMPLATE_PLURAL, template)
    assert any(crd_says in e for e in errors), errors
    with pytest.raises(SpecError, match=r"^GPRTemplate team-a/t: spec\."):
        template_spec(template)


@pytest.mark.parametrize("spec", [
    {"milliPerDevice": 1000, "devicesPerNode": 8}, {"exitDuration": "1h30m"},
    {"exitDuration": "1.5h", "idleTimeout": ".5h"}, {"idleTimeout": "90s", "enforceIdleTimeout": True},
    {"exitDuration": "250ms"}, {"exitDuration": "2562047h"}, {"idleTimeout": "2562046h59m59.5s"},
    {"models": ["A", "B"]}, {"priority": 1}, {"priority": 300}, {"retryLimit": 0},
    {"resource": "neureality.com/nr1", "nodeCount": 16}, {"memoryPerDeviceMiB": 0},
])
def test_valid_specs_are_accepted_by_both(spec: dict[str, Any]) -> None:
    stored, errors = admit(GPR_PLURAL, gpr(spec))
    assert errors == []
    from_object(stored, NOW)


@pytest.mark.parametrize("milli", [1, 250, 500, 999])
def test_fractions_are_refused_on_a_cluster_and_kept_by_the_core(milli: int) -> None:
    """The kubelet hands out whole devices, so a fraction GPR could only fail after it was stored: the CRD (and
    the validating webhook, tests/extender/test_webhook.py) refuse it with the reason; the conversion to the
    core keeps accepting it (the core and the simulator place fractions) and the controller names the same
    reason for an object stored before the rule."""
    _, errors = admit(GPR_PLURAL, gpr({"milliPerDevice": milli}))
    assert len(errors) == 1 and errors[0].startswith(".spec.milliPerDevice: fractions of a device"), errors
    assert "time-slicing replicas" in errors[0]
    template = {"apiVersion": f"{GROUP}/{VERSION}", "kind": TEMPLATE_KIND,
                "metadata": {"name": "t", "namespace": "team-a"}, "spec": {"milliPerDevice": milli}}
    assert admit(TEMPLATE_PLURAL, template)[1] == errors
    g = from_object(gpr({"milliPerDevice": milli}), NOW)
    assert g.milli_per_device == milli
    assert cluster_refusal(g).startswith("spec.milliPerDevice: fractions of a device are not supported")


def test_duplicate_models_are_refused_by_the_crd_as_a_set() -> None:
    _, errors = admit(GPR_PLURAL, gpr({"models": ["A", "A"]}))
    assert any("non-unique" in e for e in errors), errors


def test_resource_is_immutable_on_update() -> None:
    old, errors = admit(GPR_PLURAL, gpr({"resource": "nvidia.com/gpu"}))
    assert errors == []
    _, errors = admit(GPR_PLURAL, gpr({"resource": "neureality.com/nr1"}), old=old)
    assert errors == [".spec.resource: resource is immutable"]
    _, errors = admit(GPR_PLURAL, gpr({"resource": "nvidia.com/gpu", "priority": 120}), old=old)
    assert errors == []


# ---- status bodies written by the controller fit the status schema ---------------------------------------------
def test_status_bodies_validate_against_the_status_schema() -> None:
    status_schema = schema_of(GPR_PLURAL)["properties"]["status"]
    check = validator(status_schema)
    g = GPR(name="team-a/x", workspace="team-a", devices_per_node=2, submitted_at=NOW - 60)
    g.history.append((NOW - 60, Phase.QUEUED, "Submitted"))
    bodies = [status_body(g, queue_position=1, estimated_start=NOW + 60, reservation=[], now=NOW,
                          observed_generation=1)]
    g.transition(Phase.ADMITTED, NOW - 30, "Placed")
    g.transition(Phase.RUNNING, NOW - 10)
    bodies.append(status_body(g, queue_position=None, estimated_start=None, now=NOW, observed_generation=2,
                              reservation=[{"node": "n1", "devices": 2}, {"node": "n2", "devices": [0, 1]}],
                              conditions=[{"type": "EvictionBlocked", "status": "True", "reason": "PodDisruptionBudget",
                                           "message": "blocked"}]))
    g.transition(Phase.EVICTED, NOW, "Preempted by team-b/y (priority 250)")  # a reason that is not a CamelCase word
    bodies.append(status_body(g, queue_position=None, estimated_start=None, reservation=[], now=NOW,
                              observed_generation=None))
    for body in bodies:
        errors = [e.message for e in check.iter_errors(body["status"])]
        assert errors == [], errors
    assert check.iter_errors({"phase": "Sleeping"}).__next__().message.startswith("'Sleeping' is not one of")
    assert list(check.iter_errors({"estimatedStart": "tomorrow"}))


def test_names_longer_than_a_label_value_are_refused_by_both() -> None:
    long = gpr({})
    long["metadata"]["name"] = "n" * 64
    _, errors = admit(GPR_PLURAL, long)
    assert errors == [": metadata.name must be at most 63 characters (pods name their GPR in the label "
                      "accelstack.io/gpr)"]
    with pytest.raises(SpecError, match=r"^metadata\.name: at most 63 characters"):
        from_object(long, NOW)
    long["metadata"]["name"] = "n" * 63
    assert admit(GPR_PLURAL, long)[1] == []
    from_object(long, NOW)
