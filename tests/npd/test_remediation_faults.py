"""The remediation controller process against an API server that misbehaves (issue #10): a list that fails is
never taken for "no nodes" (not ready, retried with backoff, no taint added or lifted on what it cannot see), a
stale write is refused and decided again on a fresh read, a half-open watch ends and a later change is still
acted on, and every write carries the controller's field manager."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kubeapi.client import KubeClient, connected
from npd.remediation import FIELD_MANAGER, HEALTHY_SINCE_ANNOTATION, RemediationMetrics, RemediationProcess
from tests.apiserver_peer import APIServerPeer
from tests.apiserver_peer import status as status_answer
from tests.npd.test_remediation import KEY, NODES, annotations_of, node, set_condition, settings, taints_of


@pytest.fixture
async def peer() -> AsyncIterator[APIServerPeer]:
    p = APIServerPeer(bookmark_interval=0.2)
    await p.start()
    yield p
    await p.stop()


class Running:
    """A RemediationProcess on the peer, with its /readyz and /metrics on an ephemeral port."""

    def __init__(self, process: RemediationProcess, kube: KubeClient) -> None:
        self.process = process
        self.controller = process.controller
        self.kube = kube
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def get(self, path: str) -> tuple[int, str]:
        endpoint = self.process.endpoint
        assert endpoint is not None
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{endpoint.port}{path}") as r:
            return r.status, await r.text()


@pytest.fixture
async def start(peer: APIServerPeer) -> AsyncIterator[Any]:
    running: list[Running] = []

    async def start_process(*flags: str, **options: Any) -> Running:
        metrics = RemediationMetrics()
        kube = await stack.enter_async_context(connected(
            peer.url, field_manager=FIELD_MANAGER, timeout=1.0, backoff_base=0.05, backoff_cap=0.2,
            registry=metrics.registry))
        values = dict(settings("--remediation-metrics-address", "127.0.0.1:0", "--remediation-resync", "30s",
                               *flags))
        options = {"watch_timeout": (30, 30), "backoff": (0.05, 0.5), **options}
        run = Running(RemediationProcess(kube, values, metrics, **options), kube)
        run.task = asyncio.create_task(run.process.run(run.stop))
        running.append(run)
        await wait_for(lambda: run.process.endpoint is not None, 2)
        return run

    async with contextlib.AsyncExitStack() as stack:
        try:
            yield start_process
        finally:
            for run in running:
                run.stop.set()
                assert run.task is not None
                await asyncio.wait_for(run.task, 5)  # stops by itself, nothing left hanging


async def wait_for(predicate: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def wait_ready(run: Running, want: bool, seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while (await run.get("/readyz"))[0] != (200 if want else 503):
        assert time.monotonic() < deadline, f"/readyz never became {'200' if want else '503'}"
        await asyncio.sleep(0.05)


def writes(peer: APIServerPeer, **match: Any) -> list[Any]:
    return [r for r in peer.calls(**match) if r.method in ("POST", "PUT", "PATCH", "DELETE")]


def events(peer: APIServerPeer) -> list[str]:
    found = [o for (r, _, _), o in peer.objects.items() if r == "api/v1/events"]
    return [e["reason"] for e in sorted(found, key=lambda e: int(e["metadata"]["resourceVersion"]))]


TAINT = {"key": KEY, "value": "GPUUnhealthy", "effect": "NoSchedule"}


@pytest.mark.parametrize("code", [429, 500])
async def test_a_failing_node_list_is_not_ready_retried_with_backoff_and_changes_nothing(
        peer: APIServerPeer, start: Any, code: int) -> None:
    now = time.time()
    await peer.put_object(NODES, node("sick", {"GPUUnhealthy": ("True", now)}))
    await peer.put_object(NODES, node("recovered", {"GPUUnhealthy": ("False", now - 3600)}, taints=[TAINT]))
    fault = peer.inject("GET", "nodes", verb="list", status=code, **({"retry_after": 1} if code == 429 else {}))
    mark = peer.mark()
    run = await start("--remediation-hold-time", "1m")
    await wait_for(lambda: peer.count(method="GET", resource="nodes", verb="list") >= 6, 10)
    status, text = await run.get("/readyz")
    assert status == 503, text
    assert str(code) in run.controller.informer.last_error
    _, metrics = await run.get("/metrics")
    assert 'accelstack_kube_informer_healthy{informer="remediation-nodes"} 0.0' in metrics
    assert f'accelstack_kube_request_seconds_count{{code="{code}",resource="nodes",verb="GET"}}' in metrics
    # an error answer is not "no nodes": nothing is tainted, nothing is lifted, nothing is written at all
    assert writes(peer) == []
    assert not taints_of(peer, "sick") and taints_of(peer, "recovered") == [TAINT]
    # retried, with backoff and jitter: no storm
    assert peer.max_rate(resource="nodes", verb="list", window=1.0, since=mark) < 30
    fault.remove()
    await wait_ready(run, True)
    await wait_for(lambda: taints_of(peer, "sick") == [TAINT] and not taints_of(peer, "recovered"), 5)
    await wait_for(lambda: len(events(peer)) == 2, 3)  # each Event is written just after its node's patch
    assert sorted(events(peer)) == ["AccelstackTainted", "AccelstackUntainted"]


async def test_a_relist_that_fails_keeps_the_view_and_a_stale_hold_does_not_lift_the_taint(
        peer: APIServerPeer, start: Any) -> None:
    """The hold runs out while the nodes cannot be listed, and meanwhile the GPU failed again (unseen): the
    write made from the old view is refused (409), read again, decided again: the taint stays."""
    off_at = float(int(time.time()))
    await peer.put_object(NODES, node("gpu-h", {"GPUUnhealthy": ("False", off_at)}, taints=[TAINT],
                                      capacity={"nvidia.com/gpu": "8"}))
    run = await start("--remediation-hold-time", "5s")
    await wait_ready(run, True)
    await wait_for(lambda: HEALTHY_SINCE_ANNOTATION in annotations_of(peer, "gpu-h"), 3)
    await wait_for(lambda: run.controller.nodes["gpu-h"]["metadata"]["resourceVersion"]
                   == peer.get(NODES, "", "gpu-h")["metadata"]["resourceVersion"], 3)  # type: ignore[index]
    peer.inject("GET", "nodes", verb="list", status=500)
    peer.compact()  # the open watch ends with 410: the controller must relist, and the relist fails
    await wait_ready(run, False)
    assert time.time() < off_at + 5, "too slow: the hold ran out before the fault was set up"
    await set_condition(peer, "gpu-h", "GPUUnhealthy", "True", time.time())  # not seen: nothing watches
    await wait_for(lambda: peer.count(method="PATCH", resource="nodes", status=409) >= 1, off_at + 8 - time.time())
    await wait_for(lambda: HEALTHY_SINCE_ANNOTATION not in annotations_of(peer, "gpu-h"), 3)  # the flap was seen
    assert taints_of(peer, "gpu-h") == [TAINT]
    assert "AccelstackUntainted" not in events(peer)
    assert run.controller.nodes["gpu-h"]["status"]["conditions"][1]["status"] == "False"  # the view was kept


async def test_a_conflict_on_the_node_patch_is_read_again_and_decided_again(peer: APIServerPeer,
                                                                            start: Any) -> None:
    # 1. the write is refused because the node changed: the GPU recovered meanwhile -> no taint at all
    await peer.put_object(NODES, node("gpu-c", {"GPUUnhealthy": ("False", 0)}))
    await peer.put_object(NODES, node("marker", {"GPUUnhealthy": ("False", 0)}))

    async def recovered_meanwhile(request: web.Request) -> web.StreamResponse:
        await set_condition(peer, "gpu-c", "GPUUnhealthy", "False", time.time())
        return status_answer(409, "Conflict", 'Operation cannot be fulfilled on nodes "gpu-c": the object has '
                             "been modified; please apply your changes to the latest version and try again")

    run = await start()
    await wait_ready(run, True)
    peer.inject("PATCH", "nodes", name="gpu-c", respond=recovered_meanwhile, times=1)
    mark = peer.mark()
    await set_condition(peer, "gpu-c", "GPUUnhealthy", "True", time.time())
    await wait_for(lambda: peer.count(method="GET", resource="nodes", name="gpu-c", since=mark) >= 1, 5)
    # a later change, acted on after gpu-c's own MODIFIED events: by then gpu-c is settled
    await set_condition(peer, "marker", "GPUUnhealthy", "True", time.time())
    await wait_for(lambda: bool(taints_of(peer, "marker")), 5)
    assert [r.status for r in peer.calls("PATCH", "nodes", name="gpu-c", since=mark)] == [409]
    assert not taints_of(peer, "gpu-c")
    # 2. refused, nothing changed: read again and the same decision is written on the fresh copy
    peer.inject("PATCH", "nodes", name="gpu-c", status=409, times=1)
    mark = peer.mark()
    await set_condition(peer, "gpu-c", "GPUUnhealthy", "True", time.time())
    await wait_for(lambda: taints_of(peer, "gpu-c") == [TAINT] and len(events(peer)) == 2, 5)
    assert [r.status for r in peer.calls("PATCH", "nodes", name="gpu-c", since=mark)] == [409, 200]
    assert peer.count("GET", "nodes", name="gpu-c", since=mark) == 1
    assert events(peer) == ["AccelstackTainted", "AccelstackTainted"]  # marker, then gpu-c once


async def test_a_half_open_watch_ends_and_a_later_node_change_is_acted_on(peer: APIServerPeer,
                                                                        start: Any) -> None:
    await peer.put_object(NODES, node("gpu-w", {"GPUUnhealthy": ("False", 0)}))
    peer.inject("GET", "nodes", watch=True, half_open=True, times=1)
    run = await start(watch_timeout=(1, 1), read_margin=0.5)
    await wait_ready(run, True)
    await wait_for(lambda: peer.count("GET", "nodes", watch=True) >= 1, 2)
    await set_condition(peer, "gpu-w", "GPUUnhealthy", "True", time.time())  # sent while the watch is silent
    await wait_for(lambda: taints_of(peer, "gpu-w") == [TAINT], 6)
    assert peer.count("GET", "nodes", watch=True) >= 2
    assert run.controller.informer.relists == 1  # resumed from its resourceVersion, nothing lost
    assert (await run.get("/readyz"))[0] == 200


async def test_every_write_carries_the_field_manager(peer: APIServerPeer, start: Any) -> None:
    await peer.put_object(NODES, node("gpu-m", {"GPUUnhealthy": ("True", 0)}))
    await start("--remediation-cordon", "true")
    await wait_for(lambda: taints_of(peer, "gpu-m") == [TAINT] and events(peer) == ["AccelstackTainted"], 5)
    stored = peer.get(NODES, "", "gpu-m") or {}
    assert stored["spec"]["unschedulable"] is True
    assert {(e["manager"], e["operation"]) for e in stored["metadata"]["managedFields"]} == {
        (FIELD_MANAGER, "Update")}
    event = next(o for (r, _, _), o in peer.objects.items() if r == "api/v1/events")
    assert [e["manager"] for e in event["metadata"]["managedFields"]] == [FIELD_MANAGER]
    assert event["source"]["component"] == FIELD_MANAGER == "accelstack-remediation"
    sent = writes(peer)
    assert sent and all(r.user_agent == f"accelstack/{FIELD_MANAGER}" for r in peer.calls())
    assert all(r.query.get("fieldManager") == FIELD_MANAGER for r in sent)


async def test_a_crashed_worker_is_restarted(peer: APIServerPeer, start: Any, caplog: Any) -> None:
    from kubeapi.metrics import api_metrics

    restarts = api_metrics().task_restarts.labels("remediation-worker")
    before = restarts._value.get()
    await peer.put_object(NODES, node("gpu-s", {"GPUUnhealthy": ("False", 0)}))
    run = await start()
    await wait_ready(run, True)
    crashes: list[int] = []
    real = run.controller._next_wake

    def crash_once() -> float:
        if not crashes:
            crashes.append(1)
            raise RuntimeError("a bug in the worker")
        return real()

    run.controller._next_wake = crash_once  # type: ignore[method-assign]
    await peer.put_object(NODES, node("other", {"GPUUnhealthy": ("False", 0)}))  # wakes the worker
    await wait_for(lambda: bool(crashes), 5)
    await wait_for(lambda: restarts._value.get() == before + 1, 3)
    assert any(r.getMessage() == "background task crashed; restarting" for r in caplog.records)
    await set_condition(peer, "gpu-s", "GPUUnhealthy", "True", time.time())
    await wait_for(lambda: taints_of(peer, "gpu-s") == [TAINT], 5)  # the restarted worker acts
