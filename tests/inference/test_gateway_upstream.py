"""The gateway's HTTP/1.1 client to the replicas (inference/gateway/upstream.py), against scripted raw servers:
keep-alive reuse, a connection the replica closed, chunked and until-EOF bodies, an oversized head."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from inference.gateway.server import gauge_total
from inference.gateway.upstream import MAX_HEAD, Pool, UpstreamError, UpstreamTimeout, request_head, split_url

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


class RawReplica:
    """A TCP server that reads each request (head and Content-Length body) and lets ``script`` answer it."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.host, self.port = "127.0.0.1", 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.script(reader, writer, request)
                if writer.is_closing():
                    return
        finally:
            writer.close()

    def head(self, body: bytes = b"{}") -> bytes:
        return request_head("POST", "/v1/embeddings", f"{self.host}:{self.port}", [("x-request-id", "r1")],
                            len(body))


@pytest.fixture
async def replica_of() -> AsyncIterator[Callable[[Script], Awaitable[RawReplica]]]:
    started: list[RawReplica] = []

    async def make(script: Script) -> RawReplica:
        replica = RawReplica(script)
        await replica.start()
        started.append(replica)
        return replica

    yield make
    for replica in started:
        assert replica.server is not None
        replica.server.close()


def ok(body: bytes = b'{"ok":1}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def answer_ok(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
    w.write(ok())
    await w.drain()


async def test_keep_alive_connection_is_reused(replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    replica = await replica_of(answer_ok)
    pool = Pool()
    for _ in range(3):
        answer = await pool.request(replica.host, replica.port, replica.head(), b"{}")
        assert answer.status == 200 and answer.headers["content-type"] == "application/json"
        assert await answer.read() == b'{"ok":1}'
        answer.close()
    assert pool.opened == 1 and replica.connections == 1 and len(replica.requests) == 3
    assert replica.requests[0].startswith(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:")
    assert replica.requests[0].endswith(b"x-request-id: r1\r\n\r\n{}")
    pool.close()


async def test_connection_close_is_not_reused(replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    async def closing(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(ok(extra=b"Connection: close\r\n"))
        await w.drain()
        w.close()

    replica = await replica_of(closing)
    pool = Pool()
    for _ in range(2):
        answer = await pool.request(replica.host, replica.port, replica.head(), b"{}")
        assert await answer.read() == b'{"ok":1}'
        answer.close()
    assert pool.opened == 2 and pool.idle(replica.host, replica.port) == 0
    pool.close()


async def test_idle_connection_closed_by_the_replica_is_replaced_before_sending(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """The replica closes a kept-alive connection while it is idle (its keep-alive timeout): the next request goes
    on a fresh connection, sent once, and succeeds."""
    closed = asyncio.Event()

    async def answer_then_close(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(ok())  # keep-alive by HTTP/1.1's default
        await w.drain()
        if len(replica.requests) == 1:
            w.close()
            closed.set()

    replica = await replica_of(answer_then_close)
    pool = Pool()
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}")
    assert await answer.read() == b'{"ok":1}'
    answer.close()
    assert pool.idle(replica.host, replica.port) == 1
    await closed.wait()
    for _ in range(100):  # the FIN reaches the client's loop
        if pool.idle(replica.host, replica.port) == 0:
            break
        await asyncio.sleep(0.01)
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}")
    assert answer.status == 200 and await answer.read() == b'{"ok":1}'
    answer.close()
    assert pool.opened == 2 and len(replica.requests) == 2
    pool.close()


async def test_a_request_sent_and_not_answered_is_not_replayed(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """Once the request was written, a connection that closes without an answer is an error for the gateway's
    own retry rule: the replica may have started on it, so the pool never sends it again by itself."""
    async def hang_up(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.close()

    replica = await replica_of(hang_up)
    pool = Pool()
    with pytest.raises(UpstreamError, match="closed the connection without answering"):
        await pool.request(replica.host, replica.port, replica.head(), b"{}")
    assert len(replica.requests) == 1 and pool.opened == 1
    pool.close()


async def test_chunked_body_is_decoded_and_passed_on_as_it_arrives(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """Each chunk is readable before the replica writes the next (a stream token by token), sizes with extensions
    and a trailer are understood, a chunk split across writes is joined, and the connection is reused."""
    go_on = asyncio.Event()

    async def chunked(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"e;ext=1\r\ndata: token1\n\n\r\n")
        await w.drain()
        await go_on.wait()
        go_on.clear()
        for piece in (b"E\r\ndata: tok", b"en2\n\n\r", b"\n0\r\nX-Trailer: t\r\n\r\n"):
            w.write(piece)
            await w.drain()
            await asyncio.sleep(0.01)

    replica = await replica_of(chunked)
    pool = Pool()
    for _ in range(2):
        answer = await pool.request(replica.host, replica.port, replica.head(), b"{}")
        assert answer.headers["transfer-encoding"] == "chunked"
        assert await answer.readany() == b"data: token1\n\n"  # before the replica sent the rest
        go_on.set()
        assert await answer.read() == b"data: token2\n\n"
        assert await answer.readany() == b""
        answer.close()
    assert pool.opened == 1
    pool.close()


async def test_body_without_length_runs_until_the_replica_closes(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    async def until_eof(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\":")
        await w.drain()
        await asyncio.sleep(0.02)
        w.write(b"1}")
        await w.drain()
        w.close()

    replica = await replica_of(until_eof)
    pool = Pool()
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}")
    assert await answer.read() == b'{"a":1}'
    answer.close()
    assert pool.idle(replica.host, replica.port) == 0  # its end was the close: never reused
    pool.close()


async def test_broken_body_is_an_error(replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    async def short(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await w.drain()
        w.close()

    replica = await replica_of(short)
    pool = Pool()
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}")
    with pytest.raises(UpstreamError, match="before the answer ended"):
        await answer.read()
    answer.close()
    pool.close()


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * (MAX_HEAD + 10) + b"\r\n\r\n",  # never ends within the cap
    b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * MAX_HEAD + b"\r\nContent-Length: 0\r\n\r\n",  # ends past it
    b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: x1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
])
async def test_bad_heads_are_errors(replica_of: Callable[[Script], Awaitable[RawReplica]], head: bytes) -> None:
    async def bad(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(head)
        await w.drain()
        await asyncio.sleep(0.5)  # the client gives up first

    replica = await replica_of(bad)
    pool = Pool()
    with pytest.raises(UpstreamError) as err:
        await pool.request(replica.host, replica.port, replica.head(), b"{}")
    assert "aaaa" not in str(err.value)
    if len(head) > MAX_HEAD:
        assert f"larger than {MAX_HEAD} bytes" in str(err.value)
    pool.close()


async def test_unreachable_replica_is_an_error() -> None:
    with pytest.raises(UpstreamError, match="refused the connection"):
        await Pool().request("127.0.0.1", 9, b"GET / HTTP/1.1\r\n\r\n")


def test_request_head_and_urls() -> None:
    head = request_head("POST", "/v1/completions", "h:1", [("User-Agent", "a\r\nX-Injected: 1"), ("Accept", "*/*")], 2)
    assert head == b"POST /v1/completions HTTP/1.1\r\nHost: h:1\r\nContent-Length: 2\r\nAccept: */*\r\n\r\n"
    assert split_url("http://10.0.0.1:8000") == ("10.0.0.1", 8000, "10.0.0.1:8000")
    assert split_url("http://[fd00::1]:8000") == ("fd00::1", 8000, "[fd00::1]:8000")
    with pytest.raises(ValueError, match="not an http:// replica address"):
        split_url("https://x:1")


def test_gauge_total_reads_only_its_metric() -> None:
    text = (b"# HELP vllm:num_requests_waiting waiting\n# TYPE vllm:num_requests_waiting gauge\n"
            b'vllm:num_requests_waiting{model_name="a}b"} 3.0\nvllm:num_requests_waiting{model_name="c"} 2\n'
            b"vllm:num_requests_waiting_total 100\nother 7\n")
    assert gauge_total(text, b"vllm:num_requests_waiting") == 5.0
    assert gauge_total(b"x 1\n", b"vllm:num_requests_waiting") == 0.0
    assert gauge_total(b"vllm:num_requests_waiting{a=\"b\"} nope\n", b"vllm:num_requests_waiting") is None


async def test_request_deadline_covers_the_head_and_the_body(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """``timeout`` bounds the whole answer: a replica silent before its head, and one whose body stops halfway, both
    end in UpstreamTimeout (a TimeoutError, so the gateway answers 504), and neither connection is reused."""
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: bytes) -> None:
        if b"half" in req:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
            await w.drain()
        await asyncio.sleep(30)

    replica = await replica_of(script)
    pool = Pool()
    with pytest.raises(UpstreamTimeout) as silent:
        await pool.request(replica.host, replica.port, replica.head(), b"{}", timeout=0.3)
    assert isinstance(silent.value, TimeoutError)
    answer = await pool.request(replica.host, replica.port, replica.head(b'"half"'), b'"half"', timeout=0.3)
    with pytest.raises(TimeoutError):
        await answer.read()
    answer.close()
    assert pool.opened == 2 and pool.idle(replica.host, replica.port) == 0
    pool.close()


async def test_an_earlier_requests_deadline_spares_the_next_on_the_same_connection(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """The deadline's timer outlives a quick answer on a kept-alive connection; when it fires during the next
    request, whose own deadline is later, that request goes on (the timer sleeps again until its deadline)."""
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: bytes) -> None:
        if b"slow" in req:
            await asyncio.sleep(1.2)
        w.write(ok())
        await w.drain()

    replica = await replica_of(script)
    pool = Pool()
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}", timeout=2.0)
    assert await answer.read() == b'{"ok":1}'
    answer.close()
    await asyncio.sleep(1.2)  # the second request's answer comes 2.4 s after the first one's deadline was set
    answer = await pool.request(replica.host, replica.port, replica.head(b'"slow"'), b'"slow"', timeout=2.0)
    assert await answer.read() == b'{"ok":1}'
    answer.close()
    assert pool.opened == 1
    pool.close()


async def test_a_stream_past_its_first_chunk_is_no_longer_bounded_by_the_deadline(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """After ``end_deadline`` (the gateway calls it once a stream's first chunk came) a pause longer than the
    request's timeout does not end the answer: each chunk has the stream's idle timeout instead."""
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst \r\n")
        await w.drain()
        await asyncio.sleep(0.8)
        w.write(b"4\r\nlast\r\n0\r\n\r\n")
        await w.drain()

    replica = await replica_of(script)
    pool = Pool()
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}", timeout=0.3)
    assert await answer.readany() == b"first "
    answer.end_deadline()
    assert await answer.read() == b"last"
    answer.close()
    assert pool.idle(replica.host, replica.port) == 1
    pool.close()


async def test_a_read_within_a_bound_ends_a_stalled_stream(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """``readany_within`` (a stream's idle timeout between chunks): a replica that stops sending mid-stream is an
    UpstreamTimeout, a TimeoutError, and the connection is not reused."""
    stop = asyncio.Event()

    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst \r\n")
        await w.drain()
        await stop.wait()  # never another chunk

    replica = await replica_of(script)
    pool = Pool()
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}", timeout=30)
    answer.end_deadline()
    assert await answer.readany_within(5) == b"first "
    with pytest.raises(UpstreamTimeout) as caught:
        await answer.readany_within(0.2)
    assert isinstance(caught.value, TimeoutError)
    answer.close()
    assert pool.idle(replica.host, replica.port) == 0
    stop.set()
    pool.close()


async def test_a_read_within_a_bound_does_not_bound_the_time_between_reads(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """The bound covers the wait for the next chunk only: a caller that takes longer than it to pass a chunk on
    (a slow client) does not end the stream."""
    more = asyncio.Event()

    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst \r\n")
        await w.drain()
        await more.wait()
        w.write(b"4\r\nlast\r\n0\r\n\r\n")
        await w.drain()

    replica = await replica_of(script)
    pool = Pool()
    answer = await pool.request(replica.host, replica.port, replica.head(), b"{}", timeout=30)
    answer.end_deadline()
    assert await answer.readany_within(0.5) == b"first "
    await asyncio.sleep(0.8)  # past the first read's bound, between reads, the stream still open
    more.set()
    assert await answer.readany_within(5.0) == b"last"
    assert await answer.readany_within(5.0) == b""
    answer.close()
    assert pool.idle(replica.host, replica.port) == 1
    pool.close()


async def test_the_same_head_with_other_lengths_is_read_by_its_own_length(
        replica_of: Callable[[Script], Awaitable[RawReplica]]) -> None:
    """A replica's answer head is parsed once and then found again, less its Content-Length: each answer is still
    read by its own length, and a head with two lengths is an error every time it comes."""
    bodies = [b'{"a":1}', b'{"a":1,"b":"' + b"x" * 50 + b'"}', b'{"c":2}']

    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        body = bodies[(len(replica.requests) - 1) % len(bodies)]
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                + body)
        await w.drain()

    replica = await replica_of(script)
    pool = Pool()
    for expected in bodies * 2:
        answer = await pool.request(replica.host, replica.port, replica.head(), b"{}", timeout=30)
        assert await answer.read() == expected
        answer.close()
    assert replica.connections == 1

    async def two_lengths(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: 1\r\ncontent-length: 9\r\n\r\nab")
        await w.drain()

    doubled = await replica_of(two_lengths)
    for _ in range(2):
        with pytest.raises(UpstreamError):
            answer = await pool.request(doubled.host, doubled.port, doubled.head(), b"{}", timeout=30)
            await answer.read()
    pool.close()
