"""The gateway's listener over raw sockets on loopback (issue 36.3/36.5/36.8): malformed HTTP answered with a fixed
body and logged as one line without header values, header/body/idle timeouts, no version banner."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from inference.gateway.listener import MALFORMED_BODY
from inference.gateway.server import Settings
from tests.inference.harness import KEY_A, endpoint, slices

SECRET = "sk-team-a-0123456789abcdef-never-echoed"


async def start(make_peers: Any, make_gateway: Any, **listener: Any) -> tuple[str, int]:
    (peer,) = await make_peers(1)
    gw = await make_gateway(Settings(request_timeout=5, idle_timeout=5, queue_timeout=5, body_timeout=0.3),
                            **listener)
    gw.load([endpoint("llm")], slices("llm", [peer.url]))
    await gw.start()
    parts = urlsplit(gw.url)
    assert parts.hostname and parts.port
    return parts.hostname, parts.port


async def exchange(host: str, port: int, raw: bytes, wait: float = 30.0) -> bytes:
    """Send raw bytes and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), wait)
    finally:
        writer.close()


@pytest.mark.parametrize("raw", [
    f"POST /v1/embeddings HTTP/1.1\nHost: x\nAuthorization: Bearer {SECRET}\nContent-Length: 2\n\n{{}}".encode(),
    f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\x7f\r\nContent-Length: 2\r\n\r\n{{}}"
    .encode(),
    f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Bad\x00: {SECRET}\r\n\r\n".encode(),
], ids=["bare-lf", "del-at-header-end", "nul-in-name"])
async def test_malformed_http_gets_a_fixed_answer_and_one_log_line(make_peers: Any, make_gateway: Any,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  raw: bytes) -> None:
    host, port = await start(make_peers, make_gateway)
    caplog.clear()
    answer = await exchange(host, port, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", answer[:200]
    assert body == MALFORMED_BODY
    assert SECRET.encode() not in answer
    assert b"Python" not in head and b"aiohttp" not in head
    records = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith(("aiohttp", "accelstack"))]
    assert [r.getMessage() for r in records] == ["malformed request"], [r.getMessage() for r in records]
    assert records[0].exc_info is None
    assert all(SECRET not in r.getMessage() and SECRET not in str(r.__dict__) for r in caplog.records)


async def test_no_version_banner(make_peers: Any, make_gateway: Any) -> None:
    host, port = await start(make_peers, make_gateway)
    answer = await exchange(host, port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head = answer.partition(b"\r\n\r\n")[0].decode()
    assert head.startswith("HTTP/1.1 200")
    assert "\r\nServer: accelstack-gateway" in head and "Python" not in head and "aiohttp" not in head


async def test_dripping_headers_are_cut_off(make_peers: Any, make_gateway: Any) -> None:
    host, port = await start(make_peers, make_gateway, header_timeout=0.5)
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
    closed_after = None
    try:
        for _ in range(600):  # one header byte every 50 ms, for up to 30 s: never a complete head
            writer.write(b"X")
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                continue
    except ConnectionError:
        closed_after = time.monotonic() - started
    finally:
        writer.close()
    assert closed_after is not None, "a client dripping headers kept its connection"
    assert closed_after >= 0.5  # not before the header timeout


async def test_silent_connection_is_closed(make_peers: Any, make_gateway: Any) -> None:
    host, port = await start(make_peers, make_gateway, header_timeout=0.3)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()


async def test_idle_keepalive_connection_is_closed(make_peers: Any, make_gateway: Any) -> None:
    host, port = await start(make_peers, make_gateway, keepalive_timeout=0.3, header_timeout=60)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 30)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(), 30) == b""  # then silence: closed by the idle timeout
    finally:
        writer.close()


async def test_idle_clock_counts_from_the_last_answer(make_peers: Any, make_gateway: Any) -> None:
    """A connection used every 0.6 s with a 1 s idle timeout is never closed under a request (the one idle timer
    per connection, scheduled after the first answer, sleeps again when it fires 0.4 s after the second), and once
    left alone it is closed, not before the idle timeout counted from the last answer."""
    host, port = await start(make_peers, make_gateway, keepalive_timeout=1.0, header_timeout=60)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(4):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            (head, _), = await _answers(reader, 1)
            assert head.startswith(b"HTTP/1.1 200")
            last = time.monotonic()
            await asyncio.sleep(0.6)
        assert await asyncio.wait_for(reader.read(), 30) == b""  # then silence: closed by the idle timeout
        assert time.monotonic() - last >= 1.0
    finally:
        writer.close()


async def test_body_that_never_completes_gets_408_and_the_connection_closed(make_peers: Any,
                                                                            make_gateway: Any) -> None:
    host, port = await start(make_peers, make_gateway)
    answer = await exchange(host, port, (f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}"
                                         "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                                         '{"model": "m"').encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"408", answer[:300]
    assert b'"code":"request_timeout"' in body


async def test_body_split_after_the_head_is_forwarded_whole_and_ids_are_unique(make_peers: Any,
                                                                             make_gateway: Any) -> None:
    """A Content-Length body whose head arrives alone, then half the body, then the rest, is read whole (the
    fast path takes only a body that came with its head); every answer carries its own generated request id."""
    host, port = await start(make_peers, make_gateway)
    body = b'{"model": "m", "input": "' + b"x" * 2000 + b'"}'
    ids = set()
    for _ in range(3):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write((f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode())
            for piece in (body[:1000], body[1000:]):
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(piece)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        finally:
            writer.close()
        assert head.split(b" ")[1] == b"200", head
        ids.add(next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                     if line.lower().startswith(b"x-request-id:")))
    assert len(ids) == 3 and all(len(i) == 32 for i in ids), ids


async def test_fuzzed_requests_never_get_a_5xx_an_echoed_key_or_a_traceback(make_peers: Any, make_gateway: Any,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The extender's seeded fuzz of hostile request heads and bodies (bounded count), over the gateway: every
    answer a 2xx-4xx that quotes no key, no traceback in the log, and the gateway still serves afterwards."""
    import random

    from tests.extender import test_security_listeners as extender_fuzz

    caplog.set_level(logging.DEBUG)
    host, port = await start(make_peers, make_gateway)
    rng = random.Random(extender_fuzz.SEED)
    for i in range(extender_fuzz.FUZZ_CASES):
        data = extender_fuzz.fuzz_case(rng).replace(extender_fuzz.SECRET.encode(), SECRET.encode())
        answer = await exchange(host, port, data, wait=10)
        assert SECRET.encode() not in answer, (i, data[:120])
        if answer:
            status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b""
            assert status[:1] in (b"2", b"3", b"4"), (i, data[:120], answer[:200])
    ok = await exchange(host, port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
    assert all(SECRET not in r.getMessage() and SECRET not in str(r.__dict__) for r in caplog.records)
    tracebacks = [r for r in caplog.records if r.exc_info and r.levelno >= logging.ERROR]
    assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks[:3]]


async def test_distinct_bogus_tokens_cost_no_more_than_the_failure_limit_in_token_reviews(
        make_peers: Any, make_gateway: Any) -> None:
    """Issue 36.4: every unknown token cost a TokenReview (20,000 bogus keys, 20,000 reviews). Only what could be a
    service-account token (a JWT) is reviewed at all, and failed reviews are limited per client address: past
    the burst, 429 with Retry-After and no review."""
    import aiohttp

    from inference.gateway.kube_source import TokenReviewer
    from inference.gateway.server import FAILED_AUTH_BURST
    from kubeapi.client import connected
    from tests.apiserver_peer import APIServerPeer

    apiserver = APIServerPeer()
    await apiserver.start()
    (peer,) = await make_peers(1)
    gw = await make_gateway(Settings(request_timeout=5, idle_timeout=5, queue_timeout=5))
    gw.load([endpoint("llm")], slices("llm", [peer.url]))
    try:
        async with connected(apiserver.url, field_manager="test") as kube:
            reviewer = TokenReviewer(kube)
            gw.gateway.reviewer = reviewer
            await gw.start()
            statuses: list[int] = []
            async with aiohttp.ClientSession() as http:
                for i in range(60):
                    token = f"bogus-key-{i}" if i % 2 else f"eyJhbGciOi.eyJzdWIi{i}.c2lnbmF0dXJl{i}"
                    async with http.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {token}"}) as r:
                        statuses.append(r.status)
                        if r.status == 429:
                            assert int(r.headers["Retry-After"]) >= 1
            assert set(statuses) <= {401, 429} and 429 in statuses
            assert reviewer.reviews <= FAILED_AUTH_BURST + 2, reviewer.reviews  # the burst, and what refilled
            assert statuses.count(429) >= 30 - FAILED_AUTH_BURST - 2
            # a good key still passes from the same address
            async with aiohttp.ClientSession() as http, http.get(
                    f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}) as r:
                assert r.status == 200
    finally:
        await apiserver.stop()


def _post(body: bytes, *, path: str = "/v1/embeddings", extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def _answers(reader: asyncio.StreamReader, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` whole answers (Content-Length framed) from ``reader``: (head, body) each."""
    out = []
    for _ in range(count):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        out.append((head, await asyncio.wait_for(reader.readexactly(length), 30)))
    return out


async def test_pipelined_requests_are_answered_in_order(make_peers: Any, make_gateway: Any) -> None:
    """Three requests in one write (the second a GET, the third asking to close): three answers in order on the
    same connection, then the close."""
    host, port = await start(make_peers, make_gateway)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_post(b'{"model": "m", "input": "a"}', extra="x-request-id: one\r\n")
                     + f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode()
                     + _post(b'{"model": "m", "input": "b"}', extra="x-request-id: three\r\nConnection: close\r\n"))
        await writer.drain()
        (h1, b1), (h2, b2), (h3, _) = await _answers(reader, 3)
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed after the third, as it asked
    finally:
        writer.close()
    assert h1.startswith(b"HTTP/1.1 200") and b"x-request-id: one" in h1 and b'"embedding"' in b1
    assert h2.startswith(b"HTTP/1.1 200") and b'"object":"list"' in b2
    assert h3.startswith(b"HTTP/1.1 200") and b"x-request-id: three" in h3 and b"Connection: close" in h3


async def test_a_client_reuses_its_connection(make_peers: Any, make_gateway: Any) -> None:
    """aiohttp's client keeps one connection for many requests: every one answered, one connection used."""
    import aiohttp

    (peer,) = await make_peers(1)
    gw = await make_gateway()
    gw.load([endpoint("llm")], slices("llm", [peer.url]))
    await gw.start()
    assert gw.listener is not None
    seen = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        for i in range(5):
            async with http.post(f"{gw.url}/v1/embeddings", json={"model": "m", "input": str(i)},
                                 headers={"Authorization": f"Bearer {KEY_A}"}) as r:
                assert r.status == 200 and (await r.json())["object"] == "list"
            seen |= {id(c) for c in gw.listener.connections}
    assert len(seen) == 1, seen  # one connection carried all five


async def test_http_1_0_gets_an_answer_and_a_close(make_peers: Any, make_gateway: Any) -> None:
    """HTTP/1.0 without keep-alive: the answer (framed by Content-Length), then the connection closes. A stream
    to an HTTP/1.0 client is delimited by the close, not chunked (it could not decode chunks)."""
    host, port = await start(make_peers, make_gateway)
    answer = await exchange(host, port, _post(b'{"model": "m", "input": "x"}', version="1.0"))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" in head and b'"embedding"' in body
    stream = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    answer = await exchange(host, port, _post(stream, path="/v1/chat/completions", version="1.0"))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower(), head
    assert body.startswith(b"data: ") and body.rstrip().endswith(b"data: [DONE]"), body[-200:]


async def test_http_1_0_keep_alive_is_honoured(make_peers: Any, make_gateway: Any) -> None:
    host, port = await start(make_peers, make_gateway)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(2):
            writer.write(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            (head, body), = await _answers(reader, 1)
            assert head.startswith(b"HTTP/1.1 200") and body == b"ok"
    finally:
        writer.close()


async def test_chunked_request_body_is_read_whole(make_peers: Any, make_gateway: Any) -> None:
    """A chunked body in pieces (a chunk extension, a trailer) is forwarded whole; the connection stays usable."""
    host, port = await start(make_peers, make_gateway)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write((f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n").encode())
        for piece in (b'd;ext=1\r\n{"model', b'": "m"\r', b'\n10\r\n, "input": "xy"}\r\n', b"0\r\nX-Trailer: 1\r\n\r\n"):
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(piece)
        (head, body), = await _answers(reader, 1)
        assert head.startswith(b"HTTP/1.1 200") and b'"embedding"' in body, (head, body)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        (head, body), = await _answers(reader, 1)
        assert body == b"ok"
    finally:
        writer.close()


async def test_broken_chunked_body_is_a_400_in_the_openai_shape(make_peers: Any, make_gateway: Any) -> None:
    host, port = await start(make_peers, make_gateway)
    answer = await exchange(host, port, (f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}"
                                         "\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n").encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", answer[:300]
    assert b'"code":"invalid_body"' in body and b"malformed chunked body" in body


async def test_body_slower_than_the_timeout_gets_408(make_peers: Any, make_gateway: Any) -> None:
    """A body that keeps arriving, a byte at a time, but not all within --client-body-timeout (0.3 s here): 408
    and the connection closed, however steadily it drips."""
    host, port = await start(make_peers, make_gateway)
    body = b'{"model": "m", "input": "' + b"x" * 200 + b'"}'
    reader, writer = await asyncio.open_connection(host, port)
    answer = b""
    try:
        writer.write(_post(body)[:-len(body)])
        for byte in body:
            writer.write(bytes([byte]))
            try:
                await writer.drain()
                answer += await asyncio.wait_for(reader.read(65536), 0.02)
            except TimeoutError:
                continue
            except ConnectionError:
                break
            if answer.endswith(b"}}") or not answer:
                break
        answer += await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    assert answer.split(b" ", 2)[1] == b"408", answer[:300]
    assert b'"code":"request_timeout"' in answer


async def test_dripping_head_on_a_kept_alive_connection_is_cut_off(make_peers: Any, make_gateway: Any) -> None:
    """The head's clock starts again with the first byte of the next request on a kept-alive connection: a
    second request whose head drips forever is closed (the idle timeout, far longer, does not apply)."""
    host, port = await start(make_peers, make_gateway, header_timeout=0.5, keepalive_timeout=60)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        (head, _), = await _answers(reader, 1)
        assert head.startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        closed = False
        for _ in range(600):
            try:
                writer.write(b"X")
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except ConnectionError:
                closed = True
                break
    finally:
        writer.close()
    assert closed, "a dripping head on a kept-alive connection kept it"
    assert time.monotonic() - started >= 0.5


@pytest.mark.parametrize(("raw", "status"), [
    (b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"431"),
    (b"GET / HTTP/1.1\r\n" + b"X-A: 1\r\n" * 200 + b"\r\n", b"431"),
    (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", b"400"),
    (b"POST /v1/embeddings HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", b"400"),
    (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", b"400"),
], ids=["wrong-method", "no-route", "long-line", "many-headers", "two-lengths", "both-framings", "folding"])
async def test_refusals_are_4xx_in_the_openai_shape(make_peers: Any, make_gateway: Any, raw: bytes,
                                                    status: bytes) -> None:
    host, port = await start(make_peers, make_gateway)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == status, answer[:300]
    assert b'"error"' in body and b'"type"' in body
    if status in (b"404", b"405"):  # a well-framed refusal: the connection serves the next request
        assert answer.rstrip().endswith(b"ok")


async def test_the_same_headers_with_other_lengths_are_read_by_their_own_length(make_peers: Any,
                                                                                 make_gateway: Any) -> None:
    """A client's header block is parsed once and then found again, less its Content-Length: each request is still
    read by its own length (a stale one would cut a longer body short, a 400, or wait for bytes never sent), and a
    block seen before with a second Content-Length is still refused."""
    host, port = await start(make_peers, make_gateway)
    bodies = [b'{"model": "m", "input": "a"}', b'{"model": "m", "input": "' + b"b" * 40 + b'"}',
              b'{"model": "m", "input": "c"}', b'{"model": "m", "input": "' + b"d" * 200 + b'"}']
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"".join(_post(body) for body in bodies))
        await writer.drain()
        answers = await _answers(reader, len(bodies))
        twice = _post(bodies[0]).replace(b"Content-Length:", b"Content-Length: 28\r\nContent-Length:", 1)
        writer.write(twice)
        await writer.drain()
        refused = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    assert [head.split(b"\r\n", 1)[0] for head, _ in answers] == [b"HTTP/1.1 200 OK"] * len(bodies)
    assert refused.startswith(b"HTTP/1.1 400") and refused.endswith(MALFORMED_BODY)


def test_a_header_block_found_again_still_counts_its_lines() -> None:
    """A block of exactly the header limit, repeated names joined (so fewer distinct headers than lines), found
    again with a Content-Length line added: one line over the limit, 431, as if it had never been seen."""
    from inference.gateway.listener import MAX_HEADERS, Malformed, _parse_head

    lines = b"".join(b"\r\nX-Repeat: %d" % (i % 2) for i in range(MAX_HEADERS - 1))
    at_limit = b"POST /v1/embeddings HTTP/1.1\r\nHost: x" + lines
    assert _parse_head(at_limit)[3]["x-repeat"].startswith("0, 1, 0")
    with pytest.raises(Malformed) as caught:
        _parse_head(at_limit + b"\r\nContent-Length: 5")
    assert caught.value.status == 431
