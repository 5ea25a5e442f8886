"""Which pods reach the pod webhook: the two entries of ``manifests/extender/webhooks.yaml`` that call
``/mutate-pods``, each with its ``objectSelector`` and its ``matchConditions`` (evaluated with cel-python as the API
server evaluates them, ``object`` = the pod), on a matrix of pods. Every pod the webhook acts on (gates, labels,
refuses, warns) must match one entry, and no pod both (the API server would call the webhook twice); every other
pod must match none, so that an extender outage (``failurePolicy: Fail``) refuses only pods that ask for a managed
accelerator or name a GPR."""

from __future__ import annotations

import copy
import functools
import itertools
import re
from pathlib import Path
from typing import Any

import celpy
import yaml

from scheduler_extender.admission.webhook import Webhook
from scheduler_extender.cmd.extender import RESOURCE_NAMES
from scheduler_extender.objects.gpr_codec import GPR_LABEL
from scheduler_extender.objects.resources import pod_requests
from tests.extender.test_webhook import NOW, MemoryLookup, review, serve

WEBHOOKS = Path(__file__).resolve().parents[2] / "manifests" / "extender" / "webhooks.yaml"


def pod_webhooks() -> list[dict[str, Any]]:
    """The entries that call the pod endpoint."""
    (mutating,) = [d for d in yaml.safe_load_all(WEBHOOKS.read_text()) if d["kind"] == "MutatingWebhookConfiguration"]
    hooks = [w for w in mutating["webhooks"] if w["clientConfig"]["service"]["path"] == "/mutate-pods"]
    assert [w["name"] for w in hooks] == ["gpr-pods.accelstack.io", "pods.accelstack.io"]
    return hooks


@functools.cache
def programs(name: str) -> list[tuple[str, Any]]:
    env = celpy.Environment()
    (hook,) = [w for w in pod_webhooks() if w["name"] == name]
    return [(c["name"], env.program(env.compile(c["expression"]))) for c in hook.get("matchConditions") or ()]


def selected(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) as the API server applies an objectSelector."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or ():
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"Exists": key in labels, "DoesNotExist": key not in labels, "In": labels.get(key) in values,
              "NotIn": key not in labels or labels[key] not in values}[op]
        if not ok:
            return False
    return True


def hooks_called(pod: dict[str, Any]) -> list[str]:
    """The entries the API server calls for ``pod``: its objectSelector selects the pod and all its
    matchConditions are true (an evaluation error fails the test)."""
    called = []
    for hook in pod_webhooks():
        if not selected(hook.get("objectSelector"), (pod.get("metadata") or {}).get("labels") or {}):
            continue
        results = []
        for name, program in programs(hook["name"]):
            value = program.evaluate({"object": celpy.json_to_cel(pod)})
            assert isinstance(value, celpy.celtypes.BoolType), (name, value)  # not an evaluation error
            results.append(bool(value))
        if all(results):
            called.append(hook["name"])
    return called


def matches(pod: dict[str, Any]) -> bool:
    called = hooks_called(pod)
    assert len(called) <= 1, called  # never both: the webhook would be called twice for one pod
    return bool(called)


# ---- the matrix ---------------------------------------------------------------------------------------------------
RESOURCE_SETS: list[dict[str, str] | None] = [
    None, {}, {"cpu": "1", "memory": "1Gi"}, {"nvidia.com/gpu": "1"}, {"neureality.com/nr1": "2"},
    {"nvidia.com/gpu": "0"}, {"amd.com/gpu": "1"}, {"nvidia.com/gpu.shared": "1"}, {"nvidia.com/mig-1g.10gb": "1"},
]


LIMIT_SETS: list[dict[str, str] | None] = [None, {"cpu": "1"}, {"nvidia.com/gpu": "1"}, {"neureality.com/nr1": "2"}]


def container(name: str, requests: dict[str, str] | None, limits: dict[str, str] | None,
              with_resources: bool = True) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "busybox"}
    if with_resources:
        resources: dict[str, Any] = {}
        if requests is not None:
            resources["requests"] = requests
        if limits is not None:
            resources["limits"] = limits
        c["resources"] = resources
    return c


@functools.cache
def matrix() -> list[tuple[str, dict[str, Any], bool]]:
    """(what, pod, whether the conditions send it to the webhook), evaluated once for the module."""
    return [(what, pod, matches(pod)) for what, pod in pods()]


def pods() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    label_variants: list[tuple[str, dict[str, str] | None]] = [
        ("no labels", None), ("other labels", {"app": "web"}), ("gpr label", {GPR_LABEL: "train"})]
    for (label_name, labels), (requests, limits), where in itertools.product(
            label_variants, itertools.product(RESOURCE_SETS, LIMIT_SETS), ("containers", "initContainers")):
        spec: dict[str, Any] = {"containers": [container("main", None, None, with_resources=False)]}
        if where == "containers":
            spec["containers"].append(container("second", requests, limits))
        else:
            spec["initContainers"] = [container("init", requests, limits)]
        meta: dict[str, Any] = {"name": "p", "namespace": "team-a"}
        if labels is not None:
            meta["labels"] = dict(labels)
        out.append((f"{label_name}, {where} requests={requests} limits={limits}",
                    {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}))
    # shapes of their own: no resources anywhere, no containers key, empty lists, only an init container
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-a"}}
    out.append(("no spec.containers", {**bare, "spec": {}}))
    out.append(("empty containers", {**bare, "spec": {"containers": [], "initContainers": []}}))
    out.append(("containers without resources",
                {**bare, "spec": {"containers": [container(f"c{i}", None, None, False) for i in range(3)]}}))
    out.append(("empty resources", {**bare, "spec": {"containers": [container("c", None, None)]}}))
    out.append(("only an init container asks",
                {**bare, "spec": {"containers": [container("c", {"cpu": "1"}, None)],
                                  "initContainers": [container("i", None, {"nvidia.com/gpu": "1"})]}}))
    return out


def names_managed(pod: dict[str, Any]) -> bool:
    """The rule in Python: a managed resource named in any container's or init container's requests or limits
    (a zero included), or the GPR label."""
    spec = pod["spec"]
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        resources = c.get("resources") or {}
        if any(r in (resources.get(k) or {}) for r in RESOURCE_NAMES for k in ("requests", "limits")):
            return True
    return GPR_LABEL in (pod["metadata"].get("labels") or {})


def test_conditions_name_the_managed_resources_and_the_label() -> None:
    names = set()
    for hook in pod_webhooks():
        assert hook["failurePolicy"] == "Fail"
        for condition in hook.get("matchConditions") or ():
            names |= set(re.findall(r"'([^']+)'", condition["expression"]))
        names |= {e["key"] for e in hook["objectSelector"]["matchExpressions"]}
    assert names == {*RESOURCE_NAMES, GPR_LABEL}
    # a pod of a GPR is selected by its label alone: no CEL for the API server to evaluate
    (labelled,) = [w for w in pod_webhooks() if w["name"] == "gpr-pods.accelstack.io"]
    assert "matchConditions" not in labelled


def test_pods_reach_the_webhook_exactly_when_they_name_a_managed_resource_or_a_gpr() -> None:
    assert len(matrix()) > 200
    for what, pod, matched in matrix():
        assert matched == names_managed(pod), what
        if pod_requests(pod["spec"], RESOURCE_NAMES):  # every pod the webhook gates or refuses gets there
            assert matched, what
    assert sum(not matched for _, _, matched in matrix()) >= 50  # and the others do not


async def test_a_pod_the_conditions_skip_is_one_the_webhook_leaves_unchanged() -> None:
    """Skipping is safe: for every pod the conditions let through unwebhooked, the webhook itself (asked
    anyway) allows it unchanged, without a patch or a warning."""
    lookup = MemoryLookup()
    lookup.namespace("team-a")
    http = await serve(Webhook(lookup, clock=lambda: NOW))
    skipped = 0
    try:
        for what, pod, matched in matrix():
            if matched:
                continue
            r = await http.post("/mutate-pods", json=review(copy.deepcopy(pod)))
            response = (await r.json())["response"]
            assert response["allowed"] is True and "patch" not in response and "warnings" not in response, what
            skipped += 1
    finally:
        await http.close()
    assert skipped >= 50
