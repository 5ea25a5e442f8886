"""Narrowing a gated pod to the nodes its GPR reserved: its required node affinity ANDed with those nodes (a term
kube-scheduler's NodeAffinity PreFilter can use), and the PATCH body that sets it and lifts the gate. Used by the
controller (ungating) and by admission (auto-GPR pods)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler_extender.objects.cluster import PodView
from scheduler_extender.objects.podfit import (
    HOSTNAME_LABEL,
    NODE_NAME_FIELD,
    REQUIRED_AFFINITY,
)


def _by_name(node: str) -> dict[str, Any]:
    # a node field selector takes exactly one value (the API server refuses `In` with two or more)
    return {"key": NODE_NAME_FIELD, "operator": "In", "values": [node]}


def narrow_affinity(affinity: dict[str, Any] | None, nodes: list[str], hostnames: Mapping[str, str] | None = None,
                    base: str = "/spec/affinity") -> list[dict[str, Any]]:
    """JSON-patch ops that narrow a pod's required node affinity to ``nodes``, in the forms the API server
    accepts on a new pod or, for a gated one, as a narrowing (KEP-3838: a required node affinity that has terms
    keeps them, each keeping its requirements, new ones appended):

    - no required term yet: one term per node, ``matchFields metadata.name In [node]`` (a field selector takes one
      value; terms are ORed), however many nodes: kube-scheduler's NodeAffinity PreFilter then hands the
      scheduler those nodes only (a union over the terms), where a label expression would make it filter every
      node of the cluster for every pod (~25 ms a pod at 5,000 nodes, measured in the real scheduler; the terms
      cost about 80 bytes a node in the pod object).
    - terms already (the user's): appended to each, ``metadata.name In [node]`` for one node, else
      ``kubernetes.io/hostname In [...]``; when a node's label is not known, nothing (the filter keeps the pod on
      its reservation all the same).

    Nothing when it is narrowed already."""
    names = sorted(set(nodes))
    labels = sorted({(hostnames or {}).get(n, "") for n in names})
    by_label = {"key": HOSTNAME_LABEL, "operator": "In", "values": labels}
    fresh: dict[str, Any] = {"nodeSelectorTerms": [{"matchFields": [_by_name(n)]} for n in names]}
    if affinity is None:
        return [{"op": "add", "path": base, "value": {"nodeAffinity": {REQUIRED_AFFINITY: fresh}}}]
    node_affinity = affinity.get("nodeAffinity")
    if node_affinity is None:
        return [{"op": "add", "path": f"{base}/nodeAffinity", "value": {REQUIRED_AFFINITY: fresh}}]
    terms = (node_affinity.get(REQUIRED_AFFINITY) or {}).get("nodeSelectorTerms") or []
    if not terms:
        return [{"op": "add", "path": f"{base}/nodeAffinity/{REQUIRED_AFFINITY}", "value": fresh}]
    if all(_within(term, "matchFields", NODE_NAME_FIELD, set(names)) for term in terms):
        return []  # narrowed already (a webhook called again, a gate lifted by the last leader's patch)
    if len(names) == 1:
        key, need = "matchFields", _by_name(names[0])
    else:
        if "" in labels:
            return []
        if all(_within(term, "matchExpressions", HOSTNAME_LABEL, set(labels)) for term in terms):
            return []
        key, need = "matchExpressions", by_label
    narrowed = []
    for term in terms:
        requirements = list(term.get(key) or [])
        if need not in requirements:
            requirements.append(need)
        narrowed.append({**term, key: requirements})
    if narrowed == terms:
        return []
    return [{"op": "replace", "path": f"{base}/nodeAffinity/{REQUIRED_AFFINITY}/nodeSelectorTerms",
             "value": narrowed}]


def _within(term: dict[str, Any], kind: str, key: str, allowed: set[str]) -> bool:
    """Whether a term already keeps a pod within ``allowed`` by ``key`` (an ``In`` requirement naming only
    those)."""
    return any(r.get("key") == key and r.get("operator") == "In" and r.get("values")
               and set(r["values"]) <= allowed for r in term.get(kind) or [])


def ungate_patch(pod: PodView, nodes: list[str], gate: str, hostnames: Mapping[str, str] | None = None
                 ) -> list[dict[str, Any]] | None:
    """A JSON patch that narrows the pod's required node affinity to ``nodes`` and lifts ``gate``, in one
    request (Kubernetes lets a gated pod's node affinity be narrowed, never widened). Tests guard against a
    concurrent change. None when the pod does not carry the gate."""
    if gate not in pod.gates or not nodes:
        return None
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/spec/schedulingGates",
                                  "value": [{"name": g} for g in pod.gates]}]
    if pod.affinity is not None:
        ops.append({"op": "test", "path": "/spec/affinity", "value": pod.affinity})
    ops += narrow_affinity(pod.affinity, nodes, hostnames)
    ops.append({"op": "replace", "path": "/spec/schedulingGates",
                "value": [{"name": g} for g in pod.gates if g != gate]})
    return ops
