"""The client layer against an API server that misbehaves (issue #10, points 4 and 5): error answers are never
data, a storm of retries never happens, a half-open watch ends, 410 relists, bookmarks move the resourceVersion,
lists are paginated, every call has a timeout, writes carry the field manager; leader election with client-go's
semantics (renew deadline, local observation of expiry, a hung or failing renewal ends leadership cleanly)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kubeapi import ApiError, NotFound, TransportError
from kubeapi.client import KubeClient, connected
from kubeapi.informer import Informer
from kubeapi.leader import LeaderElector
from kubeapi.resources import GPRS, NODES
from kubeapi.tasks import supervise, while_leading
from tests.apiserver_peer import PROXY_502_HTML, APIServerPeer
from tests.extender.harness import gpr, node, wait_until


@pytest.fixture
async def peer() -> AsyncIterator[APIServerPeer]:
    p = APIServerPeer(bookmark_interval=0.2)
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def kube(peer: APIServerPeer) -> AsyncIterator[KubeClient]:
    async with connected(peer.url, field_manager="accelstack-test", timeout=1.0, backoff_base=0.05,
                         backoff_cap=0.2) as client:
        yield client


class Store:
    """What an informer's callbacks built."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.syncs = 0

    def on_event(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.items.pop(name, None)
        else:
            self.items[name] = obj

    def on_sync(self, items: list[dict[str, Any]]) -> None:
        self.syncs += 1
        self.items = {o["metadata"]["name"]: o for o in items}


async def run_informer(informer: Informer) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    return stop, asyncio.create_task(informer.run(stop))


async def finish(stop: asyncio.Event, task: asyncio.Task[None]) -> None:
    stop.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("code", [403, 404, 429, 500, 503])
async def test_a_list_error_is_never_data_and_is_retried_with_backoff(peer: APIServerPeer, kube: KubeClient,
                                                                      code: int) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    fault = peer.inject("GET", "nodes", verb="list", status=code)
    store = Store()
    informer = Informer(kube, NODES, store.on_event, store.on_sync, backoff=(0.05, 0.5))
    mark = peer.mark()
    stop, task = await run_informer(informer)
    try:
        await asyncio.sleep(1.5)
        assert not informer.synced.is_set() and not informer.healthy and store.syncs == 0
        assert str(code) in informer.last_error
        # retried, but with backoff: no storm (the old informer made ~590 requests/s here)
        # (each informer attempt is a client call that itself retries transient answers a few times)
        assert 2 <= peer.count(method="GET", resource="nodes", verb="list") <= 40
        assert peer.max_rate(resource="nodes", verb="list", window=1.0, since=mark) < 30
        fault.remove()
        await wait_until(lambda: informer.healthy and set(store.items) == {"a"}, timeout=5)
    finally:
        await finish(stop, task)


async def test_a_failing_relist_keeps_what_the_view_has(peer: APIServerPeer, kube: KubeClient) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    store = Store()
    informer = Informer(kube, NODES, store.on_event, store.on_sync, backoff=(0.05, 0.2), watch_timeout=(30, 30))
    stop, task = await run_informer(informer)
    try:
        await wait_until(lambda: informer.healthy and set(store.items) == {"a"})
        fault = peer.inject("GET", "nodes", verb="list", status=500)
        peer.inject("GET", "nodes", watch=True, watch_error=410, times=1)  # the next watch expires, and
        peer.compact()  # the open one ends with 410: the informer must relist, and the relist fails
        await wait_until(lambda: not informer.healthy)
        await asyncio.sleep(0.3)
        assert set(store.items) == {"a"}  # an error body did not wipe the view
        fault.remove()
        await peer.put_object("api/v1/nodes", node("b"))
        await wait_until(lambda: informer.healthy and set(store.items) == {"a", "b"})
    finally:
        await finish(stop, task)


async def test_watch_errors_are_not_events_and_do_not_spin(peer: APIServerPeer, kube: KubeClient) -> None:
    await peer.put_object(GPRS.path("default").lstrip("/").rsplit("/namespaces", 1)[0] + "/gpuprovisioningrequests",
                          gpr("g", phase=None))
    peer.inject("GET", "gpuprovisioningrequests", watch=True, status=500)
    store = Store()
    events: list[str] = []
    informer = Informer(kube, GPRS, lambda k, o: events.append(k), store.on_sync, backoff=(0.05, 0.5))
    stop, task = await run_informer(informer)
    try:
        await wait_until(lambda: informer.synced.is_set())
        await asyncio.sleep(1.5)
        assert events == []  # the error answers were not taken for events
        watches = peer.count(method="GET", resource="gpuprovisioningrequests", watch=True)
        assert 2 <= watches <= 20
        assert informer.healthy  # the list works: the view is current as of the last list
    finally:
        await finish(stop, task)


async def test_a_half_open_watch_ends_by_read_timeout(peer: APIServerPeer, kube: KubeClient) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    peer.inject("GET", "nodes", watch=True, half_open=True, times=1)
    store = Store()
    informer = Informer(kube, NODES, store.on_event, store.on_sync, watch_timeout=(1, 1), read_margin=0.5,
                        backoff=(0.05, 0.2))
    stop, task = await run_informer(informer)
    try:
        await wait_until(lambda: informer.synced.is_set())
        await peer.put_object("api/v1/nodes", node("b"))  # sent while the first watch is silent
        await wait_until(lambda: "b" in store.items, timeout=6)
        assert peer.count(method="GET", resource="nodes", watch=True) >= 2
        assert informer.relists == 1  # resumed from its resourceVersion: nothing lost, no relist needed
    finally:
        await finish(stop, task)


async def test_410_relists_and_bookmarks_move_the_resource_version(peer: APIServerPeer, kube: KubeClient) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    store = Store()
    informer = Informer(kube, NODES, store.on_event, store.on_sync, watch_timeout=(30, 30), backoff=(0.05, 0.2))
    stop, task = await run_informer(informer)
    try:
        await wait_until(lambda: informer.synced.is_set())
        seen = informer.resource_version
        await peer.put_object("api/v1/pods", {"metadata": {"name": "x", "namespace": "default"}, "spec": {}})
        # a change to another kind moves the server's revision; a bookmark brings it to this watch
        await wait_until(lambda: int(informer.resource_version) > int(seen), timeout=3)
        assert informer.relists == 1
        peer.inject("GET", "nodes", watch=True, watch_error=410, times=1)
        peer.compact()
        await peer.put_object("api/v1/nodes", node("c"))
        await wait_until(lambda: informer.relists >= 2 and "c" in store.items, timeout=5)
    finally:
        await finish(stop, task)


async def test_lists_are_paginated(peer: APIServerPeer, kube: KubeClient) -> None:
    for i in range(1_201):
        await peer.put_object("api/v1/nodes", node(f"n{i:04d}"))
    items, rv = await kube.list(NODES, page_size=500)
    assert len(items) == 1_201 and rv
    lists = peer.calls(method="GET", resource="nodes", verb="list")
    assert len(lists) == 3 and all(r.query.get("limit") == "500" for r in lists)


async def test_calls_time_out_retry_reads_and_never_retry_writes_blindly(peer: APIServerPeer,
                                                                          kube: KubeClient) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    with peer.inject("GET", "nodes", name="a", hang=True):
        started = time.monotonic()
        with pytest.raises(TransportError):
            await kube.get(NODES, "a", timeout=0.3)
        assert time.monotonic() - started < 3  # bounded: 0.3 s per attempt, a few attempts, short backoff
    peer.inject("GET", "nodes", name="a", status=503, retry_after=0, times=2)
    assert (await kube.get(NODES, "a"))["metadata"]["name"] == "a"  # retried past two 503s
    peer.inject("GET", "nodes", name="a", body=PROXY_502_HTML, status=502, times=10)
    with pytest.raises(ApiError) as err:
        await kube.get(NODES, "a")
    assert err.value.status == 502 and "html" in err.value.message.lower()
    before = peer.count(method="PATCH", resource="nodes")
    with peer.inject("PATCH", "nodes", status=500), pytest.raises(ApiError):
        await kube.patch(NODES, "a", {"metadata": {"labels": {"x": "y"}}})
    assert peer.count(method="PATCH", resource="nodes") == before + 1  # a write's outcome is the caller's call
    with pytest.raises(NotFound):
        await kube.get(NODES, "nope")
    written = await kube.patch(NODES, "a", {"metadata": {"labels": {"x": "y"}}})
    assert "accelstack-test" in {m["manager"] for m in written["metadata"]["managedFields"]}


async def test_a_cancellation_that_lands_with_the_calls_own_timeout_is_not_swallowed(peer: APIServerPeer) -> None:
    # the caller's deadline and the call's timeout expire in the same tick: the caller's cancellation wins, and
    # the call is not retried past it (aiohttp's own total timer turned it into a retried timeout 17 times in 20)
    await peer.put_object("api/v1/nodes", node("a"))
    async with connected(peer.url, field_manager="t", timeout=0.1, backoff_base=0.01, backoff_cap=0.02,
                         max_retries=20) as kube:
        with peer.inject("GET", "nodes", name="a", hang=True):
            for _ in range(8):
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(kube.get(NODES, "a"), 0.1)
                assert time.monotonic() - started < 1.5  # 20 retries of 0.1 s would take over 2 s (17: 1.7 s)


def elector(kube: KubeClient, identity: str, **kw: Any) -> LeaderElector:
    return LeaderElector(kube, "ns", "lease", identity, lease_duration=kw.get("lease", 1.5),
                         renew_deadline=kw.get("deadline", 1.0), retry_period=kw.get("retry", 0.2))


@pytest.mark.parametrize("fault", [{"status": 500}, {"hang": True}, {"status": 409}])
async def test_a_renewal_that_fails_or_hangs_ends_leadership_within_the_renew_deadline(
        peer: APIServerPeer, kube: KubeClient, fault: dict[str, Any]) -> None:
    e = elector(kube, "me", lease=4.0, deadline=2.0, retry=0.3)
    stop = asyncio.Event()
    task = asyncio.create_task(e.run(stop))
    try:
        await wait_until(lambda: e.leading.is_set())
        broken = peer.inject("PUT", "leases", **fault)
        lost_at = time.monotonic()
        await wait_until(lambda: not e.leading.is_set(), timeout=6)
        assert time.monotonic() - lost_at < e.lease_duration  # before anyone else may take it
        assert not task.done()  # the election loop survived the errors
        broken.remove()
        await wait_until(lambda: e.leading.is_set(), timeout=5)  # and leads again once the server answers
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)


async def test_expiry_is_judged_by_the_local_clock_not_the_holders(peer: APIServerPeer, kube: KubeClient) -> None:
    # a holder whose clock runs an hour ahead stopped renewing: it still expires after the lease duration
    await peer.put_lease("ns", "lease", "other", skew=3600, duration=1)
    e = elector(kube, "me", lease=1.5, deadline=1.0)
    stop = asyncio.Event()
    task = asyncio.create_task(e.run(stop))
    try:
        started = time.monotonic()
        await wait_until(lambda: e.leading.is_set(), timeout=5)
        assert time.monotonic() - started >= 0.9  # not before its lease duration of silence had passed
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
    # a holder whose clock runs an hour behind but keeps renewing is never taken over
    await peer.put_lease("ns", "lease", "other", skew=-3600, duration=1)
    e2 = elector(kube, "me2", lease=1.5, deadline=1.0)
    stop2 = asyncio.Event()
    task2 = asyncio.create_task(e2.run(stop2))
    try:
        for _ in range(10):
            await peer.put_lease("ns", "lease", "other", skew=-3600, duration=1)  # it renews (behind)
            await asyncio.sleep(0.2)
            assert not e2.leading.is_set()
    finally:
        stop2.set()
        await asyncio.gather(task2, return_exceptions=True)


async def test_one_leader_at_a_time_and_leader_work_stops_with_the_term(peer: APIServerPeer,
                                                                        kube: KubeClient) -> None:
    a, b = elector(kube, "a"), elector(kube, "b")
    stop = asyncio.Event()
    working: dict[str, int] = {"a": 0, "b": 0}

    def work(name: str) -> Any:
        async def run(term: asyncio.Event) -> None:
            working[name] += 1
            try:
                await term.wait()
            finally:
                working[name] -= 1
        return run

    tasks = [asyncio.create_task(a.run(stop)), asyncio.create_task(b.run(stop)),
             asyncio.create_task(while_leading(a, stop, {"w": work("a")})),
             asyncio.create_task(while_leading(b, stop, {"w": work("b")}))]
    try:
        await wait_until(lambda: a.leading.is_set() or b.leading.is_set())
        leader, name = (a, "a") if a.leading.is_set() else (b, "b")
        other = "b" if name == "a" else "a"
        await wait_until(lambda: working[name] == 1)
        with peer.inject("PUT", "leases", when=lambda r: True, status=500):
            await wait_until(lambda: not leader.leading.is_set(), timeout=3)
            await wait_until(lambda: working[name] == 0, timeout=1)  # its leader work was cancelled
        await wait_until(lambda: a.leading.is_set() or b.leading.is_set(), timeout=5)
        for _ in range(20):
            assert not (a.leading.is_set() and b.leading.is_set())
            assert working["a"] + working["b"] <= 1
            await asyncio.sleep(0.05)
        assert working[other] + working[name] == 1
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_crashed_background_task_is_restarted() -> None:
    runs: list[int] = []
    stop = asyncio.Event()

    async def flaky(_: asyncio.Event) -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("boom")
        await stop.wait()

    task = asyncio.create_task(supervise("flaky", flaky, stop, backoff=(0.01, 0.02)))
    await wait_until(lambda: len(runs) == 3)
    stop.set()
    await asyncio.wait_for(task, 2)


def test_gc_pauses_are_measured_per_generation() -> None:
    import gc

    from prometheus_client import CollectorRegistry

    from kubeapi.metrics import api_metrics

    registry = CollectorRegistry()
    api_metrics(registry)

    def count(generation: str) -> float:
        return registry.get_sample_value("accelstack_gc_pause_seconds_count", {"generation": generation}) or 0.0

    before = count("2")
    gc.collect(2)
    gc.collect(2)
    assert count("2") == before + 2
    total = registry.get_sample_value("accelstack_gc_pause_seconds_sum", {"generation": "2"})
    assert total is not None and total > 0


def real_node(name: str) -> dict[str, Any]:
    """A node the size a real cluster's are (18 KB: 60 feature labels, managedFields, 50 images)."""
    obj = node(name, gpus=8)
    obj["metadata"]["labels"] = {f"nvidia.com/gpu.feature-{i}": f"value-{i}-xxxxxxxx" for i in range(60)}
    obj["metadata"]["managedFields"] = [
        {"manager": f"m{i}", "operation": "Update", "apiVersion": "v1", "time": "2026-11-30T00:00:00Z",
         "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {f"f:l{j}": {} for j in range(40)}}}}
        for i in range(6)]
    obj["status"]["images"] = [{"names": [f"registry.example.com/team/image-{i}@sha256:{'a' * 64}",
                                          f"registry.example.com/team/image-{i}:v1.2.{i}"], "sizeBytes": 123456789}
                               for i in range(50)]
    return obj


async def test_a_relist_of_real_sized_objects_gives_the_loop_back(peer: APIServerPeer, kube: KubeClient) -> None:
    """A relist of real-sized nodes (18 KB each) into the extender's view never holds the loop for long: the
    items are decoded as the view reads them, in slices, the cyclic collector is held off meanwhile (full
    collections of 60-130 ms each, set off by the decoded survivors, were the longest stretch), and what the
    swap replaced is freed a slice at a time. Before: a page of 500 such nodes decoded at once held the loop
    70-180 ms. A plain ``on_sync`` gets the same objects, decoded beforehand (a consumer that keeps a million
    new objects pays one young collection over them when the pause ends). The pages come from the peer first;
    the relists measured are handed those same pages (the peer, in this process, would be measured too)."""
    from scheduler_extender.objects.cluster import ClusterView
    from tests.extender.harness import hold_share

    for i in range(1000):
        await peer.put_object("api/v1/nodes", real_node(f"n{i:04}"))
    raw, rv = await kube.list_raw(NODES, page_size=100)
    assert len(raw) == 1000 and rv
    assert 10 <= peer.count(method="GET", resource="nodes", verb="list") <= 11  # paginated

    class Pages:  # the pages as the client returned them, handed out again
        metrics = kube.metrics

        async def list_raw(self, *args: Any, **kwargs: Any) -> tuple[list[Any], str]:
            return raw, rv

    store, view = Store(), ClusterView()
    eager = Informer(Pages(), NODES, store.on_event, store.on_sync)  # type: ignore[arg-type]
    lazy = Informer(Pages(), NODES, view.on_node, view.resync_nodes, lazy=True)  # type: ignore[arg-type]
    await eager._list()
    assert eager.synced.is_set() and eager.resource_version == rv
    shares = []
    for _ in range(3):
        share, _ = await hold_share(lazy._list)
        shares.append(share)
    assert min(shares) < 0.2, shares
    assert lazy.synced.is_set() and lazy.resource_version == rv
    assert sorted(store.items) == sorted(view.nodes) == [f"n{i:04}" for i in range(1000)]
    assert store.items["n0007"]["status"]["images"] == peer.objects["api/v1/nodes", "", "n0007"]["status"]["images"]
    assert view.nodes["n0007"].allocatable == {"nvidia.com/gpu": 8}
    assert gc.isenabled()  # the pause ended with the relist


@pytest.mark.parametrize("body", [b'{"metadata": {}, "items": [1]}', b'{"metadata": {}, "items": [{"a": }]}',
                                  b'{"items": {"not": "a list"}}', b'[]'])
async def test_a_list_answer_that_is_not_a_list_of_objects_is_an_error(peer: APIServerPeer, kube: KubeClient,
                                                                       body: bytes) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    fault = peer.inject("GET", "nodes", verb="list", status=200, body=body, content_type="application/json")
    store = Store()
    informer = Informer(kube, NODES, store.on_event, store.on_sync, backoff=(0.05, 0.2))
    stop, task = await run_informer(informer)
    try:
        await wait_until(lambda: "BadList" in informer.last_error or "500" in informer.last_error)
        assert not informer.synced.is_set() and store.syncs == 0
        fault.remove()
        await wait_until(lambda: informer.healthy and set(store.items) == {"a"}, timeout=5)
    finally:
        await finish(stop, task)


async def test_list_until_retries_a_failing_list_and_gives_up_when_told(peer: APIServerPeer,
                                                                        kube: KubeClient) -> None:
    """What a new leader reads before it acts (the controller's GPRs, the binder's pods): a failing list is tried
    again after a backoff, each failure reported once, until it succeeds; a stop ends the tries with None."""
    await peer.put_object("api/v1/nodes", node("n0"))
    broken = peer.inject("GET", "nodes", watch=False, status=500)  # every try fails (the client's own retries too)
    failures: list[ApiError] = []
    task = asyncio.create_task(kube.list_until(NODES, asyncio.Event(), failures.append))
    await wait_until(lambda: len(failures) >= 2, timeout=15)
    assert not task.done() and {exc.status for exc in failures} == {500}
    broken.remove()
    listed = await asyncio.wait_for(task, 15)
    assert listed is not None and [o["metadata"]["name"] for o in listed[0]] == ["n0"]
    peer.inject("GET", "nodes", watch=False, status=503)
    stop = asyncio.Event()
    task = asyncio.create_task(kube.list_until(NODES, stop, failures.append))
    seen = len(failures)
    await wait_until(lambda: len(failures) > seen, timeout=15)
    stop.set()
    assert await asyncio.wait_for(task, 15) is None
