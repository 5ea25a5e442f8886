"""The gateway when replicas misbehave or are busy: retries, ejection, stalls, the wait queue, bursting."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest

from inference.gateway.server import Settings
from inference.names import POOL_BURST
from inference.routing import EjectionPolicy
from tests.inference.harness import KEY_A, endpoint, eventually, slices
from tests.inference.test_gateway_openai import client, metric, metrics_text, serve

MSG: Any = [{"role": "user", "content": "x"}]


async def test_failed_replica_retried_elsewhere_then_ejected(make_peers: Any, make_gateway: Any) -> None:
    settings = Settings(ejection=EjectionPolicy(consecutive_failures=2, base_seconds=60), request_timeout=5)
    gw, (bad, good) = await serve(make_peers, make_gateway, count=2, settings=settings)
    bad.fail_status = 503
    c = client(gw.url)
    for _ in range(20):
        await c.embeddings.create(model="m", input="x")  # every one answered: a 503 before any byte is retried
    assert good.completed == 20
    assert bad.received == 2  # two failures eject it; no request reaches it afterwards
    assert gw.gateway.routes["m"].core.replicas[bad.url].ejected(gw.gateway.clock())
    assert await metric(gw.url, "accelstack_gateway_ejections_total", model="m") == 1
    assert await metric(gw.url, "accelstack_gateway_retries_total", model="m") == 2
    assert await metric(gw.url, "accelstack_gateway_replicas", model="m", state="ejected") == 1


async def test_unreachable_replica_retried(make_peers: Any, make_gateway: Any) -> None:
    peers = await make_peers(1)
    gw = await make_gateway()
    gw.load([endpoint("llm")], slices("llm", [peers[0].url, "http://127.0.0.1:9"]))  # port 9: nothing listens
    await gw.start()
    c = client(gw.url)
    for _ in range(6):
        await c.embeddings.create(model="m", input="x")
    assert peers[0].completed == 6


async def test_all_replicas_failing_gives_openai_shaped_502(make_peers: Any, make_gateway: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37.6: the 502 says how many replicas failed and how the last did, naming no pod and no address
    (before: 'The replica llm-primary-1 answered HTTP 500.'); the log line has them, with the request id."""
    gw, peers = await serve(make_peers, make_gateway, count=2)
    for p in peers:
        p.fail_status = 500
    with pytest.raises(openai.InternalServerError) as err:
        await client(gw.url).embeddings.create(model="m", input="x", extra_headers={"x-request-id": "req-7"})
    assert err.value.status_code == 502 and err.value.code == "upstream_error"
    assert sum(p.received for p in peers) == 2  # one try and one retry, each at a different replica
    assert err.value.message.endswith("All 2 replicas of 'm' tried failed; the last answered HTTP 500.")
    for p in peers:
        assert p.url.removeprefix("http://") not in err.value.message and "127.0.0.1" not in err.value.message
    assert "llm-primary" not in err.value.message
    (line,) = [r for r in caplog.records if r.getMessage() == "upstream failed"]
    assert line.__dict__["request_id"] == "req-7"
    assert sorted(line.__dict__["replicas"]) == sorted(p.url for p in peers)
    assert sorted(line.__dict__["pods"]) == ["llm-primary-0", "llm-primary-1"]


async def test_stream_stalled_before_first_byte_is_retried(make_peers: Any, make_gateway: Any) -> None:
    # round-robin, so the stalled replica is surely tried (the default picks at random between two idle
    # replicas: one run in 16 never reached it, and no try was abandoned)
    settings = Settings(request_timeout=0.5, idle_timeout=5, policy="round-robin")
    gw, peers = await serve(make_peers, make_gateway, count=2, settings=settings)
    peers[0].stall_after = 0  # headers, then silence
    c = client(gw.url)
    for _ in range(4):
        stream = await c.chat.completions.create(model="m", messages=MSG, stream=True)
        assert "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]) == "tok " * 8
    assert peers[1].completed == 4
    await eventually(lambda: peers[0].cancelled >= 1, what="the runtime saw the stalled try abandoned")


async def test_stream_stalled_midway_ends_with_an_error_event_and_no_retry(make_peers: Any,
                                                                          make_gateway: Any) -> None:
    settings = Settings(request_timeout=5, idle_timeout=0.3)
    gw, peers = await serve(make_peers, make_gateway, count=2, settings=settings)
    for p in peers:
        p.stall_after = 2
    stream = await client(gw.url).chat.completions.create(model="m", messages=MSG, stream=True)
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert got == ["tok ", "tok "]
    assert "sent nothing for 0.3 s" in err.value.message
    assert sum(p.received for p in peers) == 1  # bytes had reached the client: no retry
    assert await metric(gw.url, "accelstack_gateway_errors_total", model="m", reason="stream_interrupted") == 1


async def test_stream_interrupted_log_line_names_request_and_caller(make_peers: Any, make_gateway: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    gw, peers = await serve(make_peers, make_gateway, count=1)
    peers[0].break_after = 3
    stream = await client(gw.url).chat.completions.create(model="m", messages=MSG, stream=True,
                                                          extra_headers={"x-request-id": "req-42"})
    with pytest.raises(openai.APIError):
        async for _chunk in stream:
            pass
    (line,) = [r for r in caplog.records if r.getMessage() == "stream interrupted"]
    assert line.__dict__["request_id"] == "req-42" and line.__dict__["caller"] == "team-a/app"


async def test_stream_closed_by_the_client_after_done_is_a_success(make_peers: Any, make_gateway: Any) -> None:
    """The official client closes the connection right after ``[DONE]``: that stream succeeded (issue 37.3)."""
    gw, peers = await serve(make_peers, make_gateway, count=1)
    peers[0].hold_after_done = True  # the replica has not ended the response when the client leaves
    async with aiohttp.ClientSession() as session, session.post(
            gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"},
            json={"model": "m", "messages": MSG, "stream": True}) as r:
        seen = b""
        while b"data: [DONE]" not in seen:
            chunk = await r.content.readany()
            assert chunk, "the stream ended before [DONE]"
            seen += chunk
        r.close()  # gone right after [DONE], as the openai client is
    await eventually(lambda: peers[0].cancelled == 1, what="the gateway saw the client leave")
    await eventually(lambda: gw.gateway.inflight == 0, what="the request finished")
    assert await metric(gw.url, "accelstack_gateway_errors_total", model="m", reason="client_disconnected") == 0
    assert await metric(gw.url, "accelstack_gateway_requests_total", model="m", code="200") == 1
    assert await metric(gw.url, "accelstack_gateway_request_seconds_count", model="m") == 1


async def test_stream_closed_by_the_client_before_done_is_a_disconnect(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, count=1)
    peers[0].stall_after = 2
    async with aiohttp.ClientSession() as session, session.post(
            gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"},
            json={"model": "m", "messages": MSG, "stream": True}) as r:
        assert await r.content.readany()
        r.close()
    await eventually(lambda: gw.gateway.inflight == 0, what="the request finished")
    assert await metric(gw.url, "accelstack_gateway_errors_total", model="m", reason="client_disconnected") == 1
    assert await metric(gw.url, "accelstack_gateway_requests_total", model="m") == 0


async def test_stream_broken_midway_ends_with_an_error_event(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, count=1)
    peers[0].break_after = 3
    stream = await client(gw.url).chat.completions.create(model="m", messages=MSG, stream=True)
    with pytest.raises(openai.APIError) as err:
        async for _chunk in stream:
            pass
    assert "broke the stream" in err.value.message


async def test_hung_replica_times_out_then_retry(make_peers: Any, make_gateway: Any) -> None:
    settings = Settings(request_timeout=0.3)
    gw, peers = await serve(make_peers, make_gateway, count=2, settings=settings)
    peers[0].hang = True
    c = client(gw.url)
    for _ in range(3):
        await c.embeddings.create(model="m", input="x")
    assert peers[1].completed == 3


async def test_queue_then_429_with_retry_after(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, count=1, max_inflight=1, max_queue=1, latency=0.3)
    c = client(gw.url)
    first = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: peers[0].inflight == 1, what="first request at the replica")
    second = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: len(gw.gateway.routes["m"].waiters) == 1, what="second request queued")
    assert await metric(gw.url, "accelstack_gateway_queue_depth", model="m") == 1
    with pytest.raises(openai.RateLimitError) as err:
        await c.embeddings.create(model="m", input="x")
    assert err.value.code == "model_overloaded"
    assert int(err.value.response.headers["Retry-After"]) >= 1
    await asyncio.gather(first, second)  # the queued one was served once the first finished
    assert peers[0].max_inflight == 1 and peers[0].completed == 2


async def test_queue_timeout_gives_429(make_peers: Any, make_gateway: Any) -> None:
    settings = Settings(queue_timeout=0.2)
    gw, peers = await serve(make_peers, make_gateway, settings=settings, max_inflight=1, latency=2)
    c = client(gw.url)
    first = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: peers[0].inflight == 1, what="first request at the replica")
    with pytest.raises(openai.RateLimitError) as err:
        await c.embeddings.create(model="m", input="x")
    assert "within 0.2 s" in err.value.message
    assert not gw.gateway.routes["m"].waiters
    first.cancel()


async def test_queue_is_first_in_first_out(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, max_inflight=1, latency=0.05)
    c = client(gw.url)
    order: list[int] = []

    async def one(i: int) -> None:
        await c.embeddings.create(model="m", input=str(i))
        order.append(i)

    def arrived(n: int) -> Callable[[], bool]:
        return lambda: peers[0].received + len(gw.gateway.routes["m"].waiters) == n

    tasks = []
    for i in range(6):
        tasks.append(asyncio.create_task(one(i)))
        await eventually(arrived(i + 1), what=f"request {i} in")
    await asyncio.gather(*tasks)
    assert order == list(range(6))


async def test_burst_pool_used_only_while_primary_is_saturated(make_peers: Any, make_gateway: Any) -> None:
    primary, burst = await make_peers(2, latency=0.3)
    gw = await make_gateway()
    gw.load([endpoint("llm", max_inflight=1)],
            slices("llm", [primary.url]) + slices("llm", [burst.url], pool=POOL_BURST))
    await gw.start()
    c = client(gw.url)
    first = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: primary.inflight == 1, what="first request at the primary")
    second = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: burst.inflight == 1, what="second request burst")
    assert await metric(gw.url, "accelstack_gateway_bursting", model="m") == 1
    await asyncio.gather(first, second)
    await c.embeddings.create(model="m", input="x")
    assert (primary.received, burst.received) == (2, 1)
    assert await metric(gw.url, "accelstack_gateway_bursting", model="m") == 0


async def test_replicas_change_without_dropping_requests(make_peers: Any, make_gateway: Any) -> None:
    old, new = await make_peers(2, latency=0.2)
    gw = await make_gateway()
    gw.load([endpoint("llm")], slices("llm", [old.url]))
    await gw.start()
    c = client(gw.url)
    running = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: old.inflight == 1, what="request at the old replica")
    moved = slices("llm", [new.url])
    moved[0]["endpoints"][0]["targetRef"]["name"] = "llm-primary-new"
    gw.load([endpoint("llm")], moved)
    await c.embeddings.create(model="m", input="x")
    await running  # the request at the replica that left still completes
    assert (old.completed, new.completed) == (1, 1)
    # the old replica left while busy: once its request ended, its series went too
    assert await metric(gw.url, "accelstack_gateway_requests_total", replica="llm-primary-new") == 1
    assert 'replica="llm-primary-0"' not in await metrics_text(gw.url)
    gw.load([], [])
    with pytest.raises(openai.NotFoundError):
        await c.embeddings.create(model="m", input="x")


async def test_queued_requests_go_to_replicas_that_appear(make_peers: Any, make_gateway: Any) -> None:
    busy, fresh = await make_peers(2, latency=1)
    gw = await make_gateway()
    gw.load([endpoint("llm", max_inflight=1)], slices("llm", [busy.url]))
    await gw.start()
    c = client(gw.url)
    first = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: busy.inflight == 1, what="first request at the busy replica")
    second = asyncio.create_task(c.embeddings.create(model="m", input="x"))
    await eventually(lambda: len(gw.gateway.routes["m"].waiters) == 1, what="second request queued")
    gw.load([endpoint("llm", max_inflight=1)], slices("llm", [busy.url, fresh.url]))
    await eventually(lambda: fresh.inflight == 1, what="queued request at the new replica")
    await asyncio.gather(first, second)


async def test_no_ready_replica_is_503(make_peers: Any, make_gateway: Any) -> None:
    gw = await make_gateway()
    gw.load([endpoint("llm")], slices("llm", ["http://127.0.0.1:9"], ready=False))
    await gw.start()
    with pytest.raises(openai.InternalServerError) as err:
        await client(gw.url).embeddings.create(model="m", input="x")
    assert err.value.status_code == 503 and err.value.code == "no_ready_replica"


async def test_runtime_reported_queue_steers_requests_away(make_peers: Any, make_gateway: Any) -> None:
    settings = Settings(load_poll_interval=0.05)
    gw, (queued, idle) = await serve(make_peers, make_gateway, count=2, settings=settings)
    queued.reported_queue = 50
    await eventually(lambda: gw.gateway.routes["m"].core.replicas[queued.url].reported_queue == 50,
                     what="the runtime's queue read from its /metrics")
    c = client(gw.url)
    for _ in range(10):
        await c.embeddings.create(model="m", input="x")
    assert (queued.received, idle.received) == (0, 10)
    queued.reported_queue = 0
    await eventually(lambda: gw.gateway.routes["m"].core.replicas[queued.url].reported_queue == 0,
                     what="the queue drained")


async def test_a_replica_whose_metrics_hang_holds_no_poll_up(make_peers: Any, make_gateway: Any) -> None:
    """The poll's deadline (the pool's, no asyncio.timeout per poll) ends a hung /metrics read and aborts its
    connection: the other replica's queue is still read every round, and connections do not pile up."""
    settings = Settings(load_poll_interval=0.05)
    gw, (hung, fine) = await serve(make_peers, make_gateway, count=2, settings=settings)
    hung.metrics_hang = True
    assert gw.gateway._pool is not None
    def read(value: float) -> bool:
        return gw.gateway.routes["m"].core.replicas[fine.url].reported_queue == value

    for value in (7, 3, 9):
        fine.reported_queue = value
        await eventually(functools.partial(read, value),
                         what=f"the other replica's queue ({value}) read while one replica's /metrics hangs")
    await asyncio.sleep(1.0)  # several polls time out (the deadline is 0.2 s) in the meantime
    assert len(gw.gateway._pool._all) <= 3  # the hung poll's connection aborted each time, not left open
    assert gw.gateway.routes["m"].core.replicas[hung.url].reported_queue == 0


async def test_no_retry_onto_an_ejected_replica(make_peers: Any, make_gateway: Any) -> None:
    settings = Settings(ejection=EjectionPolicy(consecutive_failures=1, base_seconds=60), queue_timeout=30)
    gw, (a, b) = await serve(make_peers, make_gateway, count=2, settings=settings)
    a.fail_status = b.fail_status = 500
    c = client(gw.url)
    with pytest.raises(openai.InternalServerError):
        await c.embeddings.create(model="m", input="x")  # one fails and is ejected; the retry fails too
    ejected = [r for r in gw.gateway.routes["m"].core.replicas.values() if r.ejected(gw.gateway.clock())]
    assert len(ejected) == 1
    started = asyncio.get_running_loop().time()
    with pytest.raises(openai.InternalServerError):
        await c.embeddings.create(model="m", input="x")  # the other is tried; no wait for the ejected one
    assert asyncio.get_running_loop().time() - started < 5
