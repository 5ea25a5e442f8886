"""A hub GPR's workload (``spec.workload``, docs/multicluster.md) as pure functions: which manifests the member's
agent may create, what it creates, when, what it may delete, and what the hub is shown.

- **What**: ``spec.workload.objects``, at most :data:`MAX_OBJECTS` manifests of the kinds in :data:`KINDS`
  (namespaced, nothing that grants or reads rights), :data:`MAX_BYTES` in all, each named, with no namespace or
  the GPR's, no two of a kind sharing a name. The hub has no webhook: its GPR CRD refuses a kind outside the list
  and a missing name (CEL); :func:`problems` checks everything again in the agent before anything is created, so
  a bad object is a condition on the hub GPR, never a crash.
- **As whom**: the agent creates them as the ServiceAccount :data:`RUNNER` of the GPR's namespace (HTTP
  impersonation: its member ClusterRole may impersonate that one name and create nothing of these kinds itself),
  so the member's RBAC decides what a hub GPR can make there; a refusal is the condition's message.
- **When**: once the member's copy of the GPR is ``Admitted`` or ``Running`` (:func:`step`), never before: the
  pods then find their devices reserved. Level-triggered: an object missing then is created again.
- **Tied to the GPR**: each carries the label ``accelstack.io/gpr=<name>`` (a pod template too, so the member's
  webhook and controller tie the pods to the GPR as any GPR pod) and an owner reference to the member's copy of
  the GPR, so the member's garbage collector deletes them with it. The agent also deletes them itself when the
  GPR goes (:func:`ours` first: an object without both marks is never touched), for a member where no collector
  runs.

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubeapi.resources import CONFIGMAPS, DEPLOYMENTS, JOBS, PODS, SERVICES, STATEFUL_SETS, Resource

KINDS: dict[tuple[str, str], Resource] = {
    ("v1", "Pod"): PODS, ("v1", "Service"): SERVICES, ("v1", "ConfigMap"): CONFIGMAPS, ("batch/v1", "Job"): JOBS,
    ("apps/v1", "Deployment"): DEPLOYMENTS, ("apps/v1", "StatefulSet"): STATEFUL_SETS}
ALLOWED_TEXT = "v1 Pod, Service, ConfigMap; batch/v1 Job; apps/v1 Deployment, StatefulSet"
WITH_TEMPLATE = ("Job", "Deployment", "StatefulSet")  # their pods come from spec.template
MAX_OBJECTS = 32
MAX_BYTES = 256 * 1024  # the objects as JSON
RUNNER = "accelstack-workload"  # the ServiceAccount, in the GPR's namespace, the agent creates them as
GPR_LABEL = "accelstack.io/gpr"  # pod -> GPR (scheduler_extender.objects.gpr_codec.GPR_LABEL)
OBJECTS = "accelstack.io/workload-objects"  # annotation on the member GPR: JSON [[apiVersion, kind, name], ...]
CONDITION = "WorkloadCreated"  # on the dispatch, mirrored to the hub GPR
CREATE_PHASES = ("Admitted", "Running")
WAIT_PHASES = ("", "Queued")
GPR_API_VERSION = "accelstack.io/v1alpha1"
GPR_KIND = "GPUProvisioningRequest"

Ref = tuple[str, str, str]  # apiVersion, kind, name


def runner(namespace: str) -> str:
    """The user name the agent impersonates in ``namespace``."""
    return f"system:serviceaccount:{namespace}:{RUNNER}"


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def problems(workload: Any, namespace: str) -> list[str]:
    """Every reason ``workload`` may not be created in ``namespace``, one line each ([] when it may)."""
    if not isinstance(workload, Mapping):
        return [f"spec.workload: must be an object, got {type(workload).__name__}"]
    objects = workload.get("objects")
    if not isinstance(objects, list) or not objects:
        return ["spec.workload.objects: must be a non-empty list of manifests"]
    out: list[str] = []
    if len(objects) > MAX_OBJECTS:
        out.append(f"spec.workload.objects: at most {MAX_OBJECTS} objects, got {len(objects)}")
    size = len(json.dumps(objects, separators=(",", ":"), default=str))
    if size > MAX_BYTES:
        out.append(f"spec.workload.objects: at most {MAX_BYTES // 1024} KiB in all, got {size // 1024} KiB")
    seen: set[tuple[str, str]] = set()
    for i, obj in enumerate(objects):
        where = f"spec.workload.objects[{i}]"
        if not isinstance(obj, Mapping):
            out.append(f"{where}: must be a manifest (an object), got {type(obj).__name__}")
            continue
        api, kind = obj.get("apiVersion"), obj.get("kind")
        if (api, kind) not in KINDS:
            out.append(f"{where}: {api} {kind} is not allowed in a workload (allowed: {ALLOWED_TEXT})")
        name = _name(obj)
        if not name:
            out.append(f"{where}: metadata.name is required (generateName is not: the agent finds its objects by "
                       "name)")
        meta = obj.get("metadata")
        ns = meta.get("namespace") if isinstance(meta, Mapping) else None
        if ns not in (None, "", namespace):
            out.append(f"{where}: metadata.namespace {ns!r} is not the GPR's namespace {namespace!r}")
        if name and (str(kind), name) in seen:
            out.append(f"{where}: a second {kind} named {name!r}")
        seen.add((str(kind), name))
    return out


def refs(workload: Any) -> list[Ref]:
    """(apiVersion, kind, name) of each allowed, named object of ``workload``, in order."""
    objects = workload.get("objects") if isinstance(workload, Mapping) else None
    return [(str(o["apiVersion"]), str(o["kind"]), _name(o)) for o in objects or ()
            if isinstance(o, Mapping) and (o.get("apiVersion"), o.get("kind")) in KINDS and _name(o)]


def refs_annotation(workload: Any) -> str:
    return json.dumps([list(r) for r in refs(workload)], separators=(",", ":"))


def refs_of(member_gpr: Mapping[str, Any]) -> list[Ref]:
    """The objects the member GPR's annotation names (what the agent deletes with it); [] when it names none or
    cannot be read."""
    text = ((member_gpr.get("metadata") or {}).get("annotations") or {}).get(OBJECTS)
    try:
        items = json.loads(text) if isinstance(text, str) else []
    except ValueError:
        return []
    return [(a, k, n) for item in items if isinstance(item, list) and len(item) == 3
            for a, k, n in [item] if isinstance(a, str) and isinstance(k, str) and isinstance(n, str)
            and (a, k) in KINDS and n] if isinstance(items, list) else []


def resource_of(ref: Ref) -> Resource:
    return KINDS[(ref[0], ref[1])]


def owner_ref(member_gpr: Mapping[str, Any]) -> dict[str, Any]:
    """An owner reference to the member's GPR (not a controller, no blockOwnerDeletion: that would ask the
    impersonated account for rights on the GPR's finalizers)."""
    meta = member_gpr.get("metadata") or {}
    return {"apiVersion": GPR_API_VERSION, "kind": GPR_KIND, "name": str(meta.get("name") or ""),
            "uid": str(meta.get("uid") or "")}


def desired(member_gpr: Mapping[str, Any], workload: Any) -> list[dict[str, Any]]:
    """The objects to create for ``member_gpr``: each manifest in its namespace, labelled with the GPR's name
    (its pod template too), owned by it; what the API server sets (status, uid, resourceVersion...) left out."""
    meta = member_gpr.get("metadata") or {}
    ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    owner = owner_ref(member_gpr)
    out = []
    objects = workload.get("objects") if isinstance(workload, Mapping) else None
    for obj in objects or ():
        if not isinstance(obj, Mapping) or (obj.get("apiVersion"), obj.get("kind")) not in KINDS or not _name(obj):
            continue
        body = copy.deepcopy(dict(obj))
        body.pop("status", None)
        src = body.get("metadata")
        keep = {k: v for k, v in (src if isinstance(src, Mapping) else {}).items()
                if k in ("name", "labels", "annotations")}
        keep["namespace"] = ns
        keep["labels"] = {**(keep.get("labels") or {}), GPR_LABEL: name}
        keep["ownerReferences"] = [owner]
        body["metadata"] = keep
        template = (body.get("spec") or {}).get("template") if body.get("kind") in WITH_TEMPLATE else None
        if isinstance(template, dict):
            tmeta = template.setdefault("metadata", {})
            if isinstance(tmeta, dict):
                tmeta["labels"] = {**(tmeta.get("labels") or {}), GPR_LABEL: name}
        out.append(body)
    return out


def ref_of(obj: Mapping[str, Any]) -> Ref:
    return str(obj.get("apiVersion") or ""), str(obj.get("kind") or ""), _name(obj)


def ref_text(ref: Ref) -> str:
    return f"{ref[1]}/{ref[2]}"


def ours(obj: Mapping[str, Any], member_gpr: Mapping[str, Any]) -> bool:
    """Whether ``obj`` is this GPR's: its label names the GPR and an owner reference holds the GPR's UID. The
    agent creates, keeps and deletes nothing else."""
    meta = obj.get("metadata") or {}
    gmeta = member_gpr.get("metadata") or {}
    uid = gmeta.get("uid")
    return bool(uid) and (meta.get("labels") or {}).get(GPR_LABEL) == gmeta.get("name") and any(
        isinstance(o, Mapping) and o.get("uid") == uid for o in meta.get("ownerReferences") or ())


# ---- the decision -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One look at a GPR's workload: what to create now, and the condition to show so far."""
    create: list[dict[str, Any]] = field(default_factory=list)
    status: str = ""  # the condition: "True" | "False"; "" = keep what the hub shows (a finished GPR)
    reason: str = ""
    message: str = ""


def step(member_gpr: Mapping[str, Any], workload: Any, found: Mapping[Ref, Mapping[str, Any] | None]) -> Step:
    """What to do for ``member_gpr``'s ``workload``, given what its namespace holds (``found``: each ref ->
    the object there, or None when absent; refs not looked up count as absent). Nothing while the GPR waits
    (not admitted: the pods would only wait for devices) or when it is finished; an invalid workload is never
    created; an object of that name that is not this GPR's is never touched."""
    meta = member_gpr.get("metadata") or {}
    ns = str(meta.get("namespace") or "")
    phase = str((member_gpr.get("status") or {}).get("phase") or "")
    bad = problems(workload, ns)
    if bad:
        return Step(status="False", reason="WorkloadInvalid", message="; ".join(bad))
    want = desired(member_gpr, workload)
    if phase in WAIT_PHASES:
        return Step(status="False", reason="WaitingForAdmission",
                    message=f"{len(want)} object(s), created in {ns} once this cluster admits the GPR")
    if phase not in CREATE_PHASES:
        return Step()
    taken = [ref_text(ref_of(o)) for o in want if (there := found.get(ref_of(o))) is not None
             and not ours(there, member_gpr)]
    if taken:
        return Step(status="False", reason="NameTaken", message=(
            f"{', '.join(taken)} already exist(s) in {ns} and are not this GPR's (no label {GPR_LABEL} and owner "
            "reference to it): not touched, nothing created"))
    create = [o for o in want if found.get(ref_of(o)) is None]
    return Step(create=create, status="True", reason="Created",
                message=f"{len(want)} of {len(want)} object(s) in {ns} as {runner(ns)}")


def refused(ref: Ref, error: str, created: int, total: int, namespace: str,
            reason: str = "WorkloadRefused") -> tuple[str, str, str]:
    """The condition for a call the member's API server refused (``WorkloadRefused``: 403, the account's rights;
    ``WorkloadInvalid``: 400/422, the manifest): its message in one line."""
    one_line = " ".join(str(error).split())[:600]
    return ("False", reason, f"{ref_text(ref)} in {namespace} as {runner(namespace)}: {one_line} "
            f"({created} of {total} object(s) there)")


def to_delete(member_gpr: Mapping[str, Any], found: Mapping[Ref, Mapping[str, Any] | None]) -> list[tuple[Ref, str]]:
    """The objects to delete with ``member_gpr`` (ref, uid): those its annotation names that are still there and
    are its own (:func:`ours`)."""
    out = []
    for ref in refs_of(member_gpr):
        there = found.get(ref)
        if there is not None and ours(there, member_gpr):
            out.append((ref, str((there.get("metadata") or {}).get("uid") or "")))
    return out


def condition(status: str, reason: str, message: str, before: Iterable[Any], now_text: str) -> dict[str, Any]:
    """The ``WorkloadCreated`` condition, its transition time kept while its status does not change."""
    old = next((c for c in before if isinstance(c, Mapping) and c.get("type") == CONDITION), {})
    since = old.get("lastTransitionTime") if old.get("status") == status else None
    return {"type": CONDITION, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since or now_text}


def with_condition(patch: dict[str, Any], current: Mapping[str, Any],
                   shown: tuple[str, str, str] | None, now_text: str) -> dict[str, Any]:
    """``patch`` (a dispatch status, :func:`~.placement.mirror`) with the workload condition: ``shown``, or
    when None the one the dispatch already has (a finished GPR keeps what it last showed)."""
    before: Sequence[Any] = current.get("conditions") or ()
    conditions = [c for c in patch.get("conditions") or () if isinstance(c, Mapping) and c.get("type") != CONDITION]
    if shown is not None:
        conditions.append(condition(*shown, before, now_text))
    else:
        old = next((c for c in before if isinstance(c, Mapping) and c.get("type") == CONDITION), None)
        if old is not None:
            conditions.append(dict(old))
    return {**patch, "conditions": conditions or None}
