"""Preferred allocation: which of the available devices a container should get.

Whole devices: the set with the best interconnect. Each pair of devices has a score (NVLink links count most,
then a shared PCIe switch, then the same host bridge, then the same NUMA node — the ordering the upstream
NVIDIA plugin's best-effort policy uses); the chosen set maximises the sum of its pair scores and always
contains ``must_include``. Eight GPUs give at most 70 candidate sets of four, so the search is exhaustive up to
a bound and greedy beyond it.

Replicas (time-slicing): ``packed`` fills the GPUs that are already busiest, ``distributed`` spreads over the
GPUs with the most free replicas; ties go to the lower ID so the answer is deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from device_plugin.devices import describe_ids, physical_of

PairScore = Callable[[str, str], int]
EXHAUSTIVE_LIMIT = 5000  # candidate sets; beyond this, greedy


class AllocationError(ValueError):
    pass


def validate_request(available: Sequence[str], must_include: Sequence[str], size: int) -> None:
    if size < 0:
        raise AllocationError(f"allocation_size must not be negative, got {size}")
    missing = set(must_include) - set(available)
    if missing:
        raise AllocationError(f"must_include devices not in available {describe_ids(missing)}")
    if len(set(must_include)) > size:
        raise AllocationError(f"must_include has {len(set(must_include))} devices, more than allocation_size {size}")
    if size > len(set(available)):
        raise AllocationError(f"allocation_size {size} exceeds the {len(set(available))} available devices")


def _set_score(devices: Sequence[str], pair_score: PairScore) -> int:
    return sum(pair_score(a, b) for a, b in itertools.combinations(devices, 2))


def best_connected(available: Sequence[str], must_include: Sequence[str], size: int, pair_score: PairScore) -> list[str]:
    """The ``size``-set of whole devices with the highest summed pair score that contains ``must_include``."""
    validate_request(available, must_include, size)
    required = sorted(set(must_include))
    pool = sorted(set(available) - set(required))
    need = size - len(required)
    if need == 0:
        return required
    if math.comb(len(pool), need) <= EXHAUSTIVE_LIMIT:
        best: tuple[int, ...] | None = None
        best_score = -1
        for combo in itertools.combinations(range(len(pool)), need):
            chosen = required + [pool[i] for i in combo]
            score = _set_score(chosen, pair_score)
            if score > best_score:  # strictly greater: the first (lowest IDs) wins ties
                best, best_score = combo, score
        assert best is not None
        return sorted(required + [pool[i] for i in best])
    chosen = list(required)
    remaining = list(pool)
    while len(chosen) < size:
        pick = max(remaining, key=lambda d: (sum(pair_score(d, c) for c in chosen), -remaining.index(d)))
        chosen.append(pick)
        remaining.remove(pick)
    return sorted(chosen)


def pick_replicas(available: Sequence[str], must_include: Sequence[str], size: int, policy: str) -> list[str]:
    """Choose ``size`` replica IDs (``<gpu>::<k>``) by policy ``packed`` or ``distributed``."""
    validate_request(available, must_include, size)
    chosen = sorted(set(must_include))
    free: dict[str, list[str]] = {}
    for aid in sorted(set(available) - set(chosen)):
        free.setdefault(physical_of(aid), []).append(aid)
    taken: dict[str, int] = {}
    for aid in chosen:
        taken[physical_of(aid)] = taken.get(physical_of(aid), 0) + 1
    while len(chosen) < size:
        candidates = [g for g, ids in free.items() if ids]
        if policy == "packed":
            # busiest GPU first: fewest free replicas left, then most already taken in this request
            gpu = min(candidates, key=lambda g: (len(free[g]), -taken.get(g, 0), g))
        else:
            # spread: least taken in this request, then most free replicas
            gpu = min(candidates, key=lambda g: (taken.get(g, 0), -len(free[g]), g))
        chosen.append(free[gpu].pop(0))
        taken[gpu] = taken.get(gpu, 0) + 1
    return sorted(chosen)
