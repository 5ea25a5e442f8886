"""Queue order, eviction planning and wait-time estimation, each on small exact cases."""

from __future__ import annotations

import math

from scheduler_extender.core.eviction import Candidate, plan_eviction
from scheduler_extender.core.gpr import GPR
from scheduler_extender.core.inventory import Inventory, NodeAssignment, NodeSpec, Placement
from scheduler_extender.core.placement import BestFit, Request
from scheduler_extender.core.queue import GPRQueue
from scheduler_extender.core.waittime import Holder, Waiting, earliest_fit, estimate_starts


def test_queue_orders_by_priority_then_submission_and_drops_workspaces() -> None:
    q = GPRQueue()
    gs = [
        GPR("a", priority=10, submitted_at=0, workspace="w1"),
        GPR("b", priority=250, submitted_at=5, workspace="w2"),
        GPR("c", priority=250, submitted_at=1, workspace="w1"),
        GPR("d", priority=150, submitted_at=0, workspace="w2"),
    ]
    for i, g in enumerate(gs):
        g.seq = i
        q.push(g)
    assert [g.name for g in q.ordered()] == ["c", "b", "d", "a"]
    walk = q.walk()
    first = next(walk)
    walk.drop(first.workspace)
    assert [g.name for g in walk] == ["b", "d"]
    q.remove("b")
    assert [g.name for g in q.ordered()] == ["c", "d", "a"]
    fifo = GPRQueue(use_priority=False)
    for g in gs:
        fifo.push(g)
    assert [g.name for g in fifo.ordered()] == ["a", "d", "c", "b"]


def _one(node: int, devs: tuple[int, ...]) -> Placement:
    return Placement((NodeAssignment(node, devs, 1000),))


def _cluster() -> Inventory:
    inv = Inventory([NodeSpec("n0", 2), NodeSpec("n1", 2)])
    inv.allocate("lo1", _one(0, (0,)))
    inv.allocate("lo2", _one(0, (1,)))
    inv.allocate("mid", _one(1, (0, 1)))
    return inv


def test_eviction_takes_lowest_priority_then_least_work() -> None:
    inv = _cluster()
    cands = [Candidate("lo1", 10, True, 500), Candidate("lo2", 10, True, 100), Candidate("mid", 150, True, 1)]
    assert plan_eviction(inv, Request(count=1), 200, cands) == ["lo2"]
    assert sorted(plan_eviction(inv, Request(count=2), 200, cands) or []) == ["lo1", "lo2"]


def test_eviction_spares_non_preemptible_and_equal_priority_and_never_evicts_in_vain() -> None:
    inv = _cluster()
    cands = [Candidate("lo1", 10, False, 0), Candidate("lo2", 200, True, 0), Candidate("mid", 150, True, 0)]
    assert plan_eviction(inv, Request(count=2), 200, cands) == ["mid"]
    assert plan_eviction(inv, Request(count=2, node_count=2), 200, cands) is None
    assert plan_eviction(inv, Request(count=1, resource="neureality.com/nr1"), 300, cands) is None


def test_eviction_result_is_minimal() -> None:
    # cheapest-first greedy would take lo1 (useless for a 2-device node) before mid; pruning drops it
    inv = Inventory([NodeSpec("n0", 1), NodeSpec("n1", 2)])
    inv.allocate("lo1", _one(0, (0,)))
    inv.allocate("mid", _one(1, (0, 1)))
    cands = [Candidate("lo1", 5, True, 0), Candidate("mid", 6, True, 0)]
    assert plan_eviction(inv, Request(count=2), 100, cands) == ["mid"]


def test_a_victim_on_a_closed_node_is_put_back_as_it_was() -> None:
    """A cordoned node takes no new placement (its devices are marked unusable) but what holds it stays. Planning
    an eviction releases candidates on a scratch copy and puts back those not needed: one on the cordoned node
    must go back as it was, not crash the plan (every pass of the controller failed so)."""
    inv = Inventory([NodeSpec("n0", 2), NodeSpec("n1", 2)])
    inv.allocate("cordoned", _one(0, (0, 1)))
    inv.allocate("lo", _one(1, (0, 1)))
    inv.set_health("n0", None, False)  # closed: Scheduler.close
    cands = [Candidate("cordoned", 5, True, 0), Candidate("lo", 6, True, 0)]
    assert plan_eviction(inv, Request(count=2), 100, cands) == ["lo"]
    inv.check()


def test_earliest_fit_and_estimates() -> None:
    inv = _cluster()
    holders = [Holder("lo1", 100), Holder("lo2", 50), Holder("mid", math.inf)]
    t, _ = earliest_fit(inv, Request(count=2), holders, now=0)
    assert t == 100
    t, _ = earliest_fit(inv, Request(count=2, node_count=2), holders, now=0)
    assert t == math.inf
    est = estimate_starts(
        inv,
        holders,
        [Waiting("a", Request(count=1), 30), Waiting("b", Request(count=2), 10), Waiting("c", Request(count=4), 1)],
        now=0,
        policy=BestFit(),
    )
    assert est == {"a": 50, "b": 100, "c": math.inf}
