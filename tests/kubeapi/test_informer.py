"""Informers resume watches from the last resourceVersion and relist after 410 Gone."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from kubeapi.client import connected
from kubeapi.informer import Informer
from kubeapi.resources import NODES
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import node, wait_until


async def test_resume_then_relist_after_410() -> None:
    peer = APIServerPeer()
    await peer.start()
    await peer.put_object("api/v1/nodes", node("a"))
    kube_cm = connected(peer.url, field_manager="test")
    kube = await kube_cm.__aenter__()
    state: dict[str, dict[str, Any]] = {}
    events: list[str] = []

    def on_event(kind: str, obj: dict[str, Any]) -> None:
        events.append(kind)
        if kind == "DELETED":
            state.pop(obj["metadata"]["name"], None)
        else:
            state[obj["metadata"]["name"]] = obj

    def on_sync(items: list[dict[str, Any]]) -> None:
        state.clear()
        state.update({o["metadata"]["name"]: o for o in items})

    informer = Informer(kube, NODES, on_event, on_sync, watch_timeout=(1, 1), backoff=(0.05, 0.1))
    stop = asyncio.Event()
    task = asyncio.create_task(informer.run(stop))
    try:
        await informer.synced.wait()
        assert set(state) == {"a"} and informer.relists == 1
        await peer.put_object("api/v1/nodes", node("b"))
        await wait_until(lambda: "b" in state)
        await asyncio.sleep(1.3)  # the server ends the watch; the informer resumes from its resourceVersion
        watches = [q for m, q in peer.requests if "watch=true" in q]
        assert len(watches) >= 2 and f"resourceVersion={informer.resource_version}" in watches[-1]
        assert informer.relists == 1
        # history compacted: the open watch ends with 410, the resume from the old version gets 410 too, and
        # the informer relists; changes made meanwhile are not lost
        peer.compact()
        await peer.delete_object("api/v1/nodes", "", "a")
        await peer.put_object("api/v1/nodes", node("c"))
        await wait_until(lambda: informer.relists == 2, timeout=5)
        await peer.put_object("api/v1/nodes", node("d"))
        await wait_until(lambda: set(state) == {"b", "c", "d"}, timeout=5)
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube_cm.__aexit__(None, None, None)
        await peer.stop()


async def test_a_burst_of_events_never_holds_the_loop(monkeypatch: Any) -> None:
    """Watch events that arrive together are read from the buffer without a pause; the informer gives the loop
    back every millisecond of handling, so a request on the same loop waits for one slice, not for the burst."""
    import time

    import kubeapi.informer as informer_module

    async def worst_gap(yield_after: float, burst: int) -> tuple[float, int]:
        monkeypatch.setattr(informer_module, "YIELD_AFTER", yield_after)
        peer = APIServerPeer()
        await peer.start()
        kube_cm = connected(peer.url, field_manager="test")
        kube = await kube_cm.__aenter__()
        seen: list[str] = []

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            until = time.perf_counter() + 0.0003  # an event's handling: decode, view update
            while time.perf_counter() < until:
                pass
            seen.append(obj["metadata"]["name"])

        informer = Informer(kube, NODES, on_event, lambda items: None, watch_timeout=(30, 30))
        stop = asyncio.Event()
        task = asyncio.create_task(informer.run(stop))
        gaps: list[float] = []
        try:
            await informer.synced.wait()
            await asyncio.sleep(0.2)  # the watch is open
            # the peer writes the burst in a few large chunks (one loop: the client reads what is buffered)
            for i in range(burst):
                await peer.put_object("api/v1/nodes", node(f"n{i}"))
            time.sleep(0.3)
            last = time.perf_counter()
            while len(seen) < burst:
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            return max(gaps), len(seen)
        finally:
            stop.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await kube_cm.__aexit__(None, None, None)
            await peer.stop()

    held, seen_all = await worst_gap(float("inf"), 300)
    assert seen_all == 300
    assert held > 0.02, f"the burst did not arrive at once ({held * 1000:.1f} ms): the test proves nothing"
    # the best of up to three tries: a machine that pauses this process once (the suite runs on 2 busy cores)
    # lengthens one gap of one try; an informer that holds the loop lengthens a gap in every try. Against the
    # unsliced burst measured on the same machine, not in milliseconds: a loaded machine stretches both
    sliced = math.inf
    for _ in range(3):
        gap, seen_all = await worst_gap(0.001, 300)
        assert seen_all == 300
        sliced = min(sliced, gap)
        if sliced < held / 3:
            break
    assert sliced < held / 3, (sliced, held)


async def test_a_relist_taken_in_slices_is_awaited_before_events_and_readiness() -> None:
    """An ``on_sync`` that is a coroutine function (a view that takes a large relist in slices) is awaited: the
    informer is synced only when it has finished, and the watch's events come after it, never in the middle."""
    peer = APIServerPeer()
    await peer.start()
    for name in ("a", "b"):
        await peer.put_object("api/v1/nodes", node(name))
    kube_cm = connected(peer.url, field_manager="test")
    kube = await kube_cm.__aenter__()
    log: list[str] = []
    release = asyncio.Event()

    async def on_sync(items: list[dict[str, Any]]) -> None:
        log.append("sync started")
        await release.wait()  # as if the slices took a while; the loop runs other work meanwhile
        log.append("sync done: " + ",".join(sorted(o["metadata"]["name"] for o in items)))

    informer = Informer(kube, NODES, lambda kind, obj: log.append(f"{kind} {obj['metadata']['name']}"), on_sync,
                        watch_timeout=(30, 30))
    stop = asyncio.Event()
    task = asyncio.create_task(informer.run(stop))
    try:
        await wait_until(lambda: log == ["sync started"])
        await peer.put_object("api/v1/nodes", node("c"))
        await asyncio.sleep(0.2)
        assert not informer.synced.is_set() and log == ["sync started"]
        release.set()
        await informer.synced.wait()
        await wait_until(lambda: log[-1:] == ["ADDED c"])
        assert log == ["sync started", "sync done: a,b", "ADDED c"]
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube_cm.__aexit__(None, None, None)
        await peer.stop()


class _Outage:
    """A client whose API server can be taken away: while ``down`` every watch is refused (no answer at all);
    lists are never reached after the first, as a watch resumes from its resourceVersion."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        from kubeapi.metrics import api_metrics

        self.metrics = api_metrics(CollectorRegistry())
        self.down = False
        self.lists = 0

    async def list_raw(self, *_: Any, **__: Any) -> tuple[list[bytes], str]:
        self.lists += 1
        return [b'{"metadata": {"name": "a", "resourceVersion": "1"}}'], "1"

    async def watch(self, *_: Any, on_open: Any = None, **__: Any) -> Any:
        from kubeapi.errors import TransportError

        if self.down:
            raise TransportError("watch nodes: ClientConnectorError: Connect call failed ('127.0.0.1', 6443)")
        if on_open is not None:
            on_open()
        await asyncio.sleep(0.02)
        return
        yield  # an async generator that ends without an event, as a watch the server closes


async def test_health_is_false_while_the_api_server_is_unreachable_and_back_once_a_watch_is_answered() -> None:
    """Docs: not healthy (so /readyz 503) while the server cannot be reached; before, a refused watch only
    logged "watch failed; resuming" and the informer stayed healthy through a 70 s outage."""
    client = _Outage()
    informer = Informer(client, NODES, lambda k, o: None, lambda items: None,  # type: ignore[arg-type]
                        backoff=(0.01, 0.05))
    stop = asyncio.Event()
    task = asyncio.create_task(informer.run(stop))
    try:
        await wait_until(lambda: informer.healthy and informer.synced.is_set())
        client.down = True
        await wait_until(lambda: not informer.healthy)
        assert "Connect call failed" in informer.last_error
        client.down = False
        await wait_until(lambda: informer.healthy)
        assert client.lists == 1  # recovered by the watch being answered again, without a relist
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_until_the_first_list_succeeds_retries_are_at_most_4s_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extender started before its RBAC: with the full 30 s cap its lists were 9-16 s apart by the 30 s start
    deadline, so RBAC that came back 8 s before it was never seen (issue 35.7)."""
    import random

    from kubeapi.errors import Forbidden

    client = _Outage()
    refusals = 12
    listed = client.list_raw

    async def list_raw(*a: Any, **k: Any) -> tuple[list[bytes], str]:
        nonlocal refusals
        if refusals:
            refusals -= 1
            raise Forbidden(403, "Forbidden", "nodes is forbidden: User cannot list resource")
        return await listed(*a, **k)

    monkeypatch.setattr(client, "list_raw", list_raw)
    gaps: list[float] = []

    async def pause(_: asyncio.Event, seconds: float) -> None:
        gaps.append(seconds)

    informer = Informer(client, NODES, lambda k, o: None, lambda items: None,  # type: ignore[arg-type]
                        rng=random.Random(7))
    monkeypatch.setattr(informer, "_pause", pause)
    stop = asyncio.Event()
    task = asyncio.create_task(informer.run(stop))
    try:
        await wait_until(lambda: informer.synced.is_set())
        assert len(gaps) >= 12 and max(gaps[:12]) <= 4.0, gaps
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_after_an_outage_retries_are_at_most_4s_apart_until_a_watch_is_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3 s API-server restart: the watches met refused connections, then a starting server's 503s; with the 30 s
    cap the extender stayed unready (/readyz 503) for up to 30 s after the server was back. While the informer is
    not healthy and only its watch fails, retries are at most 4 s apart; a failing relist keeps the full cap."""
    import random

    from kubeapi.errors import ApiError

    client = _Outage()
    answers: list[str] = ["refused"] * 10 + ["starting"] * 4
    watched = client.watch

    def watch(*a: Any, **k: Any) -> Any:
        if answers:
            kind = answers.pop(0)
            if kind == "starting":
                raise ApiError(503, "ServiceUnavailable", "the server is currently unable to handle the request")
            client.down = True
        else:
            client.down = False
        return watched(*a, **k)

    gaps: list[float] = []

    async def pause(_: asyncio.Event, seconds: float) -> None:
        gaps.append(seconds)
        await asyncio.sleep(0)

    informer = Informer(client, NODES, lambda k, o: None, lambda items: None,  # type: ignore[arg-type]
                        rng=random.Random(3))
    monkeypatch.setattr(client, "watch", watch)
    monkeypatch.setattr(informer, "_pause", pause)
    stop = asyncio.Event()
    task = asyncio.create_task(informer.run(stop))
    try:
        await wait_until(lambda: informer.synced.is_set() and not answers and informer.healthy)
        assert len(gaps) >= 14 and max(gaps[:14]) <= 4.0, gaps
        assert client.lists == 1
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
