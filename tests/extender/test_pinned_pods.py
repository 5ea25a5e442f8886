"""Pods pinned to one node: the replica that answers the verbs narrows each new pod of an admitted GPR to one
reserved node, the one whose share of the GPR has least left that fits (a pod of one node term, where narrowing to
every reserved node made a term a node: 25 for the benchmark's GPRs, 10% of its pace in kube-apiserver and
kube-scheduler). The node's share is the pod's from the webhook's answer until it is bound: the filter offers it to
no other pod of the GPR (pinned or not), counts the pins whose pods are not seen yet, and claims nothing for a pinned
pod (its pin is its claim). Another replica, or a GPR with no share left anywhere, narrows to every reserved node."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import msgspec

from scheduler_extender.admission.webhook import Webhook
from scheduler_extender.extender.verbs import ask_of, filter_nodes
from scheduler_extender.extender.wire import ExtenderArgs
from scheduler_extender.objects.cluster import GPU, ClusterView, pinned_node
from tests.extender.harness import gpr, node

NODES = [f"n{i}" for i in range(4)]
GPR_KEY = "default/spread"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoLookup:
    """The webhook reads the informer's view for a GPR it knows; nothing here may reach the API server."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the webhook called the API ({name}) for a GPR its view holds")


def world() -> tuple[ClusterView, Clock]:
    view, clock = ClusterView(ledger="memory"), Clock()
    view.clock = clock
    view.sync_nodes([node(n, gpus=8) for n in NODES])
    view.sync_gprs([gpr("spread", reservation=dict.fromkeys(NODES, 2), nodes=4, devices=2)])
    return view, clock


def new_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default",
                                                             "labels": {"accelstack.io/gpr": "spread"}},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {GPU: "1"}, "limits": {GPU: "1"}}}]}}


def admit(webhook: Webhook, obj: dict[str, Any]) -> dict[str, Any]:
    """The pod as the API server stores it after the webhook's patch (a UID given, as it gives one)."""
    req = {"uid": f"review-{obj['metadata']['name']}", "operation": "CREATE", "namespace": "default", "object": obj}
    answer = asyncio.run(webhook._mutate_pod(req))["response"]
    assert answer["allowed"], answer
    out = json.loads(json.dumps(obj))
    for op in json.loads(base64.b64decode(answer.get("patch") or "W10=")):
        assert op["op"] == "add" and op["path"] == "/spec/affinity", op
        out["spec"]["affinity"] = op["value"]
    out["metadata"]["uid"] = f"uid-{obj['metadata']['name']}"
    return out


def terms(obj: dict[str, Any]) -> list[Any]:
    return list(obj["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"])


def filter_of(view: ClusterView, obj: dict[str, Any], names: list[str]) -> list[str]:
    args = msgspec.json.decode(json.dumps({"Pod": obj, "NodeNames": names}).encode(), type=ExtenderArgs)
    assert args.Pod is not None
    return filter_nodes(view, ask_of(view, args.Pod), names).passed


def test_the_binder_pins_each_pod_to_one_node_until_the_shares_are_given_then_narrows_to_all() -> None:
    view, _ = world()
    webhook = Webhook(NoLookup(), view=view, pin=lambda: True)  # type: ignore[arg-type]
    pods = [admit(webhook, new_pod(f"p{i}")) for i in range(9)]
    pinned = [pinned_node(p["spec"]["affinity"]) for p in pods[:8]]
    assert all(len(terms(p)) == 1 for p in pods[:8])
    assert sorted(pinned) == sorted(NODES * 2)  # two a node, the GPR's share there: packed, node by node
    assert pinned[:2] == [pinned[0]] * 2
    # every share is pinned (none of those pods is seen yet): the ninth is narrowed to all four, as before
    assert pinned_node(pods[8]["spec"]["affinity"]) == "" and len(terms(pods[8])) == 4
    # a replica that does not answer the verbs pins nothing
    other = Webhook(NoLookup(), view=world()[0], pin=lambda: False)  # type: ignore[arg-type]
    assert len(terms(admit(other, new_pod("q")))) == 4


def test_a_pinned_share_is_offered_to_no_other_pod_until_its_pod_is_bound_or_gone() -> None:
    view, _ = world()
    webhook = Webhook(NoLookup(), view=view, pin=lambda: True)  # type: ignore[arg-type]
    a, b = admit(webhook, new_pod("a")), admit(webhook, new_pod("b"))
    n = pinned_node(a["spec"]["affinity"])
    assert pinned_node(b["spec"]["affinity"]) == n
    # neither seen by the informer yet: the pins ahead of them hold n's share of 2
    wide = admit(Webhook(NoLookup(), view=view, pin=lambda: False), new_pod("wide"))  # type: ignore[arg-type]
    assert filter_of(view, wide, NODES) != [n] and n not in filter_of(view, wide, [n])
    # the pinned pods themselves pass on n, and claim nothing (their pin is their claim)
    assert filter_of(view, a, [n]) == [n] and filter_of(view, b, [n]) == [n]
    assert not view.claims
    # seen: counted as pinned pods, the pins ahead of them used up
    view.on_pod("ADDED", a)
    view.on_pod("ADDED", b)
    assert not view.pins_ahead and view.pinned == {(n, GPR_KEY, GPU): 2}
    assert filter_of(view, a, [n]) == [n] and filter_of(view, wide, [n]) == []
    # a bound: its share is counted as used there now, not pinned; b deleted: its share is free
    bound = json.loads(json.dumps(a))
    bound["spec"]["nodeName"] = n
    view.on_pod("MODIFIED", bound)
    view.on_pod("DELETED", b)
    assert view.pinned == {}
    assert filter_of(view, wide, [n]) == [n]


def test_a_pin_whose_pod_never_comes_lapses() -> None:
    view, clock = world()
    webhook = Webhook(NoLookup(), view=view, pin=lambda: True)  # type: ignore[arg-type]
    first = [pinned_node(admit(webhook, new_pod(f"p{i}"))["spec"]["affinity"]) for i in range(8)]
    assert len(set(first)) == 4
    clock.now += view.pin_ttl + 1  # the pods were refused after the webhook (another admission said no)
    again = admit(webhook, new_pod("later"))
    assert pinned_node(again["spec"]["affinity"]) in NODES


def test_a_relist_counts_the_pinned_pods_it_finds_and_the_pins_ahead_of_them_end() -> None:
    view, _ = world()
    webhook = Webhook(NoLookup(), view=view, pin=lambda: True)  # type: ignore[arg-type]
    pods = [admit(webhook, new_pod(f"p{i}")) for i in range(3)]
    view.sync_pods(pods)
    assert not view.pins_ahead
    assert sum(view.pinned.values()) == 3


def test_a_webhook_called_again_for_a_pod_it_pinned_keeps_the_pin_and_gives_no_second() -> None:
    """``reinvocationPolicy: IfNeeded``: when another webhook changes the pod after this one, the API server calls
    this one again with the pod as pinned: no second pin may be counted for the one pod."""
    view, _ = world()
    webhook = Webhook(NoLookup(), view=view, pin=lambda: True)  # type: ignore[arg-type]
    once = admit(webhook, new_pod("p"))
    node_of = pinned_node(once["spec"]["affinity"])
    before = {k: list(v) for k, v in view.pins_ahead.items()}
    again = {**once, "metadata": {k: v for k, v in once["metadata"].items() if k != "uid"}}
    assert admit(webhook, again)["spec"]["affinity"] == once["spec"]["affinity"]  # nothing to patch
    assert view.pins_ahead == before and sum(c for _, c in view.pins_ahead[(node_of, GPR_KEY, GPU)]) == 1


def test_a_pin_ahead_ends_when_its_pod_is_first_seen_already_bound() -> None:
    """A pinned pod the informer first shows bound (its events came together, or a relist is the first to show
    it): the pin ahead of it ends at once, not after ``pin_ttl`` (its share is counted as used there already: held
    on as a pin too, the node's share would be counted twice and refused to the GPR's next pod)."""
    for relist in (False, True):
        view, _ = world()
        webhook = Webhook(NoLookup(), view=view, pin=lambda: True)  # type: ignore[arg-type]
        a = admit(webhook, new_pod("a"))
        n = pinned_node(a["spec"]["affinity"])
        a["spec"]["nodeName"] = n
        if relist:
            view.sync_pods([a])
        else:
            view.on_pod("ADDED", a)
        assert not view.pins_ahead and view.pinned_share(n, GPR_KEY, GPU) == 0, relist
        later = admit(Webhook(NoLookup(), view=view, pin=lambda: False), new_pod("b"))  # type: ignore[arg-type]
        assert filter_of(view, later, [n]) == [n], relist  # 1 of n's 2 left for it
