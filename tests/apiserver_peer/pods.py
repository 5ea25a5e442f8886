"""The pod validation rules of a real API server that accelstack's writes meet (k8s.io/kubernetes
pkg/apis/core/validation: ``ValidatePodCreate``/``ValidatePodUpdate``), so a write that a real cluster refuses is
refused here too, with the same field path and words:

- node affinity requirements: ``matchFields`` only ``metadata.name``, ``In``/``NotIn`` with exactly one value
  (a set of nodes needs a term per node, or a label); ``matchExpressions`` ``In``/``NotIn`` with values,
  ``Exists``/``DoesNotExist`` without;
- an update may change a pod's spec only where Kubernetes allows: images, ``activeDeadlineSeconds``,
  tolerations (additions), ``schedulingGates`` (deletions only); while the stored pod is gated (KEP-3838),
  ``nodeSelector`` additions and node affinity narrowing: anything where there was no required node affinity or
  no term, else the same terms, each with its requirements kept at the front and new ones only appended.
"""

from __future__ import annotations

import copy
from typing import Any

from tests.apiserver_peer.wire import Refused

AFFINITY = "spec.affinity.nodeAffinity"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
FIELD_SELECTOR_KEYS = ("metadata.name",)


def _invalid(name: str, errors: list[str]) -> Refused:
    # the API server joins the field errors: `Pod "p" is invalid: [a, b]`, or without brackets for one
    body = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    return Refused(422, f'Pod "{name}" is invalid: {body}', "Invalid", {"name": name, "kind": "pods"})


def _required_terms(spec: dict[str, Any]) -> list[Any] | None:
    affinity = spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    required = node_affinity.get(REQUIRED) if isinstance(node_affinity, dict) else None
    if not isinstance(required, dict):
        return None
    terms = required.get("nodeSelectorTerms")
    return terms if isinstance(terms, list) else []


def affinity_errors(spec: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    for i, term in enumerate(_required_terms(spec) or []):
        path = f"{AFFINITY}.{REQUIRED}.nodeSelectorTerms[{i}]"
        if not isinstance(term, dict):
            errors.append(f"{path}: Invalid value: must be an object")
            continue
        for j, req in enumerate(term.get("matchExpressions") or []):
            op, values = req.get("operator"), req.get("values") or []
            where = f"{path}.matchExpressions[{j}]"
            if op in ("In", "NotIn") and not values:
                errors.append(f"{where}.values: Required value: must be specified when `operator` is 'In' or "
                              "'NotIn'")
            elif op in ("Exists", "DoesNotExist") and values:
                errors.append(f"{where}.values: Forbidden: may not be specified when `operator` is 'Exists' or "
                              "'DoesNotExist'")
            elif op not in ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"):
                errors.append(f'{where}.operator: Invalid value: "{op}": not a valid selector operator')
        for j, req in enumerate(term.get("matchFields") or []):
            op, values = req.get("operator"), req.get("values") or []
            where = f"{path}.matchFields[{j}]"
            if op in ("In", "NotIn"):
                if len(values) != 1:
                    errors.append(f"{where}.values: Required value: must be only one value when `operator` is "
                                  "'In' or 'NotIn' for node field selector")
            else:
                errors.append(f'{where}.operator: Invalid value: "{op}": not a valid selector operator')
            if req.get("key") not in FIELD_SELECTOR_KEYS:
                errors.append(f'{where}.key: Invalid value: "{req.get("key")}": not a valid field selector key')
    return errors


def validate_create(pod: dict[str, Any]) -> None:
    errors = affinity_errors(pod.get("spec") or {})
    if errors:
        raise _invalid((pod.get("metadata") or {}).get("name", ""), errors)


def _only_appended(new: list[Any], old: list[Any]) -> bool:
    return len(new) >= len(old) and new[:len(old)] == old


def _narrowing_errors(new_spec: dict[str, Any], old_spec: dict[str, Any]) -> list[str]:
    old_terms = _required_terms(old_spec)
    if not old_terms:  # no required node affinity, or no term: anything may be set
        return []
    new_terms = _required_terms(new_spec) or []
    path = f"{AFFINITY}.{REQUIRED}.nodeSelectorTerms"
    if len(new_terms) != len(old_terms):
        return [f"{path}: Invalid value: no additions/deletions to non-empty NodeSelectorTerms list are allowed"]
    errors = []
    for i, (new, old) in enumerate(zip(new_terms, old_terms, strict=True)):
        if not all(_only_appended(list((new or {}).get(k) or []), list((old or {}).get(k) or []))
                   for k in ("matchExpressions", "matchFields")):
            errors.append(f"{path}[{i}]: Invalid value: only additions are allowed (no mutations or deletions)")
    return errors


def validate_update(new: dict[str, Any], old: dict[str, Any]) -> None:
    """A write of the main resource (not /status)."""
    name = (old.get("metadata") or {}).get("name", "")
    new_spec, old_spec = new.get("spec") or {}, old.get("spec") or {}
    errors = affinity_errors(new_spec)
    if errors:
        raise _invalid(name, errors)
    old_gates = [g.get("name") for g in old_spec.get("schedulingGates") or [] if isinstance(g, dict)]
    new_gates = [g.get("name") for g in new_spec.get("schedulingGates") or [] if isinstance(g, dict)]
    added = [g for g in new_gates if g not in old_gates]
    if added:
        raise _invalid(name, [f"spec.schedulingGates: Forbidden: only deletion is allowed, but found new scheduling "
                              f"gate '{added[0]}'"])
    munged, base = copy.deepcopy(new_spec), copy.deepcopy(old_spec)
    for key in ("containers", "initContainers"):
        for i, container in enumerate(munged.get(key) or []):
            olds = base.get(key) or []
            if i < len(olds) and isinstance(container, dict) and isinstance(olds[i], dict):
                container["image"] = olds[i].get("image")
    old_tolerations = base.get("tolerations") or []
    if not _only_appended(list(munged.get("tolerations") or []), list(old_tolerations)):
        raise _invalid(name, ["spec.tolerations: Forbidden: existing toleration can not be modified except its "
                              "tolerationSeconds"])
    for key in ("activeDeadlineSeconds", "tolerations", "schedulingGates", "terminationGracePeriodSeconds"):
        munged.pop(key, None)
        base.pop(key, None)
    if old_gates:
        old_selector, new_selector = base.get("nodeSelector") or {}, munged.get("nodeSelector") or {}
        if any(new_selector.get(k) != v for k, v in old_selector.items()):
            raise _invalid(name, ["spec.nodeSelector: Invalid value: only additions to spec.nodeSelector are "
                                  "allowed (no mutations or deletions)"])
        errors = _narrowing_errors(munged, base)
        if errors:
            raise _invalid(name, errors)
        for spec in (munged, base):
            spec.pop("nodeSelector", None)
            affinity = spec.get("affinity")
            if isinstance(affinity, dict):
                affinity = {k: v for k, v in affinity.items() if k != "nodeAffinity" and v is not None}
                spec["affinity"] = affinity
                if not affinity:
                    spec.pop("affinity")
    if munged != base:
        raise _invalid(name, ["spec: Forbidden: pod updates may not change fields other than "
                              "`spec.containers[*].image`,`spec.initContainers[*].image`,"
                              "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing "
                              "tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it "
                              "was previously negative)"])
