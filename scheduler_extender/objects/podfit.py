"""Whether a pod could run on a node as kube-scheduler's own filters judge it, before any extender is asked:
TaintToleration (every ``NoSchedule``/``NoExecute`` taint of the node tolerated) and NodeAffinity (the pod's
``nodeSelector`` and required node affinity: terms ORed, requirements ANDed; ``matchFields`` name the node).
Pure functions over the informer views, and :class:`NodeFit`, which keeps them between passes: the GPR controller
places a queued GPR only on nodes its pods can run on, and says when an admitted GPR's pods cannot run on the
nodes reserved for it (created after the admission, say)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
NODE_NAME_FIELD = "metadata.name"
HOSTNAME_LABEL = "kubernetes.io/hostname"
REQUIRED_AFFINITY = "requiredDuringSchedulingIgnoredDuringExecution"


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


@dataclass(frozen=True)
class Constraints:
    """A pod's constraints on nodes, read from a pod spec as sent (an admission request): what :func:`why_not`
    reads of a pod view."""

    tolerations: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] | None = None
    affinity: Mapping[str, Any] | None = None

    @classmethod
    def of_spec(cls, spec: Mapping[str, Any]) -> Constraints | None:
        """None when a field is not of its type (the API server refuses such a pod: nothing to judge)."""
        tolerations, selector, affinity = spec.get("tolerations") or [], spec.get("nodeSelector"), spec.get("affinity")
        if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
            return None
        if selector is not None and not isinstance(selector, Mapping):
            return None
        if affinity is not None and not isinstance(affinity, Mapping):
            return None
        return cls(tuple(tolerations), selector, affinity)


def why_not(pod: Any, node: Any, lifecycle: bool = True) -> str:
    """Why kube-scheduler's own filters keep ``pod`` (a PodView) off ``node`` (a NodeView); "" when they would
    let it through. ``lifecycle=False``: the node lifecycle's taints left out (see :func:`placement_taints`)."""
    taint = untolerated(node.taints if lifecycle else placement_taints(node), pod.tolerations)
    if taint:
        return f"untolerated taint {taint}"
    return selector_mismatch(pod.node_selector, pod.affinity, node.name, node.labels)


def _required_terms(affinity: Mapping[str, Any] | None) -> list[Any]:
    return list((((affinity or {}).get("nodeAffinity") or {}).get(REQUIRED_AFFINITY) or {})
                 .get("nodeSelectorTerms") or [])


def narrowed(pod: Any) -> bool:
    """Whether accelstack narrowed this pod to a reservation (a required term names nodes by metadata.name or
    by their hostname label)."""
    terms = _required_terms(pod.affinity)
    return any(f.get("key") == NODE_NAME_FIELD for t in terms for f in t.get("matchFields") or []) or \
        any(e.get("key") == HOSTNAME_LABEL and e.get("operator") == "In"
            for t in terms for e in t.get("matchExpressions") or [])


def label_keys(node_selector: Mapping[str, Any] | None, affinity: Mapping[str, Any] | None) -> set[str]:
    """The node labels a pod's ``nodeSelector`` and required node affinity read."""
    keys = set(node_selector or ())
    for term in _required_terms(affinity):
        if isinstance(term, Mapping):
            keys.update(str(r.get("key")) for r in term.get("matchExpressions") or () if isinstance(r, Mapping))
    return keys


def fit_key(pod: Any) -> str:
    """The pod's constraints on nodes, in one canonical string: tolerations (in any order), ``nodeSelector`` and
    required node affinity."""
    tolerations = sorted(orjson.dumps(t, option=orjson.OPT_SORT_KEYS) for t in pod.tolerations)
    terms = _required_terms(pod.affinity)
    return orjson.dumps([[t.decode() for t in tolerations], pod.node_selector or {}, terms],
                        option=orjson.OPT_SORT_KEYS).decode()


LIFECYCLE_TAINT_PREFIX = "node.kubernetes.io/"


def placement_taints(node: Any) -> tuple[Mapping[str, Any], ...]:
    """The node's taints that decide where a GPR may be placed: all but the node lifecycle's own
    (``node.kubernetes.io/unschedulable``, ``not-ready``, ``unreachable``, ``memory-pressure``, ``disk-pressure``
    ...). Those come and go with the node's state: a cordoned or unready node is closed to new reservations (see
    cluster.closed_reason) and expected back; a GPR's nodes are not moved, nor a GPR called Unschedulable, while
    a node is under pressure for a while."""
    return tuple(t for t in node.taints if not str(t.get("key") or "").startswith(LIFECYCLE_TAINT_PREFIX))


class NodeFit:
    """Which nodes a GPR's pods can run on, as kube-scheduler's own filters judge them (:func:`why_not`, the
    node lifecycle's taints left to the node's state: :func:`placement_taints`), kept between passes: each pod's
    key by its view, the nodes each distinct key allows and each GPR's answer, until the node set changes, a
    node's taints do, or a node label that some key reads (a status heartbeat, or a label nobody selects by such
    as GPU feature discovery's ``nvidia.com/gfd.timestamp``, changes nothing). What it answers is a function of
    the views alone: a restart rebuilds it identically."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.views: dict[str, Any] = {}
        self.groups: list[tuple[tuple[Any, ...], list[str]]] = []  # distinct taints -> the nodes that have them
        self.allowed_by_key: dict[str, frozenset[str] | None] = {}
        self.keys: dict[str, tuple[Any, str]] = {}  # pod UID -> (its view, its key)
        self.label_keys: set[str] = set()  # the node labels the keys in allowed_by_key read
        self.generation = 0  # +1 whenever allowed_by_key is dropped
        # GPR -> (generation, node count, its pods' views, answer) of the last pass: most GPRs' pods stay the same
        self.by_group: dict[str, tuple[int, int, list[Any], frozenset[str] | None]] = {}
        self._seen: dict[str, tuple[int, int, list[Any], frozenset[str] | None]] = {}

    def sync(self, names: Sequence[str], nodes: Mapping[str, Any]) -> None:
        """Judge against ``names`` (the inventory's nodes), as ``nodes`` (views by name) now have them."""
        same = len(names) == len(self.names) and list(names) == self.names
        if same:
            views = self.views
            for name in names:
                view, old = nodes[name], views[name]
                if view is not old:
                    if placement_taints(view) != placement_taints(old) or any(
                            view.labels.get(k) != old.labels.get(k) for k in self.label_keys):
                        same = False
                        break
                    views[name] = view
        if same:
            return
        self.names = list(names)
        self.views = {name: nodes[name] for name in names}
        by_taints: dict[bytes, tuple[tuple[Any, ...], list[str]]] = {}
        for name in names:
            taints = placement_taints(self.views[name])
            key = orjson.dumps(list(taints), option=orjson.OPT_SORT_KEYS)
            by_taints.setdefault(key, (taints, []))[1].append(name)
        self.groups = list(by_taints.values())
        self.allowed_by_key = {}
        self.label_keys = set()
        self.generation += 1

    def allowed(self, pod: Any) -> frozenset[str] | None:
        """The nodes ``pod`` can run on (None: every node)."""
        hit = self.keys.get(pod.uid)
        if hit is not None and hit[0] is pod:
            key = hit[1]
        else:
            key = fit_key(pod)
            self.keys[pod.uid] = (pod, key)
        if key in self.allowed_by_key:
            return self.allowed_by_key[key]
        affinity = pod.affinity
        selective = bool(pod.node_selector) or bool(_required_terms(affinity))
        self.label_keys |= label_keys(pod.node_selector, affinity)
        ok: list[str] = []
        for taints, names in self.groups:
            if untolerated(taints, pod.tolerations):
                continue
            if not selective:
                ok += names
                continue
            views = self.views
            ok += [n for n in names if not selector_mismatch(pod.node_selector, affinity, n, views[n].labels)]
        allowed = None if len(ok) == len(self.names) else frozenset(ok)
        self.allowed_by_key[key] = allowed
        return allowed

    def of_gpr(self, key: str, pods: list[Any], node_count: int) -> frozenset[str] | None:
        """:meth:`of_group` for GPR ``key``, kept while its pods are the very views seen last time (a list compares
        its items by identity first) and nothing the answers depend on changed."""
        hit = self.by_group.get(key)
        if hit is None or hit[0] != self.generation or hit[1] != node_count or hit[2] != pods:
            hit = (self.generation, node_count, pods, self.of_group(pods, node_count))
        self._seen[key] = hit
        return hit[3]

    def keep_groups(self) -> None:
        """Keep every GPR's answer through the next :meth:`forget_except` (a pass that asked none again)."""
        self._seen.update(self.by_group)

    def of_group(self, pods: Iterable[Any], node_count: int) -> frozenset[str] | None:
        """The nodes a GPR of ``node_count`` nodes may be placed on for ``pods`` (None: any): those every pod
        can run on while there are enough of them; when pods pinned apart leave fewer, those any of them can
        run on (each pod then picks the reserved node it can go to, and the controller says when one has
        none)."""
        sets = {self.allowed(p) for p in pods}
        if not sets or sets == {None}:
            return None
        limited = [s for s in sets if s is not None]
        both = limited[0].intersection(*limited[1:]) if len(limited) > 1 else limited[0]
        if len(both) >= node_count:
            return both
        if None in sets:
            return None
        return frozenset().union(*limited)

    def forget_except(self, live: Mapping[str, Sequence[Any]]) -> None:
        """Drop what was kept of pods not in ``live`` (GPR -> pod views) once it is twice as much: pods come and
        go, this must not grow with them."""
        if len(self.keys) > 2 * sum(map(len, live.values())) + 64:
            keep = {p.uid for group in live.values() for p in group}
            for uid in [u for u in self.keys if u not in keep]:
                del self.keys[uid]
        if len(self.allowed_by_key) > 4 * max(len(self.keys), 64):
            self.allowed_by_key = {}
            self.label_keys = set()
            self.generation += 1
        self.by_group, self._seen = self._seen, {}  # the GPRs asked about since the last call
