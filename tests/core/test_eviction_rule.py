"""The eviction rule (issue 35.8): an eviction that makes room is carried out only when the work the victims lose
is worth the wait it spares, or when the preemptor would otherwise wait long (the priority guarantee).

Hold times come from an empty predictor here: a holder is expected to run as long again as it already has, capped
by its exitDuration, so every wait below is exact."""

from __future__ import annotations

import math

import pytest

from scheduler_extender.core.eviction import EvictionRule
from scheduler_extender.core.gpr import GPR, Phase
from scheduler_extender.core.inventory import Inventory, NodeSpec
from scheduler_extender.core.placement import BestFit
from scheduler_extender.core.scheduler import Scheduler, SchedulerConfig


def _sched(*devs: int, **cfg: object) -> Scheduler:
    inv = Inventory([NodeSpec(f"n{i}", d) for i, d in enumerate(devs)])
    return Scheduler(inv, BestFit(), SchedulerConfig(audit=True, **cfg))  # type: ignore[arg-type]


def _evicted(events: list) -> list[str]:
    return [e.gpr for e in events if e.kind == "evicted"]


def _busy(s: Scheduler, exit_s: float | None, at: float = 0.0, workspace: str = "default") -> None:
    """One low-priority preemptible GPR holding the single device from ``at``."""
    s.submit(GPR("victim", priority=10, exit_duration_s=exit_s, workspace=workspace), at)
    s.tick(at)
    s.start("victim", at)


def test_a_short_wait_does_not_buy_an_eviction_of_hours_of_work() -> None:
    """At t=3000 the victim (exitDuration 4000) is predicted to end in 1000 s: evicting it would throw away 3000
    GPU-seconds to spare 1000 of waiting (ratio 3 > 1), and the wait (1000 s) is under the 1800 s guarantee. So
    the high-priority GPR waits, and starts when the victim ends at its bound. Before the rule it evicted."""
    s = _sched(1)
    _busy(s, 4000)
    s.submit(GPR("vip", priority=280, enable_eviction=True, exit_duration_s=600), 3000)
    assert _evicted(s.tick(3000)) == [] and s.gprs["vip"].phase is Phase.QUEUED
    assert s.evictions_declined == 1
    assert s.gprs["victim"].holding and s.gprs["victim"].evictions == 0
    ev = s.tick(4000)  # the victim reaches its exitDuration
    assert ("admitted", "vip") in [(e.kind, e.gpr) for e in ev] and s.gprs["victim"].phase is Phase.COMPLETE
    assert s.inversions == 0


def test_the_ratio_is_the_stated_trade_off() -> None:
    """The same case with K = 3 (3000 lost <= 3 x 1000 spared) evicts; with K = 2.9 it does not."""
    for ratio, evicts in ((3.0, True), (2.9, False)):
        s = _sched(1, eviction_cost_ratio=ratio)
        _busy(s, 4000)
        s.submit(GPR("vip", priority=280, enable_eviction=True), 3000)
        assert _evicted(s.tick(3000)) == (["victim"] if evicts else []), ratio


def test_high_priority_still_evicts_when_it_would_otherwise_wait_long() -> None:
    """The victim (exitDuration 10 h) is predicted to run 3000 s more: a wait past the 1800 s guarantee, so the
    eviction happens whatever the work lost (3000 GPU-seconds against 3000 spared would pass anyway at K = 1,
    hence K = 0.1 here)."""
    s = _sched(1, eviction_cost_ratio=0.1)
    _busy(s, 36000)
    s.submit(GPR("vip", priority=280, enable_eviction=True), 3000)
    ev = s.tick(3000)
    assert _evicted(ev) == ["victim"] and ("admitted", "vip") in [(e.kind, e.gpr) for e in ev]


def test_the_time_already_waited_counts_towards_the_guarantee() -> None:
    """A victim without exitDuration and no history is expected to hold 3600 s in all. At t=1000 that leaves 2600 s
    (declined: 1000 GPU-s lost > 0.3 x 2600 spared, 2600 s < 3000 s), and so until t=3599. Once it outlives that
    prediction (t=3600) it is expected to run about as long again: 2600 s waited + that >= 3000 s, so the GPR
    evicts then, though the work lost has only grown."""
    s = _sched(1, eviction_cost_ratio=0.3, eviction_max_wait_s=3000)
    _busy(s, None)
    s.submit(GPR("vip", priority=280, enable_eviction=True), 1000)
    for t in (1000, 1500, 3599):
        assert _evicted(s.tick(t)) == [], t
    assert _evicted(s.tick(3600)) == ["victim"] and s.gprs["vip"].holding


def test_work_that_has_not_started_is_evicted_without_weighing() -> None:
    """A victim admitted a moment ago has done nothing: evicting it loses nothing, whatever the wait."""
    s = _sched(1, eviction_cost_ratio=0.0)
    _busy(s, 4000, at=100)
    s.submit(GPR("vip", priority=280, enable_eviction=True), 100)
    s.tick(100)  # a tick after the victim's, at the same time
    assert s.gprs["vip"].holding and s.gprs["victim"].phase is Phase.QUEUED


def test_off_evicts_whenever_it_makes_room() -> None:
    s = _sched(1, eviction_cost_ratio=None)
    _busy(s, 4000)
    s.submit(GPR("vip", priority=280, enable_eviction=True), 3000)
    assert _evicted(s.tick(3000)) == ["victim"]


def test_quota_evictions_are_weighed_too() -> None:
    """Room under a workspace's quota, not in the cluster: the same rule. The cluster has a free device, the
    workspace's quota (1 device) is held by a victim predicted to end in 1000 s after running 3000 s."""
    s = _sched(2, quotas={"team": 1000})
    _busy(s, 4000, workspace="team")
    s.submit(GPR("vip", priority=280, enable_eviction=True, workspace="team"), 3000)
    ev = s.tick(3000)
    assert _evicted(ev) == [] and [e.kind for e in ev if e.gpr == "vip"] == ["workspacequota"]
    s = _sched(2, quotas={"team": 1000}, eviction_max_wait_s=900)
    _busy(s, 4000, workspace="team")
    s.submit(GPR("vip", priority=280, enable_eviction=True, workspace="team"), 3000)
    assert _evicted(s.tick(3000)) == ["victim"] and s.gprs["vip"].holding


@pytest.mark.parametrize(("cfg", "message"), [
    ({"eviction_cost_ratio": -1.0}, "eviction_cost_ratio: must be a finite number >= 0 or None, got -1.0"),
    ({"eviction_cost_ratio": math.nan}, "eviction_cost_ratio: must be a finite number >= 0 or None, got nan"),
    ({"eviction_max_wait_s": -5.0}, "eviction_max_wait_s: must be >= 0 (inf: never regardless of cost), got -5.0"),
    ({"eviction_max_wait_s": math.nan}, "eviction_max_wait_s: must be >= 0 (inf: never regardless of cost), got nan"),
])
def test_a_bad_rule_is_one_clear_line(cfg: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        _sched(1, **cfg)
    assert str(exc.value) == message and "\n" not in str(exc.value)


def test_the_rule_in_words() -> None:
    assert EvictionRule().describe() == ("evict when the victims' lost GPU-hours are at most 1 x the preemptor's "
                                         "GPU-hours of waiting spared, or when it would otherwise wait 1800 s or more")
    assert EvictionRule(None).describe() == "evict whenever it makes room"
    # no guarantee (inf): the ratio alone decides, however long the wait
    assert EvictionRule(2.0, math.inf).allows(2e9 + 1, 1000, 1e9, 1e6) is False
    assert EvictionRule(2.0, math.inf).allows(2e9, 1000, 1e9, 1e6) is True
