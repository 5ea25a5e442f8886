"""The engine: one exact scenario per transition, and hypothesis properties over random event streams."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler_extender.core.gpr import GPR, Phase, backoff_delay
from scheduler_extender.core.inventory import Inventory, NodeSpec
from scheduler_extender.core.placement import BestFit, make_policy
from scheduler_extender.core.scheduler import LEVEL, QueuedBlock, Scheduler, SchedulerConfig


def _sched(*devs: int, **cfg: object) -> Scheduler:
    inv = Inventory([NodeSpec(f"n{i}", d) for i, d in enumerate(devs)])
    return Scheduler(inv, BestFit(), SchedulerConfig(audit=True, **cfg))  # type: ignore[arg-type]


WAIT_KINDS = ("insufficientcapacity", "behindhigherpriority", "behindblockedgprs", "backoff")  # why a GPR waits: tested on their own below


def kinds(events: list, waits: bool = False) -> list[tuple[str, str]]:
    return [(e.kind, e.gpr) for e in events if waits or e.kind not in WAIT_KINDS]


def test_admit_run_complete() -> None:
    s = _sched(2)
    s.submit(GPR("a", exit_duration_s=100), 0)
    assert kinds(s.tick(0)) == [("admitted", "a")]
    assert s.gprs["a"].placement is not None
    s.start("a", 1)
    assert s.gprs["a"].phase is Phase.RUNNING
    assert kinds(s.finish("a", 5)) == [("completed", "a")]
    assert s.inv.used_milli() == 0


def test_exit_duration_expiry_frees_devices() -> None:
    s = _sched(1)
    s.submit(GPR("a", exit_duration_s=10), 0)
    s.submit(GPR("b", exit_duration_s=10), 0)
    s.tick(0)
    assert s.next_wakeup() == 10
    ev = s.tick(10)
    assert ("expired", "a") in kinds(ev) and ("admitted", "b") in kinds(ev)
    assert s.gprs["a"].reason == "ExitDurationReached"


def test_idle_timeout_enforced_or_only_reported() -> None:
    s = _sched(2)
    s.submit(GPR("strict", idle_timeout_s=30, enforce_idle_timeout=True), 0)
    s.submit(GPR("lax", idle_timeout_s=30), 0)
    s.tick(0)
    s.start("strict", 0)
    s.start("lax", 0)
    s.activity("strict", 20)  # pushes its deadline to 50
    ev = s.tick(30)
    assert kinds(ev) == [("idle", "lax")] and s.gprs["lax"].holding
    ev = s.tick(50)
    assert ("completed", "strict") in kinds(ev) and s.gprs["strict"].reason == "IdleTimeout"
    assert not s.gprs["strict"].holding


def test_failure_requeues_with_backoff_until_the_limit() -> None:
    s = _sched(1)
    s.submit(GPR("a", requeue_on_failure=True, retry_limit=2), 0)
    t = 0.0
    for n in (1, 2):
        s.tick(t)
        assert s.gprs["a"].phase is Phase.ADMITTED
        ev = s.finish("a", t, ok=False, reason="OOM")
        assert kinds(ev) == [("failed", "a"), ("requeued", "a")]
        assert s.gprs["a"].not_before == t + backoff_delay(n)
        s.tick(t + backoff_delay(n) - 1)
        assert s.gprs["a"].phase is Phase.QUEUED  # still backing off
        t += backoff_delay(n)
    s.tick(t)
    ev = s.finish("a", t, ok=False)
    assert kinds(ev) == [("failed", "a")] and s.gprs["a"].reason == "RetryLimitExceeded"


def test_cancel_from_queue_and_from_holding() -> None:
    s = _sched(1)
    s.submit(GPR("a"), 0)
    s.submit(GPR("b"), 0)
    s.tick(0)
    s.cancel("b", 1)
    s.cancel("a", 1)
    assert s.gprs["a"].phase is s.gprs["b"].phase is Phase.CANCELLED
    assert s.inv.used_milli() == 0 and len(s.queue) == 0


def test_eviction_of_lower_priority_preemptible_work() -> None:
    s = _sched(2)
    s.submit(GPR("keep", priority=50, preemptible=False), 0)
    s.submit(GPR("victim", priority=50), 0)
    s.tick(0)
    s.submit(GPR("vip", priority=280, enable_eviction=True), 5)
    ev = s.tick(5)
    assert ("evicted", "victim") in kinds(ev) and ("admitted", "vip") in kinds(ev)
    assert s.gprs["victim"].phase is Phase.QUEUED and s.gprs["victim"].evictions == 1
    assert s.gprs["keep"].holding


def test_unhealthy_device_fails_its_holder_and_takes_no_new_work() -> None:
    s = _sched(1, 1)
    s.submit(GPR("a", requeue_on_failure=True), 0)
    s.tick(0)
    node = s.inv.names[s.gprs["a"].placement.assignments[0].node]  # type: ignore[union-attr]
    ev = s.set_health(node, 0, False, 1)
    assert ("failed", "a") in kinds(ev)
    s.tick(1 + backoff_delay(1))
    assert s.inv.names[s.gprs["a"].placement.assignments[0].node] != node  # type: ignore[union-attr]


def test_backfill_only_when_it_cannot_delay_the_blocked_head() -> None:
    s = _sched(4)
    s.submit(GPR("run", devices_per_node=2, exit_duration_s=100), 0)
    s.tick(0)
    s.submit(GPR("head", devices_per_node=4, priority=200, exit_duration_s=50), 1)
    s.submit(GPR("short", devices_per_node=1, priority=10, exit_duration_s=50), 1)
    s.submit(GPR("long", devices_per_node=1, priority=10, exit_duration_s=500), 1)
    ev = s.tick(1)
    assert kinds(ev) == [("backfilled", "short")]  # ends by 51 <= head's start at 100; long would delay it
    assert s.reservations[0].gpr == "head" and s.reservations[0].start == 100
    ev = s.tick(100)
    assert ("admitted", "head") in kinds(ev) and s.inversions == 0


def test_strict_priority_and_fifo_baselines_do_not_backfill() -> None:
    for cfg in ({"backfill": False}, {"backfill": False, "use_priority": False, "eviction": False}):
        s = _sched(4, **cfg)
        s.submit(GPR("run", devices_per_node=2, exit_duration_s=100), 0)
        s.tick(0)
        s.submit(GPR("head", devices_per_node=4, priority=200, exit_duration_s=50), 1)
        s.submit(GPR("short", devices_per_node=1, priority=10, exit_duration_s=50), 1)
        assert kinds(s.tick(1)) == []


def test_quota_keeps_a_workspace_to_its_share() -> None:
    s = _sched(4, quotas={"team": 2000})
    for i in range(3):
        s.submit(GPR(f"g{i}", workspace="team"), 0)
    s.submit(GPR("other", workspace="else"), 0)
    ev = s.tick(0)
    assert sorted(g for k, g in kinds(ev) if k == "admitted") == ["g0", "g1", "other"]
    # issue 35.4: the one held back says which quota, what the workspace uses and what it needs; said once
    said = [e for e in ev if e.kind == "workspacequota"]
    assert [(e.gpr, e.detail) for e in said] == [("g2", "workspace team quota: 2 of 2 devices in use; it needs 1")]
    assert s.gprs["g2"].reason == "WorkspaceQuota" and s.tick(1) == []
    s.finish("g0", 2)
    assert ("admitted", "g2") in kinds(s.tick(2)) and s.gprs["g2"].reason == "Admitted"
    s.check()


def test_unschedulable_is_cleared_as_soon_as_the_gpr_fits_again() -> None:
    """Issue 35.4: a GPR too big for the healthy cluster says Unschedulable; once it would fit (here: a node
    comes back) the reason goes at the next pass, though something else still holds the devices."""
    s = _sched(4, 4)
    s.submit(GPR("busy", devices_per_node=4, exit_duration_s=100), 0)
    s.tick(0)
    s.set_health("n1", None, False, 1)
    s.submit(GPR("big", devices_per_node=4, node_count=2), 1)
    assert ("unschedulable", "big") in kinds(s.tick(1)) and s.gprs["big"].reason == "Unschedulable"
    s.set_health("n1", None, True, 2)
    s.tick(2)
    assert s.gprs["big"].phase is Phase.QUEUED and s.gprs["big"].reason == "InsufficientCapacity"


def test_a_model_cap_holds_a_workspace_to_its_devices_of_that_model() -> None:
    # two 8-GPU H100 nodes and a 16-GPU A100 node (BestFit would rather fill an H100 node); team may hold 8 H100s
    inv = Inventory([NodeSpec("h0", 8, "H100"), NodeSpec("h1", 8, "H100"), NodeSpec("a0", 16, "A100")])
    s = Scheduler(inv, BestFit(), SchedulerConfig(audit=True, order="priority", model_caps={"team": {"H100": 8000}}))
    s.submit(GPR("first", workspace="team", devices_per_node=8, models=("H100",)), 0)
    assert kinds(s.tick(0)) == [("admitted", "first")]
    assert s.model_usage["team", "H100"] == 8000
    s.submit(GPR("second", workspace="team", devices_per_node=8, models=("H100",)), 1)
    s.submit(GPR("anywhere", workspace="team", devices_per_node=8), 1)
    s.submit(GPR("other", workspace="else", devices_per_node=8, models=("H100",)), 1)
    ev = s.tick(1)
    # the second H100 request waits for the team's H100s, naming the cap; the any-model one goes to the A100s;
    # the other workspace takes the free H100 node
    assert kinds(ev) == [("modelquota", "second"), ("admitted", "anywhere"), ("admitted", "other")]
    assert "H100: 8 of 8 devices held" in ev[0].detail
    assert s.gprs["second"].phase is Phase.QUEUED and s.gprs["second"].reason == "ModelQuota"
    assert s.inv.names[s.gprs["anywhere"].placement.assignments[0].node] == "a0"  # type: ignore[union-attr]
    assert s.model_usage["team", "A100"] == 8000
    other = s.gprs["other"].placement
    assert other is not None and s.inv.models[int(s.inv.model[other.assignments[0].node])] == "H100"
    assert ("else", "H100") not in s.model_usage  # a workspace without caps is not counted per model
    s.check()
    assert s.tick(2) == []  # said once; still waiting
    s.finish("first", 3)
    assert kinds(s.tick(3)) == [("admitted", "second")]
    assert s.inv.names[s.gprs["second"].placement.assignments[0].node] == "h0"  # type: ignore[union-attr]
    s.check()
    s.cancel("second", 4)
    assert s.model_usage["team", "H100"] == 0


def test_a_model_cap_counts_the_whole_request_and_leaves_uncapped_models_open() -> None:
    inv = Inventory([NodeSpec("h0", 8, "H100"), NodeSpec("a0", 8, "A100")])
    s = Scheduler(inv, BestFit(), SchedulerConfig(audit=True, order="priority", model_caps={"team": {"H100": 6000}}))
    s.submit(GPR("four", workspace="team", devices_per_node=4, models=("H100",)), 0)
    s.submit(GPR("two", workspace="team", devices_per_node=2, models=("H100",)), 0)
    s.submit(GPR("three", workspace="team", devices_per_node=3, models=("H100",)), 0)  # 4 + 2 + 3 > 6
    s.submit(GPR("spill", workspace="team", devices_per_node=3), 0)  # any model: 3 more H100s would pass 6
    assert kinds(s.tick(0)) == [("admitted", "four"), ("admitted", "two"), ("modelquota", "three"),
                                ("admitted", "spill")]
    assert s.inv.names[s.gprs["spill"].placement.assignments[0].node] == "a0"  # type: ignore[union-attr]
    s.check()
    # an invariant breach is caught: the cap lowered under what is held
    s.cfg.model_caps = {"team": {"H100": 4000}}
    with pytest.raises(AssertionError, match="over its H100 cap"):
        s.check()


def test_eviction_for_a_capped_request_makes_room_only_on_models_it_may_take() -> None:
    inv = Inventory([NodeSpec("h0", 4, "H100"), NodeSpec("a0", 4, "A100")])
    s = Scheduler(inv, BestFit(), SchedulerConfig(audit=True, order="priority", model_caps={"team": {"H100": 4000}}))
    s.submit(GPR("mine", workspace="team", devices_per_node=4, models=("H100",), priority=10), 0)
    s.submit(GPR("low", workspace="else", devices_per_node=4, models=("A100",), priority=50), 0)
    s.tick(0)
    s.submit(GPR("urgent", workspace="team", devices_per_node=4, priority=250, enable_eviction=True), 1)
    ev = s.tick(1)
    # it may not take H100s (the team holds its 4), so the A100 holder makes room, not the lowest-priority "mine"
    assert ("evicted", "low") in kinds(ev) and ("admitted", "urgent") in kinds(ev)
    assert s.gprs["mine"].holding
    assert s.inv.names[s.gprs["urgent"].placement.assignments[0].node] == "a0"  # type: ignore[union-attr]
    s.check()


def test_estimates_follow_exit_durations() -> None:
    s = _sched(1)
    s.submit(GPR("a", exit_duration_s=100), 0)
    s.tick(0)
    s.submit(GPR("b", exit_duration_s=30), 10)
    s.submit(GPR("c", exit_duration_s=30), 10)
    assert s.estimates(10) == {"b": 100, "c": 130}


def test_estimates_of_a_gpr_kept_to_some_nodes_wait_for_those_nodes() -> None:
    """An H100 node busy until 100 and an idle A100 node: a GPR that may use the H100 node only (its pods' limit,
    or its models) is estimated to start when that node frees, not now; one that may use either, now."""
    inv = Inventory([NodeSpec("h0", 4, model="H100"), NodeSpec("a0", 4, model="A100")])
    s = Scheduler(inv, BestFit(), SchedulerConfig(backfill=True))
    s.submit(GPR("busy", devices_per_node=4, exit_duration_s=100), 0)
    s.limit("busy", frozenset({"h0"}))
    s.tick(0)
    assert _nodes_of(s, "busy") == {"h0"}
    s.submit(GPR("pinned", devices_per_node=2, exit_duration_s=50, priority=300), 1)
    s.limit("pinned", frozenset({"h0"}))
    s.submit(GPR("modelled", devices_per_node=2, exit_duration_s=50, models=("H100",), priority=300), 1)
    s.submit(GPR("any", devices_per_node=4, exit_duration_s=50), 1)
    assert s.estimates(1) == {"pinned": 100, "modelled": 100, "any": 1}
    s.limit("pinned", None)  # its pods can run anywhere now
    assert s.estimates(1)["pinned"] == 1


def test_estimates_when_every_queued_gpr_is_kept_to_node_sets_apart() -> None:
    """Every queued GPR kept to H100 or to A100 nodes (sets that do not overlap): each set is its GPRs' pool. A
    GPR behind a waiting H100 one in the queue does not wait for it when it may use the idle A100 node."""
    inv = Inventory([NodeSpec("h0", 4, model="H100"), NodeSpec("a0", 4, model="A100")])
    s = Scheduler(inv, BestFit(), SchedulerConfig(backfill=True))
    s.submit(GPR("busy", devices_per_node=4, exit_duration_s=100, models=("H100",)), 0)
    s.tick(0)
    s.submit(GPR("h", devices_per_node=4, exit_duration_s=50, models=("H100",), priority=300), 1)
    s.submit(GPR("h2", devices_per_node=4, exit_duration_s=50, priority=300), 1)
    s.limit("h2", frozenset({"h0"}))
    s.submit(GPR("a", devices_per_node=4, exit_duration_s=50, models=("A100",)), 1)
    s.submit(GPR("a2", devices_per_node=4, exit_duration_s=50, models=("A100",)), 1)
    assert s.estimates(1) == {"h": 100, "h2": 150, "a": 1, "a2": 51}


# ----------------------------------------------------------------------------------- properties
gpr_spec = st.fixed_dictionaries(
    {
        "devices": st.sampled_from([1, 1, 2, 4]),
        "milli": st.sampled_from([250, 500, 1000, 1000]),
        "nodes": st.sampled_from([1, 1, 1, 2]),
        "priority": st.integers(1, 300),
        "exit": st.sampled_from([None, 10, 30, 60, 120, 200]),
        "preemptible": st.booleans(),
        "evict": st.booleans(),
        "requeue": st.booleans(),
        "limit": st.integers(0, 3),
        "models": st.sampled_from([(), (), ("A",), ("B",)]),
    }
)
step = st.tuples(
    st.sampled_from(["submit"] * 6 + ["finish", "fail", "tick", "cancel"]), gpr_spec, st.integers(0, 60)
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, min_size=10, max_size=50), st.sampled_from(["bestfit", "fgd", "random"]), st.booleans(),
       st.sampled_from(["priority", "size"]))
def test_invariants_hold_under_random_event_streams(steps: list, policy_name: str, with_quota: bool,
                                                    order: str) -> None:
    from scheduler_extender.core.placement import Shape, TypicalShapes

    inv = Inventory([NodeSpec(f"n{i}", d, m) for i, (d, m) in enumerate([(1, "A"), (2, "A"), (4, "B"), (4, "B")])],
                    tie_seed=3)
    shapes = TypicalShapes.from_requests([Shape(0, 1, 500), Shape(0, 2, 1000)], inv.models)
    # with quotas: w0 may hold 4 devices in all, w1 4 of model B (and any number of A)
    cfg = SchedulerConfig(audit=True, quotas={"w0": 4000} if with_quota else None, order=order, ageing_s=30,
                          model_caps={"w1": {"B": 4000}} if with_quota else None)
    s = Scheduler(inv, make_policy(policy_name, shapes, 1), cfg)
    now = 0.0
    fail_times: dict[str, list[float]] = {}
    for i, (op, spec, dt) in enumerate(steps):
        now += dt
        holders = sorted(s.holders)
        if op == "submit":
            milli = spec["milli"] if spec["devices"] == 1 else 1000
            s.submit(
                GPR(
                    f"g{i}",
                    workspace=f"w{i % 2}",
                    devices_per_node=spec["devices"],
                    milli_per_device=milli,
                    node_count=spec["nodes"],
                    models=spec["models"],
                    priority=spec["priority"],
                    exit_duration_s=spec["exit"],
                    preemptible=spec["preemptible"],
                    enable_eviction=spec["evict"],
                    requeue_on_failure=spec["requeue"],
                    retry_limit=spec["limit"],
                    submitted_at=now,
                ),
                now,
            )
        elif op in ("finish", "fail") and holders:
            name = holders[dt % len(holders)]
            ev = s.finish(name, now, ok=op == "finish")
            if op == "fail":
                fail_times.setdefault(name, []).append(now)
                g = s.gprs[name]
                requeued = any(e.kind == "requeued" for e in ev)
                assert requeued == (g.requeue_on_failure and g.failures <= g.retry_limit)
                if requeued:
                    assert g.not_before == now + backoff_delay(g.failures)
        elif op == "cancel" and s.queue.ordered():
            s.cancel(s.queue.ordered()[0].name, now)
        events = s.tick(now)
        # eviction only of lower-priority preemptible work, on behalf of an admitted GPR
        for e in events:
            if e.kind == "evicted":
                victim = s.gprs[e.gpr]
                assert victim.preemptible and victim.priority < s.gprs[e.detail].priority
                assert s.gprs[e.detail].holding
        s.check()  # nothing over-allocated; holders == allocations; quotas and model caps respected
        assert s.inversions == 0  # no backfill moved a higher-priority reservation later
        # the head of the queue is never left waiting while it fits now (unless its workspace is at quota or
        # every model it may take is at its workspace's cap), on the models its caps leave it
        queued = s.queue.ordered()
        if queued:
            head = queued[0]
            q = (cfg.quotas or {}).get(head.workspace)
            caps = (cfg.model_caps or {}).get(head.workspace)
            req = s._capped(head, head.request(), caps) if caps else head.request()
            if req is not None and (q is None or s.usage.get(head.workspace, 0) + head.milli_total() <= q):
                assert s.policy.place(s.inv, req) is None
        # no GPR ever holds past its exit bound
        assert all(g.end_bound() > now or math.isinf(g.end_bound()) for g in s.holders.values())
        # priority levels stay strict in the queue, whatever the order within a level
        levels = [LEVEL[g.priority_class] for g in s.queue.ordered()]
        assert order == "priority" or levels == sorted(levels, reverse=True)
        # every estimate has its range around it, none before now
        for iv in s.estimate_ranges(now).values():
            assert now <= iv.low <= iv.start <= iv.high or math.isinf(iv.start)


def test_node_set_changes_keep_surviving_allocations() -> None:
    s = _sched(2, 2)
    s.submit(GPR("a", devices_per_node=2, requeue_on_failure=True), 0)
    s.submit(GPR("b", devices_per_node=2), 0)
    s.tick(0)
    node_a = s.inv.names[s.gprs["a"].placement.assignments[0].node]  # type: ignore[union-attr]
    node_b = s.inv.names[s.gprs["b"].placement.assignments[0].node]  # type: ignore[union-attr]
    s.inv.set_health(node_b, 1, False)
    ev = s.set_nodes([NodeSpec(node_b, 2), NodeSpec("n9", 4)], 5)
    assert kinds(ev) == [("failed", "a"), ("requeued", "a")]
    assert s.gprs["b"].holding and not s.inv.healthy[s.inv.index[node_b], 1]
    assert node_a not in s.inv.index
    s.check()
    s.tick(5 + backoff_delay(1))
    assert s.inv.names[s.gprs["a"].placement.assignments[0].node] == "n9"  # type: ignore[union-attr]


def test_estimates_respect_workspace_quotas() -> None:
    s = _sched(4, quotas={"team": 1000})
    s.submit(GPR("run", workspace="team", exit_duration_s=100), 0)
    s.tick(0)
    s.submit(GPR("next", workspace="team", exit_duration_s=50), 1)
    s.submit(GPR("after", workspace="team", exit_duration_s=50), 1)
    s.submit(GPR("free", workspace="other", exit_duration_s=50, devices_per_node=4), 1)
    s.tick(1)
    assert s.gprs["free"].phase is Phase.QUEUED  # needs all 4 devices; "run" holds one until 100
    # "next" and "after" go first in queue order (the quota frees at 100, then at 150); "free" needs all four
    # devices, so it waits until "after" (predicted to use its whole exitDuration: no history yet) ends at 200
    assert s.estimates(1) == {"next": 100, "after": 150, "free": 200}


def test_adopt_restores_a_holder_after_restart() -> None:
    from scheduler_extender.core.inventory import NodeAssignment, Placement

    s = _sched(2)
    g = GPR("a", exit_duration_s=50, phase=Phase.RUNNING, admitted_at=10.0)
    assert s.adopt(g, Placement((NodeAssignment(0, (1,), 1000),)), now=20)
    assert s.holders["a"] is g and s.inv.free[0, 1] == 0 and s.next_wakeup() == 60
    clash = GPR("b", phase=Phase.ADMITTED)
    assert not s.adopt(clash, Placement((NodeAssignment(0, (1,), 1000),)), now=20)
    assert "b" not in s.gprs
    ev = s.tick(60)
    assert ("expired", "a") in kinds(ev)
    s.check()


# ----------------------------------------------------------------------------------- size order and ageing
def _one_device_stream(ageing_s: float) -> float:
    """One device; a long GPR arrives at 0 behind a running one, then a short one every 5 s for 3,000 s (twice
    what the device can serve). Returns when the long GPR started (inf: never within the stream)."""
    s = _sched(1, order="size", ageing_s=ageing_s)
    for _ in range(20):  # history: short GPRs take 10 s, long ones 1,000 s
        s.predictor.observe(s.job_key(GPR("x", workspace="w")), 10.0, 10.0)
        s.predictor.observe(s.job_key(GPR("y", workspace="w", devices_per_node=1, template="long")), 1000.0, 1000.0)
    s.submit(GPR("first", workspace="w", exit_duration_s=10), 0)
    s.tick(0)
    s.submit(GPR("long", workspace="w", template="long", exit_duration_s=1000, submitted_at=0), 0)
    t, i, started = 0.0, 0, math.inf
    running: dict[str, float] = {"first": 10.0}
    while t < 3000:
        t += 5
        for name, end in list(running.items()):
            if end <= t:
                s.finish(name, end)
                del running[name]
        s.submit(GPR(f"short{i}", workspace="w", exit_duration_s=10, submitted_at=t), t)
        i += 1
        for e in s.tick(t):
            if e.kind in ("admitted", "backfilled"):
                running[e.gpr] = t + (1000 if e.gpr == "long" else 10)
                if e.gpr == "long":
                    started = min(started, t)
        s.check()
        assert s.inversions == 0
    return started


def test_ageing_bounds_the_wait_of_a_long_gpr_under_a_stream_of_short_ones() -> None:
    # the long GPR queues as if submitted ageing * log2(1 + 1000/60) = 4.1 * ageing later; short ones as
    # 0.22 * ageing later: those arriving after 3.9 * ageing = 390 s queue behind it, and the ~80 ahead of it
    # take 10 s each
    start = _one_device_stream(ageing_s=100)
    assert start <= 390 + 81 * 10 + 10
    # without ageing to speak of (pure shortest-first) the same stream starves it for the whole stream
    assert _one_device_stream(ageing_s=1e6) == math.inf


def test_size_order_keeps_levels_strict_and_puts_short_work_first() -> None:
    s = _sched(1, order="size", ageing_s=3600)
    for _ in range(10):
        s.predictor.observe(s.job_key(GPR("x", workspace="w", template="short")), 60.0)
        s.predictor.observe(s.job_key(GPR("x", workspace="w", template="long")), 36_000.0)
    s.submit(GPR("run", workspace="w", exit_duration_s=100), 0)
    s.tick(0)
    s.submit(GPR("long-low", workspace="w", template="long", priority=50, submitted_at=1), 1)
    s.submit(GPR("short-low", workspace="w", template="short", priority=10, submitted_at=2), 2)
    s.submit(GPR("long-high", workspace="w", template="long", priority=250, submitted_at=3), 3)
    assert [g.name for g in s.queued()] == ["long-high", "short-low", "long-low"]
    fifo = _sched(1, order="priority")
    for name, prio, t in (("long-low", 50, 1), ("short-low", 10, 2), ("long-high", 250, 3)):
        fifo.submit(GPR(name, workspace="w", priority=prio, submitted_at=t), t)
    assert [g.name for g in fifo.queued()] == ["long-high", "long-low", "short-low"]


def test_estimates_use_predicted_ends_and_learn_their_error() -> None:
    s = _sched(1)
    for _ in range(10):  # GPRs of this workspace use a tenth of their exitDuration
        s.predictor.observe(s.job_key(GPR("x", workspace="w")), 100.0, 1000.0)
    s.submit(GPR("a", workspace="w", exit_duration_s=1000), 0)
    s.tick(0)
    s.submit(GPR("b", workspace="w", exit_duration_s=1000), 10)
    iv = s.estimate_ranges(10)["b"]
    assert iv.start == pytest.approx(100, rel=0.15)  # a is predicted to end near 100, not at its bound 1000
    assert iv.low <= iv.start <= iv.high
    # starts that come twice as late as projected, again and again: the calibrated estimate follows
    cal = s.calibrator
    assert cal.estimate("low", 0.0, 1000.0).start == 1000.0  # nothing learned yet: the projection as it is
    for _ in range(100):
        cal.observe("low", 1000.0, 2060.0)
    later = cal.estimate("low", 0.0, 1000.0)
    assert later.start == pytest.approx(2060, rel=0.1) and later.low <= later.start <= later.high


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["low", "medium", "high"]), st.floats(0, 2e6), st.floats(0, 4e6)),
                max_size=60),
       st.lists(st.tuples(st.sampled_from(["low", "medium", "high"]),
                          st.one_of(st.just(math.inf), st.floats(-100, 3e6))), max_size=40))
def test_calibrated_estimates_scale_every_wait_by_what_all_first_projections_got_wrong(observed: list,
                                                                                      asked: list) -> None:
    """estimate_all (a refresh calibrates every queued GPR at once) answers, for each projected start, the wait
    scaled by the median and range ratios that every start has shown (ratios(): pooled over classes and waits,
    docs/estimates.md round 3), with the slack; the projection as it is, with a range of half to twice the wait,
    where nothing is known; no estimate for a start that cannot be projected."""
    from scheduler_extender.core.waittime import CAL_SLACK_S, Calibrator, Interval

    cal = Calibrator(min_samples=3)
    for cls, projected, actual in observed:
        cal.observe(cls, projected, actual)
    now = 1_000.0

    def expected(cls: str, start: float) -> Interval:
        if not math.isfinite(start):
            return Interval(math.inf, math.inf, math.inf)
        wait = max(0.0, start - now)
        q = cal.ratios(cls, wait)
        if q is None:
            return Interval(now + wait, now + wait / 2, now + 2 * wait)

        def at(lr: float) -> float:
            return now + max(0.0, (wait + CAL_SLACK_S) * math.exp(lr) - CAL_SLACK_S)

        return Interval(at(q[1]), at(q[0]), at(q[2]))

    assert cal.estimate_all(now, asked) == [expected(cls, start) for cls, start in asked]
    assert [cal.estimate(cls, now, start) for cls, start in asked] == [expected(cls, start) for cls, start in asked]
    # waits of hundreds of seconds ("low") came twice as late, more often than waits of days ("high") came twice
    # as early: every class and wait is scaled by the pooled median, twice as late
    cal = Calibrator(min_samples=3)
    for k in range(30):
        cal.observe("low", 300.0, 660.0)
        if k % 2:
            cal.observe("high", 300_000.0, 150_000.0)
    asked = [("low", now + 300.0), ("high", now + 300_000.0), ("medium", now + 3_000.0)]
    short, long, other = cal.estimate_all(now, asked)
    assert short.start - now == pytest.approx(660, rel=0.1)
    assert long.start - now == pytest.approx(600_060, rel=0.1) and other.start - now == pytest.approx(6_060, rel=0.1)
    assert [short, long, other] == [expected(cls, start) for cls, start in asked]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 300), st.integers(0, 5),
                          st.integers(-2, 3), st.sampled_from([None, 1800.0, 7200.0])), min_size=0, max_size=40),
       st.sampled_from(["size", "priority"]))
def test_restoring_a_queue_equals_submitting_it(items: list, order: str) -> None:
    """restore_queued (the controller rebuilds its queue from stored GPRs at every pass) leaves the scheduler
    as submit() does: the same queue order, keys, backoffs and GPR fields; the queue's ordered() is its walk."""
    now = 10_000.0

    def gprs() -> list[tuple[GPR, float | None]]:
        out = []
        for i, (ws, priority, age, wait, exit_s) in enumerate(items):
            g = GPR(f"{ws}/g{i}", workspace=ws, priority=priority, submitted_at=now - 60 * age,
                    exit_duration_s=exit_s, devices_per_node=1 + i % 2)
            out.append((g, now + 30 * wait if wait else None))
        return out

    a, b = _sched(4, 4, order=order), _sched(4, 4, order=order)
    for g, not_before in gprs():
        a.submit(g, now, not_before, validated=True)
    for g, not_before in gprs():
        b.restore_queued(g, now, not_before)
    assert [g.name for g in a.queued()] == [g.name for g in b.queued()]
    assert [a.queue.key(g.name) for g in a.queued()] == [b.queue.key(g.name) for g in b.queued()]
    assert sorted(a._backoff) == sorted(b._backoff)
    assert {n: vars(g) for n, g in a.gprs.items()} == {n: vars(g) for n, g in b.gprs.items()}
    assert [g.name for g in b.queue.ordered()] == [g.name for g in b.queue.walk()]
    assert kinds(a.tick(now + 100)) == kinds(b.tick(now + 100))
    with pytest.raises(ValueError, match="already exists"):
        b.restore_queued(GPR("x/dup"), now)
        b.restore_queued(GPR("x/dup"), now)


def test_the_size_orders_level_is_the_priority_class() -> None:
    s = _sched(1, order="size")
    for p in range(1, 301):
        g = GPR(f"default/p{p}", priority=p, exit_duration_s=60.0)
        assert s._order_key(g)[0] == -LEVEL[g.priority_class], p


def test_a_shared_queue_entry_is_copied_when_first_handed_out_and_never_changed() -> None:
    """restore_queued(shared=True): the driver's prototype stays as it was whatever the pass does; the copy the
    queue hands out is what restoring a copy would have queued (seq, not_before), and admitting it changes only
    the copy."""
    now = 1000.0
    protos = [GPR(f"default/q{i}", priority=100 + i, submitted_at=10.0 * i, exit_duration_s=600.0,
                  devices_per_node=2) for i in range(5)]
    before = [dict(vars(p)) for p in protos]
    a, b = _sched(4), _sched(4)
    for p in protos:
        a.restore_queued(p, now, None, news=False, shared=True)
        copy = dataclasses.replace(p)
        copy.history = []
        b.restore_queued(copy, now, None, news=False)
    assert a.queued_names() == b.queued_names() == [g.name for g in b.queued()]
    assert all(a.gprs[p.name] is p for p in protos)  # nothing handed out yet: the prototypes, read-only
    assert kinds(a.tick(now)) == kinds(b.tick(now))  # two of the five are admitted on the 4-GPU node
    assert [vars(p) for p in protos] == before  # the pass changed none of the prototypes
    admitted = [n for n, g in a.gprs.items() if g.phase is Phase.ADMITTED]
    assert len(admitted) == 2 and all(a.gprs[n] is not p for n in admitted for p in protos)
    assert {n: vars(g) for n, g in a.gprs.items() if g.phase is Phase.ADMITTED} == {
        n: vars(g) for n, g in b.gprs.items() if g.phase is Phase.ADMITTED}
    assert [vars(g) for g in a.queued()] == [vars(g) for g in b.queued()]  # handed out: as restored copies
    with pytest.raises(ValueError, match="only a GPR stored as Queued"):
        a.restore_queued(GPR("default/new"), now, None, news=True, shared=True)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 300), st.integers(1, 4)), min_size=0,
                max_size=30, unique_by=lambda t: t), st.sets(st.integers(0, 29)),
       st.lists(st.tuples(st.integers(0, 29), st.booleans(), st.booleans()), max_size=24), st.sampled_from([0, 3, 64]))
def test_a_queued_block_restores_what_restoring_each_prototype_queues(items: list, dropped: set[int],
                                                                      churn: list, few: int) -> None:
    """A block of prototypes (kept by the controller between passes, some discarded again as their objects
    change, changed ones discarded and added again, under the same rank or an edited one, with or without a
    read in between) restores the queue that restore_queued(shared=True) of each prototype in it builds: the
    same order, the same admissions, the prototypes unchanged; a GPR handed out is a copy with arrival number 0."""
    now = 10_000.0
    protos = [GPR(f"{ws}/g{i}", workspace=ws, priority=p, submitted_at=100.0 * i, exit_duration_s=600.0,
                  devices_per_node=d) for i, (ws, p, d) in enumerate(items)]
    before = [dict(vars(p)) for p in protos]
    a, b = _sched(4, 4), _sched(4, 4)
    block = QueuedBlock(few)  # keys taken out one by one (by bisection) or by filtering the whole list
    for p in protos:
        block.add(p, a.size_rank(p))
    current = {p.name: p for i, p in enumerate(protos) if i not in dropped}  # what the block holds
    for i in sorted(dropped):
        if i < len(protos):
            block.discard(protos[i].name)

    def change(steps: list) -> None:
        """As the pass does for each GPR whose object changed: out of the block, then in again (same rank, or
        its priority edited), or out for good."""
        for i, edit, gone in steps:
            if i >= len(protos):
                continue
            p = protos[i]
            block.discard(p.name)
            current.pop(p.name, None)
            if not gone:
                q = dataclasses.replace(p, priority=p.priority + 100) if edit else p
                block.add(q, a.size_rank(q))
                current[p.name] = q

    change(churn[:len(churn) // 2])
    kept = list(current.values())
    for p in kept:
        b.restore_queued(p, now, None, news=False, shared=True)
    a.restore_block(block, now)
    assert len(block) == len(kept)
    assert a.queued_names() == b.queued_names() == [g.name for g in a.queued()]
    assert kinds(a.tick(now)) == kinds(b.tick(now))
    assert [vars(p) for p in protos] == before  # neither pass changed a prototype
    assert all(a.gprs[p.name] is not p for p in kept if a.gprs[p.name].phase is Phase.ADMITTED)
    assert all(g.seq == 0 and g.not_before == now for g in a.queued())  # handed out by queued(): copies
    change(churn[len(churn) // 2:])  # changes after the block was read: it serves pass after pass
    a2, b2 = _sched(4, 4), _sched(4, 4)
    a2.restore_block(block, now + 1)
    for p in current.values():
        b2.restore_queued(p, now + 1, None, news=False, shared=True)
    assert a2.queued_names() == b2.queued_names() and len(a2.queue) == len(current) == len(block)
    assert kinds(a2.tick(now + 1)) == kinds(b2.tick(now + 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 300), st.sampled_from([1, 2]),
                          st.sampled_from([None, 600.0, 3600.0]), st.sampled_from([None, 90.0, 1800.0]),
                          st.booleans(), st.integers(0, 3000)), min_size=0, max_size=8),
       st.sampled_from([None, {"a": {"X": 2000}}]))
def test_restored_holders_equal_holders_adopted_one_by_one(items: list, caps: dict | None) -> None:
    """holder_state + restore_holders (the controller restores 4,800 holders each pass from the state one
    adoption left) leave what adopting each copy in turn leaves: the same indexes, and the same expiries, idle
    timeouts, admissions and evictions as time passes."""
    from scheduler_extender.core.gpr import clone
    from scheduler_extender.core.inventory import NodeAssignment, Placement

    now = 10_000.0
    nodes = [NodeSpec(f"n{i}", 2, "X" if i % 2 else "Y") for i in range(8)]

    def build() -> tuple[Scheduler, list[tuple[GPR, Placement]]]:
        s = Scheduler(Inventory(nodes), BestFit(), SchedulerConfig(audit=True, model_caps=caps))
        out = []
        for i, (ws, prio, devs, exit_s, idle_s, running, age) in enumerate(items):
            g = GPR(f"{ws}/h{i}", workspace=ws, priority=prio, devices_per_node=devs, exit_duration_s=exit_s,
                    idle_timeout_s=idle_s, enforce_idle_timeout=True, preemptible=True,
                    phase=Phase.RUNNING if running else Phase.ADMITTED, admitted_at=now - age,
                    last_active_at=now - age / 2 if running else None)
            p = Placement((NodeAssignment(i, tuple(range(devs)), 1000),))
            s.inv.allocate(g.name, p)
            out.append((g, p))
        return s, out

    a, adopted = build()
    for g, p in adopted:
        a.adopt(g, p, now, allocated=True, seq=0)
    state, templates = a.holder_state(), [clone(g) for g, _ in adopted]  # as adopted (placement, seq)
    b, _ = build()
    b.restore_holders(state, {t.name: clone(t) for t in templates}, now)
    assert list(a.holders) == list(b.holders) and a.usage == b.usage and a.model_usage == b.model_usage
    assert a._held_models == b._held_models and a._ws_entry == b._ws_entry
    assert {ws: a._ends_of(ws) for ws in a._ws_ends} == {ws: b._ends_of(ws) for ws in b._ws_ends}
    assert sorted(a._expiry) == sorted(b._expiry) and sorted(a._idle) == sorted(b._idle)
    for s in (a, b):
        s.submit(GPR("c/big", priority=300, devices_per_node=2, node_count=8, enable_eviction=True), now)
    for t in (now, now + 100, now + 1000, now + 4000):
        assert kinds(a.tick(t)) == kinds(b.tick(t))
        assert {n: vars(g) for n, g in a.gprs.items()} == {n: vars(g) for n, g in b.gprs.items()}
    assert b.holders  # c/big at least
    with pytest.raises(ValueError, match="holds nothing yet"):
        b.restore_holders(state, {t.name: clone(t) for t in templates}, now)
    with pytest.raises(ValueError, match="a copy of each holder"):
        _sched(2).restore_holders(dataclasses.replace(state, holders=[*state.holders, "x/y"]), {}, now)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([1, 2]), st.sampled_from([None, 600.0, 3600.0]),
                          st.integers(0, 3000)), min_size=0, max_size=8),
       st.sets(st.integers(0, 7)), st.integers(0, 3), st.sampled_from([None, {"a": {"X": 2000}}]))
@example(items=[("a", 1, None, 0), ("b", 2, 600.0, 10)], leaving={0}, joining=1, caps={"a": {"X": 2000}})
def test_a_revised_holder_state_is_the_one_adopting_afresh_leaves(items: list, leaving: set[int], joining: int,
                                                                   caps: dict | None) -> None:
    """revised_holder_state (a driver's kept holders when some stop holding and the newest start) equals the state
    adopting the remaining holders and then the joiners one by one leaves: the same holders in the same order,
    counts (no entry left for a workspace or model nobody holds any more), workspace ends and expiries; and the
    scheduler it is asked of is left as it was."""
    from scheduler_extender.core.gpr import clone
    from scheduler_extender.core.inventory import NodeAssignment, Placement

    now = 10_000.0
    nodes = [NodeSpec(f"n{i}", 2, "X" if i % 2 else "Y") for i in range(12)]
    gprs = []
    for i, (ws, devs, exit_s, age) in enumerate([*items, ("b", 1, 600.0, 5), ("a", 2, None, 1), ("a", 1, 3600.0, 0)]):
        g = GPR(f"{ws}/h{i}", workspace=ws, devices_per_node=devs, exit_duration_s=exit_s, phase=Phase.ADMITTED,
                admitted_at=now - age)
        gprs.append((g, Placement((NodeAssignment(i, tuple(range(devs)), 1000),))))
    old, new = gprs[:len(items)], gprs[len(items):len(items) + joining]  # the joiners: the newest

    def scheduler(holding: list[tuple[GPR, Placement]]) -> Scheduler:
        s = Scheduler(Inventory(nodes), BestFit(), SchedulerConfig(model_caps=caps))
        for g, p in holding:
            s.inv.allocate(g.name, p)
        return s

    a = scheduler(old + new)
    for g, p in old:
        a.adopt(clone(g), p, now, allocated=True, seq=0)
    state = a.holder_state()
    gone = [clone(a.gprs[g.name]) for i, (g, _) in enumerate(old) if i in leaving]
    asked = scheduler(old + new)
    revised = asked.revised_holder_state(state, gone, [(clone(g), p) for g, p in new], now)
    assert not asked.holders and not asked.usage and not asked._ws_entry  # left as it was
    b = scheduler(old + new)
    for g, p in [(g, p) for i, (g, p) in enumerate(old) if i not in leaving] + new:
        b.adopt(clone(g), p, now, allocated=True, seq=0)
    afresh = b.holder_state()
    assert revised.holders == afresh.holders
    assert revised.usage == afresh.usage and revised.held_models == afresh.held_models
    assert revised.model_usage == afresh.model_usage and revised.ws_entry == afresh.ws_entry
    assert {ws: sorted(lst) for ws, lst in revised.ws_ends.items()} == {ws: sorted(lst) for ws, lst in afresh.ws_ends.items()}
    assert sorted(revised.expiry) == sorted(afresh.expiry)
    with pytest.raises(ValueError, match="not a holder"):
        asked.revised_holder_state(state, [GPR("x/y")], [], now)


def test_reading_the_queue_hands_no_prototype_out() -> None:
    """A refresh reads every queued GPR (positions, estimates, projections) and changes none: peek_queued,
    queued_names and estimate_ranges leave the prototypes in place, with a GPR in its backoff beside them, and
    estimate as a queue of handed-out copies does."""
    now = 10_000.0
    a, b = _sched(2, 2), _sched(2, 2)
    block = QueuedBlock()
    protos = [GPR(f"default/q{i}", priority=50 + 50 * i, submitted_at=100.0 * i, exit_duration_s=600.0,
                  devices_per_node=2) for i in range(6)]
    for p in protos:
        block.add(p, a.size_rank(p))
        b.restore_queued(dataclasses.replace(p, history=[]), now, None, news=False)
    a.restore_block(block, now)
    for s in (a, b):
        s.submit(GPR("default/later", devices_per_node=2, exit_duration_s=600.0), now, not_before=now + 300)
    assert [g.name for g in a.peek_queued()] == a.queued_names() == b.queued_names()
    assert a.estimate_ranges(now) == b.estimate_ranges(now)
    assert all(a.queue.is_shared(p.name) and a.gprs[p.name] is p for p in protos)
    assert [g.name for g in a.queued()] == b.queued_names() and not any(a.queue.is_shared(p.name) for p in protos)


def test_a_queued_block_refuses_what_restore_queued_refuses() -> None:
    block = QueuedBlock()
    with pytest.raises(ValueError, match="only a GPR stored as Queued"):
        block.add(GPR("default/run", phase=Phase.RUNNING), (-1, 0.0, 60.0))
    block.add(GPR("default/q"), (-1, 0.0, 60.0))
    with pytest.raises(ValueError, match="already in the block"):
        block.add(GPR("default/q"), (-1, 0.0, 60.0))
    with pytest.raises(ValueError, match="size order"):
        _sched(4, order="priority").restore_block(block, 0.0)
    s = _sched(4)
    s.submit(GPR("default/q"), 0.0)
    with pytest.raises(ValueError, match="known already"):
        s.restore_block(block, 0.0)
    assert s.queued_names() == ["default/q"] and s.gprs["default/q"].seq == 1  # unchanged


def test_a_request_admitted_in_a_tick_is_not_evicted_in_the_same_tick() -> None:
    """Within a priority level the queue is in size order, so a small priority-201 request comes before a large
    priority-202 one. The small one evicts a low-priority holder to fit; the large one may then not take that
    reservation back in the same tick (the first eviction would have been for nothing): it waits, and nothing
    is evicted on behalf of a GPR that does not end the tick holding devices."""
    s = _sched(4, order="size")
    s.submit(GPR("low", devices_per_node=4, priority=1, preemptible=True), 0)
    assert kinds(s.tick(0)) == [("admitted", "low")]
    s.submit(GPR("small", devices_per_node=1, priority=201, preemptible=True, enable_eviction=True), 10)
    s.submit(GPR("large", devices_per_node=4, priority=202, enable_eviction=True), 10)
    events = s.tick(10)
    assert [(e.kind, e.gpr, e.detail) for e in events if e.kind == "evicted"] == [("evicted", "low", "small")]
    assert s.gprs["small"].holding and s.gprs["large"].phase.value == "Queued"
    later = s.tick(20)  # a later tick: the higher priority takes its place, as priority says
    assert ("evicted", "small") in kinds(later) and s.gprs["large"].holding


def _nodes_of(s: Scheduler, name: str) -> set[str]:
    placement = s.gprs[name].placement
    assert placement is not None
    return {s.inv.names[a.node] for a in placement.assignments}


def test_a_limited_gpr_is_placed_within_its_limit_and_blocks_no_one_outside_it() -> None:
    """Scheduler.limit (the nodes a GPR's pods can run on): placements keep to it; a GPR waiting for its only
    node reserves that node and lets work that fits elsewhere go ahead; limited to nodes that could never hold it,
    it is Unschedulable and blocks nobody."""
    s = _sched(4, 4)
    s.submit(GPR("a", devices_per_node=4, exit_duration_s=100), 0)
    s.limit("a", frozenset({"n1"}))
    s.tick(0)
    assert _nodes_of(s, "a") == {"n1"}
    s.submit(GPR("b", devices_per_node=2, priority=200, exit_duration_s=100), 1)
    s.limit("b", frozenset({"n1"}))  # waits for a, the head of the queue
    s.submit(GPR("c", devices_per_node=4, exit_duration_s=1000), 2)  # fits on n0, after b's reservation starts
    s.submit(GPR("d", devices_per_node=4, exit_duration_s=10), 3)
    s.limit("d", frozenset({"nowhere"}))
    events = s.tick(3)
    assert s.gprs["b"].phase is Phase.QUEUED and s.gprs["d"].reason == "Unschedulable"
    assert ("unschedulable", "d") in kinds(events)
    assert s.gprs["c"].phase is Phase.ADMITTED and _nodes_of(s, "c") == {"n0"}
    s.finish("a", 10)
    s.tick(10)
    assert _nodes_of(s, "b") == {"n1"}
    s.limit("d", None)  # its pods can run anywhere again: it is placed when there is room
    s.finish("c", 11)
    s.tick(11)
    assert s.gprs["d"].phase is Phase.ADMITTED and _nodes_of(s, "d") == {"n0"}


def test_an_admitted_gpr_gives_its_reservation_back_and_is_placed_again() -> None:
    s = _sched(4, 4)
    s.submit(GPR("a", devices_per_node=4, exit_duration_s=100), 0)
    s.tick(0)
    assert _nodes_of(s, "a") == {"n0"}
    events = s.give_back("a", 5, "Requeued: its pods cannot run on reserved node n0")
    g = s.gprs["a"]
    assert kinds(events) == [("requeued", "a")]
    assert g.phase is Phase.QUEUED and g.failures == 0 and g.placement is None and s.inv.used_milli() == 0
    s.limit("a", frozenset({"n1"}))
    s.tick(5)
    assert g.phase is Phase.ADMITTED and _nodes_of(s, "a") == {"n1"}
    s.check()
    s.start("a", 6)
    with pytest.raises(ValueError, match="not admitted"):
        s.give_back("a", 7, "too late: a pod of it runs")


def test_a_gprs_host_need_steers_its_placement_and_is_asked_only_when_placing() -> None:
    """The driver answers what a GPR's pods need of a node's CPU and memory (``need_host``); the core asks when it
    places the GPR and keeps it off nodes without that much free, as it does for a spec's own host amounts."""
    import numpy as np

    inv = Inventory([NodeSpec("busy", 8, cpu_milli=32_000), NodeSpec("idle", 8, cpu_milli=32_000)])
    inv.withhold_host(np.array([0]), np.array([28_000]), np.array([0]))  # other pods request 28 cores of busy's
    sched = Scheduler(inv, BestFit(), SchedulerConfig(instant_eviction=False))

    class Needs:
        def __init__(self) -> None:
            self.asked: list[str] = []

        def need(self, g: GPR) -> tuple[int, int] | None:
            self.asked.append(g.name)
            return (8_000, 0) if g.name == "big" else None

    needs = Needs()
    sched.need_host(needs)
    sched.submit(GPR("big", devices_per_node=1), 0.0)
    sched.submit(GPR("small", devices_per_node=1), 0.0)
    sched.tick(0.0)
    where = {name: sched.inv.names[g.placement.assignments[0].node] for name, g in sched.holders.items()
             if g.placement is not None}
    assert where == {"big": "idle", "small": "busy"}  # best fit packs small onto busy; big needs the cores
    assert set(needs.asked) == {"big", "small"}
    sched.check()


def test_unbounded_head_does_not_block_other_pools_or_its_own_nodes() -> None:
    """Issue 35.1: a head stuck behind a holder with no end (a non-GPR pod) claims every node it could ever use,
    whole; a later request of its level that fits on nodes the head can never use (another model, nodes its
    constraints exclude) is backfilled, one that needs the head's nodes is not, and no reservation moves."""
    inv = Inventory([NodeSpec("a0", 8, model="a100"), NodeSpec("h0", 8, model="h100"), NodeSpec("h1", 8, model="h100"),
                     NodeSpec("a1", 8, model="a100")])
    s = Scheduler(inv, BestFit(), SchedulerConfig(audit=True))
    assert s.hold("pod/ns/squatter", "a0", 8) == 8
    s.limit("stuck", frozenset({"a0"}))  # its pods can run only on a0 (node affinity)
    s.submit(GPR("stuck", devices_per_node=8, priority=150, models=("a100",)), 0)
    s.submit(GPR("other-model", devices_per_node=8, priority=150, models=("h100",)), 1)
    s.submit(GPR("excluded-node", devices_per_node=8, priority=150, models=("a100",)), 2)  # a1: stuck can never use it
    ev = s.tick(2)
    assert kinds(ev) == [("backfilled", "other-model"), ("backfilled", "excluded-node")]
    assert s.reservations[0].gpr == "stuck" and math.isinf(s.reservations[0].start)
    s.submit(GPR("takes-a0", devices_per_node=1, priority=1, exit_duration_s=10), 3)  # a lower level: behind stuck
    ev = s.tick(3)
    assert kinds(ev) == [("backfilled", "takes-a0")]
    assert s.inv.names[s.gprs["takes-a0"].placement.assignments[0].node] == "h1"  # type: ignore[union-attr]
    s.submit(GPR("needs-stucks-node", devices_per_node=8, priority=1, models=("a100",), exit_duration_s=10), 4)
    assert kinds(s.tick(4)) == []  # a1 is taken, a0 is stuck's: a short one would still delay it
    assert s.inversions == 0


def test_a_gpr_left_waiting_says_why_capacity_or_a_higher_level_and_the_reason_follows_the_cluster() -> None:
    """Issue 35.4: a queued GPR the pass could not place says so (``InsufficientCapacity``, with what it needs,
    how many nodes it could use have that much free and who holds them); one that would fit now but is kept off
    by a blocked GPR of a higher priority level says ``BehindHigherPriority`` and names the level. Each is said
    once (an Event, for the status message), and changes when the cause does. Before: reason '' for both."""
    s = _sched(4)
    s.submit(GPR("run", workspace="team-b", devices_per_node=2, exit_duration_s=100), 0)
    s.tick(0)
    s.submit(GPR("head", devices_per_node=4, priority=200, exit_duration_s=50), 1)
    s.submit(GPR("long", devices_per_node=1, priority=10, exit_duration_s=500), 1)
    ev = s.tick(1)
    said = {e.gpr: (e.kind, e.detail) for e in ev if e.kind in WAIT_KINDS}
    assert s.gprs["head"].reason == "InsufficientCapacity" and said["head"] == (
        "insufficientcapacity", "needs 1 node(s) x 4 nvidia.com/gpu; 0 of 1 fitting nodes have 4 free; held by run (n0)")
    assert s.gprs["long"].reason == "BehindHigherPriority"
    assert said["long"][0] == "behindhigherpriority" and "head at priority level medium (101-200)" in said["long"][1]
    assert [e for e in s.tick(2) if e.kind in WAIT_KINDS] == []  # said once, while it stands
    s.finish("run", 3)
    s.tick(3)
    assert s.gprs["head"].phase is Phase.ADMITTED
    # the head holds every device now: long waits for capacity, no longer behind a blocked higher level
    assert s.gprs["long"].reason == "InsufficientCapacity"


def test_a_drained_gpr_holds_its_devices_until_its_pods_go_then_requeues_without_a_failure() -> None:
    """Deboarding a node: its Running GPR goes Evicting (devices still held, nothing new placed on them), and
    once its pods are gone it is requeued as after any eviction: no failure, no backoff."""
    s = _sched(4)
    s.submit(GPR("a", devices_per_node=4, exit_duration_s=100), 0)
    s.tick(0)
    with pytest.raises(ValueError, match="not running"):
        s.drain("a", 1, "NodeDeboarding")
    s.start("a", 1)
    assert kinds(s.drain("a", 2, "NodeDeboarding")) == [("evicted", "a")]
    g = s.gprs["a"]
    assert g.phase is Phase.EVICTING and g.reason == "NodeDeboarding" and s.inv.used_milli() == 4000
    s.check()
    assert kinds(s.evicted("a", 3)) == [("requeued", "a")]
    assert g.phase is Phase.QUEUED and g.failures == 0 and s.inv.used_milli() == 0


def test_every_queued_gpr_a_pass_does_not_get_to_is_told_why_once() -> None:
    """A pass stops after ``max_reservations`` blocked GPRs and walks no further into a workspace after as many
    held by its quota (issue 35.4: every queued GPR says why it waits). Those it did not get to say so too,
    instead of the empty reason of a GPR nobody looked at: ``WorkspaceQuota`` when their workspace's quota holds
    them, else ``BehindBlockedGPRs``; once each (a later pass says nothing new), and a pass that does get to
    one gives it the reason it finds."""
    quota = _sched(8, 8, quotas={"team": 1000})
    for i in range(14):
        quota.submit(GPR(f"q{i:02d}", workspace="team", exit_duration_s=3600.0 + i), float(i))
    first = quota.tick(20.0)
    queued = [g for g in quota.gprs.values() if g.phase is Phase.QUEUED]
    assert len(queued) == 13 and {g.reason for g in queued} == {"WorkspaceQuota"}  # before: the last four ''
    said = {e.gpr: e.detail for e in first if e.kind == "workspacequota"}
    assert len(said) == 13 and said["q13"] == "workspace team quota: 1 of 1 devices in use; it needs 1"
    assert quota.tick(30.0) == []  # said once

    busy = _sched(8)
    busy.submit(GPR("holder", devices_per_node=8, exit_duration_s=3600.0), 0.0)
    busy.tick(0.0)
    for i in range(12):
        busy.submit(GPR(f"b{i:02d}", workspace=f"w{i}", devices_per_node=8, exit_duration_s=3600.0 + i), 1.0 + i)
    events = busy.tick(20.0)
    reasons = {g.name: g.reason for g in busy.gprs.values() if g.phase is Phase.QUEUED}
    looked = [n for n, r in reasons.items() if r == "InsufficientCapacity"]
    behind = sorted(n for n, r in reasons.items() if r == "BehindBlockedGPRs")
    assert len(looked) == busy.cfg.max_reservations + 1 and behind == ["b09", "b10", "b11"]  # before: ''
    told = [e for e in events if e.kind == "behindblockedgprs"]
    assert [e.gpr for e in told] == behind  # in queue order
    assert told[0].detail == ("behind 9 GPRs that wait for devices; a pass stops there, and looks at this one "
                              "once fewer wait ahead of it")
    assert busy.tick(30.0) == []
    for name in looked[:3]:  # fewer ahead: the pass gets to them and says what it finds there
        busy.cancel(name, 40.0)
    busy.tick(40.0)
    assert {busy.gprs[n].reason for n in behind} == {"InsufficientCapacity"}


def test_a_gpr_kept_back_for_its_workspace_quota_says_so_without_being_over_it() -> None:
    """A small GPR behind a quota-held one of its own workspace, which it would delay, fits the quota by itself
    but waits for it all the same: reason ``WorkspaceQuota``, the detail saying it waits behind the workspace's
    own GPRs (before: '')."""
    s = _sched(8, quotas={"team": 4000})
    s.submit(GPR("one", workspace="team", exit_duration_s=3600.0), 0.0)
    s.tick(0.0)
    s.submit(GPR("wide", workspace="team", devices_per_node=4, priority=150, exit_duration_s=3600.0), 1.0)
    s.submit(GPR("long", workspace="team", exit_duration_s=7200.0), 2.0)  # ends after the wide one could start
    events = s.tick(3.0)
    assert s.gprs["wide"].reason == "WorkspaceQuota" and s.gprs["long"].phase is Phase.QUEUED
    assert s.gprs["long"].reason == "WorkspaceQuota"
    assert [e.detail for e in events if e.gpr == "long"] == [
        "workspace team quota: 1 of 4 devices in use; GPRs of the workspace ahead of it wait for that quota, and "
        "starting it first would delay them"]


def test_prototypes_restored_without_a_reason_get_one_on_their_copies_only() -> None:
    """The GPR controller restores its stored queue as shared prototypes each pass: one stored without a reason
    that the pass does not get to is given one on its working copy (what the controller writes back), and the
    prototype, which nobody may change, is left as it was; one stored with a reason is not handed out."""
    now = 1_000.0
    s = _sched(8)
    s.submit(GPR("holder", devices_per_node=8, exit_duration_s=3600.0), 0.0)
    s.tick(0.0)
    block = QueuedBlock()
    protos = [GPR(f"default/p{i:02d}", devices_per_node=8, exit_duration_s=600.0 + i, submitted_at=float(i),
                  reason="InsufficientCapacity" if i == 11 else "") for i in range(12)]
    for p in protos:
        block.add(p, s.size_rank(p))
    assert block.unjudged == {p.name for p in protos[:11]}
    s.restore_block(block, now)
    s.tick(now)
    assert all(p.reason == ("InsufficientCapacity" if p is protos[11] else "") for p in protos)  # unchanged
    assert {s.gprs[p.name].reason for p in protos[9:11]} == {"BehindBlockedGPRs"}
    assert s.queue.is_shared(protos[11].name) and s.gprs[protos[11].name] is protos[11]
    block.discard(protos[0].name)
    assert protos[0].name not in block.unjudged
