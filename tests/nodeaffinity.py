"""kube-scheduler's NodeAffinity filter as the test schedulers use it (k8s.io/component-helpers
scheduling/corev1/nodeaffinity): a pod's required terms are ORed, the requirements of a term ANDed;
``matchFields`` names the node (``metadata.name``), ``matchExpressions`` test its labels. A term with no
requirement matches no node. The PreFilter's shortcut: when every term names nodes by ``metadata.name In``, only
those nodes are looked at.

Written apart from the product's ``scheduler_extender/objects/podfit.py`` on purpose: the test schedulers stand in for
kube-scheduler, so a mistake in the product's reading of node affinity must not be repeated by its judge."""

from __future__ import annotations

from typing import Any


def required_terms(pod: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The pod's required node selector terms, or None when it has none (every node matches)."""
    terms = ((((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
    return terms or None


def _requirement(req: dict[str, Any], value: str | None) -> bool:
    op, values = req.get("operator"), req.get("values") or []
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None:
        try:
            have, bound = int(value), int(values[0])
        except (ValueError, IndexError):
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def term_matches(term: dict[str, Any], name: str, labels: dict[str, str]) -> bool:
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False
    return all(_requirement(r, labels.get(r.get("key", ""))) for r in expressions) and \
        all(_requirement(r, name if r.get("key") == "metadata.name" else None) for r in fields)


def matches(pod: dict[str, Any], name: str, labels: dict[str, str]) -> bool:
    """Whether the node passes the pod's required node affinity (and its ``nodeSelector``)."""
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    terms = required_terms(pod)
    return terms is None or any(term_matches(t, name, labels) for t in terms)


def named_nodes(pod: dict[str, Any]) -> set[str] | None:
    """PreFilter's node names: when every term has ``metadata.name In`` requirements, the union over the terms of
    their intersections; else None (every node is looked at)."""
    terms = required_terms(pod)
    if terms is None:
        return None
    out: set[str] = set()
    for term in terms:
        names: set[str] | None = None
        for r in term.get("matchFields") or []:
            if r.get("key") == "metadata.name" and r.get("operator") == "In":
                values = set(r.get("values") or [])
                names = values if names is None else names & values
        if names is None:
            return None
        out |= names
    return out


def _tolerated(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return toleration.get("operator", "Equal") == "Equal" and \
        (toleration.get("value") or "") == (taint.get("value") or "")


def tolerates(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    """kube-scheduler's TaintToleration filter: every NoSchedule or NoExecute taint of the node is tolerated by one
    of the pod's tolerations (k8s.io/api core/v1 Toleration.ToleratesTaint)."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    return all(any(_tolerated(t, taint) for t in tolerations)
               for taint in (node.get("spec") or {}).get("taints") or []
               if taint.get("effect") in ("NoSchedule", "NoExecute"))


# NodeResourcesFit, CPU and memory only, for the plain pods the tests make (containers' requests, no init
# containers): a pod fits a node when what the live pods bound there request plus its own is within allocatable.
_UNITS = {"m": 0.001, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}


def _amount(value: Any) -> float:
    text = str(value)
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * _UNITS[unit]
    return float(text)


def _asks(pod: dict[str, Any]) -> tuple[float, float]:
    cpu = mem = 0.0
    for c in (pod.get("spec") or {}).get("containers") or []:
        requests = (c.get("resources") or {}).get("requests") or {}
        cpu += _amount(requests.get("cpu", 0))
        mem += _amount(requests.get("memory", 0))
    return cpu, mem


def requested(pods: Any) -> dict[str, tuple[float, float]]:
    """Node -> CPU cores and memory bytes the live pods bound there request."""
    out: dict[str, tuple[float, float]] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if node and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            cpu, mem = _asks(p)
            have = out.get(node, (0.0, 0.0))
            out[node] = (have[0] + cpu, have[1] + mem)
    return out


def room(pod: dict[str, Any], node: dict[str, Any], used: dict[str, tuple[float, float]]) -> bool:
    """Whether the node's allocatable CPU and memory take the pod beside what ``used`` says is bound there."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    cpu, mem = _asks(pod)
    have = used.get(node["metadata"]["name"], (0.0, 0.0))
    return ((cpu == 0 or "cpu" not in allocatable or have[0] + cpu <= _amount(allocatable["cpu"]) + 1e-9)
            and (mem == 0 or "memory" not in allocatable or have[1] + mem <= _amount(allocatable["memory"])))
