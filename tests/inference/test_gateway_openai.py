"""The gateway through the official ``openai`` client, in front of runtime peers: the API, streaming, errors."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.inference.harness import CLIENTS, KEY_A, KEY_B, endpoint, eventually, key_secret, slices


def client(url: str, key: str = KEY_A, **kw: Any) -> openai.AsyncOpenAI:
    """The official client, without its own retries; closed after the test (conftest)."""
    made = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=kw.pop("timeout", 5), **kw)
    CLIENTS.append(made)
    return made


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def metric(url: str, name: str, **labels: str) -> float:
    text = await metrics_text(url)
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def serve(make_peers: Any, make_gateway: Any, count: int = 1, settings: Any = None, access: Any = None,
                max_inflight: int = 64, max_queue: int = 256, **peer_kw: Any) -> tuple[Any, list[Any]]:
    peers = await make_peers(count, **peer_kw)
    gw = await make_gateway(settings)
    gw.load([endpoint("llm", models=["m"], access=access, max_inflight=max_inflight, max_queue=max_queue)],
            slices("llm", [p.url for p in peers]))
    await gw.start()
    return gw, peers


async def test_chat_completion_round_trip_counts_tokens(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway)
    answer = await client(gw.url).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == " ".join(["tok"] * 8)
    assert answer.system_fingerprint == peers[0].name
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    assert peers[0].paths == ["/v1/chat/completions"]
    assert "Authorization" not in peers[0].last_headers and "authorization" not in peers[0].last_headers
    assert await metric(gw.url, "accelstack_gateway_requests_total", model="m", code="200") == 1
    assert await metric(gw.url, "accelstack_gateway_tokens_total", model="m", kind="completion") == 8
    assert await metric(gw.url, "accelstack_gateway_tokens_total", model="m", kind="prompt") == 5


async def test_completions_and_embeddings(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway)
    c = client(gw.url)
    completion = await c.completions.create(model="m", prompt="once upon")
    assert completion.choices[0].text.startswith("tok")
    embedding = await c.embeddings.create(model="m", input=["a", "b"])
    assert [len(d.embedding) for d in embedding.data] == [3, 3]
    assert peers[0].paths == ["/v1/completions", "/v1/embeddings"]


async def test_stream_passes_chunks_through_as_they_come(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, tokens=6, token_rate=20)  # 0.25 s from first to last
    stream = await client(gw.url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True})
    texts: list[str] = []
    arrivals: list[float] = []
    usage = None
    async for chunk in stream:
        arrivals.append(time.monotonic())
        if not texts:
            assert peers[0].completed == 0, "the first chunk must reach the client before the runtime finished"
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(texts) == "tok " * 6
    assert arrivals[-1] - arrivals[0] > 0.15  # spread out like the runtime wrote them, not one buffered burst
    assert usage is not None and usage.completion_tokens == 6
    assert await metric(gw.url, "accelstack_gateway_tokens_total", model="m", kind="completion") == 6
    assert await metric(gw.url, "accelstack_gateway_time_to_first_byte_seconds_count", model="m") == 1


async def test_models_lists_what_the_caller_may_call(make_peers: Any, make_gateway: Any) -> None:
    peers = await make_peers(1)
    gw = await make_gateway()
    gw.load([endpoint("a", "team-a", models=["ma"]),
             endpoint("shared", "team-a", models=["ms"], access={"namespaces": ["team-b"]})],
            slices("a", [peers[0].url]) + slices("shared", [peers[0].url]))
    await gw.start()
    assert sorted(m.id for m in (await client(gw.url, KEY_A).models.list()).data) == ["ma", "ms"]
    assert [m.id for m in (await client(gw.url, KEY_B).models.list()).data] == ["ms"]
    model = await client(gw.url, KEY_B).models.retrieve("ms")
    assert model.owned_by == "team-a"
    with pytest.raises(openai.NotFoundError):
        await client(gw.url, KEY_B).models.retrieve("ma")


async def test_unknown_model_is_404_in_openai_shape(make_peers: Any, make_gateway: Any) -> None:
    gw, _ = await serve(make_peers, make_gateway)
    with pytest.raises(openai.NotFoundError) as err:
        await client(gw.url).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    assert "nope" in err.value.message
    with pytest.raises(openai.AuthenticationError):  # unauthenticated, with a made-up model name
        await client(gw.url, "sk-unknown-0123456789").embeddings.create(model="made-up-by-a-stranger", input="x")
    assert await metric(gw.url, "accelstack_gateway_errors_total", model="-", reason="model_not_found") == 1
    assert await metric(gw.url, "accelstack_gateway_errors_total", model="-", reason="unauthorized") == 1
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        assert "made-up-by-a-stranger" not in await r.text() and "nope" not in await r.text()


async def test_bad_key_is_401_and_never_echoed_or_logged(make_peers: Any, make_gateway: Any,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    gw, peers = await serve(make_peers, make_gateway)
    wrong = "sk-wrong-key-that-must-not-leak"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(openai.AuthenticationError) as err:
        await client(gw.url, wrong).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "invalid_api_key"
    assert wrong not in str(err.value.body) and wrong not in caplog.text and KEY_A not in caplog.text
    assert peers[0].received == 0


async def test_a_removed_key_stops_working_though_it_was_used(make_peers: Any, make_gateway: Any) -> None:
    """Keys that matched are remembered by their Authorization header (no SHA-256 per request); a key table without
    the key (its Secret deleted) must refuse it at once, and a new key table that maps it elsewhere must be used."""
    gw, peers = await serve(make_peers, make_gateway)
    await client(gw.url, KEY_A).embeddings.create(model="m", input="x")
    with pytest.raises(openai.PermissionDeniedError):  # team-b's key: known, and refused by the access map
        await client(gw.url, KEY_B).embeddings.create(model="m", input="x")
    gw.load([endpoint("llm", models=["m"])], slices("llm", [p.url for p in peers]),
            [key_secret("app", "team-b", KEY_B)])
    with pytest.raises(openai.AuthenticationError):
        await client(gw.url, KEY_A).embeddings.create(model="m", input="x")
    gw.load([endpoint("llm", models=["m"])], slices("llm", [p.url for p in peers]),
            [key_secret("app", "team-a", KEY_B)])  # the same key, now a team-a Secret's: its caller follows
    await client(gw.url, KEY_B).embeddings.create(model="m", input="x")
    assert peers[0].received == 2


async def test_headers_are_read_in_any_case_and_forwarded(make_peers: Any, make_gateway: Any) -> None:
    """Header names are case-insensitive: a key, a request id and the forwarded OpenAI headers sent in odd cases
    all count; the request id goes to the replica and back."""
    gw, peers = await serve(make_peers, make_gateway)
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/embeddings", data=b'{"model": "m", "input": "x"}',
                                                    headers={"AUTHORIZATION": f"Bearer {KEY_A}",
                                                             "X-Request-ID": "req-odd-case",
                                                             "openai-organization": "org-1",
                                                             "OPENAI-PROJECT": "proj-1"}) as r:
        assert r.status == 200 and r.headers["x-request-id"] == "req-odd-case"
    sent = {k.lower(): v for k, v in peers[0].last_headers.items()}
    assert (sent["x-request-id"], sent["openai-organization"], sent["openai-project"]) == (
        "req-odd-case", "org-1", "proj-1")


async def test_access_map_refuses_other_namespaces(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway)
    with pytest.raises(openai.PermissionDeniedError) as err:
        await client(gw.url, KEY_B).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_access_denied" and "team-b/app" in err.value.message
    assert peers[0].received == 0


async def test_rate_limit_per_key_with_retry_after(make_peers: Any, make_gateway: Any) -> None:
    peers = await make_peers(1)
    gw = await make_gateway()
    gw.load([endpoint("llm", models=["m"])], slices("llm", [peers[0].url]),
            [key_secret("slow", "team-a", KEY_A, rate=0.5, burst=2)])
    await gw.start()
    c = client(gw.url)
    for _ in range(2):
        await c.embeddings.create(model="m", input="x")
    with pytest.raises(openai.RateLimitError) as err:
        await c.embeddings.create(model="m", input="x")
    assert err.value.code == "rate_limit_exceeded"
    assert int(err.value.response.headers["Retry-After"]) >= 1
    assert peers[0].received == 2


async def test_malformed_bodies_are_400(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway)
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    cases = [(b"{not json", "invalid_json"), (b"[1, 2]", "invalid_json"), (b'{"messages": []}', "missing_model"),
             (b'{"model": "m", "stream": "yes"}', "invalid_type")]
    async with aiohttp.ClientSession() as s:
        for body, code in cases:
            async with s.post(gw.url + "/v1/chat/completions", data=body, headers=headers) as r:
                doc = await r.json()
                assert r.status == 400, body
                assert doc["error"]["code"] == code and doc["error"]["type"] == "invalid_request_error"
        async with s.post(gw.url + "/v1/chat/completions", data=b"x" * (9 * 1024 * 1024), headers=headers) as r:
            assert r.status == 413
    assert peers[0].received == 0


async def test_upstream_4xx_passes_through(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, count=2)
    for p in peers:
        p.fail_status = 400
    with pytest.raises(openai.BadRequestError):
        await client(gw.url).embeddings.create(model="m", input="x")
    assert sum(p.received for p in peers) == 1  # a client error is not retried


async def test_client_disconnect_cancels_the_upstream_stream(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, tokens=200, token_rate=20)
    stream = await client(gw.url).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                          stream=True)
    async for _chunk in stream:
        break
    await stream.close()
    await eventually(lambda: peers[0].cancelled == 1, what="the runtime's request cancelled")
    assert peers[0].completed == 0
    await eventually(lambda: gw.gateway.inflight == 0, what="the gateway's request ended")


async def test_client_timeout_cancels_the_upstream_request(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, latency=30)
    with pytest.raises(openai.APITimeoutError):
        await client(gw.url, timeout=0.3).embeddings.create(model="m", input="x")
    await eventually(lambda: peers[0].cancelled == 1, what="the runtime's request cancelled")
    await eventually(lambda: gw.gateway.routes["m"].core.outstanding() == 0, what="the replica's slot returned")


async def test_concurrent_requests_all_answered(make_peers: Any, make_gateway: Any) -> None:
    gw, peers = await serve(make_peers, make_gateway, count=3, latency=0.01)
    c = client(gw.url)
    answers = await asyncio.gather(*(c.embeddings.create(model="m", input="x") for _ in range(60)))
    assert len(answers) == 60
    assert all(p.received > 0 for p in peers)
    assert gw.gateway.routes["m"].core.outstanding() == 0


async def test_access_log_is_off_by_default_and_one_line_per_request_without_the_key(
        make_peers: Any, make_gateway: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37.6: --access-log writes one structured line per API request (request id, caller, model, status,
    duration); never the key, not even a refused one; nothing without the flag."""
    from inference.gateway.server import Settings

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "accelstack.gateway.access"]

    gw, _ = await serve(make_peers, make_gateway)
    await client(gw.url).embeddings.create(model="m", input="x")
    assert lines() == []
    await gw.stop()

    gw, _ = await serve(make_peers, make_gateway, settings=Settings(access_log=True))
    await client(gw.url).embeddings.create(model="m", input="x", extra_headers={"x-request-id": "req-1"})
    wrong = "sk-wrong-0123456789abcdef"
    with pytest.raises(openai.AuthenticationError):
        await client(gw.url, key=wrong).embeddings.create(model="m", input="x", extra_headers={"x-request-id": "req-2"})
    ok, refused = lines()
    assert (ok.__dict__["request_id"], ok.__dict__["caller"], ok.__dict__["model"], ok.__dict__["status"]) == (
        "req-1", "team-a/app", "m", 200)
    assert ok.__dict__["duration_ms"] >= 0 and ok.__dict__["path"] == "/v1/embeddings"
    assert (refused.__dict__["request_id"], refused.__dict__["caller"], refused.__dict__["status"]) == (
        "req-2", "", 401)
    for record in [r for r in caplog.records if r.name.startswith("accelstack")]:
        text = record.getMessage() + repr(record.__dict__)
        assert KEY_A not in text and wrong not in text
