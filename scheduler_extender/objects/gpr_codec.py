"""The ``GPUProvisioningRequest`` custom resource and the policy core's :class:`GPR`, converted both ways.

A GPR object (``accelstack.io/v1alpha1``) carries the spec in camelCase; :func:`from_object` checks every field
(types, ranges, the fraction rule) and builds the core model, named ``<namespace>/<name>`` with the namespace as
its workspace. :func:`status_body` renders the core model back as the body for the ``status`` subresource.
The CRD in ``manifests/crds/`` states the same rules as an OpenAPI schema with CEL, so the API server refuses
what :func:`from_object` would refuse; the two are tested against the same examples.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from scheduler_extender.core.gpr import GPR, PRIORITY_MAX, PRIORITY_MIN, RESOURCES, Phase
from scheduler_extender.core.inventory import GPU, MILLI_PER_DEVICE

GROUP = "accelstack.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
GPR_PLURAL = "gpuprovisioningrequests"
GPR_KIND = "GPUProvisioningRequest"
TEMPLATE_PLURAL = "gprtemplates"
TEMPLATE_KIND = "GPRTemplate"
GPR_LABEL = "accelstack.io/gpr"  # pod -> GPR name (same namespace)
SCHEDULING_GATE = "accelstack.io/gpr"
ALLOCATION_ANNOTATION = "accelstack.io/allocation"

# The spec fields of a GPR (and of a GPRTemplate, whose spec is a GPR spec plus ``description``).
SPEC_FIELDS = (
    "resource", "devicesPerNode", "milliPerDevice", "nodeCount", "models", "memoryPerDeviceMiB", "priority",
    "exitDuration", "idleTimeout", "enforceIdleTimeout", "enableEviction", "preemptible", "requeueOnFailure",
    "retryLimit",
)
MAX_MODELS, MAX_MODEL_LENGTH = 32, 128  # as the CRD's maxItems and maxLength
MAX_NAME = 63  # a GPR's name is the value of the pod label accelstack.io/gpr: a label value has at most 63
TERMINAL_PHASES = frozenset({Phase.COMPLETE.value, Phase.CANCELLED.value})
# A Failed (or Evicted) GPR is final too: a failure that is retried is written as Queued with nextRetryTime.
FINAL_PHASES = TERMINAL_PHASES | {Phase.FAILED.value, Phase.EVICTED.value}
ALLOCATED_PHASES = frozenset({Phase.ADMITTED.value, Phase.RUNNING.value, Phase.EVICTING.value})


class SpecError(ValueError):
    """A GPR (or template) field is wrong; the message starts with the field's path."""


def gpr_key(namespace: str, name: str) -> str:
    """The core's name for a GPR: ``namespace/name``."""
    return f"{namespace}/{name}"


# ---- durations (Go's time.ParseDuration, which metav1.Duration uses) ---------------------------------------
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TERM = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
# What a spec field accepts (the CRD's ``pattern``, ASCII units as CEL's duration() everywhere parses them); the
# value must then also be positive (the CRD's CEL rule).
SPEC_DURATION_PATTERN = r"^(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|ms|s|m|h))+$"
# The longest duration accepted, as the CRD's CEL rule ``duration(self) <= duration('2562047h')`` states it: Go's
# time.Duration (which the API server's CEL duration() parses into) ends at 2562047h47m16.854775807s; a longer
# value would pass a Python parser but never the CRD.
MAX_DURATION = "2562047h"
MAX_DURATION_S = 2562047 * 3600.0


def parse_duration(value: Any) -> float:
    """Seconds from a Go duration string (``"90s"``, ``"30m"``, ``"1h30m"``, ``"1.5h"``, ``"250ms"``) or a
    number of seconds; :class:`SpecError` otherwise. Like Go, a sign is allowed and ``"0"`` needs no unit."""
    if isinstance(value, bool):
        raise SpecError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or abs(value) > MAX_DURATION_S:
            raise SpecError(f"not a duration: {value!r} (at most {MAX_DURATION_S:g} seconds, {MAX_DURATION})")
        return float(value)
    if not isinstance(value, str):
        raise SpecError(f"not a duration: {value!r} (want a string such as \"90s\", \"30m\", \"2h\", \"1h30m\")")
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if text[:1] in "+-" and text else text
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(body):
        m = _TERM.match(body, pos)
        if m is None:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise SpecError(f"not a duration: {value!r} (want Go syntax such as \"90s\", \"30m\", \"2h\", \"1h30m\")")
    if total > MAX_DURATION_S:
        raise SpecError(f"not a duration: {_clip(value)} is longer than {MAX_DURATION} (about 292 years, the "
                        "longest duration Kubernetes parses)")
    return sign * total


def _clip(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def format_duration(seconds: float) -> str:
    """Go's ``Duration.String()``: ``"1h30m0s"``, ``"1m30s"``, ``"1.5s"``, ``"500ms"``, ``"0s"``."""
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite duration: {seconds!r}")
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)

    def frac(value: int, scale: int) -> str:
        whole, rest = divmod(value, scale)
        if not rest:
            return str(whole)
        digits = str(rest).rjust(len(str(scale)) - 1, "0").rstrip("0")
        return f"{whole}.{digits}"

    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{frac(ns, 1_000)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{frac(ns, 1_000_000)}ms"
    hours, rest = divmod(ns, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    out = f"{frac(rest, 10**9)}s"
    if hours or minutes:
        out = f"{minutes}m" + out
    if hours:
        out = f"{hours}h" + out
    return sign + out


# ---- timestamps --------------------------------------------------------------------------------------------
def rfc3339(epoch: float) -> str:
    """``2026-11-30T06:00:00Z`` (metav1.Time has second precision)."""
    t = time.gmtime(math.floor(epoch))
    return f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}Z"


def parse_time(value: Any) -> float | None:
    """Epoch seconds from an RFC 3339 string; None when absent or unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


# ---- spec ----------------------------------------------------------------------------------------------
def _int(spec: Mapping[str, Any], key: str, default: int, lo: int, hi: int | None = None) -> int:
    value = spec.get(key, default)
    if value is None:
        value = default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type; 2.0 is 2
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"spec.{key}: must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        want = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise SpecError(f"spec.{key}: must be {want}, got {value}")
    return value


def _bool(spec: Mapping[str, Any], key: str, default: bool) -> bool:
    value = spec.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(f"spec.{key}: must be true or false, got {value!r}")
    return value


def _duration(spec: Mapping[str, Any], key: str) -> float | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(SPEC_DURATION_PATTERN, value):
        raise SpecError(f"spec.{key}: not a duration: {value!r} (want a string such as \"90s\", \"30m\", \"8h\", "
                        "\"1h30m\")")
    try:
        seconds = parse_duration(value)
    except SpecError as exc:
        raise SpecError(f"spec.{key}: {exc}") from None
    if seconds <= 0:
        raise SpecError(f"spec.{key}: must be positive, got {value!r}")
    return seconds


def check_spec(spec: Any) -> dict[str, Any]:
    """The spec's fields as core keyword arguments, defaults applied; :class:`SpecError` naming the field."""
    if not isinstance(spec, Mapping):
        raise SpecError(f"spec: must be an object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPEC_FIELDS))
    if unknown:
        raise SpecError(f"spec.{unknown[0]}: unknown field (known: {', '.join(SPEC_FIELDS)})")
    resource = spec.get("resource", GPU)
    if resource is None:
        resource = GPU
    if resource not in RESOURCES:
        raise SpecError(f"spec.resource: must be one of {', '.join(RESOURCES)}, got {resource!r}")
    devices = _int(spec, "devicesPerNode", 1, 1)
    milli = _int(spec, "milliPerDevice", MILLI_PER_DEVICE, 1, MILLI_PER_DEVICE)
    if milli < MILLI_PER_DEVICE and devices != 1:
        raise SpecError(f"spec.milliPerDevice: a fraction ({milli} < {MILLI_PER_DEVICE}) needs devicesPerNode 1, "
                        f"got {devices}")
    models = spec.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise SpecError(f"spec.models: must be a list of non-empty strings, got {models!r}")
    if len(models) > MAX_MODELS or any(len(m) > MAX_MODEL_LENGTH for m in models):
        raise SpecError(f"spec.models: at most {MAX_MODELS} names of at most {MAX_MODEL_LENGTH} characters")
    idle = _duration(spec, "idleTimeout")
    enforce = _bool(spec, "enforceIdleTimeout", False)
    if enforce and idle is None:
        raise SpecError("spec.enforceIdleTimeout: requires spec.idleTimeout")
    return {
        "resource": resource,
        "devices_per_node": devices,
        "milli_per_device": milli,
        "node_count": _int(spec, "nodeCount", 1, 1),
        "models": tuple(dict.fromkeys(models)),
        "memory_mib_per_device": _int(spec, "memoryPerDeviceMiB", 0, 0),
        "priority": _int(spec, "priority", 100, PRIORITY_MIN, PRIORITY_MAX),
        "exit_duration_s": _duration(spec, "exitDuration"),
        "idle_timeout_s": idle,
        "enforce_idle_timeout": enforce,
        "enable_eviction": _bool(spec, "enableEviction", False),
        "preemptible": _bool(spec, "preemptible", True),
        "requeue_on_failure": _bool(spec, "requeueOnFailure", False),
        "retry_limit": _int(spec, "retryLimit", 3, 0),
    }


def from_object(obj: dict[str, Any], now: float) -> GPR:
    """A GPR object (as the API server returns it) as the core's :class:`GPR`, with what its status records
    (phase, reason, counters, timestamps) restored so a restarted controller continues where it was.
    ``submitted_at`` is the creation timestamp (``now`` when there is none)."""
    if not isinstance(obj, Mapping):
        raise SpecError(f"object: must be a JSON object, got {type(obj).__name__}")
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        raise SpecError("metadata: missing")
    name, namespace = meta.get("name"), meta.get("namespace") or "default"
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name: must be a non-empty string")
    if len(name) > MAX_NAME:
        raise SpecError(f"metadata.name: at most {MAX_NAME} characters (pods name their GPR in the label "
                        f"{GPR_LABEL}), got {len(name)}")
    if not isinstance(namespace, str):
        raise SpecError("metadata.namespace: must be a string")
    fields = check_spec(obj.get("spec") if obj.get("spec") is not None else {})
    created = parse_time(meta.get("creationTimestamp"))
    g = GPR(name=gpr_key(namespace, name), workspace=namespace, submitted_at=created if created is not None else now,
            **fields)
    try:
        g.validate()
    except ValueError as exc:  # the checks above cover the core's; this keeps the two from drifting apart
        raise SpecError(f"spec: {exc}") from None
    status = obj.get("status")
    if isinstance(status, Mapping):
        restore_status(g, status)
    return g


def restore_status(g: GPR, status: Mapping[str, Any]) -> None:
    """Put what a GPR's status records (phase, reason, counters, timestamps, retry time) back on ``g``."""
    try:
        g.phase = Phase(status.get("phase") or Phase.QUEUED.value)
    except ValueError:
        g.phase = Phase.QUEUED
    reason = status.get("reason")
    g.reason = reason if isinstance(reason, str) else ""
    for attr, key in (("failures", "failures"), ("evictions", "evictions")):
        value = status.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            setattr(g, attr, value)
    g.admitted_at = parse_time(status.get("admittedAt"))
    g.started_at = parse_time(status.get("startedAt"))
    g.finished_at = parse_time(status.get("finishedAt"))
    if g.started_at is not None:
        g.last_active_at = g.started_at
    retry = parse_time(status.get("nextRetryTime"))
    if retry is not None:
        g.not_before = retry


def to_spec(g: GPR) -> dict[str, Any]:
    """The core model's spec as a CR ``spec`` (only fields that differ from the defaults, plus resource)."""
    spec: dict[str, Any] = {"resource": g.resource, "devicesPerNode": g.devices_per_node, "nodeCount": g.node_count,
                            "priority": g.priority}
    if g.milli_per_device != MILLI_PER_DEVICE:
        spec["milliPerDevice"] = g.milli_per_device
    if g.models:
        spec["models"] = list(g.models)
    if g.memory_mib_per_device:
        spec["memoryPerDeviceMiB"] = g.memory_mib_per_device
    if g.exit_duration_s is not None:
        spec["exitDuration"] = format_duration(g.exit_duration_s)
    if g.idle_timeout_s is not None:
        spec["idleTimeout"] = format_duration(g.idle_timeout_s)
    for key, value, default in (("enforceIdleTimeout", g.enforce_idle_timeout, False),
                                ("enableEviction", g.enable_eviction, False), ("preemptible", g.preemptible, True),
                                ("requeueOnFailure", g.requeue_on_failure, False), ("retryLimit", g.retry_limit, 3)):
        if value != default:
            spec[key] = value
    return spec


# ---- status --------------------------------------------------------------------------------------------
# Condition type -> the phases in which it is True.
CONDITIONS: dict[str, frozenset[Phase]] = {
    "Queued": frozenset({Phase.QUEUED}),
    "Admitted": frozenset({Phase.ADMITTED, Phase.RUNNING}),
    "Running": frozenset({Phase.RUNNING}),
    "Evicting": frozenset({Phase.EVICTING}),
    "Finished": frozenset({Phase.COMPLETE, Phase.FAILED, Phase.EVICTED, Phase.CANCELLED}),
}


def _message(g: GPR, queue_position: int | None, estimated_start: float | None, nodes: list[str]) -> str:
    ask = f"{g.node_count} node(s) x {g.devices_per_node} {g.resource}"
    if g.milli_per_device < MILLI_PER_DEVICE:
        ask = f"{g.node_count} node(s) x {g.milli_per_device}/{MILLI_PER_DEVICE} of one {g.resource}"
    if g.phase is Phase.QUEUED:
        where = f" at position {queue_position}" if queue_position is not None else ""
        when = f", estimated start {rfc3339(estimated_start)}" if estimated_start is not None else ""
        return f"waiting{where} for {ask}{when}"
    if g.phase is Phase.ADMITTED:
        return f"{ask} reserved on {', '.join(nodes) or 'no node'}; waiting for its pods to start"
    if g.phase is Phase.RUNNING:
        return f"running on {', '.join(nodes) or 'no node'}"
    if g.phase is Phase.EVICTING:
        return f"evicting ({g.reason}): still holds {', '.join(nodes) or 'no node'} until its pods are gone"
    return f"{g.phase.value.lower()}{': ' + g.reason if g.reason else ''}"


_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # metav1.Condition's reason


def _derived_conditions(g: GPR, now: float, generation: int | None) -> list[dict[str, Any]]:
    steps = list(g.history) or [(g.submitted_at, g.phase, g.reason)]
    if steps[-1][1] is not g.phase:  # status restored from the object without a history: trust the phase
        steps.append((now, g.phase, g.reason))
    out = []
    for ctype, phases in CONDITIONS.items():
        value = g.phase in phases
        since = steps[0][0]
        previous: bool | None = None
        for at, phase, _ in steps:
            truth = phase in phases
            if truth != previous:
                since, previous = at, truth
        condition: dict[str, Any] = {
            "type": ctype, "status": "True" if value else "False",
            "reason": g.reason if _REASON.match(g.reason) else g.phase.value,
            "message": f"phase {g.phase.value}" + (f" ({g.reason})" if g.reason else ""),
            "lastTransitionTime": rfc3339(since),
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        out.append(condition)
    return out


def _condition(c: Mapping[str, Any], now: float, generation: int | None) -> dict[str, Any]:
    if not isinstance(c.get("type"), str) or c.get("status") not in ("True", "False", "Unknown"):
        raise ValueError(f"condition needs a type and a status of True, False or Unknown: {c!r}")
    out = {"reason": c.get("type"), "message": "", **c}
    when = out.get("lastTransitionTime")
    out["lastTransitionTime"] = rfc3339(when) if isinstance(when, int | float) else (when or rfc3339(now))
    if generation is not None:
        out.setdefault("observedGeneration", generation)
    return out


def queue_fields(position: int | None, estimated_start: float | None,
                 estimated_range: tuple[float, float] | None) -> dict[str, Any]:
    """The status fields of a queued GPR's place in the queue, as :func:`status_body` writes them."""
    out: dict[str, Any] = {}
    if position is not None:
        out["queuePosition"] = position
    if estimated_start is not None and math.isfinite(estimated_start):
        out["estimatedStart"] = rfc3339(estimated_start)
        if estimated_range is not None and all(math.isfinite(t) for t in estimated_range):
            # the P10-P90 range of the start: about 8 in 10 GPRs start inside it
            out["estimatedStartRange"] = {"earliest": rfc3339(min(estimated_range[0], estimated_start)),
                                          "latest": rfc3339(max(estimated_range[1], estimated_start))}
    return out


def status_body(g: GPR, *, queue_position: int | None, estimated_start: float | None, reservation: list[dict[str, Any]],
                now: float, observed_generation: int | None,
                conditions: list[dict[str, Any]] | None = None,
                previous_conditions: list[dict[str, Any]] | None = None,
                estimated_range: tuple[float, float] | None = None, detail: str = "") -> dict[str, Any]:
    """``{"status": {...}}`` for the status subresource. ``reservation`` is ``[{"node", "devices"}]`` (a count
    or a list of device indices). Conditions ``Queued``, ``Admitted``, ``Running`` and ``Finished`` are derived
    from the phase and its history; ``conditions`` given here are added, replacing derived ones of the same
    type (``lastTransitionTime`` may be epoch seconds or absent, then ``now``). ``queuePosition`` and
    ``estimatedStart`` are written only while the GPR is queued. ``previous_conditions`` (the object's current
    ``status.conditions``) keeps each condition's ``lastTransitionTime`` while its status stays the same, as
    ``meta.SetStatusCondition`` does, so an unchanged GPR renders an unchanged status (also after a restart).
    ``detail``: for a queued GPR, what its ``reason`` means for it (which quota, how much of it is used), appended
    to the message as ``; <reason>: <detail>``."""
    counts: dict[str, int] = {}
    for entry in reservation:
        node, devices = entry.get("node"), entry.get("devices")
        if isinstance(devices, list | tuple):
            devices = len(devices)
        if not isinstance(node, str) or not isinstance(devices, int) or isinstance(devices, bool):
            raise ValueError(f"reservation entry needs node (string) and devices (int): {entry!r}")
        counts[node] = counts.get(node, 0) + devices
    nodes = sorted(counts)
    queued = g.phase is Phase.QUEUED
    status: dict[str, Any] = {
        "phase": g.phase.value,
        "reason": g.reason,
        "message": _message(g, queue_position if queued else None, estimated_start if queued else None, nodes)
                   + (f"; {g.reason}: {detail}" if queued and detail and g.reason else ""),
        "reservation": [{"node": n, "devices": counts[n]} for n in nodes],
        "reservedNodes": nodes,
        "failures": g.failures,
        "evictions": g.evictions,
    }
    if queued:
        status.update(queue_fields(queue_position, estimated_start, estimated_range))
    if queued and g.not_before > now:
        status["nextRetryTime"] = rfc3339(math.ceil(g.not_before))
    for key, value in (("admittedAt", g.admitted_at), ("startedAt", g.started_at), ("finishedAt", g.finished_at)):
        if value is not None:
            status[key] = rfc3339(value)
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    merged = {c["type"]: c for c in _derived_conditions(g, now, observed_generation)}
    for c in conditions or []:
        c2 = _condition(c, now, observed_generation)
        merged[c2["type"]] = c2
    before = {c.get("type"): c for c in previous_conditions or [] if isinstance(c, Mapping)}
    for ctype, c in merged.items():
        old = before.get(ctype)
        if old is not None and old.get("status") == c["status"] and isinstance(old.get("lastTransitionTime"), str):
            c["lastTransitionTime"] = old["lastTransitionTime"]
    status["conditions"] = list(merged.values())
    return {"status": status}


def reservation_of(obj: dict[str, Any]) -> dict[str, int]:
    """Node -> reserved device count from ``status.reservation``; ``{}`` when there is none. Malformed entries
    are skipped (the status is written by the controller, but a reader must not crash on a hand edit)."""
    status = obj.get("status") if isinstance(obj, Mapping) else None
    entries = status.get("reservation") if isinstance(status, Mapping) else None
    out: dict[str, int] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping):
            continue
        node, devices = entry.get("node"), entry.get("devices")
        if isinstance(node, str) and isinstance(devices, int) and not isinstance(devices, bool) and devices >= 0:
            out[node] = out.get(node, 0) + devices
    return out


def phase_of(obj: dict[str, Any]) -> str:
    """``status.phase``, or ``Queued`` when there is none (or it is not a phase)."""
    status = obj.get("status") if isinstance(obj, Mapping) else None
    phase = status.get("phase") if isinstance(status, Mapping) else None
    return phase if isinstance(phase, str) and phase in Phase._value2member_map_ else Phase.QUEUED.value


def is_terminal(obj: dict[str, Any]) -> bool:
    """Complete or Cancelled: the GPR holds nothing and will not come back."""
    return phase_of(obj) in TERMINAL_PHASES


def template_spec(template_obj: dict[str, Any]) -> dict[str, Any]:
    """A GPRTemplate's spec as a GPR spec (``description`` dropped), checked like a GPR's; :class:`SpecError`
    naming the template when it is not a valid GPR spec."""
    if not isinstance(template_obj, Mapping):
        raise SpecError("template: must be an object")
    meta = template_obj.get("metadata") or {}
    where = f"GPRTemplate {meta.get('namespace', '')}/{meta.get('name', '')}"
    spec = template_obj.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise SpecError(f"{where}: spec: must be an object")
    out = {k: copy.deepcopy(v) for k, v in spec.items() if k != "description"}
    try:
        check_spec(out)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return out


def new_object(namespace: str, name: str, spec: dict[str, Any], labels: dict[str, str] | None = None,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A GPR object to create."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = dict(labels)
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": API_VERSION, "kind": GPR_KIND, "metadata": meta, "spec": copy.deepcopy(spec)}


def live_cluster_limitation() -> str:
    return ("spec.milliPerDevice: fractions of a device are not supported on a cluster (the simulator models "
            "them); share GPUs with time-slicing replicas and ask for whole replicas instead")


def cluster_refusal(g: GPR) -> str:
    """Why a cluster cannot serve a GPR the core accepts ('' when it can): a fraction of a device (the kubelet
    hands out whole devices; the controller fails such a GPR with the same reason)."""
    return live_cluster_limitation() if g.milli_per_device < MILLI_PER_DEVICE else ""
