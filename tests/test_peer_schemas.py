"""The API-server peer's CRD handling (tests/apiserver_peer/schemas.py over tests/crd_schema.py): objects of the
CRDs in manifests/crds are pruned, defaulted and validated as kube-apiserver does it, with its words and field
paths; a /status write judges only the status; transition rules see oldSelf on update only; everything else
passes untouched."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_extender.core.gpr import GPR, Phase
from scheduler_extender.objects.gpr_codec import from_object, status_body
from tests.apiserver_peer.schemas import CustomSchemas, warning_header
from tests.apiserver_peer.wire import Refused, merge_patch
from tests.crd_schema import field_path, go_float, go_value

EXAMPLES = Path(__file__).resolve().parents[1] / "manifests" / "examples"
GROUP = "apis/accelstack.io/v1alpha1"
GPRS, TEMPLATES, BINDINGS = f"{GROUP}/gpuprovisioningrequests", f"{GROUP}/gprtemplates", f"{GROUP}/gprtemplatebindings"
WORKSPACES, ENDPOINTS = f"{GROUP}/workspaces", f"{GROUP}/inferenceendpoints"
ACCELERATOR_NODES = f"{GROUP}/acceleratornodes"
CLUSTERS = f"{GROUP}/clusters"
NOW = 1_796_018_400.0
NOT_CHECKED = ('<nil>: Invalid value: "null": some validation rules were not checked because the object was invalid; '
               "correct the existing errors to complete validation")
SCHEMAS = CustomSchemas()


def examples(kind: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == kind]
    assert found, kind
    return found


def gpr(spec: dict[str, Any] | None = None, name: str = "x") -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
                           "metadata": {"name": name, "namespace": "team-a"}}
    if spec is not None:
        obj["spec"] = spec
    return obj


def binding(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplateBinding",
            "metadata": {"name": "b", "namespace": "team-a"}, "spec": {"template": "t", **spec}}


def workspace(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": "w"},
            "spec": {"namespaces": ["a"], **spec}}


def stored(obj: dict[str, Any], resource: str = GPRS) -> dict[str, Any]:
    """``obj`` as a create stores it."""
    obj = copy.deepcopy(obj)
    assert SCHEMAS.admit(resource, obj) == []
    return obj


def refusal(resource: str, obj: dict[str, Any], old: dict[str, Any] | None = None, sub: str = "",
            **kwargs: Any) -> Refused:
    with pytest.raises(Refused) as info:
        SCHEMAS.admit(resource, copy.deepcopy(obj), old, sub, **kwargs)
    return info.value


def errors_of(refused: Refused) -> list[str]:
    """The field errors of a 422, as the message lists them."""
    assert refused.code == 422 and refused.reason == "Invalid"
    assert refused.details is not None
    return [f"{c['field']}: {c['message']}" for c in refused.details["causes"]]


# ---- what passes ---------------------------------------------------------------------------------------------------
def test_example_gprs_are_accepted_and_defaulted() -> None:
    for example in examples("GPUProvisioningRequest"):
        obj = copy.deepcopy(example)
        assert SCHEMAS.admit(GPRS, obj) == [], example["metadata"]["name"]
        for key, value in example["spec"].items():  # what the example says is kept
            assert obj["spec"][key] == value
        for key, default in (("resource", "nvidia.com/gpu"), ("devicesPerNode", 1), ("milliPerDevice", 1000),
                             ("nodeCount", 1), ("priority", 100), ("preemptible", True), ("retryLimit", 3)):
            assert obj["spec"][key] == example["spec"].get(key, default)
        assert obj["metadata"] == example["metadata"]
        from_object(obj, NOW)


@pytest.mark.parametrize(("kind", "resource"), [("GPRTemplate", TEMPLATES), ("Workspace", WORKSPACES),
                                                ("GPRTemplateBinding", BINDINGS), ("InferenceEndpoint", ENDPOINTS)])
def test_examples_of_the_other_crds_are_accepted(kind: str, resource: str) -> None:
    for example in examples(kind):
        obj = copy.deepcopy(example)
        assert SCHEMAS.admit(resource, obj) == []
        assert {k: v for k, v in obj.items() if k != "spec"} == {k: v for k, v in example.items() if k != "spec"}
        if kind == "InferenceEndpoint":  # defaults below defaulted objects
            assert obj["spec"]["gpr"] == {**example["spec"]["gpr"], "preemptible": False}
            assert obj["spec"]["autoscaling"] == {**example["spec"]["autoscaling"], "scaleUpStabilizationSeconds": 0}
        else:
            assert obj == example  # nothing to default: templates default nothing, the examples set the rest


def test_a_gpr_without_spec_gets_the_defaults_and_its_kind() -> None:
    obj = gpr()
    del obj["apiVersion"], obj["kind"]  # the API server takes them from the URL
    assert SCHEMAS.admit(GPRS, obj) == []
    assert (obj["apiVersion"], obj["kind"]) == ("accelstack.io/v1alpha1", "GPUProvisioningRequest")
    assert obj["spec"] == {"resource": "nvidia.com/gpu", "devicesPerNode": 1, "milliPerDevice": 1000, "nodeCount": 1,
                           "priority": 100, "enforceIdleTimeout": False, "enableEviction": False,
                           "preemptible": True, "requeueOnFailure": False, "retryLimit": 3}


def test_nulls_are_defaulted_or_dropped() -> None:
    obj = gpr({"priority": None, "models": None, "exitDuration": None})
    assert SCHEMAS.admit(GPRS, obj) == []
    assert obj["spec"]["priority"] == 100  # null and a default: the default
    assert "models" not in obj["spec"] and "exitDuration" not in obj["spec"]  # null without one: dropped


# ---- pruning -------------------------------------------------------------------------------------------------------
def test_unknown_fields_are_pruned_with_a_warning_each() -> None:
    obj = gpr({"priority": 120, "gpus": 2, "selector": {"a": "b"}})
    obj["extra"] = True
    obj["metadata"]["labels"] = {"app": "x"}
    obj["metadata"]["owner"] = "bob"  # not an ObjectMeta field
    assert SCHEMAS.admit(GPRS, obj) == ['unknown field "extra"', 'unknown field "metadata.owner"',
                                        'unknown field "spec.gpus"', 'unknown field "spec.selector"']
    assert "extra" not in obj and obj["metadata"] == {"name": "x", "namespace": "team-a", "labels": {"app": "x"}}
    assert obj["spec"]["priority"] == 120 and not {"gpus", "selector"} & set(obj["spec"])


def test_unknown_fields_in_list_items_and_nested_objects_are_pruned() -> None:
    ws = workspace(access=[{"kind": "User", "name": "bob", "role": "admin", "team": "x"}],
                   policy={"maxGPRs": 2, "burst": True})
    assert SCHEMAS.admit(WORKSPACES, ws) == ['unknown field "spec.access[0].team"',
                                             'unknown field "spec.policy.burst"']
    assert ws["spec"]["access"] == [{"kind": "User", "name": "bob", "role": "admin"}]
    assert ws["spec"]["policy"] == {"maxGPRs": 2}


def test_preserve_unknown_fields_keeps_what_the_schema_does_not_declare() -> None:
    (example,) = examples("InferenceEndpoint")
    obj = copy.deepcopy(example)
    template = obj["spec"]["template"]
    template["readinessProbe"] = {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5}
    template["env"] = [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    template["resources"] = {"requests": {"cpu": "2", "memory": 1024}}
    template["sidecar"] = {"image": "x"}  # template itself prunes
    assert SCHEMAS.admit(ENDPOINTS, obj) == ['unknown field "spec.template.sidecar"']
    assert template["readinessProbe"] == {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5}
    assert template["env"] == [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    assert template["resources"] == {"requests": {"cpu": "2", "memory": 1024}}


def test_pruning_and_defaulting_never_reach_into_the_stored_object() -> None:
    """A merge patch shares the parts it does not touch with the stored object (wire.merge_patch): admit
    changes the write's own copy only, also when the write is refused."""
    current = gpr({"priority": 120, "gpus": 2})  # stored before pruning existed (put_object)
    current["metadata"]["labels"] = {"app": "x"}
    snapshot = copy.deepcopy(current)
    new = merge_patch(current, {"metadata": {"annotations": {"a": "b"}}})
    assert new["spec"] is current["spec"]
    assert SCHEMAS.admit(GPRS, new, current) == ['unknown field "spec.gpus"']
    assert "gpus" not in new["spec"] and new["spec"]["retryLimit"] == 3
    assert current == snapshot
    broken = gpr({"devicesPerNode": 0, "gpus": 2})  # stored before the rules: any update of it is refused
    snapshot = copy.deepcopy(broken)
    with pytest.raises(Refused):
        SCHEMAS.admit(GPRS, merge_patch(broken, {"metadata": {"annotations": {"a": "b"}}}), broken)
    assert broken == snapshot


def test_field_validation_strict_refuses_and_ignore_stays_silent() -> None:
    obj = gpr({"gpus": 2, "shape": "x"})
    refused = refusal(GPRS, obj, field_validation="Strict")
    assert (refused.code, refused.reason) == (400, "BadRequest")
    assert refused.message == ('GPUProvisioningRequest in version "v1alpha1" cannot be handled as a '
                               'GPUProvisioningRequest: strict decoding error: unknown field "spec.gpus", '
                               'unknown field "spec.shape"')
    quiet = copy.deepcopy(obj)
    assert SCHEMAS.admit(GPRS, quiet, field_validation="Ignore") == []
    assert "gpus" not in quiet["spec"]
    assert SCHEMAS.admit(GPRS, gpr({}), field_validation="Strict") == []
    assert refusal(GPRS, gpr({}), field_validation="Lenient").code == 400


def test_warning_header_quotes_as_the_api_server_does() -> None:
    assert warning_header('unknown field "spec.gpus"') == '299 - "unknown field \\"spec.gpus\\""'


# ---- what is refused, in the API server's words --------------------------------------------------------------------
INVALID = [
    (GPRS, gpr({"priority": 301}),
     ["spec.priority: Invalid value: 301: spec.priority in body should be less than or equal to 300"]),
    (GPRS, gpr({"priority": "high"}),
     ['spec.priority: Invalid value: "string": spec.priority in body must be of type integer: "string"', NOT_CHECKED]),
    (GPRS, gpr({"preemptible": "yes"}),
     ['spec.preemptible: Invalid value: "string": spec.preemptible in body must be of type boolean: "string"',
      NOT_CHECKED]),
    (GPRS, gpr({"models": "A100"}),
     ['spec.models: Invalid value: "string": spec.models in body must be of type array: "string"', NOT_CHECKED]),
    (GPRS, gpr({"resource": "amd.com/gpu"}),
     ['spec.resource: Unsupported value: "amd.com/gpu": supported values: "nvidia.com/gpu", "neureality.com/nr1"',
      NOT_CHECKED]),
    (GPRS, gpr({"exitDuration": "1d"}),
     ["spec.exitDuration: Invalid value: \"1d\": spec.exitDuration in body should match "
      "'^(([0-9]+(\\.[0-9]*)?|\\.[0-9]+)(ns|us|ms|s|m|h))+$'"]),
    (GPRS, gpr({"exitDuration": "1" * 64 + "h"}), ["spec.exitDuration: Too long: may not be longer than 64", NOT_CHECKED]),
    (GPRS, gpr({"models": [""]}),
     ['spec.models[0]: Invalid value: "": spec.models[0] in body should be at least 1 chars long']),
    (GPRS, gpr({"models": [f"m{i}" for i in range(33)]}),
     ["spec.models: Too many: 33: must have at most 32 items", NOT_CHECKED]),
    (GPRS, gpr({"nodeCount": 2**31}),
     ['spec.nodeCount: Invalid value: 2147483648: spec.nodeCount in body must be of type int32: "2147483648"',
      NOT_CHECKED]),
    (GPRS, gpr({"models": ["A", "B", "A", "A"]}), ['spec.models[2]: Duplicate value: "A"']),
    (GPRS, gpr({"milliPerDevice": 500, "devicesPerNode": 2}),
     ['spec.milliPerDevice: Invalid value: "object": milliPerDevice < 1000 (a fraction of one device) requires '
      "devicesPerNode == 1",
      'spec.milliPerDevice: Invalid value: "integer": fractions of a device (milliPerDevice below 1000) are not '
      "supported on a cluster: the kubelet hands out whole devices; share GPUs with time-slicing replicas and ask "
      "for whole replicas (the simulator models fractions)"]),
    (GPRS, gpr({"enforceIdleTimeout": True}),
     ['spec.enforceIdleTimeout: Invalid value: "object": enforceIdleTimeout requires idleTimeout']),
    (GPRS, gpr({"idleTimeout": "0h0m"}), ['spec.idleTimeout: Invalid value: "string": idleTimeout must be positive']),
    (GPRS, gpr({}, name="n" * 64),
     ['<nil>: Invalid value: "object": metadata.name must be at most 63 characters (pods name their GPR in the '
      "label accelstack.io/gpr)"]),
    (GPRS, gpr({}, name="Team_A"),
     ['metadata.name: Invalid value: "Team_A": a lowercase RFC 1123 subdomain must consist of lower case '
      "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. "
      "'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*"
      "[a-z0-9])?)*')"]),
    (GPRS, {**gpr({}), "kind": "GPRTemplate"}, ['kind: Invalid value: "GPRTemplate": must be GPUProvisioningRequest']),
    (TEMPLATES, {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate", "metadata": {"name": "t"}},
     ["spec: Required value", NOT_CHECKED]),
    (BINDINGS, {**binding(), "spec": {"weight": 1}}, ["spec.template: Required value", NOT_CHECKED]),
    (BINDINGS, binding(template="t" * 254), ["spec.template: Too long: may not be longer than 253", NOT_CHECKED]),
    (BINDINGS, binding(namespaces=[]),
     ["spec.namespaces: Invalid value: 0: spec.namespaces in body should have at least 1 items"]),
    (BINDINGS, binding(weight=-1001),
     ["spec.weight: Invalid value: -1001: spec.weight in body should be greater than or equal to -1000"]),
    (BINDINGS, binding(workloadSelector={"matchLabels": {"app": 5}}),
     ['spec.workloadSelector.matchLabels.app: Invalid value: "integer": spec.workloadSelector.matchLabels.app in '
      'body must be of type string: "integer"', NOT_CHECKED]),
    (BINDINGS, binding(workloadSelector={"matchLabels": {f"k{i}": "v" for i in range(65)}}),
     ["spec.workloadSelector.matchLabels: Too many: 65: must have at most 64 items", NOT_CHECKED]),
    (BINDINGS, binding(workloadSelector={"matchExpressions": [{"key": "app", "operator": "In"}]}),
     ['spec.workloadSelector.matchExpressions[0]: Invalid value: "object": operators In and NotIn need values; '
      "Exists and DoesNotExist take none"]),
    (WORKSPACES, workspace(access=[{"kind": "User", "name": "bob", "namespace": "a", "role": "admin"}]),
     ['spec.access[0].namespace: Invalid value: "object": only a ServiceAccount subject has a namespace']),
    (WORKSPACES, workspace(policy={"devices": [{"resource": "nvidia.com/gpu", "max": 1}] * 2}),
     ['spec.policy.devices: Invalid value: "array": one entry per resource and model']),
]


@pytest.mark.parametrize(("resource", "obj", "expected"), INVALID)
def test_invalid_objects_are_refused_with_the_field_and_the_words(resource: str, obj: dict[str, Any],
                                                                  expected: list[str]) -> None:
    refused = refusal(resource, obj)
    assert errors_of(refused) == expected
    kind = {GPRS: "GPUProvisioningRequest", TEMPLATES: "GPRTemplate", BINDINGS: "GPRTemplateBinding",
            WORKSPACES: "Workspace"}[resource]
    body = expected[0] if len(expected) == 1 else "[" + ", ".join(expected) + "]"
    assert refused.message == f'{kind}.accelstack.io "{obj["metadata"]["name"]}" is invalid: {body}'


def test_the_refusal_is_the_api_servers_invalid_status() -> None:
    refused = refusal(GPRS, gpr({"devicesPerNode": 0}))
    assert refused.message == ('GPUProvisioningRequest.accelstack.io "x" is invalid: spec.devicesPerNode: Invalid '
                               "value: 0: spec.devicesPerNode in body should be greater than or equal to 1")
    assert (refused.code, refused.reason) == (422, "Invalid")
    assert refused.details == {"name": "x", "group": "accelstack.io", "kind": "GPUProvisioningRequest", "causes": [
        {"reason": "FieldValueInvalid", "field": "spec.devicesPerNode",
         "message": "Invalid value: 0: spec.devicesPerNode in body should be greater than or equal to 1"}]}
    both = refusal(GPRS, gpr({"devicesPerNode": 0, "priority": 0}))
    assert both.message.endswith("is invalid: [spec.devicesPerNode: Invalid value: 0: spec.devicesPerNode in body "
                                 "should be greater than or equal to 1, spec.priority: Invalid value: 0: "
                                 "spec.priority in body should be greater than or equal to 1]")
    unsupported = refusal(GPRS, gpr({"resource": "tpu"}))
    assert unsupported.details is not None
    assert [c["reason"] for c in unsupported.details["causes"]] == ["FieldValueNotSupported", "FieldValueInvalid"]


def test_a_cel_rule_that_cannot_be_evaluated_is_an_error_at_its_field() -> None:
    (error,) = errors_of(refusal(GPRS, gpr({"exitDuration": "999999999h"})))[:1]
    assert error.startswith('spec.exitDuration: Invalid value: "string": ')
    assert error.endswith(" evaluating rule: exitDuration must be positive")


# ---- /status and the main resource --------------------------------------------------------------------------------
def test_a_status_write_with_an_invalid_phase_is_refused() -> None:
    current = stored(gpr({}))
    new = {**copy.deepcopy(current), "status": {"phase": "Sleeping"}}
    assert errors_of(refusal(GPRS, new, current, "status")) == [
        'status.phase: Unsupported value: "Sleeping": supported values: "Queued", "Admitted", "Running", '
        '"Evicting", "Complete", "Failed", "Evicted", "Cancelled"', NOT_CHECKED]
    for status, error in (({"queuePosition": -1}, "status.queuePosition: Invalid value: -1: status.queuePosition "
                                                  "in body should be greater than or equal to 0"),
                          ({"estimatedStart": "tomorrow"}, 'status.estimatedStart: Invalid value: "tomorrow": '
                                                           "status.estimatedStart in body must be of type date-time: "
                                                           '"tomorrow"'),
                          ({"reservation": [{"node": "n1", "devices": 1}, {"node": "n1", "devices": 2}]},
                           'status.reservation[1]: Duplicate value: map[string]interface {}{"node":"n1"}'),
                          ({"reservation": [{"node": "n1"}]}, "status.reservation[0].devices: Required value")):
        assert errors_of(refusal(GPRS, {**current, "status": status}, current, "status"))[0] == error


def test_a_status_write_does_not_judge_the_stored_spec_again() -> None:
    current = gpr({"priority": 0, "milliPerDevice": 250, "gpus": 1})  # stored before the rules (put_object)
    new = {**copy.deepcopy(current), "status": {"phase": "Queued", "queuePosition": 1, "note": "x"}}
    assert SCHEMAS.admit(GPRS, new, current, "status") == ['unknown field "status.note"']
    assert new["spec"] == current["spec"]  # neither pruned, nor defaulted, nor refused
    assert new["status"] == {"phase": "Queued", "queuePosition": 1}
    gone = copy.deepcopy(current)
    gone["status"] = None
    assert SCHEMAS.admit(GPRS, gone, current, "status") == [] and "status" not in gone


def test_a_main_write_leaves_the_stored_status_alone() -> None:
    current = stored(gpr({}))
    current["status"] = {"phase": "Sleeping", "note": "hand-edited"}  # as stored; the server keeps it on updates
    new = copy.deepcopy(current)
    new["spec"]["priority"] = 200
    assert SCHEMAS.admit(GPRS, new, current) == []
    assert new["status"] == {"phase": "Sleeping", "note": "hand-edited"}
    assert SCHEMAS.has_status_subresource(GPRS) and not SCHEMAS.has_status_subresource(TEMPLATES)


def test_a_crd_without_a_status_subresource_has_no_status_endpoint_and_prunes_status() -> None:
    template = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate", "metadata": {"name": "t"},
                "spec": {}, "status": {"used": 1}}
    assert refusal(TEMPLATES, template, template, "status").code == 404
    assert SCHEMAS.admit(TEMPLATES, template) == ['unknown field "status"'] and "status" not in template


def test_controller_status_bodies_pass_a_status_write_unchanged() -> None:
    """What the GPR controller writes (gpr_resource.status_body, sent as a merge patch to /status) fits."""
    current = stored(gpr({"devicesPerNode": 2}, name="y"))
    g = GPR(name="team-a/y", workspace="team-a", devices_per_node=2, submitted_at=NOW - 60)
    g.history.append((NOW - 60, Phase.QUEUED, "Submitted"))
    bodies = [status_body(g, queue_position=1, estimated_start=NOW + 60, reservation=[], now=NOW,
                          observed_generation=1, estimated_range=(NOW + 30, NOW + 600))]
    g.transition(Phase.ADMITTED, NOW - 30, "Placed")
    g.transition(Phase.RUNNING, NOW - 10)
    bodies.append(status_body(g, queue_position=None, estimated_start=None, now=NOW, observed_generation=2,
                              reservation=[{"node": "n1", "devices": 2}, {"node": "n2", "devices": [0, 1]}],
                              conditions=[{"type": "EvictionBlocked", "status": "True",
                                           "reason": "PodDisruptionBudget", "message": "blocked"}]))
    g.transition(Phase.EVICTED, NOW, "Preempted by team-b/y (priority 250)")
    bodies.append(status_body(g, queue_position=None, estimated_start=None, reservation=[], now=NOW,
                              observed_generation=None))
    assert "estimatedStartRange" in bodies[0]["status"] and len(bodies[1]["status"]["reservation"]) == 2
    for body in bodies:
        new = merge_patch(current, body)
        written = copy.deepcopy(new)
        assert SCHEMAS.admit(GPRS, written, current, "status") == []
        assert written == new
        current = written


# ---- transition rules ----------------------------------------------------------------------------------------------
def test_a_transition_rule_holds_on_update_only() -> None:
    created = stored(gpr({"resource": "neureality.com/nr1"}))  # no old value: self == oldSelf is not evaluated
    moved = copy.deepcopy(created)
    moved["spec"]["resource"] = "nvidia.com/gpu"
    assert errors_of(refusal(GPRS, moved, created)) == ['spec.resource: Invalid value: "string": resource is immutable']
    same = copy.deepcopy(created)
    same["spec"]["priority"] = 250
    assert SCHEMAS.admit(GPRS, same, created) == []
    legacy = gpr({"priority": 100})  # stored without spec.resource: the update adds it, there is no oldSelf
    assert SCHEMAS.admit(GPRS, gpr({"resource": "neureality.com/nr1"}), legacy) == []
    status = {**copy.deepcopy(created), "status": {"phase": "Queued"}}
    status["spec"]["resource"] = "nvidia.com/gpu"  # a /status write does not look at the spec
    assert SCHEMAS.admit(GPRS, status, created, "status") == []


# ---- resources without a CRD ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("resource", "sub"), [
    ("api/v1/pods", ""), ("api/v1/pods", "status"), ("api/v1/nodes", ""), ("apis/coordination.k8s.io/v1/leases", ""),
    ("apis/apps/v1/deployments", ""), ("apis/example.io/v1/gpuprovisioningrequests", ""),
    ("apis/accelstack.io/v1beta1/gpuprovisioningrequests", ""), (GPRS, "scale"),
])
def test_objects_of_resources_without_a_crd_are_untouched(resource: str, sub: str) -> None:
    obj = {"apiVersion": "v1", "kind": "Thing", "metadata": {"name": "Not_A_Name", "owner": "x"},
           "spec": {"priority": "high", "gpus": None}, "status": {"phase": "Sleeping"}, "extra": 1}
    before = copy.deepcopy(obj)
    assert SCHEMAS.admit(resource, obj, copy.deepcopy(obj), sub) == []
    assert obj == before
    assert SCHEMAS.get(resource) is None or sub == "scale"


# ---- features the CRDs here do not use (yet), on a CRD of the test's own ---------------------------------------------
WIDGETS = "apis/example.io/v1/widgets"
WIDGET_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.example.io}
spec:
  group: example.io
  scope: Namespaced
  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              x-kubernetes-validations:
                - rule: "!has(self.min) || !has(self.max) || self.min <= self.max"
                  messageExpression: "'min ' + string(self.min) + ' is above max ' + string(self.max)"
                  fieldPath: .min
                - rule: "!has(self.owner) || self.owner != 'root'"
                  messageExpression: "self.nosuchfield"
                  message: root may not own a widget
                - rule: "!has(self.secret)"
                  reason: FieldValueForbidden
                  message: secrets belong in a Secret
                  fieldPath: .secret
                - rule: "has(self.name)"
                  reason: FieldValueRequired
                  fieldPath: .name
              properties:
                name: {type: string}
                owner: {type: string}
                secret: {type: string}
                min: {type: integer}
                max: {type: integer}
                note: {type: string, nullable: true}
                size: {type: integer, default: 3}
                limits:
                  type: object
                  additionalProperties:
                    type: integer
                    x-kubernetes-validations:
                      - rule: self >= 0
                disks:
                  type: array
                  x-kubernetes-list-type: map
                  x-kubernetes-list-map-keys: [name]
                  items:
                    type: object
                    required: [name]
                    x-kubernetes-validations:
                      - rule: self.size >= oldSelf.size
                        message: a disk may not shrink
                    properties:
                      name: {type: string}
                      size: {type: integer}
                tags:
                  type: array
                  items:
                    type: object
                    x-kubernetes-validations:
                      - rule: "!has(oldSelf.v) || self.v == oldSelf.v"
                        message: never evaluated, tags is not a map list
                    properties:
                      v: {type: string}
                extra:
                  type: object
                  x-kubernetes-preserve-unknown-fields: true
                  properties:
                    known:
                      type: object
                      properties:
                        a: {type: string}
    - name: v0
      served: false
      storage: false
      schema:
        openAPIV3Schema: {type: object}
"""


@pytest.fixture
def widgets(tmp_path: Path) -> CustomSchemas:
    (tmp_path / "widgets.yaml").write_text(textwrap.dedent(WIDGET_CRD))
    (tmp_path / "kustomization.yaml").write_text("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n")
    return CustomSchemas(tmp_path)


def widget(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "example.io/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "a"},
            "spec": {"name": "w", **spec}}


def widget_errors(schemas: CustomSchemas, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    with pytest.raises(Refused) as info:
        schemas.admit(WIDGETS, obj, old)
    return errors_of(info.value)


def test_only_served_versions_of_crds_are_loaded(widgets: CustomSchemas) -> None:
    assert list(widgets.resources) == [WIDGETS]
    assert widgets.get("apis/example.io/v0/widgets") is None


def test_message_expression_reason_and_default_messages(widgets: CustomSchemas) -> None:
    assert widget_errors(widgets, widget(min=5, max=2)) == ['spec.min: Invalid value: "object": min 5 is above max 2']
    assert widget_errors(widgets, widget(owner="root")) == [
        'spec: Invalid value: "object": root may not own a widget']  # a failing messageExpression: the message
    assert widget_errors(widgets, widget(secret="s")) == ["spec.secret: Forbidden: secrets belong in a Secret"]
    obj = widget()
    del obj["spec"]["name"]
    assert widget_errors(widgets, obj) == ["spec.name: Required value: failed rule: has(self.name)"]
    assert widget_errors(widgets, widget(limits={"gpu": 2, "cpu": -1})) == [
        'spec.limits[cpu]: Invalid value: "integer": failed rule: self >= 0']


def test_transition_rules_in_map_lists_see_the_item_of_the_same_key(widgets: CustomSchemas) -> None:
    old = widget(disks=[{"name": "a", "size": 10}, {"name": "b", "size": 5}], tags=[{"v": "x"}])
    assert widgets.admit(WIDGETS, copy.deepcopy(old)) == []
    reordered = widget(disks=[{"name": "c", "size": 1}, {"name": "b", "size": 6}, {"name": "a", "size": 10}],
                       tags=[{"v": "y"}])  # a new key has no old item; tags (not a map list) has no oldSelf
    assert widgets.admit(WIDGETS, reordered, old) == []
    shrunk = widget(disks=[{"name": "b", "size": 4}, {"name": "a", "size": 10}])
    assert widget_errors(widgets, shrunk, old) == ['spec.disks[0]: Invalid value: "object": a disk may not shrink']
    twice = widget(disks=[{"name": "a", "size": 10}, {"name": "a", "size": 11}])
    assert widget_errors(widgets, twice) == [
        'spec.disks[1]: Duplicate value: map[string]interface {}{"name":"a"}']


def test_nullable_defaults_and_preserved_subtrees(widgets: CustomSchemas) -> None:
    obj = widget(note=None, size=None, owner=None,
                 extra={"anything": {"goes": 1}, "known": {"a": "x", "b": "pruned"}})
    assert widgets.admit(WIDGETS, obj) == ['unknown field "spec.extra.known.b"']
    assert obj["spec"] == {"name": "w", "note": None, "size": 3,
                           "extra": {"anything": {"goes": 1}, "known": {"a": "x"}}}


def test_a_schema_without_rules_never_says_rules_were_skipped(tmp_path: Path) -> None:
    (tmp_path / "plain.yaml").write_text(textwrap.dedent(WIDGET_CRD).replace("x-kubernetes-validations",
                                                                             "x-unused-validations"))
    plain = CustomSchemas(tmp_path)
    assert widget_errors(plain, widget(size="big")) == [
        'spec.size: Invalid value: "string": spec.size in body must be of type integer: "string"']


# ---- the pieces -------------------------------------------------------------------------------------------------------
def test_values_and_paths_print_as_go_prints_them() -> None:
    assert [go_float(v) for v in (0.5, 100.0, 1e6, 123456.5, 1e-5, 0.0001, -2.25)] == [
        "0.5", "100", "1e+06", "123456.5", "1e-05", "0.0001", "-2.25"]
    assert [go_value(v) for v in (None, True, 3, "a\"b", [1, "x"], {"b": 1, "a": None})] == [
        '"null"', "true", "3", '"a\\"b"', '[]interface {}{1, "x"}', 'map[string]interface {}{"a":interface {}(nil), '
        '"b":1}']
    assert [field_path(p) for p in ((), ("spec",), ("spec", "models", 0), ("status", "reservation", 1, "node"))] == [
        "<nil>", "spec", "spec.models[0]", "status.reservation[1].node"]


def test_the_crds_are_read_once() -> None:
    assert CustomSchemas().resources is SCHEMAS.resources
    assert set(SCHEMAS.resources) == {GPRS, TEMPLATES, BINDINGS, WORKSPACES, ENDPOINTS, ACCELERATOR_NODES, CLUSTERS}
