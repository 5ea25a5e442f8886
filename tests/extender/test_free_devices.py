"""ClusterView.free_for keeps what reservations withhold per node between changes, and filter and prioritize keep
their verdict and score per node for pods without a GPR: they must answer exactly what summing the reservations
afresh (and judging each node afresh) answers, through GPR and node changes in any order."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Callable
from typing import Any

from scheduler_extender.extender.verbs import PodAsk, _packing_score, filter_nodes, node_verdict, prioritize
from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import ALLOCATED, GPU, NR1, ClusterView, NodeView
from tests.extender.harness import gpr, node


def afresh(view: ClusterView, n: NodeView, resource: str, key: str) -> int:
    free = n.allocatable.get(resource, 0) - n.used.get(resource, 0)
    reserved = view.reserved.get(n.name)
    if reserved:
        for other, count in reserved.items():
            g = view.gprs.get(other)
            if other != key and g is not None and g.resource == resource:
                free -= max(0, count - n.used_by.get((other, resource), 0))
        if key and key in reserved:
            free = min(free, reserved[key] - n.used_by.get((key, resource), 0))
    return max(0, free)


def node_obj(rng: random.Random, name: str, keys: list[str], version: int) -> dict[str, Any]:
    obj = node(name, gpus=8)
    obj["status"]["allocatable"][NR1] = str(rng.choice([0, 4]))
    entries = {}
    for i in range(rng.randint(0, 4)):
        uid = f"{name}-p{i}"
        entries[uid] = ledger.Entry(uid, f"default/{uid}", {rng.choice([GPU, NR1]): rng.randint(1, 3)},
                                    rng.choice(["", *keys]), 1.0)
    obj["metadata"]["annotations"] = {ledger.LEDGER_ANNOTATION: ledger.render(entries)}
    obj["metadata"]["resourceVersion"] = str(version)
    return obj


def gpr_obj(rng: random.Random, name: str, nodes: list[str]) -> dict[str, Any]:
    phase = rng.choice(["Queued", "Admitted", "Running", "Evicting", "Complete"])
    reservation = {n: rng.randint(1, 4) for n in rng.sample(nodes, rng.randint(1, 3))}
    obj = gpr(name, phase=phase, reservation=reservation if phase in ALLOCATED else None,
              resource=rng.choice([GPU, NR1]))
    obj["metadata"]["uid"] = f"uid-{name}"
    return obj


def test_free_devices_match_a_fresh_sum_through_any_sequence_of_changes() -> None:
    rng = random.Random(3)
    names = [f"n{i}" for i in range(6)]
    gprs = [f"g{i}" for i in range(8)]
    keys = [f"default/{g}" for g in gprs]
    view = ClusterView()
    version = 1
    for name in names:
        view.on_node("ADDED", node_obj(rng, name, keys, version))
    for step in range(3000):
        what = rng.random()
        if what < 0.45:
            view.on_gpr("MODIFIED", gpr_obj(rng, rng.choice(gprs), names))
        elif what < 0.55:
            obj = gpr(rng.choice(gprs))
            view.on_gpr("DELETED", obj)
        elif what < 0.9:
            version += 1
            view.on_node("MODIFIED", node_obj(rng, rng.choice(names), keys, version))
        elif what < 0.95:
            view.on_node("DELETED", {"metadata": {"name": rng.choice(names)}})
        else:
            version += 1
            view.on_node("ADDED", node_obj(rng, rng.choice(names), keys, version))
        # which node's ledger records each pod (filter lets a pod onto the node holding its devices)
        assert view.recorded == {uid: n.name for n in view.nodes.values() for uid in n.ledger}, step
        for n in view.nodes.values():
            for resource in (GPU, NR1):
                for key in ("", *keys, "default/unknown"):
                    assert view.free_for(n, resource, key) == afresh(view, n, resource, key), (step, n.name, key)
        for resource in (GPU, NR1):
            for count in (1, 3, 9):
                ask = PodAsk({resource: count})
                asked = [*names, "unknown"]
                out = filter_nodes(view, ask, asked)  # the kept verdicts
                for name in asked:
                    reason, resolvable = node_verdict(view, ask, name)  # judged afresh
                    where = out.failed if resolvable else out.unresolvable
                    assert (name in out.passed) if not reason else where.get(name) == reason, (step, name, count)
                assert len(out.passed) + len(out.failed) + len(out.unresolvable) == len(asked)
                scores = dict(prioritize(view, ask, asked))  # kept scores against scores afresh
                assert scores == {name: _packing_score(view, ask, view.nodes[name]) if name in view.nodes else 0
                                  for name in asked}, (step, count)


def test_verdicts_for_counts_no_node_can_hold_are_not_kept() -> None:
    """A pod asking for more devices than a node has is judged afresh: pods with ever new huge counts cannot
    grow the memo of every node."""
    view = ClusterView()
    view.on_node("ADDED", node("a", gpus=8))
    a = view.nodes["a"]
    for count in (1, 8, 9, 10**6):
        ask = PodAsk({GPU: count})
        out = filter_nodes(view, ask, ["a"])
        assert (out.passed == ["a"]) == (count <= 8)
        prioritize(view, ask, ["a"])
    kept = {key for key in view.node_facts(a) if isinstance(key, tuple)}
    assert kept == {("verdict", GPU, 1), ("verdict", GPU, 8), ("score", GPU, 1), ("score", GPU, 8)}


def test_unfinished_gprs_per_namespace_match_a_scan_through_any_sequence_of_changes() -> None:
    """The webhook's count of unfinished GPRs (a namespace's or workspace's ``max-gprs``) is kept per namespace:
    through adds, phase changes (to and from Complete/Cancelled), deletes and relists it equals a scan of the view."""
    rng = random.Random(5)
    spaces = ["team-a", "team-ab", "b"]
    view = ClusterView()
    for step in range(4000):
        what = rng.random()
        ns, name = rng.choice(spaces), rng.choice(["g0", "g1", "g2", "g3"])
        if what < 0.7:
            view.on_gpr(rng.choice(["ADDED", "MODIFIED"]), gpr(name, namespace=ns, phase=rng.choice(
                [None, "Queued", "Admitted", "Running", "Failed", "Evicting", "Complete", "Cancelled"])))
        elif what < 0.97:
            view.on_gpr("DELETED", gpr(name, namespace=ns))
        else:
            view.sync_gprs([gpr(f"s{i}", namespace=rng.choice(spaces), phase=rng.choice(["Queued", "Complete"]))
                            for i in range(rng.randint(0, 5))])
        for chosen in ([], ["team-a"], ["team-a", "b"], spaces):
            for exclude in ("", f"{ns}/{name}", "team-a/g0", "nowhere/x"):
                scan = sum(1 for key, g in view.gprs.items() if key.split("/", 1)[0] in chosen and key != exclude
                           and g.phase not in ("Complete", "Cancelled"))
                assert view.unfinished_in(chosen, exclude) == scan, (step, chosen, exclude)


async def test_a_relist_taken_in_slices_builds_the_same_view_and_gives_the_loop_back() -> None:
    """``resync_*`` (the extender's informers) build what ``sync_*`` builds, aside, in slices: at 5,000 nodes,
    10,000 GPRs and 20,000 pods the longest stretch without a yield is a small share of the relist (the whole
    relist held the loop before: 0.3 s of nodes, 0.4 s of pods). Until the swap the view answers from before."""
    from tests.extender.harness import hold_share, pod

    rng = random.Random(7)
    names = [f"n{i:04}" for i in range(5000)]
    keys = [f"default/g{i}" for i in range(40)]
    nodes = [node_obj(rng, name, keys, i + 1) for i, name in enumerate(names)]
    gprs = [gpr_obj(rng, f"g{i}", names) for i in range(10_000)]
    for i, g in enumerate(gprs):
        g["metadata"]["namespace"] = f"team-{i % 7}"
    pods = []
    for i in range(20_000):
        p = pod(f"p{i}", gpus=rng.randint(1, 2), gpr=rng.choice(["", "g1"]), uid=f"pu{i}")
        p["spec"]["nodeName"] = rng.choice(["", *names[:50]])
        pods.append(p)

    def state(view: ClusterView) -> tuple[Any, ...]:
        return (view.nodes, view.recorded, view.gprs, view.reserved, view.pods,
                {ns: view.unfinished_in([ns]) for ns in ("default", *(f"team-{i}" for i in range(7)))})

    whole = ClusterView()
    whole.sync_nodes(nodes)
    whole.sync_gprs(gprs)
    whole.sync_pods(pods)

    sliced = ClusterView()
    sliced.on_node("ADDED", node_obj(rng, "old", keys, 1))  # what a relist replaces
    sliced.on_gpr("ADDED", gpr_obj(rng, "old", names[:3]))
    relists: list[tuple[Callable[[list[dict[str, Any]]], Awaitable[None]], list[dict[str, Any]]]] = [
        (sliced.resync_nodes, nodes), (sliced.resync_gprs, gprs), (sliced.resync_pods, pods)]
    for resync, items in relists:
        shares = []
        for _ in range(2):
            before = sliced.version
            task = asyncio.ensure_future(resync(items))
            await asyncio.sleep(0)
            assert sliced.version == before or task.done()  # nothing swapped in until the whole list is taken
            await task
            share, _ = await hold_share(functools.partial(resync, items))
            shares.append(share)
        assert min(shares) < 0.2, (resync, shares)
    assert state(sliced) == state(whole)
    assert "old" not in sliced.nodes and "default/old" not in sliced.gprs
