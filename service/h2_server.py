"""HTTP/2 beside HTTP/1.1 on one TLS listener, for the clients that offer it (kube-scheduler's extender client).

kube-scheduler keeps at most two idle HTTP/1.1 connections to an extender (Go's ``http.Transport`` default
``MaxIdleConnsPerHost``), so while more than two of its binds were in flight it opened a new TLS connection for
nearly every one: 878 connections for 2,000 pods in the control-plane benchmark, their handshakes 15% of the
extender's CPU. Its transport also offers HTTP/2 (ALPN ``h2``: ``k8s.io/apimachinery``'s ``SetTransportDefaults``
configures ``golang.org/x/net/http2``), which carries every request on one connection, multiplexed. A listener
given :class:`Routes` offers ``h2`` first; per connection, the protocol the TLS handshake settled on decides:
``h2`` is served here (the ``h2`` library's state machine), anything else by aiohttp's HTTP/1.1 handler as before
(curl, probes, clients without HTTP/2).

The bounds of the HTTP/1.1 handler (``service.http_listener``) hold here too:

- a connection must send a whole request head within ``header_timeout`` of being accepted (a silent connection is
  closed), and one with no request in progress is closed after ``idle_timeout``, with a GOAWAY;
- a request's body must arrive within ``body_timeout`` of its head (else 408) and be at most ``max_body`` bytes
  (else 413); either way the stream is reset;
- at most :data:`MAX_STREAMS` requests at once on a connection (``SETTINGS_MAX_CONCURRENT_STREAMS``), header lists
  of at most :data:`MAX_HEADER_LIST` bytes;
- a connection that breaks the protocol is closed with a GOAWAY and one WARNING line naming the error's class and
  the peer, never a header value; a route that raises answers 500 (its traceback in the log, not the answer);
- a response the route marks as closing (``force_close()``: the extender's 503 from a replica that is not the
  binder) is followed by a GOAWAY, so the client's next request goes out on a new connection;
- when the listener stops (SIGTERM), every HTTP/2 connection gets a GOAWAY at once, so the client sends its next
  requests elsewhere, and the requests in progress are answered before it closes (:func:`drain`).

Routes get the whole body (read within the bounds) and answer an :class:`aiohttp.web.Response`, so one handler
serves both protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from aiohttp import web
from prometheus_client import Counter

log = logging.getLogger("accelstack.http")
ALPN_H2 = "h2"
MAX_STREAMS = 128  # requests at once on one connection; kube-scheduler binds at most 16 pods in parallel by default
MAX_HEADER_LIST = 64 * 1024
CONNECTIONS = Counter("accelstack_http_connections_total",
                      "TLS connections accepted on a listener that offers HTTP/2, by the protocol the handshake chose",
                      ["protocol"])


@dataclass
class Request:
    """One HTTP/2 request, whole: what a route reads."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    remote: str
    peercert: Mapping[str, Any] | None = None


Route = Callable[[Request], Awaitable[web.Response]]


@dataclass(frozen=True)
class Routes:
    """What HTTP/2 requests reach: ``(method, path) -> route`` (the query string is not part of the match; any other
    path answers 404, another method on a known path 405) and the bounds of :mod:`service.h2_server`."""

    routes: Mapping[tuple[str, str], Route]
    max_body: int
    body_timeout: float


def offer_h2(context: ssl.SSLContext) -> ssl.SSLContext:
    """``context`` offering HTTP/2 first, then HTTP/1.1 (ALPN)."""
    context.set_alpn_protocols([ALPN_H2, "http/1.1"])
    return context


@dataclass(eq=False)
class _Stream:
    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)
    deadline: asyncio.TimerHandle | None = None
    window: asyncio.Event = field(default_factory=asyncio.Event)  # set when the peer opens its flow-control window
    answered: bool = False


class Negotiated(asyncio.Protocol):
    """A TLS connection's protocol: HTTP/2 when the handshake chose ``h2``, else ``http1()`` (aiohttp's handler),
    to which every callback is passed on."""

    def __init__(self, http1: Callable[[], asyncio.Protocol], routes: Routes, *, header_timeout: float,
                 idle_timeout: float, live: set[H2Connection] | None = None) -> None:
        self._http1_factory = http1
        self._routes = routes
        self._live = live
        self._header_timeout, self._idle_timeout = header_timeout, idle_timeout
        self._inner: asyncio.Protocol | H2Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        chosen = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        CONNECTIONS.labels(ALPN_H2 if chosen == ALPN_H2 else "http/1.1").inc()
        if chosen == ALPN_H2:
            # uvloop's TLS transport is a transport without being an asyncio.Transport subclass
            self._inner = H2Connection(cast(asyncio.Transport, transport), self._routes,
                                       header_timeout=self._header_timeout, idle_timeout=self._idle_timeout,
                                       live=self._live)
        else:
            self._inner = self._http1_factory()
            self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if isinstance(self._inner, asyncio.Protocol):
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if isinstance(self._inner, asyncio.Protocol):
            self._inner.resume_writing()


class H2Connection:
    """One HTTP/2 connection (server side) over ``transport``: requests collected whole, each answered by its
    route in a task of its own, responses sent within the peer's flow-control windows."""

    def __init__(self, transport: asyncio.Transport, routes: Routes, *, header_timeout: float,
                 idle_timeout: float, live: set[H2Connection] | None = None) -> None:
        self.transport = transport
        self.live = live  # the listener's open HTTP/2 connections (to drain when it stops)
        if live is not None:
            live.add(self)
        self.routes = routes
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self.loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) else str(peer or "")
        self.peercert = transport.get_extra_info("peercert")
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=True))
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST})
        self.streams: dict[int, _Stream] = {}
        # the answers being made: a stream the client resets, or a connection it drops, does not cancel its route
        # (as aiohttp does not cancel a handler whose HTTP/1.1 client went away): a bind started is finished
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False  # a GOAWAY was sent: the connection ends once the answers in progress are sent
        self.timer: asyncio.TimerHandle | None = None
        self.conn.initiate_connection()
        self._flush()
        self._idle(self.header_timeout)  # a connection must send a request within the head's bound

    # ---- the connection ---------------------------------------------------------------------------------------
    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.transport.is_closing():
            self.transport.write(data)

    def _idle(self, after: float | None) -> None:
        """(Re)arm the connection's timer: closed after ``after`` seconds with no request in progress; None: off."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if after is not None and after > 0:
            self.timer = self.loop.call_later(after, self._expired)

    def _expired(self) -> None:
        self.timer = None
        if not self.streams:
            log.info("connection closed: no request in time", extra={"remote": self.remote, "protocol": "h2"})
            self.goaway()

    def goaway(self, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
        """No new requests on this connection (a GOAWAY naming the last stream taken); it closes once the answers
        in progress are sent. The frame is written here, not through ``close_connection``: that would close the
        h2 state machine at once, and the rest of a request in progress (its body, a WINDOW_UPDATE) would then be
        a protocol error."""
        if not self.closing:
            self.closing = True
            self._flush()
            last = self.conn.highest_inbound_stream_id & 0x7FFFFFFF
            if not self.transport.is_closing():
                # frame header (length 8, type GOAWAY 0x7, no flags, stream 0), last stream id, error code
                self.transport.write(struct.pack(">I", 8)[1:] + b"\x07\x00" + struct.pack(">III", 0, last, int(code)))
        if not self.streams:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except (h2.exceptions.ProtocolError, ValueError) as exc:  # ValueError: hpack's, for a malformed block
            log.warning("malformed HTTP/2 connection closed",
                        extra={"remote": self.remote, "error": type(exc).__name__})
            self._flush()  # h2 queued the GOAWAY it owes
            self.closing = True
            self._drop_streams()
            self.transport.close()
            return
        for event in events:
            self._on(event)
        self._flush()

    def eof_received(self) -> bool | None:
        return None  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._idle(None)
        self._drop_streams()
        if self.live is not None:
            self.live.discard(self)

    def _drop_streams(self) -> None:
        for stream in self.streams.values():
            self._forget(stream)
        self.streams.clear()

    # ---- events -----------------------------------------------------------------------------------------------
    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request(event)
        elif isinstance(event, h2.events.DataReceived):
            self._data(event)
        elif isinstance(event, h2.events.StreamEnded):
            self._ended(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                self._forget(stream)
        elif isinstance(event, h2.events.WindowUpdated):
            targets = self.streams.values() if event.stream_id == 0 else filter(None, [self.streams.get(event.stream_id)])
            for stream in targets:
                stream.window.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closing = True
            if not self.streams:
                self.transport.close()

    def _request(self, event: h2.events.RequestReceived) -> None:
        headers = {_text(k): _text(v) for k, v in event.headers or ()}
        sid = event.stream_id
        if self.closing:
            self._reset(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        stream = _Stream(headers)
        self.streams[sid] = stream
        self._idle(None)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.routes.max_body:
            self._answer_now(sid, _plain(413, f"request body of {length} bytes is over the size limit of "
                                              f"{self.routes.max_body} bytes"))
            return
        stream.deadline = self.loop.call_later(self.routes.body_timeout, self._too_slow, sid)

    def _data(self, event: h2.events.DataReceived) -> None:
        sid = event.stream_id
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
        stream = self.streams.get(sid)
        if stream is None or stream.answered:
            return
        stream.body += event.data or b""
        if len(stream.body) > self.routes.max_body:
            self._answer_now(sid, _plain(413, f"request body is over the size limit of {self.routes.max_body} bytes"))

    def _too_slow(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is not None and not stream.answered:
            stream.deadline = None
            self._answer_now(sid, _plain(408, f"request body not received within {self.routes.body_timeout:g}s"))

    def _ended(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None or stream.answered:
            return
        if stream.deadline is not None:
            stream.deadline.cancel()
            stream.deadline = None
        stream.answered = True
        self._start(self._serve(sid, stream))

    # ---- answers ----------------------------------------------------------------------------------------------
    async def _serve(self, sid: int, stream: _Stream) -> None:
        method, raw_path = stream.headers.get(":method", ""), stream.headers.get(":path", "")
        path = raw_path.partition("?")[0]
        route = self.routes.routes.get((method, path))
        if route is None:
            known = any(p == path for _, p in self.routes.routes)
            response = _plain(405 if known else 404, "method not allowed" if known else "not found")
        else:
            request = Request(method, path, {k: v for k, v in stream.headers.items() if not k.startswith(":")},
                              bytes(stream.body), self.remote, self.peercert)
            try:
                response = await route(request)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("request handler failed", extra={"remote": self.remote, "protocol": "h2"})
                response = _plain(500, "500 Internal Server Error")
        await self._send(sid, stream, response)

    def _answer_now(self, sid: int, response: web.Response) -> None:
        """Answer ``sid`` before its request is whole (refused), then reset it: the rest is not read."""
        stream = self.streams[sid]
        stream.answered = True
        if stream.deadline is not None:
            stream.deadline.cancel()
            stream.deadline = None
        self._start(self._send(sid, stream, response, reset=True))

    async def _send(self, sid: int, stream: _Stream, response: web.Response, reset: bool = False) -> None:
        body = bytes(response.body) if isinstance(response.body, bytes | bytearray) else b""
        headers = [(":status", str(response.status)), ("server", "accelstack"),
                   ("content-length", str(len(body)))]
        if response.content_type and body:
            headers.append(("content-type", response.headers.get("Content-Type") or response.content_type))
        try:
            # one write for the head and as much of the body as the windows allow (each write is a TLS record and
            # a system call: a write per frame was a fifth of this process's CPU)
            self.conn.send_headers(sid, headers, end_stream=not body)
            view = memoryview(body)
            while view:
                room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size, len(view))
                if room <= 0:
                    self._flush()
                    stream.window.clear()
                    await stream.window.wait()
                    if sid not in self.streams:
                        return
                    continue
                self.conn.send_data(sid, view[:room].tobytes(), end_stream=room == len(view))
                view = view[room:]
            self._flush()
            if reset:
                self._reset(sid, h2.errors.ErrorCodes.NO_ERROR)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass  # the client reset the stream or went away meanwhile
        finally:
            gone = self.streams.pop(sid, None)
            if gone is not None:
                self._forget(gone)
            if response.keep_alive is False:  # the route asked for the connection to end (force_close)
                self.goaway()
            elif self.closing and not self.streams:
                self.transport.close()
            elif not self.streams:
                self._idle(self.idle_timeout)

    def _reset(self, sid: int, code: h2.errors.ErrorCodes) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.conn.reset_stream(sid, error_code=code)
        self._flush()

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = self.loop.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _forget(self, stream: _Stream) -> None:
        """A stream done with (answered, reset, or its connection gone): its timer off, a send waiting for window
        woken (it finds the stream gone and stops)."""
        if stream.deadline is not None:
            stream.deadline.cancel()
            stream.deadline = None
        stream.window.set()


async def drain(connections: set[H2Connection], timeout: float) -> None:
    """A GOAWAY on each of ``connections`` (no new requests), then wait up to ``timeout`` seconds for the requests
    in progress to be answered (each connection closes after its last answer); whatever is still open then is
    closed."""
    loop = asyncio.get_running_loop()
    for connection in list(connections):
        connection.goaway()
    deadline = loop.time() + timeout
    while any(not c.transport.is_closing() for c in list(connections)) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for connection in list(connections):
        connection.transport.close()


def _text(value: bytes | str) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _plain(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=f"{status} {text}\n")
