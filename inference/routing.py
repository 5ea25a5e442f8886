"""The gateway's routing core: which replica serves the next request. Pure: no I/O, no clock, no asyncio.

A model's replicas come in pools (``primary``, then ``burst``). A request goes to the primary pool while one of its
replicas has room (fewer than ``max_inflight`` outstanding requests), to the burst pool only when every primary
replica is saturated, ejected or absent, and waits (the caller's queue) when no replica of any pool has room.

Inside a pool: least outstanding requests over every replica with room (nginx's ``least_conn``), ties broken by
the lower observed latency (an EWMA of each replica's answer times), then at random. The load is the gateway's
own outstanding count plus the queue the replica reports (a runtime's waiting requests, where it exports them),
divided by its weight. Equal outstanding counts mean, by Little's law, a share of requests proportional to each
replica's speed: a 3x slower replica gets about a third of a fast one's requests. (The power of two choices used
before gave it 0.56x over four replicas at 64 clients, since half the time neither candidate was the least
loaded; with a handful of replicas per model the full scan costs no more than building the candidate list.)

Passive outlier ejection (Envoy's ``outlier_detection``): ``consecutive_failures`` errors or timeouts in a row eject
a replica for ``base_seconds`` times the number of times it has been ejected (capped at ``max_seconds``); at most
``max_fraction`` of a model's replicas are ejected at once, so a fault everywhere degrades instead of emptying
the pool. An ejected replica comes back by itself when its time is up; one success resets its failure count.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from inference.names import POOL_BURST, POOL_PRIMARY


@dataclass(frozen=True)
class ReplicaSpec:
    """A ready replica as discovery sees it."""

    url: str  # http://10.1.2.3:8000
    pool: str = POOL_PRIMARY
    pod: str = ""
    namespace: str = ""
    node: str = ""
    weight: float = 1.0


@dataclass
class Replica:
    """A replica and the gateway's load and health bookkeeping for it (mutated by the functions below)."""

    spec: ReplicaSpec
    outstanding: int = 0
    reported_queue: float = 0.0
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    latency: float = 0.0  # EWMA of answer seconds (0: none observed yet, so a new replica wins ties)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pool(self) -> str:
        return self.spec.pool

    def load(self) -> float:
        """What the replica has to do: the gateway's outstanding requests, or the runtime's reported queue when that
        is longer (clients other than this gateway). Not their sum: the requests this gateway sent that wait in the
        replica's queue are in both, and counting them twice (from a report up to a poll interval old) steered
        requests away from a replica in proportion to its own backlog of them, worse than least_conn's tail."""
        load = max(self.outstanding, self.reported_queue)
        return load / (self.spec.weight if self.spec.weight > 0 else 1.0)

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until


@dataclass(frozen=True)
class EjectionPolicy:
    consecutive_failures: int = 3
    base_seconds: float = 10.0
    max_seconds: float = 300.0
    max_fraction: float = 0.5


@dataclass
class ModelRoute:
    """One model's replicas, keyed by URL, with the per-replica concurrency limit."""

    model: str
    endpoint: str = ""  # namespace/name of the InferenceEndpoint serving it
    max_inflight: int = 64
    replicas: dict[str, Replica] = field(default_factory=dict)

    def set_replicas(self, specs: Iterable[ReplicaSpec]) -> None:
        """Replace the replica set; replicas that stay keep their load and ejection state."""
        fresh: dict[str, Replica] = {}
        for spec in specs:
            old = self.replicas.get(spec.url)
            if old is None:
                fresh[spec.url] = Replica(spec)
            else:
                old.spec = spec
                fresh[spec.url] = old
        self.replicas = fresh

    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas.values())

    def capacity(self, now: float) -> int:
        """Requests the replicas not ejected can hold at once."""
        return self.max_inflight * sum(1 for r in self.replicas.values() if not r.ejected(now))


def has_room(replica: Replica, max_inflight: int, now: float) -> bool:
    return not replica.ejected(now) and replica.outstanding < max_inflight


def pick(route: ModelRoute, rng: random.Random, now: float, exclude: Sequence[str] = ()) -> Replica | None:
    """The replica for the next request, or None when no replica has room (the caller queues the request): the
    least loaded primary replica with room (:func:`least_loaded`'s order), else the least loaded burst one.

    ``exclude``: URLs already tried for this request (a retry goes elsewhere). One pass over the replicas, every
    test inline: this runs for every proxied request.
    """
    limit = route.max_inflight
    primary: list[Replica] = []
    burst: list[Replica] = []
    for replica in route.replicas.values():
        if replica.outstanding >= limit or now < replica.ejected_until:
            continue
        spec = replica.spec
        if exclude and spec.url in exclude:
            continue
        if spec.pool == POOL_PRIMARY:
            primary.append(replica)
        elif spec.pool == POOL_BURST:
            burst.append(replica)
    candidates = primary or burst
    if not candidates:
        return None
    return candidates[0] if len(candidates) == 1 else least_loaded(candidates, rng)


def least_loaded(candidates: Sequence[Replica], rng: random.Random) -> Replica:
    """The candidate with the least load, then the lowest latency EWMA; among exact ties, one at random (so
    equal idle replicas share the first requests instead of the first listed taking them all)."""
    if len(candidates) == 1:
        return candidates[0]
    best: list[Replica] = []
    best_key = (math.inf, math.inf)
    for replica in candidates:
        weight = replica.spec.weight  # Replica.load(), inline: this runs for every candidate of every request
        key = (max(replica.outstanding, replica.reported_queue) / (weight if weight > 0 else 1.0), replica.latency)
        if key < best_key:
            best, best_key = [replica], key
        elif key == best_key:
            best.append(replica)
    return best[0] if len(best) == 1 else rng.choice(best)


LATENCY_ALPHA = 0.2  # weight of the newest answer in a replica's latency EWMA


def record_latency(replica: Replica, seconds: float) -> None:
    """Fold one answer's time into the replica's EWMA (the first one sets it)."""
    replica.latency = seconds if replica.latency <= 0 else replica.latency + LATENCY_ALPHA * (seconds - replica.latency)


def pick_round_robin(route: ModelRoute, counter: int, now: float) -> Replica | None:
    """Round robin over the replicas with room: the baseline the benchmark compares against."""
    candidates = [r for r in route.replicas.values() if has_room(r, route.max_inflight, now)]
    return candidates[counter % len(candidates)] if candidates else None


def bursting(route: ModelRoute, now: float) -> bool:
    """True when a new request would go to the burst pool: it has room and no primary replica has."""
    primary = [r for r in route.replicas.values() if r.pool == POOL_PRIMARY]
    burst = [r for r in route.replicas.values() if r.pool == POOL_BURST]
    return (any(has_room(r, route.max_inflight, now) for r in burst)
            and not any(has_room(r, route.max_inflight, now) for r in primary))


def record_success(replica: Replica) -> None:
    replica.consecutive_failures = 0


def record_failure(route: ModelRoute, replica: Replica, now: float, policy: EjectionPolicy) -> bool:
    """Count an error or timeout; True when this one ejected the replica."""
    replica.consecutive_failures += 1
    if replica.consecutive_failures < policy.consecutive_failures or replica.ejected(now):
        return False
    total = len(route.replicas)
    ejected = sum(1 for r in route.replicas.values() if r.ejected(now))
    if total == 0 or (ejected + 1) > policy.max_fraction * total:
        return False
    replica.ejections += 1
    replica.ejected_until = now + min(policy.max_seconds, policy.base_seconds * replica.ejections)
    replica.consecutive_failures = 0
    return True
