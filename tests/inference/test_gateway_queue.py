"""The model's wait queue cannot leak: whatever awaits a request is cancelled at, the accounting stays exact and an
idle replica takes the next request at once (issue 37.1: a waiter woken by a release and cancelled before it ran
kept its wake-up, and the model answered 429 to everything until the gateway restarted)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from inference.access import Access
from inference.discovery import RouteSpec
from inference.gateway.server import Gateway, LiveRoute, Rejected, Settings
from inference.routing import Replica, ReplicaSpec


def gateway(replicas: int = 1, slots: int = 2, queue: int = 2, queue_timeout: float = 30.0) -> tuple[Gateway, LiveRoute]:
    gw = Gateway(Settings(auth=False, queue_timeout=queue_timeout), rng=random.Random(7))
    specs = tuple(ReplicaSpec(url=f"http://10.0.0.{i}:8000", pod=f"p{i}") for i in range(replicas))
    gw.apply({"m": RouteSpec("m", "ns/e", Access.from_spec("ns", {}), max_inflight=slots, max_queue=queue,
                             replicas=specs)}, {}, [])
    return gw, gw.routes["m"]


def gauge(gw: Gateway, name: str) -> float:
    value = gw.metrics.registry.get_sample_value(f"accelstack_gateway_{name}", {"model": "m"})
    return value or 0.0


async def takes_at_once(gw: Gateway, live: LiveRoute) -> bool:
    """An idle model serves a new request without waiting: its acquire finishes in one step of the loop."""
    task = asyncio.ensure_future(gw._acquire(live, []))
    await asyncio.sleep(0)
    done = task.done() and not task.cancelled() and task.exception() is None
    if done:
        gw._release(live, task.result())
    else:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return done


async def test_waiter_woken_then_cancelled_before_it_runs_gives_its_wakeup_back() -> None:
    gw, live = gateway(replicas=1, slots=2, queue=2)
    a = await gw._acquire(live, [])
    b = await gw._acquire(live, [])
    c = asyncio.ensure_future(gw._acquire(live, []))
    await asyncio.sleep(0)
    assert gauge(gw, "queue_depth") == 1
    # in one step of the loop, before c runs again: its client gives up (the handler is cancelled) and a release
    # wakes it; c's next step raises CancelledError, so it never takes the slot it was woken for
    c.cancel()
    gw._release(live, a)
    outcome = (await asyncio.gather(c, return_exceptions=True))[0]
    assert isinstance(outcome, asyncio.CancelledError)
    gw._release(live, b)
    replica = live.core.replicas["http://10.0.0.0:8000"]
    assert replica.outstanding == 0 and gauge(gw, "queue_depth") == 0
    assert await takes_at_once(gw, live), "an idle replica must take the next request at once"
    assert await takes_at_once(gw, live)


async def test_woken_waiter_cancelled_passes_its_slot_to_the_next_in_line() -> None:
    gw, live = gateway(replicas=1, slots=1, queue=4)
    a = await gw._acquire(live, [])
    second = asyncio.ensure_future(gw._acquire(live, []))
    third = asyncio.ensure_future(gw._acquire(live, []))
    await asyncio.sleep(0)
    second.cancel()  # gone before it ran: third must get the slot without waiting for another release
    gw._release(live, a)  # wakes second
    got = await asyncio.wait_for(third, timeout=30)
    assert got.outstanding == 1
    await asyncio.gather(second, return_exceptions=True)


async def test_woken_at_its_deadline_takes_the_slot_or_hands_it_on() -> None:
    """A wake-up that lands as the queue timeout fires is never lost, whichever wins."""
    gw, live = gateway(replicas=1, slots=1, queue=4, queue_timeout=0.02)
    a = await gw._acquire(live, [])
    waiting = asyncio.ensure_future(gw._acquire(live, []))
    await asyncio.sleep(0.03)  # its deadline has passed, it has not run yet
    gw._release(live, a)
    outcome = (await asyncio.gather(waiting, return_exceptions=True))[0]
    if isinstance(outcome, Replica):
        gw._release(live, outcome)
    else:
        assert isinstance(outcome, Rejected) and outcome.status == 429
    assert await takes_at_once(gw, live)


def check(gw: Gateway, live: LiveRoute, holding: dict[str, int]) -> None:
    """The invariant, checked between any two steps of the event loop."""
    assert all(not w.future.done() for w in live.waiters), "a queued waiter was already woken"
    assert all(w.future.done() for w in live.woken), "a woken waiter was not woken"
    assert not set(live.waiters) & live.woken
    for url, replica in live.core.replicas.items():
        assert replica.outstanding == holding.get(url, 0), f"{url}: outstanding drifted from the requests there"
    free = sum(live.core.max_inflight - r.outstanding for r in live.core.replicas.values())
    assert len(live.woken) <= free, "more wake-ups pending than free slots"
    assert gw.stalled(live) == 0, "a request waits while a slot is free and nobody was woken"
    assert gauge(gw, "queue_depth") == len(live.waiters) + len(live.woken)


@pytest.mark.parametrize("seed", range(40))
async def test_random_cancellations_at_every_await_never_leak(seed: int) -> None:
    rng = random.Random(seed)
    gw, live = gateway(replicas=rng.choice((1, 2, 3)), slots=rng.choice((1, 2, 3)), queue=rng.choice((1, 2, 4, 8)),
                       queue_timeout=rng.choice((0.0, 0.005, 30.0)))
    holding: dict[str, int] = {}

    async def client(hold: int) -> None:
        replica = await gw._acquire(live, [])
        holding[replica.url] = holding.get(replica.url, 0) + 1
        try:
            for _ in range(hold):
                await asyncio.sleep(0)
        finally:
            holding[replica.url] -= 1
            gw._release(live, replica)

    tasks: list[asyncio.Task[Any]] = []
    for _ in range(60):  # steps of the loop; at each, clients arrive and random ones are cancelled
        for _ in range(rng.randrange(3)):
            tasks.append(asyncio.ensure_future(client(rng.randrange(4))))
        alive = [t for t in tasks if not t.done()]
        for task in alive:
            if rng.random() < 0.15:
                task.cancel()
        await asyncio.sleep(0)
        check(gw, live, holding)
    await asyncio.gather(*tasks, return_exceptions=True)
    check(gw, live, holding)
    assert not live.waiters and not live.woken and not any(holding.values())
    assert gauge(gw, "queue_depth") == 0
    assert await takes_at_once(gw, live), "the idle model must take the next request at once"
