"""The gateway's HTTP/1.1 server: a lean asyncio protocol, not aiohttp's.

Why: profiled under ``bench/bench_gateway.py`` (one replica, 64 clients), aiohttp's server was a quarter to a
third of the gateway's CPU per proxied request (request and response objects, the URL dispatcher, the response
writer's header and payload machinery, a task and a stream reader per connection) for a narrow job: a handful of
routes, small JSON bodies in, a JSON body or a server-sent-event stream out. Here a request costs a head split
and one regular-expression check, a task, and one write per answer (a stream: one write per chunk).

What a server facing anyone needs, all here:

- **Malformed HTTP** (bare LF or bare CR line endings, a header name that is no token, a control character or
  ``\\x7f`` in a value, an unknown version, a bad ``Content-Length``, any ``Transfer-Encoding`` but ``chunked``,
  both framings at once, obsolete line folding) is answered with a fixed body (:data:`MALFORMED_BODY`) that never
  echoes the request, the connection closed, and logged as one WARNING line naming the peer and a fixed
  description: never a header value.
- **Limits**: a request line or header line over :data:`MAX_LINE` bytes, more than :data:`MAX_HEADERS` headers,
  or a head over :data:`MAX_HEAD` bytes is answered 431 with a fixed body; the head is never buffered further.
- **Header timeout**: a connection must complete a request's head within ``header_timeout`` seconds of being
  accepted, or of the first byte of a later request: a client that drips headers (slowloris) or says nothing is
  closed. **Idle timeout**: a kept-alive connection with no request in progress is closed after
  ``idle_timeout``. A body's own bound is the handler's (``--client-body-timeout``: 408, then close).
- **Bodies**: by ``Content-Length`` or chunked (decoded as it streams in; chunk-size lines bounded, trailers
  skipped); reading pauses while more than :data:`HIGH_WATER` bytes wait for the handler, so a handler that
  refuses a request before reading its body (no key, a ``Content-Length`` over the limit) holds at most that much.
  ``Expect: 100-continue`` is answered when the handler first waits for the body, so a refused client is never
  invited to send it. A response sent before the body was all read closes the connection (no lingering).
- **Keep-alive and pipelining**: HTTP/1.1 connections stay open unless either side says ``Connection: close``;
  HTTP/1.0 ones only with ``Connection: keep-alive``. Pipelined requests are answered in order, one at a time:
  the bytes of the next wait (reading paused past :data:`MAX_HEAD` of them) until the answer in progress ended.
- **Responses**: a whole body with its ``Content-Length`` in one write; a :class:`Stream` chunked (HTTP/1.0:
  delimited by closing the connection), written straight to the transport, each write waiting while the
  transport's buffer is over its high-water mark (a slow client slows the replica's reader, not the memory).
- **Disconnects** cancel the request's handler (which closes its upstream connection, so the runtime stops).
- **No version banner**: ``Server: accelstack-gateway``.
- **One shutdown timeout**: :meth:`Listener.close` stops accepting, closes idle connections, lets requests in
  progress finish for ``shutdown_timeout`` seconds in all (their answers close the connection), then cancels them
  (``CANCEL_GRACE`` to close their upstream and record themselves) and closes what is left.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from email.utils import formatdate
from http import HTTPStatus

from inference.gateway.heads import SeenHeads, without_length

log = logging.getLogger("accelstack.gateway")

SERVER = "accelstack-gateway"
CANCEL_GRACE = 0.5  # seconds a cancelled handler has to close its upstream and record itself
MAX_LINE = 8190  # bytes of the request line or of one header line (aiohttp's and nginx's order of magnitude)
MAX_HEADERS = 128
MAX_HEAD = 64 * 1024  # bytes of a whole request head
MAX_CHUNK_LINE = 4096  # bytes of one chunk-size line of a chunked body (extensions included)
HIGH_WATER = 256 * 1024  # body bytes waiting for the handler before reading pauses
MALFORMED_BODY = b'{"error": {"message": "Malformed HTTP request.", "type": "invalid_request_error", ' \
                 b'"param": null, "code": "bad_request"}}'
TOO_LARGE_HEAD_BODY = b'{"error": {"message": "Request header fields too large.", "type": ' \
                      b'"invalid_request_error", "param": null, "code": "bad_request"}}'
_INTERNAL_BODY = b'{"error": {"message": "Internal error.", "type": "server_error", "param": null, "code": null}}'

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") (/[!-~]*) HTTP/1\.([01])")
_METHOD_SO_FAR = re.compile(_TOKEN + rb"(?: |$)")  # how a request's first bytes must begin
_HEADER_LINES = re.compile(rb"(?:" + _TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
# a checked header block's lines as (name, value without the blanks around it)
# (no lazy quantifier: a value of many blanks costs linear time, not quadratic)
_HEADER_PAIRS = re.compile(r"([^:]*):[ \t]*((?:[^\r]*[^\r \t])?)[ \t]*\r\n")
_BLOCKS_SEEN: SeenHeads[Headers] = SeenHeads(512, 4096)  # header blocks parsed before, less their length's line
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEAD, _BODY, _BUSY, _CLOSED = range(4)  # reading a head / a body / the answer in progress / done
_LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _ENDED = range(6)
_date = [0, b""]


def _http_date() -> bytes:
    now = int(time.time())
    if _date[0] != now:
        _date[0], _date[1] = now, formatdate(now, usegmt=True).encode()
    return _date[1]  # type: ignore[return-value]


class Malformed(Exception):
    """A request the listener answers itself (``status``: 400 or 431); ``what`` is a fixed description."""

    def __init__(self, what: str, status: int = 400) -> None:
        super().__init__(what)
        self.what, self.status = what, status


class BrokenBody(Exception):
    """A chunked body whose framing is broken; the message is fixed, never the client's bytes."""


class Headers(dict[str, str]):
    """A request's headers by lower-case name (repeats joined with ``", "``); lookups in any case. The gateway's
    own lookups, by names it knows in lower case, skip the ``lower()`` (:func:`lookup`)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, name.lower(), default)


def lookup(headers: Headers, lower_name: str) -> str | None:
    """``headers``' value of a header named in lower case (no Python-level ``get`` per lookup)."""
    return _lookup(headers, lower_name)


_lookup = dict.get


class Body:
    """A request's body as it arrives: :meth:`readany` waits for the next bytes (``b""`` at its end)."""

    __slots__ = ("_chunks", "_conn", "_error", "_waiter", "buffered", "complete", "continue_")

    def __init__(self, conn: _Connection, complete: bool, continue_: bool) -> None:
        self._conn = conn
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self.buffered = 0
        self.complete = complete  # every byte of the body arrived
        self.continue_ = continue_  # the client waits for "100 Continue" before sending it

    def read_nowait(self, n: int) -> bytes:
        """Up to ``n`` bytes already here, without waiting."""
        if not self._chunks:
            return b""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        taken, rest = data[:n], data[n:]
        self._chunks = [rest] if rest else []
        self.buffered = len(rest)
        self._conn.body_drained(self.buffered)
        return taken

    async def readany(self) -> bytes:
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            if self.continue_:
                self.continue_ = False
                self._conn.write(_CONTINUE)
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks, self._chunks, self.buffered = self._chunks, [], 0
        self._conn.body_drained(0)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self.buffered += len(data)
        self._wake()

    def end(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Request:
    """One request: ``method``, ``path`` (no query), ``version`` (0 or 1: HTTP/1.x), ``headers``, ``remote`` (the
    peer's address), ``content_length`` (None: none given, or chunked), ``content`` (the :class:`Body`)."""

    __slots__ = ("_conn", "content", "content_length", "headers", "keep_alive", "method", "path", "remote",
                 "version")

    def __init__(self, conn: _Connection, method: str, path: str, version: int, headers: Headers,
                 content_length: int | None, content: Body, keep_alive: bool) -> None:
        self._conn, self.method, self.path, self.version, self.headers = conn, method, path, version, headers
        self.content_length, self.content, self.keep_alive = content_length, content, keep_alive
        self.remote = conn.remote

    def stream(self, status: int, headers: Mapping[str, str]) -> Stream:
        """Start an answer whose body is written as it comes (its head goes out now)."""
        return Stream(self._conn, self, status, headers)


class Response:
    """A whole answer: ``status``, ``body``, ``headers``; ``close``: no further request on this connection."""

    __slots__ = ("body", "close", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", headers: Mapping[str, str] | None = None,
                 content_type: str = "text/plain; charset=utf-8", close: bool = False) -> None:
        self.status, self.body, self.close = status, body, close
        self.headers = {"Content-Type": content_type, **(headers or {})}


class Stream:
    """An answer written as it comes (chunked; HTTP/1.0: until the connection closes). :meth:`write` raises
    ``ConnectionResetError`` once the client is gone."""

    __slots__ = ("_chunked", "_conn", "ended", "status")

    def __init__(self, conn: _Connection, request: Request, status: int, headers: Mapping[str, str]) -> None:
        self._conn, self.status, self.ended = conn, status, False
        self._chunked = request.version == 1
        if not self._chunked:
            conn.closing = True  # HTTP/1.0: the body ends with the connection
        conn.started = True
        conn.write(_head(status, headers.items(), None, self._chunked, conn.closing))

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        if self._chunked:
            conn.write(b"%x\r\n" % len(data) + data + b"\r\n")
        else:
            conn.write(data)
        if conn.drain is not None:
            await conn.drain

    async def write_eof(self) -> None:
        if not self.ended:
            self.ended = True
            if self._chunked:
                self._conn.write(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable[Response | Stream]]


def _head(status: int, headers: Iterable[tuple[str, str]], length: int | None, chunked: bool, close: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\nServer: " % (status, _REASONS.get(status, b"Unknown")) + SERVER.encode()
             + b"\r\nDate: " + _http_date()]
    lines.extend(f"{k}: {v}".encode("latin-1") for k, v in headers)
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    elif chunked:
        lines.append(b"Transfer-Encoding: chunked")
    if close:
        lines.append(b"Connection: close")
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


def _parse_head(head: bytes) -> tuple[str, str, int, Headers]:
    """The request line and headers of ``head`` (without its blank line); :class:`Malformed` when anything is off.

    A client sends the same header block on request after request but for its ``Content-Length`` (an SDK's
    headers are fixed per client), so a block seen before, less that line, is not parsed again
    (:mod:`inference.gateway.heads`); ``Content-Length``'s own line is checked by the expression that finds it."""
    line_end = head.find(b"\r\n")
    first = head if line_end < 0 else head[:line_end]
    if len(first) > MAX_LINE:
        raise Malformed("request line too long", 431)
    match = _REQUEST_LINE.fullmatch(first)
    if match is None:
        raise Malformed("invalid request line")
    method, target, minor = match.groups()
    if line_end < 0:
        headers = Headers()
    else:
        key, length = without_length(head[line_end:])  # every header line, each after its CRLF
        known = _BLOCKS_SEEN.get(key)
        if known is None:
            headers = _header_block(head[line_end + 2:] + b"\r\n")
            if key.count(b"\r\n") < MAX_HEADERS:  # room for a length's line: found again, it may bring one
                kept = Headers(headers)
                if length is not None:
                    dict.pop(kept, "content-length", None)
                _BLOCKS_SEEN.keep(key, kept)
        else:
            headers = Headers(known)
            if length is not None:
                dict.__setitem__(headers, "content-length", length)
    path = target.split(b"?", 1)[0].decode("ascii")
    return method.decode("ascii"), path, int(minor), headers


def _header_block(block: bytes) -> Headers:
    """A header block's headers (``block`` ends with its last line's CRLF), checked whole by one regular
    expression, decoded once (Latin-1: names are checked tokens, values any octets but controls) and split into
    names and values by another; a repeated name's values joined in order."""
    if _HEADER_LINES.fullmatch(block) is None:
        raise Malformed("invalid header line")
    if len(block) > MAX_LINE and max(map(len, block.split(b"\r\n"))) > MAX_LINE:  # (no line of a shorter block
        raise Malformed("header line too long", 431)                                # can be too long)
    pairs = _HEADER_PAIRS.findall(block.decode("latin-1"))
    if len(pairs) > MAX_HEADERS:
        raise Malformed("too many headers", 431)
    headers = Headers({name.lower(): text for name, text in pairs})
    if len(headers) < len(pairs):  # a name came more than once: join the values, in order
        headers = Headers()
        for name, text in pairs:
            key = name.lower()
            seen = _lookup(headers, key)
            if seen is not None:
                if key in ("content-length", "transfer-encoding", "host"):
                    raise Malformed(f"repeated {key} header")
                text = f"{seen}, {text}"
            dict.__setitem__(headers, key, text)
    return headers


class _Connection(asyncio.Protocol):
    """One client connection: reads heads and bodies, runs the handler for one request at a time, writes answers."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.loop = listener.loop
        self.transport: asyncio.Transport | None = None
        self.remote = ""
        self.state = _HEAD
        self.buf = b""  # head bytes not yet complete, or pipelined bytes of the next request
        self.body: Body | None = None
        self.framing = _ENDED
        self.remaining = 0  # bytes of the Content-Length body, or of the current chunk, still to come
        self.cbuf = b""  # an incomplete chunk-size or trailer line
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None  # the head's clock: armed only while a head is incomplete
        self.idle_timer: asyncio.TimerHandle | None = None  # lazy: see _idle
        self.idle_since = 0.0  # when the last answer ended (loop time)
        self.closing = False  # no further request on this connection
        self.started = False  # the answer in progress began (its head was written)
        self.paused = False
        self.drain: asyncio.Future[None] | None = None
        self.checked = 0  # how much of buf was found free of bare CR and LF (never ends inside a CRLF)

    # ---- asyncio.Protocol ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is no asyncio.Transport
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.listener.connections.add(self)
        if self.listener.shutting_down:
            self.close()
            return
        self._arm(self.listener.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        self.closing = True
        self.listener.connections.discard(self)
        self._disarm()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.body is not None and not self.body.complete:
            self.body.fail(BrokenBody("the client closed the connection before its body ended"))
        if self.drain is not None and not self.drain.done():
            self.drain.set_exception(ConnectionResetError("the client closed the connection"))
            self.drain.exception()  # retrieved: nobody may be waiting on it
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the handler closes its upstream, so the runtime stops generating

    def pause_writing(self) -> None:
        if self.drain is None:
            self.drain = self.loop.create_future()

    def resume_writing(self) -> None:
        drain, self.drain = self.drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.state == _HEAD:
            self.buf += data
            self._read_head()
        elif self.state == _BODY:
            self._read_body(data)
        elif self.state == _BUSY:  # the next request, pipelined: it waits for the answer in progress
            self.buf += data
            if len(self.buf) > MAX_HEAD:
                self._pause()

    def eof_received(self) -> bool | None:
        self.closing = True
        if self.body is not None and not self.body.complete:
            self.body.fail(BrokenBody("the client closed the connection before its body ended"))
        # closed: connection_lost cancels a request in progress (a client's end of its side is how it leaves,
        # e.g. mid-stream; a half-close after the request, which almost no client does, is taken the same way)
        return False

    # ---- reading ---------------------------------------------------------------------------------------------
    def _read_head(self) -> None:
        buf = self.buf
        checked = self.checked
        end = buf.find(b"\r\n\r\n", max(0, checked - 3))
        stop = len(buf) if end < 0 else end + 4
        if end < 0 and buf.endswith(b"\r"):
            stop -= 1  # a CR whose LF has not arrived yet
        part = buf[checked:stop]  # only what was not checked before: a dripped head is not rescanned
        crlf = part.count(b"\r\n")
        if part.count(b"\n") != crlf or part.count(b"\r") != crlf:
            self._refuse(Malformed("bare LF or CR in the head"))
            return
        self.checked = stop
        if end < 0:
            if _METHOD_SO_FAR.match(buf) is None:  # no request can start so: refused now, not at the head timeout
                self._refuse(Malformed("invalid request line"))
            elif len(buf) > MAX_HEAD:
                self._refuse(Malformed("request head too large", 431))
            elif self.timer is None:  # the first bytes of an incomplete head start its clock (a head that came
                self._arm(self.listener.header_timeout)  # whole, the usual case, costs no timer at all)
            return
        if end > MAX_HEAD:
            self._refuse(Malformed("request head too large", 431))
            return
        try:
            method, path, version, headers = _parse_head(buf[:end])
            length, chunked = self._framing(headers, version)
        except (Malformed, UnicodeDecodeError) as exc:
            self._refuse(exc if isinstance(exc, Malformed) else Malformed("invalid request line"))
            return
        self._disarm()
        rest = buf[end + 4:]
        self.buf, self.checked = b"", 0
        connection = (_lookup(headers, "connection") or "").lower()
        keep_alive = "close" not in connection if version == 1 else "keep-alive" in connection
        if self.listener.shutting_down:
            keep_alive = False
        complete = not chunked and not length
        expect = (_lookup(headers, "expect") or "").lower() == "100-continue" and version == 1
        body = self.body = Body(self, complete, expect and not complete)
        request = Request(self, method, path, version, headers, None if chunked else length, body, keep_alive)
        self.closing = not keep_alive
        self.started = False
        if complete:
            self.framing, self.state = _ENDED, _BUSY
        else:
            self.framing, self.remaining, self.cbuf = (_CHUNK_SIZE if chunked else _LENGTH), length or 0, b""
            self.state = _BODY
        self.task = self.loop.create_task(self._serve(request))
        if rest:
            self.data_received(rest)

    @staticmethod
    def _framing(headers: Headers, version: int) -> tuple[int, bool]:
        encoding = _lookup(headers, "transfer-encoding")
        length = _lookup(headers, "content-length")
        if encoding is not None:
            if encoding.lower() != "chunked" or version == 0:
                raise Malformed("unsupported transfer-encoding")
            if length is not None:
                raise Malformed("both content-length and transfer-encoding")
            return 0, True
        if length is None:
            return 0, False
        if not length.isdigit() or not length.isascii() or len(length) > 18:
            raise Malformed("invalid content-length")
        return int(length), False

    def _read_body(self, data: bytes) -> None:
        body = self.body
        assert body is not None
        if self.framing == _LENGTH:
            if len(data) < self.remaining:
                self.remaining -= len(data)
                body.feed(data)
            else:
                part, rest = data[:self.remaining], data[self.remaining:]
                self.remaining = 0
                if part:
                    body.feed(part)
                self._body_ended(rest)
                return
        else:
            self._read_chunked(data)
        if body.buffered > HIGH_WATER:
            self._pause()

    def _read_chunked(self, data: bytes) -> None:
        body = self.body
        assert body is not None
        while data:
            if self.framing == _CHUNK_DATA:
                part, data = data[:self.remaining], data[self.remaining:]
                self.remaining -= len(part)
                body.feed(part)
                if self.remaining == 0:
                    self.framing = _CHUNK_CRLF
                continue
            line_end = (self.cbuf + data).find(b"\r\n")
            if line_end < 0:
                self.cbuf += data
                if len(self.cbuf) > MAX_CHUNK_LINE:
                    self._broken_body("a chunk-size or trailer line too long")
                return
            joined = self.cbuf + data
            line, data, self.cbuf = joined[:line_end], joined[line_end + 2:], b""
            if self.framing == _CHUNK_CRLF:
                if line:
                    self._broken_body("no CRLF after a chunk")
                    return
                self.framing = _CHUNK_SIZE
            elif self.framing == _CHUNK_SIZE:
                size = line.split(b";", 1)[0].strip(b" \t")
                if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
                    self._broken_body("invalid chunk size")
                    return
                self.remaining = int(size, 16)
                self.framing = _CHUNK_DATA if self.remaining else _TRAILER
            elif line:  # _TRAILER: a trailer field, skipped
                continue
            else:
                self._body_ended(data)
                return

    def _broken_body(self, what: str) -> None:
        assert self.body is not None
        self.closing = True
        self.state = _BUSY
        self.framing = _ENDED
        self.body.fail(BrokenBody(f"malformed chunked body: {what}"))
        self.buf = b""
        self._pause()  # nothing more is read from this connection

    def _body_ended(self, rest: bytes) -> None:
        assert self.body is not None
        self.framing = _ENDED
        self.state = _BUSY
        self.body.end()
        self.body_drained(self.body.buffered)
        if rest:
            self.data_received(rest)

    def body_drained(self, buffered: int) -> None:
        if self.paused and self.state == _BODY and buffered <= HIGH_WATER:
            self._resume()

    # ---- the request's task ----------------------------------------------------------------------------------
    async def _serve(self, request: Request) -> None:
        try:
            response = await self.listener.handler(request)
        except asyncio.CancelledError:
            self.close()
            raise
        except ConnectionResetError:  # the client went away while its answer was being written
            self.close()
            return
        except Exception as exc:  # a bug of the gateway's own: the traceback is what finds it
            log.error("request failed", exc_info=exc, extra={"peer": self.remote, "path": request.path})
            if self.started:
                self.close()
                return
            response = Response(500, _INTERNAL_BODY, content_type="application/json", close=True)
        if self.state == _CLOSED or self.transport is None or self.transport.is_closing():
            self.close()
            return
        if isinstance(response, Response):
            if response.close:
                self.closing = True
            body = response.body if request.method != "HEAD" else b""
            self.write(_head(response.status, response.headers.items(), len(response.body), False,
                             self.closing or self._body_unread()) + body)
        elif not response.ended:  # a stream the handler left open cannot be framed any more
            self.closing = True
        self._finished()

    def _body_unread(self) -> bool:
        """The request's body did not all arrive: the connection cannot carry another request."""
        if self.state == _BODY:
            self.closing = True
        return self.closing

    def _finished(self) -> None:
        """The answer went out: close, or wait for the next request."""
        self.task = None
        self.body = None
        if self.closing or self.listener.shutting_down or self.state != _BUSY:
            self.close()
            return
        self.state = _HEAD
        self._resume()
        if self.buf:
            rest, self.buf = self.buf, b""
            self.data_received(rest)
        else:
            self._idle()

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()  # what was written is flushed first

    # ---- refusals and timers ---------------------------------------------------------------------------------
    def _refuse(self, exc: Malformed) -> None:
        log.warning("malformed request", extra={"peer": self.remote, "status": exc.status, "error": exc.what})
        self.buf = b""
        self.state = _CLOSED
        self._disarm()
        if self.transport is None or self.transport.is_closing():
            return
        body = MALFORMED_BODY if exc.status == 400 else TOO_LARGE_HEAD_BODY
        headers = (("Content-Type", "application/json"),)
        self.write(_head(exc.status, headers, len(body), False, True) + body)
        self.close()

    def _arm(self, seconds: float) -> None:
        """Start the head's clock."""
        self._disarm()
        if seconds > 0:
            self.timer = self.loop.call_later(seconds, self._head_overdue)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _idle(self) -> None:
        """An answer ended: the idle clock restarts. One timer per connection, not one per request: it stays
        scheduled while requests come and go, and when it fires it closes the connection only if it has been idle
        for ``idle_timeout`` since the last answer, else it sleeps again for what is left (a kept-alive connection
        serving a request every few milliseconds costs a timer every ``idle_timeout`` seconds, not two per
        request)."""
        self.idle_since = self.loop.time()
        if self.idle_timer is None and self.listener.idle_timeout > 0:
            self.idle_timer = self.loop.call_at(self.idle_since + self.listener.idle_timeout, self._idle_overdue)

    def _head_overdue(self) -> None:
        self.timer = None
        if self.state != _HEAD:
            return
        log.info("connection closed: no complete request head in time",
                 extra={"peer": self.remote, "seconds": self.listener.header_timeout})
        self.close()

    def _idle_overdue(self) -> None:
        self.idle_timer = None
        if self.state != _HEAD or self.buf:
            return  # a request in progress (its end restarts the clock) or a head arriving (the head's clock)
        left = self.idle_since + self.listener.idle_timeout - self.loop.time()
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._idle_overdue)
        else:
            self.close()

    def _pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self.paused and self.transport is not None and not self.transport.is_closing():
            self.paused = False
            self.transport.resume_reading()


class Listener:
    """The gateway's HTTP/1.1 listener: ``handler`` answers each request (a :class:`Response` or a :class:`Stream`
    it wrote itself)."""

    def __init__(self, handler: Handler, *, header_timeout: float = 10.0, idle_timeout: float = 75.0) -> None:
        self.handler = handler
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self.connections: set[_Connection] = set()
        self.shutting_down = False
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop  # the running loop, from start()

    async def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen on ``host:port`` (0: any free port); the bound port."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), host or None, port, backlog=backlog)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self, shutdown_timeout: float = 30.0) -> None:
        """Stop accepting; let requests in progress finish within ``shutdown_timeout`` seconds in all (0: not at
        all), then cancel them; close every connection."""
        self.shutting_down = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.closing = True
            if conn.task is None or conn.task.done():
                conn.close()  # idle, or in the middle of a head: nothing to finish
        tasks = {c.task for c in self.connections if c.task is not None and not c.task.done()}
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, shutdown_timeout))
            for task in pending:
                task.cancel()  # the handler sees CancelledError: upstream closed, metrics and logs as a disconnect
            if pending:
                await asyncio.wait(pending, timeout=CANCEL_GRACE)
        for conn in list(self.connections):
            conn.close()
