"""Whether a pod could run on a node as kube-scheduler's own filters judge it, before any extender is asked:
TaintToleration (every ``NoSchedule``/``NoExecute`` taint of the node tolerated) and NodeAffinity (the pod's
``nodeSelector`` and required node affinity: terms ORed, requirements ANDed; ``matchFields`` name the node).
Pure functions over the informer views, for the GPR controller to say when a GPR's pods cannot run on the nodes
reserved for it (the reservation is made from the GPR's spec, not from its pods' constraints)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """``v1.Toleration.ToleratesTaint``: the effect (empty: any), the key (empty with ``Exists``: any) and, for
    ``Equal`` (the default operator), the value."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated(taints: Iterable[Mapping[str, Any]], tolerations: Iterable[Mapping[str, Any]]) -> str:
    """The first blocking taint no toleration matches, as ``key=value:Effect``; "" when all are tolerated."""
    tolerations = list(tolerations)
    for taint in taints:
        if taint.get("effect") in BLOCKING_EFFECTS and not any(tolerates(t, taint) for t in tolerations):
            value = taint.get("value")
            return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"
    return ""


def _requirement(req: Mapping[str, Any], value: str | None) -> bool:
    op, values = req.get("operator"), req.get("values") or []
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            have, bound = int(value), int(values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def _term(term: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> bool:
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False  # an empty term matches no node
    return all(_requirement(r, labels.get(str(r.get("key")))) for r in expressions) and \
        all(_requirement(r, name if r.get("key") == "metadata.name" else None) for r in fields)


def selector_mismatch(node_selector: Mapping[str, str] | None, affinity: Mapping[str, Any] | None, name: str,
                      labels: Mapping[str, str]) -> str:
    """Why the pod's ``nodeSelector`` or required node affinity refuses the node; "" when they accept it."""
    for key, value in (node_selector or {}).items():
        if labels.get(key) != value:
            return f"nodeSelector {key}={value}"
    required = (((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
                or {})
    terms = required.get("nodeSelectorTerms")
    if terms and not any(_term(t, name, labels) for t in terms if isinstance(t, Mapping)):
        return "required node affinity"
    return ""


def why_not(pod: Any, node: Any) -> str:
    """Why kube-scheduler's own filters keep ``pod`` (a PodView) off ``node`` (a NodeView); "" when they would
    let it through."""
    taint = untolerated(node.taints, pod.tolerations)
    if taint:
        return f"untolerated taint {taint}"
    return selector_mismatch(pod.node_selector, pod.affinity, node.name, node.labels)
