"""Kubernetes label selectors (``metav1.LabelSelector``) as the API server evaluates them, for objects accelstack
reads itself: a workspace's clusters on the hub (``Workspace.spec.clusterSelector`` against a ``Cluster``'s
``spec.labels``) and a template binding's workload selector at admission."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def selector_matches(selector: Any, labels: Mapping[str, Any]) -> bool:
    """``matchLabels`` and ``matchExpressions`` (In, NotIn, Exists, DoesNotExist) against ``labels``, all of them
    (AND). ``{}`` matches every label set; anything that is not an object, or names an unknown operator, matches
    nothing (a malformed selector must never select everything: the CRDs refuse them before they get here)."""
    if not isinstance(selector, Mapping):
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or ():
        if not isinstance(expr, Mapping):
            return False
        key, op, values = str(expr.get("key") or ""), expr.get("operator"), expr.get("values") or []
        if op not in OPERATORS:
            return False
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels.get(key) in values:
            return False
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True
