"""The routing core's invariants (property tests) and the choices it makes."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from inference.names import POOL_BURST, POOL_PRIMARY
from inference.routing import (
    EjectionPolicy,
    ModelRoute,
    ReplicaSpec,
    bursting,
    has_room,
    pick,
    pick_round_robin,
    record_failure,
    record_success,
)


def route(primary: int, burst: int = 0, max_inflight: int = 4) -> ModelRoute:
    r = ModelRoute("m", max_inflight=max_inflight)
    r.set_replicas([ReplicaSpec(f"http://p{i}", POOL_PRIMARY) for i in range(primary)]
                   + [ReplicaSpec(f"http://b{i}", POOL_BURST) for i in range(burst)])
    return r


replica_state = st.tuples(st.integers(0, 6), st.booleans(), st.booleans(), st.floats(0, 5))


@settings(max_examples=300, deadline=None)
@given(states=st.lists(replica_state, min_size=0, max_size=8), seed=st.integers(0, 2**32),
       exclude=st.sets(st.integers(0, 7)))
def test_pick_only_returns_an_eligible_replica_and_prefers_primary(
        states: list[tuple[int, bool, bool, float]], seed: int, exclude: set[int]) -> None:
    r = ModelRoute("m", max_inflight=4)
    r.set_replicas([ReplicaSpec(f"http://r{i}", POOL_BURST if burst else POOL_PRIMARY)
                    for i, (_, burst, _, _) in enumerate(states)])
    for i, (outstanding, _, ejected, queue) in enumerate(states):
        rep = r.replicas[f"http://r{i}"]
        rep.outstanding, rep.reported_queue = outstanding, queue
        rep.ejected_until = 100.0 if ejected else 0.0
    excluded = [f"http://r{i}" for i in exclude]
    chosen = pick(r, random.Random(seed), 50.0, excluded)
    eligible = [x for x in r.replicas.values() if x.url not in excluded and has_room(x, 4, 50.0)]
    if not eligible:
        assert chosen is None
        return
    assert chosen in eligible
    if any(x.pool == POOL_PRIMARY for x in eligible):
        assert chosen.pool == POOL_PRIMARY
    if not excluded:
        assert bursting(r, 50.0) == (chosen.pool == POOL_BURST)


def test_two_choices_never_picks_the_more_loaded_of_two() -> None:
    r = route(2)
    r.replicas["http://p0"].outstanding = 3
    rng = random.Random(1)
    assert all(pick(r, rng, 0.0).url == "http://p1" for _ in range(50))  # type: ignore[union-attr]


def test_reported_queue_counts_as_load() -> None:
    r = route(2, max_inflight=100)
    r.replicas["http://p0"].reported_queue = 10
    r.replicas["http://p1"].outstanding = 5
    assert pick(r, random.Random(0), 0.0).url == "http://p1"  # type: ignore[union-attr]


def test_our_own_requests_waiting_in_the_runtimes_queue_are_not_counted_twice() -> None:
    """p0 has 6 of ours outstanding, 4 of them waiting in its queue (so it reports 4); p1 has 7 and an empty queue:
    p0 has less to do. Summed, p0 looked like 10 and lost to p1."""
    r = route(2, max_inflight=100)
    r.replicas["http://p0"].outstanding, r.replicas["http://p0"].reported_queue = 6, 4
    r.replicas["http://p1"].outstanding = 7
    assert pick(r, random.Random(0), 0.0).url == "http://p0"  # type: ignore[union-attr]


def test_least_request_keeps_load_even() -> None:
    r = route(8, max_inflight=1000)
    rng = random.Random(7)
    for _ in range(400):
        chosen = pick(r, rng, 0.0)
        assert chosen is not None
        chosen.outstanding += 1
    loads = [x.outstanding for x in r.replicas.values()]
    assert max(loads) - min(loads) <= 3  # power of two choices: a log log n gap, not round robin's luck


def test_full_replicas_are_skipped_and_none_when_all_full() -> None:
    r = route(2, max_inflight=1)
    first = pick(r, random.Random(0), 0.0)
    assert first is not None
    first.outstanding = 1
    second = pick(r, random.Random(0), 0.0)
    assert second is not None and second is not first
    second.outstanding = 1
    assert pick(r, random.Random(0), 0.0) is None


def test_burst_only_when_primary_has_no_room() -> None:
    r = route(1, 1, max_inflight=1)
    assert pick(r, random.Random(0), 0.0).pool == POOL_PRIMARY  # type: ignore[union-attr]
    assert not bursting(r, 0.0)
    r.replicas["http://p0"].outstanding = 1
    assert bursting(r, 0.0)
    assert pick(r, random.Random(0), 0.0).pool == POOL_BURST  # type: ignore[union-attr]
    r.replicas["http://p0"].ejected_until = 10.0
    r.replicas["http://p0"].outstanding = 0
    assert pick(r, random.Random(0), 5.0).pool == POOL_BURST  # type: ignore[union-attr]
    assert pick(r, random.Random(0), 10.0).pool == POOL_PRIMARY  # type: ignore[union-attr]


def test_ejection_after_consecutive_failures_with_growing_time() -> None:
    r = route(4)
    policy = EjectionPolicy(consecutive_failures=3, base_seconds=10, max_seconds=25, max_fraction=0.5)
    rep = r.replicas["http://p0"]
    assert not record_failure(r, rep, 0.0, policy)
    record_success(rep)  # a success in between resets the count
    assert not record_failure(r, rep, 0.0, policy)
    assert not record_failure(r, rep, 0.0, policy)
    assert record_failure(r, rep, 0.0, policy)
    assert rep.ejected(9.9) and not rep.ejected(10.0)
    for _ in range(3):
        record_failure(r, rep, 10.0, policy)
    assert rep.ejected_until == 30.0  # second ejection: twice as long
    for _ in range(3):
        record_failure(r, rep, 30.0, policy)
    assert rep.ejected_until == 55.0  # capped at max_seconds


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10), failures=st.lists(st.integers(0, 9), max_size=80),
       fraction=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_never_more_than_max_fraction_ejected(n: int, failures: list[int], fraction: float) -> None:
    r = route(n)
    policy = EjectionPolicy(consecutive_failures=1, base_seconds=100, max_fraction=fraction)
    for i in failures:
        rep = r.replicas.get(f"http://p{i}")
        if rep is not None:
            record_failure(r, rep, 1.0, policy)
    ejected = sum(1 for x in r.replicas.values() if x.ejected(1.0))
    assert ejected <= fraction * n


def test_single_replica_is_never_ejected_by_default() -> None:
    r = route(1)
    rep = r.replicas["http://p0"]
    for _ in range(10):
        record_failure(r, rep, 0.0, EjectionPolicy())
    assert not rep.ejected(0.0)


def test_set_replicas_keeps_state_of_those_that_stay() -> None:
    r = route(2)
    r.replicas["http://p0"].outstanding = 2
    r.replicas["http://p0"].ejected_until = 5.0
    r.set_replicas([ReplicaSpec("http://p0", POOL_PRIMARY, pod="new-name"), ReplicaSpec("http://p9")])
    assert set(r.replicas) == {"http://p0", "http://p9"}
    assert r.replicas["http://p0"].outstanding == 2 and r.replicas["http://p0"].ejected_until == 5.0
    assert r.replicas["http://p0"].spec.pod == "new-name"


def test_round_robin_cycles() -> None:
    r = route(3)
    assert [pick_round_robin(r, i, 0.0).url for i in range(4)] == [  # type: ignore[union-attr]
        "http://p0", "http://p1", "http://p2", "http://p0"]
