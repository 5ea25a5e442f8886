"""The gateway's HTTP/1.1 client to the replicas: a keep-alive pool per replica on asyncio protocols.

Why not aiohttp's client: profiled under ``bench/bench_gateway.py`` it cost about a third of the gateway's CPU per
proxied request (request and payload objects, the connector's bookkeeping, header preparation, a full response
parser), for a job that is narrow here. The gateway sends one small set of headers and a body it already holds, and
needs back a status, two or three headers and the body, whole (JSON) or piece by piece as the replica writes it
(a server-sent-event stream, token by token). So:

- The request goes out as bytes, head and body in one write (a body of any size is written as it is).
- Of the answer only the status line and the framing headers are parsed (``Content-Length``,
  ``Transfer-Encoding``, ``Connection``; ``Content-Type`` is kept for the caller). A head larger than
  ``MAX_HEAD`` bytes is an error, not an unbounded buffer.
- The body comes through as it arrives: by ``Content-Length``, chunked (decoded; trailers skipped), or, with
  neither, until the replica closes (such a connection is never reused). Reading pauses while more than
  ``HIGH_WATER`` bytes wait for a slow client.
- A connection goes back to its replica's pool only after a whole, well-framed answer and only if the replica did
  not say ``Connection: close``; anything else (an error, a timeout, a cancellation, a body left unread) aborts it,
  which is also how a client's disconnect stops the runtime's generation.
- A kept-alive connection the replica closed while it was idle is dropped when it is taken out, before a byte of
  the request is written, and a fresh one is opened: that retry is always safe. Once the request was written, a
  connection that closes without an answer is an :class:`UpstreamError` for the gateway's own retry rule (the
  replica may have started on it), never replayed here. Idle connections are kept ``keepalive`` seconds (4 s by
  default: under the 5 s after which uvicorn, vLLM's server, closes an idle one, so the replica rarely closes one
  just as it is reused).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

from inference.gateway.heads import SeenHeads, without_length

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_CHUNK_LINE = 4096  # bytes of one chunk-size line (extensions included)
HIGH_WATER = 256 * 1024  # bytes of body waiting for the reader before the socket is paused

_NEVER = float("inf")
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_EOF, _DONE = range(8)


class UpstreamError(Exception):
    """The replica could not be reached, closed the connection early, or sent something that is no HTTP/1.1
    answer. The message says which, never with the replica's bytes in it."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The answer (or the part of it the caller bounded: see :meth:`Answer.end_deadline`) did not arrive before the
    request's deadline. A ``TimeoutError``, as ``asyncio.timeout`` would raise, so callers tell it from a failure."""


class Answer:
    """A replica's answer once its head arrived: ``status``, ``headers`` (lower-case names), and the body through
    :meth:`readany` / :meth:`read`. :meth:`close` hands the connection back (a whole answer) or aborts it."""

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        self._conn: _Connection | None = conn

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some if none did); ``b""`` at its end."""
        conn = self._conn
        if conn is None:
            return b""
        return await conn.readany()

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        first = await self.readany()
        if not first:
            return first
        parts = [first]
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def end_deadline(self) -> None:
        """The deadline given to :meth:`Pool.request` no longer applies (a stream's first chunk came: from here on
        the caller bounds each chunk itself, with :meth:`readany_within`)."""
        if self._conn is not None:
            self._conn.deadline = _NEVER

    async def readany_within(self, seconds: float) -> bytes:
        """:meth:`readany`, which must return within ``seconds`` or raise :class:`UpstreamTimeout` (the connection
        aborted): a stream's idle bound between two chunks, kept by the connection's one lazy timer instead of an
        ``asyncio.timeout`` (a timer and a context) per chunk. Only the wait is bounded: the time the caller then
        takes to pass the chunk on (a slow client) is not."""
        conn = self._conn
        if conn is None:
            return b""
        conn.set_deadline(conn._loop.time() + seconds)
        try:
            return await conn.readany()
        finally:
            conn.deadline = _NEVER

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()


class _Connection(asyncio.Protocol):
    """One TCP connection to a replica and the answer in progress on it (one at a time: no pipelining)."""

    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._state = _DONE
        self._buf = bytearray()  # head, or a chunk-size/trailer line, not yet complete
        self._searched = 0  # how far _buf was already searched for the head's end
        self._remaining = 0  # body bytes of the Content-Length, or of the current chunk
        self._reusable = False
        self._head: asyncio.Future[Answer] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None  # UpstreamTimeout: the deadline passed
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        # the exchange in progress must end by this loop time: one lazy timer per connection, not one per request
        # (see _arm_deadline)
        self.deadline = _NEVER
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER  # when _deadline_timer fires

    # ---- the exchange ----------------------------------------------------------------------------------------
    async def exchange(self, head: bytes, body: bytes, deadline: float = _NEVER) -> Answer:
        assert self.transport is not None
        self.set_deadline(deadline)
        self._state, self._buf, self._searched = _HEAD, bytearray(), 0
        self._chunks, self._buffered, self._error, self._reusable = [], 0, None, False
        self._head = self._loop.create_future()
        if len(body) <= 65536:
            self.transport.write(head + body)
        else:  # no copy of a big body
            self.transport.writelines((head, body))
        if self._drain is not None:  # the socket's buffer is full: wait until the kernel took the body
            await self._drain
        return await self._head

    async def readany(self) -> bytes:
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if self._paused and not self.closed and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def set_deadline(self, deadline: float) -> None:
        """The exchange in progress must end (or its next read return) by ``deadline`` (loop time): a timer is
        armed only when none is set for that time or earlier (see :meth:`_deadline_due`)."""
        self.deadline = deadline
        if deadline < self._timer_at:  # no timer, or one set for later than this deadline
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._deadline_timer, self._timer_at = self._loop.call_at(deadline, self._deadline_due), deadline

    def _deadline_due(self) -> None:
        """The deadline timer fired: fail the exchange if its deadline passed; else (the connection went on to a
        later exchange, whose deadline is later) sleep again until that one. A keep-alive connection serving
        request after request thus costs a timer per ``request_timeout`` seconds, not a timer per request (with
        ``asyncio.timeout`` around each request, timers were ~5% of the gateway's CPU per proxied request)."""
        self._deadline_timer, self._timer_at = None, _NEVER
        if self.closed or self.deadline == _NEVER or self._state == _DONE:
            return  # none in progress, or the answer is all here (the caller is about to take it)
        if self._loop.time() < self.deadline:
            self._deadline_timer = self._loop.call_at(self.deadline, self._deadline_due)
            self._timer_at = self.deadline
            return
        self._fail("did not answer in time", timeout=True)

    def finish(self) -> None:
        """The caller is done with the answer: back to the pool if it ended cleanly, else abort."""
        self.deadline = _NEVER
        if self._state == _DONE and self._reusable and not self._chunks and not self.closed:
            self.idle_since = time.monotonic()
            self.pool._put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # ---- asyncio.Protocol ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is no asyncio.Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer, self._timer_at = None, _NEVER
        self.pool._lost(self)
        if self._state == _UNTIL_EOF:
            self._state = _DONE  # the replica's close is the body's end
            self._wake()
        elif self._state != _DONE:
            self._fail("closed the connection before the answer ended" if self._head is None or self._head.done()
                       else "closed the connection without answering")
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._state == _HEAD:
            self._buf += data
            self._read_head()
        elif self._state == _LENGTH:
            self._take_length(data)
        elif self._state == _UNTIL_EOF:
            self._deliver(data)
        elif self._state == _DONE:
            if data and self._error is None:  # bytes nobody asked for: the connection's framing is lost
                self._reusable = False
                if self.pool._drop(self):
                    self.abort()
        else:
            self._read_chunked(bytes(self._buf) + data if self._buf else data)

    def eof_received(self) -> bool | None:
        return False  # close: connection_lost ends an until-EOF body or fails an unfinished answer

    # ---- parsing ---------------------------------------------------------------------------------------------
    def _fail(self, message: str, timeout: bool = False) -> None:
        error = UpstreamTimeout(message) if timeout else UpstreamError(message)
        self._error, self._state, self._reusable = error, _DONE, False
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a cancelled caller must not leave "never retrieved" behind
        self._wake()
        if not self.closed:
            self.abort()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _deliver(self, data: bytes | bytearray) -> None:
        if not data:
            return
        self._chunks.append(bytes(data))
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _read_head(self) -> None:
        while self._state == _HEAD:
            end = self._buf.find(b"\r\n\r\n", max(0, self._searched - 3))
            if end < 0:
                self._searched = len(self._buf)
                if len(self._buf) > MAX_HEAD:
                    self._fail(f"sent a response head larger than {MAX_HEAD} bytes")
                return
            if end > MAX_HEAD:
                self._fail(f"sent a response head larger than {MAX_HEAD} bytes")
                return
            head, rest = bytes(self._buf[:end]), self._buf[end + 4:]
            self._buf, self._searched = bytearray(), 0
            parsed = _parse_head(head)
            if parsed is None:
                self._fail("sent a malformed response head")
                return
            version, status, headers = parsed
            if 100 <= status < 200:  # 100 Continue and the like: the real answer follows
                self._buf = rest
                continue
            connection = headers.get("connection", "").lower()
            self._reusable = ("close" not in connection if version == b"HTTP/1.1" else "keep-alive" in connection)
            encoding = headers.get("transfer-encoding")
            length = headers.get("content-length")
            if status in (204, 304):
                self._state = _DONE
            elif encoding is not None:
                if encoding.lower().rsplit(",", 1)[-1].strip() != "chunked":
                    self._fail("sent a transfer coding other than chunked")
                    return
                self._state = _CHUNK_SIZE
            elif length is not None:
                if not length.isdigit():
                    self._fail("sent an invalid Content-Length")
                    return
                self._remaining = int(length)
                self._state = _LENGTH if self._remaining else _DONE
            else:
                self._state, self._reusable = _UNTIL_EOF, False
            assert self._head is not None
            if not self._head.done():
                self._head.set_result(Answer(self, status, headers))
            if rest:
                self.data_received(bytes(rest))
            return

    def _take_length(self, data: bytes) -> None:
        n = self._remaining
        if len(data) < n:
            self._remaining -= len(data)
            self._deliver(data)
            return
        if len(data) > n:  # more than the answer: the replica's framing is broken, never reuse this connection
            self._reusable = False
            data = data[:n]
        self._remaining = 0
        self._state = _DONE
        self._deliver(data)
        self._wake()

    def _read_chunked(self, buf: bytes) -> None:
        pos = 0
        while pos < len(buf):
            state = self._state
            if state == _CHUNK_DATA:
                take = min(self._remaining, len(buf) - pos)
                self._deliver(buf[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                self._state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    self._fail("sent a malformed chunk")
                    return
                pos += 2
                self._state = _CHUNK_SIZE
            elif state in (_CHUNK_SIZE, _TRAILER):
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_CHUNK_LINE:
                        self._fail("sent a chunk-size or trailer line that is too long")
                        return
                    break
                line = bytes(buf[pos:end])
                pos = end + 2
                if state == _TRAILER:
                    if not line:
                        self._state = _DONE
                        if pos < len(buf):
                            self._reusable = False  # bytes after the answer
                        self._wake()
                        break
                    continue
                size = line.split(b";", 1)[0].strip()
                try:
                    if not size or any(c not in b"0123456789abcdefABCDEF" for c in size):
                        raise ValueError
                    self._remaining = int(size, 16)
                except ValueError:
                    self._fail("sent a malformed chunk size")
                    return
                self._state = _CHUNK_DATA if self._remaining else _TRAILER
            else:
                break
        self._buf = bytearray(buf[pos:]) if pos < len(buf) else bytearray()


# a response head's header lines: a name without blanks or colons, a value without CR or LF (blanks around it
# dropped); a head that is not all such lines is malformed
_HEADER_LINES = re.compile(r"(?:[^:\r\n \t]+:[^\r\n]*\r\n)*")
_HEADER_PAIRS = re.compile(r"([^:]+):[ \t]*((?:[^\r]*[^\r \t])?)[ \t]*\r\n")
# answer heads parsed before, less their length's line (a replica's Date changes its head once a second)
_HEADS_SEEN: SeenHeads[tuple[bytes, int, dict[str, str]]] = SeenHeads(512, 2048)


def _parse_head(head: bytes) -> tuple[bytes, int, dict[str, str]] | None:
    """(version, status, headers with lower-case names; repeated ones joined by ", "), or None if malformed.

    A replica answers with the same head but for its ``Content-Length`` (and its ``Date``, once a second), so a
    head seen before, less that line, is not parsed again."""
    key, length = without_length(head)
    known = _HEADS_SEEN.get(key)
    if known is not None:
        version, status, headers = known
        headers = dict(headers)
        if length is not None:
            headers["content-length"] = length
        return version, status, headers
    parsed = _parse_whole_head(head)
    # not kept with two lengths (joined here, refused by the caller): found again, it would read as one
    if parsed is not None and parsed[2].get("content-length") == length:
        base = dict(parsed[2])
        base.pop("content-length", None)
        _HEADS_SEEN.keep(key, (parsed[0], parsed[1], base))
    return parsed


def _parse_whole_head(head: bytes) -> tuple[bytes, int, dict[str, str]] | None:
    line, _, rest = head.partition(b"\r\n")
    parts = line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts[1]) != 3 or not parts[1].isdigit():
        return None
    if not rest:
        return parts[0], int(parts[1]), {}
    block = rest.decode("latin-1") + "\r\n"
    if _HEADER_LINES.fullmatch(block) is None:
        return None
    pairs = _HEADER_PAIRS.findall(block)
    headers = {name.lower(): text for name, text in pairs}
    if len(headers) < len(pairs):  # a name came more than once: join the values, in order
        headers = {}
        for name, text in pairs:
            key = name.lower()
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return parts[0], int(parts[1]), headers


def split_url(url: str) -> tuple[str, int, str]:
    """``http://host:port`` → (host to connect to, port, Host header value)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http:// replica address: {url!r}")
    port = parts.port or 80
    return parts.hostname, port, parts.netloc


def request_head(method: str, path: str, host: str, headers: Iterable[tuple[str, str]], length: int) -> bytes:
    """The request line and headers; a value with a line break is left out (it could smuggle a header in)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}"]
    lines.extend(f"{k}: {v}" for k, v in headers if "\r" not in v and "\n" not in v)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


class Pool:
    """Keep-alive connections per replica (host, port): the most recently used is taken first, so the rest age
    out after ``keepalive`` seconds idle; no timer per connection (swept when the pool is used)."""

    def __init__(self, connect_timeout: float = 2.0, keepalive: float = 4.0) -> None:
        self.connect_timeout, self.keepalive = connect_timeout, keepalive
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._swept = time.monotonic()
        self.opened = 0  # connections opened so far (tests: reuse)
        # the loop the pool serves, kept at first use (asyncio.get_running_loop() checks for a fork with a
        # getpid() system call every time)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def request(self, host: str, port: int, head: bytes, body: bytes = b"", timeout: float | None = None
                      ) -> Answer:
        """Send ``head`` + ``body`` to the replica and wait for its answer's head; the caller must ``close()``
        the answer. A cancellation or error on the way aborts the connection. ``timeout``: seconds from now to
        the answer's end (connecting included); past it the wait for the head, or :meth:`Answer.readany`, raises
        :class:`UpstreamTimeout` and the connection is aborted."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline = _NEVER if timeout is None else loop.time() + timeout
        conn = self._take((host, port))
        if conn is None:
            conn = await self._connect((host, port), deadline - loop.time())
        try:
            return await conn.exchange(head, body, deadline)
        except BaseException:
            conn.abort()
            raise

    async def _connect(self, key: tuple[str, int], left: float = _NEVER) -> _Connection:
        loop = asyncio.get_running_loop()
        if left <= 0:
            raise UpstreamTimeout("did not answer in time")
        try:
            async with asyncio.timeout(min(self.connect_timeout, left)):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), key[0], key[1])
        except TimeoutError:
            if left < self.connect_timeout:  # the request's own deadline came first
                raise UpstreamTimeout("did not answer in time") from None
            raise UpstreamError(f"did not accept a connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise UpstreamError(f"refused the connection ({type(exc).__name__})") from None
        self.opened += 1
        self._all.add(conn)
        return conn

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        if now - self._swept > self.keepalive:
            self._sweep(now)
            idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue  # the replica closed it while idle: nothing was sent on it, a fresh one is safe
            if now - conn.idle_since > self.keepalive:
                conn.abort()
                continue
            return conn
        return None

    def _put(self, conn: _Connection) -> None:
        self._idle.setdefault(conn.key, []).append(conn)

    def _drop(self, conn: _Connection) -> bool:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            return True
        return False

    def _lost(self, conn: _Connection) -> None:
        self._all.discard(conn)
        self._drop(conn)

    def _sweep(self, now: float) -> None:
        self._swept = now
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since <= self.keepalive]
            for conn in idle:
                if conn not in keep and not conn.closed:
                    conn.abort()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def idle(self, host: str, port: int) -> int:
        return len(self._idle.get((host, port), ()))

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        self._all.clear()
