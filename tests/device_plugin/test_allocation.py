"""Preferred-allocation policies: request validation, best interconnect, replica packing and spreading."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_plugin.allocation import AllocationError, best_connected, pick_replicas, validate_request


def test_validation_messages() -> None:
    with pytest.raises(AllocationError, match=r"must_include devices not in available 1: \"c\""):
        validate_request(["a", "b"], ["c"], 1)
    with pytest.raises(AllocationError, match="more than allocation_size 1"):
        validate_request(["a", "b"], ["a", "b"], 1)
    with pytest.raises(AllocationError, match="exceeds the 2 available"):
        validate_request(["a", "b"], [], 3)
    with pytest.raises(AllocationError, match="must not be negative"):
        validate_request(["a"], [], -1)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.integers(0, 300), min_size=n * (n - 1) // 2, max_size=n * (n - 1) // 2),
    st.integers(1, n), st.sets(st.integers(0, n - 1), max_size=2))))
def test_best_connected_is_optimal(case: tuple[int, list[int], int, set[int]]) -> None:
    n, weights, size, must = case
    size = max(size, len(must))
    ids = [f"d{i}" for i in range(n)]
    pairs = dict(zip(itertools.combinations(ids, 2), weights, strict=True))

    def score(a: str, b: str) -> int:
        return pairs[(min(a, b), max(a, b))]

    chosen = best_connected(ids, [ids[i] for i in must], size, score)
    assert len(chosen) == size and {ids[i] for i in must} <= set(chosen)
    best = max(sum(score(a, b) for a, b in itertools.combinations(c, 2))
               for c in itertools.combinations(ids, size) if {ids[i] for i in must} <= set(c))
    assert sum(score(a, b) for a, b in itertools.combinations(chosen, 2)) == best


def test_greedy_beyond_the_exhaustive_bound() -> None:
    ids = [f"d{i:02d}" for i in range(40)]  # C(40, 8) is far beyond the bound

    def score(a: str, b: str) -> int:
        return 100 if int(a[1:]) // 8 == int(b[1:]) // 8 else 1

    assert best_connected(ids, ["d17"], 8, score) == [f"d{i}" for i in range(16, 24)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_replica_policies(gpus: int, replicas: int, data: st.DataObject) -> None:
    ids = [f"GPU-{g}::{k}" for g in range(gpus) for k in range(replicas)]
    available = data.draw(st.lists(st.sampled_from(ids), unique=True, min_size=1))
    size = data.draw(st.integers(1, len(available)))
    for policy in ("packed", "distributed"):
        chosen = pick_replicas(available, [], size, policy)
        assert len(chosen) == size == len(set(chosen)) and set(chosen) <= set(available)
    spread = pick_replicas(available, [], size, "distributed")
    per_gpu = {g: sum(c.startswith(f"GPU-{g}::") for c in spread) for g in range(gpus)}
    free = {g: sum(a.startswith(f"GPU-{g}::") for a in available) for g in range(gpus)}
    # distributed: no GPU gets two more than another unless the other ran out of free replicas
    for a in range(gpus):
        for b in range(gpus):
            assert per_gpu[a] <= per_gpu[b] + 1 or per_gpu[b] == free[b]
