"""The GPR custom resource <-> the policy core's GPR: spec checks naming the field, durations, status bodies."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from scheduler_extender.core.gpr import GPR, Phase
from scheduler_extender.objects.gpr_codec import (
    SpecError,
    format_duration,
    from_object,
    gpr_key,
    new_object,
    parse_duration,
    phase_of,
    reservation_of,
    rfc3339,
    status_body,
    template_spec,
    to_spec,
)

NOW = 1_796_018_400.0  # 2026-11-30T06:00:00Z


def obj(spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": "train", "namespace": "team-a", **meta}, "spec": spec if spec is not None else {}}


def test_now_constant_is_the_documented_instant() -> None:
    assert rfc3339(NOW) == "2026-11-30T06:00:00Z"


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("1h30m", 5400.0), ("1.5h", 5400.0), ("250ms", 0.25),
    ("1h0m0s", 3600.0), ("0", 0.0), ("-5s", -5.0), ("+2m", 120.0), (".5s", 0.5), ("1us", 1e-6), ("3µs", 3e-6),
    (45, 45.0), (2.5, 2.5),
])
def test_parse_duration_go_syntax(text: Any, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "5", "1d", "h", "1h 30m", "abc", "1.2.3s", "--1s", "1hm", True, None, [1],
                                 float("inf")])
def test_parse_duration_refuses_other_forms(bad: Any) -> None:
    with pytest.raises(SpecError, match="not a duration"):
        parse_duration(bad)


def test_parse_duration_ends_where_the_crd_does() -> None:
    """The CRD's CEL duration() (Go's time.Duration) cannot go past 2562047h47m16.85s; the CRD says at most
    2562047h, and so does the parser (tests/extender/test_crds.py checks the CRD side)."""
    assert parse_duration("2562047h") == 2562047 * 3600
    assert parse_duration(-2562047 * 3600) == -2562047 * 3600
    for too_long in ("999999999h", "2562047h0.5s", "2562048h", "9" * 60 + "h", 1e10, -1e10):
        with pytest.raises(SpecError, match="not a duration"):
            parse_duration(too_long)


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (90, "1m30s"), (3600, "1h0m0s"), (5400, "1h30m0s"), (1.5, "1.5s"), (0.5, "500ms"),
    (0.0015, "1.5ms"), (2e-6, "2µs"), (86400, "24h0m0s"), (-90, "-1m30s"),
])
def test_format_duration_is_gos_string(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_from_object_defaults() -> None:
    g = from_object(obj(creationTimestamp="2026-11-30T05:00:00Z"), NOW)
    assert g.name == gpr_key("team-a", "train") == "team-a/train"
    assert g.workspace == "team-a"
    assert (g.resource, g.devices_per_node, g.milli_per_device, g.node_count) == ("nvidia.com/gpu", 1, 1000, 1)
    assert (g.priority, g.preemptible, g.retry_limit, g.exit_duration_s) == (100, True, 3, None)
    assert g.submitted_at == NOW - 3600
    assert g.phase is Phase.QUEUED
    assert from_object(obj(), NOW).submitted_at == NOW  # no creation timestamp yet (admission)


def test_from_object_full_spec() -> None:
    spec = {"resource": "neureality.com/nr1", "devicesPerNode": 4, "nodeCount": 2, "models": ["NR1-S", "NR1-S"],
            "memoryPerDeviceMiB": 16384, "priority": 250, "exitDuration": "8h", "idleTimeout": "30m",
            "enforceIdleTimeout": True, "enableEviction": True, "preemptible": False, "requeueOnFailure": True,
            "retryLimit": 0}
    g = from_object(obj(spec), NOW)
    assert g.resource == "neureality.com/nr1" and g.devices_per_node == 4 and g.node_count == 2
    assert g.models == ("NR1-S",)
    assert g.exit_duration_s == 8 * 3600 and g.idle_timeout_s == 1800
    assert g.enforce_idle_timeout and g.enable_eviction and not g.preemptible and g.requeue_on_failure
    assert g.retry_limit == 0 and g.priority_class == "high"
    # round trip through the CR form
    back = from_object(obj(to_spec(g)), NOW)
    assert to_spec(back) == to_spec(g)


def test_fraction_with_one_device() -> None:
    g = from_object(obj({"milliPerDevice": 250}), NOW)
    assert g.milli_per_device == 250 and g.milli_total() == 250


@pytest.mark.parametrize(("spec", "message"), [
    ({"priority": 0}, r"^spec\.priority: must be 1\.\.300, got 0$"),
    ({"priority": 301}, r"^spec\.priority: must be 1\.\.300, got 301$"),
    ({"priority": "high"}, r"^spec\.priority: must be an integer"),
    ({"priority": True}, r"^spec\.priority: must be an integer"),
    ({"devicesPerNode": 0}, r"^spec\.devicesPerNode: must be >= 1, got 0$"),
    ({"devicesPerNode": 1.5}, r"^spec\.devicesPerNode: must be an integer"),
    ({"milliPerDevice": 0}, r"^spec\.milliPerDevice: must be 1\.\.1000"),
    ({"milliPerDevice": 1001}, r"^spec\.milliPerDevice: must be 1\.\.1000"),
    ({"milliPerDevice": 500, "devicesPerNode": 2}, r"^spec\.milliPerDevice: a fraction .* needs devicesPerNode 1"),
    ({"nodeCount": 0}, r"^spec\.nodeCount: must be >= 1"),
    ({"resource": "amd.com/gpu"}, r"^spec\.resource: must be one of nvidia\.com/gpu, neureality\.com/nr1"),
    ({"models": "A100"}, r"^spec\.models: must be a list of non-empty strings"),
    ({"models": [""]}, r"^spec\.models: must be a list of non-empty strings"),
    ({"memoryPerDeviceMiB": -1}, r"^spec\.memoryPerDeviceMiB: must be >= 0"),
    ({"exitDuration": "1d"}, r"^spec\.exitDuration: not a duration"),
    ({"exitDuration": "0s"}, r"^spec\.exitDuration: must be positive"),
    ({"idleTimeout": "-1m"}, r"^spec\.idleTimeout: not a duration"),
    ({"idleTimeout": 3600}, r"^spec\.idleTimeout: not a duration"),
    ({"enforceIdleTimeout": True}, r"^spec\.enforceIdleTimeout: requires spec\.idleTimeout"),
    ({"models": ["x"] * 33}, r"^spec\.models: at most 32"),
    ({"enableEviction": "yes"}, r"^spec\.enableEviction: must be true or false"),
    ({"preemptible": 1}, r"^spec\.preemptible: must be true or false"),
    ({"retryLimit": -1}, r"^spec\.retryLimit: must be >= 0"),
    ({"gpus": 2}, r"^spec\.gpus: unknown field"),
])
def test_from_object_names_the_bad_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        from_object(obj(spec), NOW)


@pytest.mark.parametrize(("bad", "message"), [
    ({"metadata": {"namespace": "a"}, "spec": {}}, r"^metadata\.name"),
    ({"spec": {}}, r"^metadata: missing"),
    ({"metadata": {"name": "x"}, "spec": [1]}, r"^spec: must be an object"),
    ([], r"^object: must be a JSON object"),
])
def test_from_object_malformed_objects(bad: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        from_object(bad, NOW)


def test_spec_error_is_a_value_error() -> None:
    assert issubclass(SpecError, ValueError)


def test_from_object_restores_status() -> None:
    o = obj({"priority": 150})
    o["status"] = {"phase": "Running", "reason": "", "failures": 2, "evictions": 1,
                   "admittedAt": "2026-11-30T05:00:00Z", "startedAt": "2026-11-30T05:01:00Z"}
    g = from_object(o, NOW)
    assert g.phase is Phase.RUNNING and g.failures == 2 and g.evictions == 1
    assert g.admitted_at == NOW - 3600 and g.started_at == NOW - 3540 and g.finished_at is None
    o["status"]["phase"] = "Bogus"
    assert from_object(o, NOW).phase is Phase.QUEUED


def test_status_body_queued() -> None:
    g = GPR(name="team-a/train", workspace="team-a", devices_per_node=2, submitted_at=NOW - 60)
    g.history.append((NOW - 60, Phase.QUEUED, "Submitted"))
    body = status_body(g, queue_position=3, estimated_start=NOW + 900, reservation=[], now=NOW,
                       observed_generation=4)
    s = body["status"]
    assert set(body) == {"status"}
    assert s["phase"] == "Queued" and s["queuePosition"] == 3
    assert s["estimatedStart"] == "2026-11-30T06:15:00Z"
    assert s["reservation"] == [] and s["reservedNodes"] == [] and s["observedGeneration"] == 4
    assert "position 3" in s["message"] and "2026-11-30T06:15:00Z" in s["message"]
    assert "admittedAt" not in s and "startedAt" not in s
    conditions = {c["type"]: c for c in s["conditions"]}
    assert conditions["Queued"]["status"] == "True" and conditions["Admitted"]["status"] == "False"
    assert conditions["Queued"]["lastTransitionTime"] == "2026-11-30T05:59:00Z"
    assert all(c["observedGeneration"] == 4 for c in s["conditions"])
    assert all(set(c) >= {"type", "status", "reason", "message", "lastTransitionTime"} for c in s["conditions"])


def test_status_body_admitted_then_running() -> None:
    g = GPR(name="team-a/train", workspace="team-a", devices_per_node=2, node_count=2, submitted_at=NOW - 600)
    g.history.append((NOW - 600, Phase.QUEUED, "Submitted"))
    g.transition(Phase.ADMITTED, NOW - 300, "Placed")
    reservation: list[dict[str, Any]] = [{"node": "n2", "devices": [0, 1]}, {"node": "n1", "devices": 2}]
    s = status_body(g, queue_position=7, estimated_start=NOW, reservation=reservation, now=NOW,
                    observed_generation=1)["status"]
    assert s["phase"] == "Admitted" and s["reason"] == "Placed"
    assert "queuePosition" not in s and "estimatedStart" not in s  # only while queued
    assert s["reservation"] == [{"node": "n1", "devices": 2}, {"node": "n2", "devices": 2}]
    assert s["reservedNodes"] == ["n1", "n2"]
    assert s["admittedAt"] == "2026-11-30T05:55:00Z"
    g.transition(Phase.RUNNING, NOW - 100)
    s = status_body(g, queue_position=None, estimated_start=None, reservation=reservation, now=NOW,
                    observed_generation=1)["status"]
    conditions = {c["type"]: c for c in s["conditions"]}
    assert conditions["Admitted"]["status"] == "True"
    assert conditions["Admitted"]["lastTransitionTime"] == "2026-11-30T05:55:00Z"  # unchanged by Running
    assert conditions["Running"]["lastTransitionTime"] == "2026-11-30T05:58:20Z"
    assert s["startedAt"] == "2026-11-30T05:58:20Z"


def test_status_body_extra_conditions_and_bad_reservation() -> None:
    g = GPR(name="a/b", workspace="a")
    extra = {"type": "EvictionBlocked", "status": "True", "reason": "PodDisruptionBudget",
             "message": "pdb/x allows 0 disruptions"}
    s = status_body(g, queue_position=None, estimated_start=None, reservation=[], now=NOW, observed_generation=None,
                    conditions=[extra, {"type": "Queued", "status": "Unknown", "lastTransitionTime": NOW}])["status"]
    conditions = {c["type"]: c for c in s["conditions"]}
    assert conditions["EvictionBlocked"]["lastTransitionTime"] == "2026-11-30T06:00:00Z"
    assert conditions["Queued"]["status"] == "Unknown"
    assert "observedGeneration" not in s
    with pytest.raises(ValueError, match="reservation entry"):
        status_body(g, queue_position=None, estimated_start=None, reservation=[{"node": "n1"}], now=NOW,
                    observed_generation=None)


def test_status_body_round_trips_through_from_object() -> None:
    g = GPR(name="team-a/train", workspace="team-a", submitted_at=NOW - 600)
    g.transition(Phase.ADMITTED, NOW - 300)
    g.transition(Phase.FAILED, NOW - 200, "PodFailed")
    g.failures = 1
    o = obj()
    o.update(status_body(g, queue_position=None, estimated_start=None, reservation=[], now=NOW,
                         observed_generation=1))
    back = from_object(o, NOW)
    assert (back.phase, back.reason, back.failures, back.finished_at) == (Phase.FAILED, "PodFailed", 1, NOW - 200)


def test_reservation_of_and_phase_of() -> None:
    o = obj()
    assert reservation_of(o) == {} and phase_of(o) == "Queued"
    o["status"] = {"phase": "Admitted", "reservation": [{"node": "n1", "devices": 2}, {"node": "n2", "devices": 1},
                                                        {"node": "n1", "devices": 1}, "junk", {"node": 3}]}
    assert reservation_of(o) == {"n1": 3, "n2": 1}
    assert phase_of(o) == "Admitted"
    o["status"]["phase"] = "Nonsense"
    assert phase_of(o) == "Queued"


def test_template_spec() -> None:
    template: dict[str, Any] = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate",
                "metadata": {"name": "default", "namespace": "team-a"},
                "spec": {"description": "one GPU, 4h", "devicesPerNode": 1, "exitDuration": "4h", "priority": 50}}
    spec = template_spec(template)
    assert spec == {"devicesPerNode": 1, "exitDuration": "4h", "priority": 50}
    spec["priority"] = 1
    assert template["spec"]["priority"] == 50  # a copy
    g = from_object(new_object("team-a", "pod-x", template_spec(template)), NOW)
    assert g.exit_duration_s == 4 * 3600 and g.priority == 50
    broken = copy.deepcopy(template)
    broken["spec"]["priority"] = 0
    with pytest.raises(SpecError, match=r"^GPRTemplate team-a/default: spec\.priority: must be 1\.\.300"):
        template_spec(broken)


def test_previous_conditions_keep_their_transition_time() -> None:
    g = GPR(name="a/b", workspace="a", submitted_at=NOW - 60)
    g.history.append((NOW, Phase.QUEUED, "Submitted"))  # e.g. resubmitted after a controller restart
    blocked = {"type": "EvictionBlocked", "status": "True", "reason": "PodDisruptionBudget", "message": "m"}
    first = status_body(g, queue_position=1, estimated_start=None, reservation=[], now=NOW, observed_generation=1,
                        conditions=[blocked])["status"]["conditions"]
    earlier = [{**c, "lastTransitionTime": "2026-11-30T05:00:00Z"} for c in first]
    later = status_body(g, queue_position=1, estimated_start=None, reservation=[], now=NOW + 30,
                        observed_generation=1, conditions=[blocked], previous_conditions=earlier)["status"]
    assert {c["lastTransitionTime"] for c in later["conditions"]} == {"2026-11-30T05:00:00Z"}
    g.transition(Phase.ADMITTED, NOW + 40)
    admitted = status_body(g, queue_position=None, estimated_start=None, reservation=[], now=NOW + 40,
                           observed_generation=1, previous_conditions=later["conditions"])["status"]
    times = {c["type"]: c["lastTransitionTime"] for c in admitted["conditions"]}
    assert times["Admitted"] == times["Queued"] == "2026-11-30T06:00:40Z"  # both changed status
    assert times["Running"] == "2026-11-30T05:00:00Z"  # still False
