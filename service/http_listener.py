"""The listeners of the extender and controller processes: aiohttp's server with the bounds a hostile client needs.

aiohttp alone answers a request it cannot parse (bare-LF line endings, a header ending in ``\\x7f``) with a 400
whose body is the parser's message — which quotes the offending bytes, an ``Authorization`` value included — and
logs the same bytes at ERROR with a traceback (``aiohttp.server``); it names Python's and its own version in
every ``Server`` header; and it keeps a connection that never finishes its request head for as long as its
keep-alive timeout (an hour). Here:

- a request that cannot be parsed is answered with a fixed body (:data:`BAD_REQUEST_BODY`) and the connection
  closed; one WARNING line (``malformed HTTP request refused``) says from where and the parser's error class,
  never a header value;
- every answer says ``Server: accelstack``;
- ``header_timeout``: a connection must deliver a whole request head within this many seconds of being accepted,
  or of the first byte of a later request (a silent connection and a dripping header are closed; Go's
  ``ReadHeaderTimeout``); with TLS the handshake has the same bound;
- ``idle_timeout``: a kept-alive connection with no request in progress is closed after this long (longer than
  kube-scheduler's and the API server's own idle timeout of 90 s, so a reused connection is never closed under
  a request the client is sending);
- the body's own bound is the handlers' (``http_body.read_body``: ``--body-timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from service.h2_server import H2Connection, Negotiated, Routes, drain, offer_h2

log = logging.getLogger("accelstack.http")
SERVER_NAME = "accelstack"
BAD_REQUEST_BODY = "400 Bad Request: malformed HTTP request\n"
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_IDLE_TIMEOUT = 120.0


@dataclass(frozen=True)
class Limits:
    """Per-connection time bounds (seconds) of a listener."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT


class HardenedHandler(RequestHandler):
    """aiohttp's per-connection protocol with a request-head deadline and a fixed, quiet answer to parser errors."""

    def __init__(self, manager: Any, *, loop: asyncio.AbstractEventLoop, header_timeout: float,
                 **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._head_timer is None and self._header_timeout > 0:
            self._head_timer = self._loop.call_later(self._header_timeout, self._head_expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        # the first bytes of a later request on a kept-alive connection start its head's clock
        if data and not self._request_in_progress and not self._messages:
            self._arm()
        super().data_received(data)
        if self._messages:  # a whole head arrived: from here the handler's body timeout bounds the request
            self._disarm()

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._request_in_progress or self._messages or self._force_close:
            return  # a request is being handled (its body is the handler's to bound)
        if self._waiter is not None and not self._waiter.done():
            log.info("connection closed: no whole request head in time",
                     extra={"remote": _peer(self), "timeout": self._header_timeout})
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A fixed answer, never the parser's message (it quotes the request's bytes); one log line naming the
        error's class. A 500 (a handler that raised: a bug) keeps its traceback in the log, not in the answer."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error response")
        if status == 500:
            log.error("request handler failed", exc_info=exc, extra={"remote": _peer(self)})
            text = "500 Internal Server Error\n"
        elif status == 400:
            log.warning("malformed HTTP request refused",
                        extra={"remote": _peer(self), "error": type(exc).__name__ if exc is not None else ""})
            text = BAD_REQUEST_BODY
        else:
            log.warning("request refused", extra={"remote": _peer(self), "status": status,
                                                  "error": type(exc).__name__ if exc is not None else ""})
            text = f"{status} request refused\n"
        response = web.Response(status=status, text=text, headers={"Server": SERVER_NAME})
        response.force_close()
        return response


def _peer(handler: RequestHandler) -> str:
    peer = handler.peername
    return str(peer[0]) if isinstance(peer, tuple) else str(peer or "")


def client_refusal(names: frozenset[str], cert: Any, remote: str) -> web.Response | None:
    """The 403 (in the extender's ``Error`` shape) for a TLS client certificate whose subject carries none of
    ``names`` as its common name, logged; None when it carries one (or ``names`` is empty). The listener's
    ``CERT_REQUIRED`` already checked that the certificate is the client's and that the CA signed it."""
    if not names:
        return None
    subject = (cert or {}).get("subject") or ()
    common = {value for rdn in subject for key, value in rdn if key == "commonName"}
    if common & names:
        return None
    log.warning("verb refused: client certificate not the scheduler's",
                extra={"remote": remote, "commonName": ",".join(sorted(common))[:100]})
    return web.json_response({"Error": "client certificate not allowed on this listener"}, status=403)


def client_names(names: frozenset[str]) -> Any:
    """A middleware that answers :func:`client_refusal`'s 403 unless the TLS client certificate's subject carries
    one of ``names`` as its common name. Empty ``names``: every such certificate."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if names:
            cert = request.transport.get_extra_info("peercert") if request.transport is not None else None
            refused = client_refusal(names, cert, request.remote or "")
            if refused is not None:
                return refused
        return await handler(request)

    return check


async def _server_name(_: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME


def harden(app: web.Application) -> web.Application:
    """``app`` answering with ``Server: accelstack`` (call before the app is started)."""
    app.on_response_prepare.append(_server_name)
    return app


def server_tls(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A listener's TLS context: TLS 1.2 at least, ``cert``/``key`` served, and with ``client_ca`` a client
    certificate from that CA required (no certificate: no TLS session at all).

    No TLS 1.3 session tickets: the clients of these listeners (kube-scheduler's extender client, the API
    server's webhook client, Go's ``http.Transport`` without a session cache) never resume a session, so the two
    tickets OpenSSL makes after every handshake were pure cost: 800 us of this process's CPU a handshake with
    them, 470 without (measured with ``ssl`` memory BIOs, ECDSA P-256, a client certificate). That is paid often:
    kube-scheduler keeps at most two idle connections to an extender (Go's default ``MaxIdleConnsPerHost``), so
    every concurrent bind beyond two opens a new TLS connection."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=client_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(cert, key)
    context.num_tickets = 0
    return context


class HardenedSite(web.TCPSite):
    """A TCP site whose connections are :class:`HardenedHandler` with ``limits``, and whose TLS handshake has the
    request head's bound. With ``h2`` (and TLS) the site offers HTTP/2 too (:mod:`service.h2_server`): a connection
    whose handshake chose it is served by those routes, any other by the HTTP/1.1 handler; with ``h2`` and
    ``http2`` false, only HTTP/1.1 is offered (ALPN), and each connection is still counted."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, limits: Limits,
                 ssl_context: ssl.SSLContext | None = None, backlog: int = 128, h2: Routes | None = None,
                 http2: bool = True, drain_timeout: float = 5.0) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context, backlog=backlog)
        self.limits = limits
        self.drain_timeout = drain_timeout
        self.h2 = h2 if ssl_context is not None else None
        self.h2_live: set[H2Connection] = set()  # its open HTTP/2 connections, drained when it stops
        if self.h2 is not None:
            assert ssl_context is not None
            if http2:
                offer_h2(ssl_context)
            else:  # HTTP/1.1 only, each connection still counted by protocol (service.h2_server.CONNECTIONS)
                ssl_context.set_alpn_protocols(["http/1.1"])

    async def start(self) -> None:
        self._runner._reg_site(self)  # BaseSite.start: TCPSite.start would create aiohttp's own handlers
        loop = asyncio.get_running_loop()
        manager = self._runner.server
        assert manager is not None
        limits = self.limits

        def protocol() -> HardenedHandler:
            return HardenedHandler(manager, loop=loop, header_timeout=limits.header_timeout,
                                   keepalive_timeout=limits.idle_timeout, access_log=None)  # type: ignore[arg-type]

        h2 = self.h2

        def negotiated() -> Negotiated:
            assert h2 is not None
            return Negotiated(protocol, h2, header_timeout=limits.header_timeout, idle_timeout=limits.idle_timeout,
                              live=self.h2_live)

        self._server = await loop.create_server(
            protocol if h2 is None else negotiated, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
            ssl_handshake_timeout=limits.header_timeout if self._ssl_context is not None else None)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else None

    async def stop(self) -> None:
        """Stop accepting; HTTP/2 connections get a GOAWAY and finish the requests in progress (aiohttp's runner
        then shuts down its HTTP/1.1 handlers the same way)."""
        if self._server is not None:
            self._server.close()
        await drain(self.h2_live, self.drain_timeout)
        await super().stop()

    @property
    def bound_port(self) -> int:
        return int(self.port)


async def serve_app(app: web.Application, host: str, port: int, *, limits: Limits | None = None,
                ssl_context: ssl.SSLContext | None = None, backlog: int = 128,
                shutdown_timeout: float = 5.0, h2: Routes | None = None, http2: bool = True
                ) -> tuple[web.AppRunner, int]:
    """``app`` served on ``host:port`` through :class:`HardenedSite` (with ``h2``: HTTP/2 too, to those routes,
    when ``http2``); (its runner, the bound port)."""
    harden(app)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = HardenedSite(runner, host, port, limits=limits or Limits(), ssl_context=ssl_context, backlog=backlog,
                        h2=h2, http2=http2, drain_timeout=shutdown_timeout)
    await site.start()
    return runner, site.bound_port
