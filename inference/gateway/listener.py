"""The gateway's HTTP listener: aiohttp's, with what a server facing anyone needs and aiohttp does not do itself.

- **Malformed HTTP** (bare-LF line endings, a header ending in ``\\x7f``, an over-long line…) is answered with a
  fixed body that never echoes the request, and logged as one line naming the status, the error's class and the
  peer: never a header value (aiohttp's own answer carried the parser's message, which quoted the offending line,
  ``Authorization`` included, and its logger printed the same bytes with a traceback).
- **Header timeout**: a connection must complete a request's head (request line and headers) within
  ``header_timeout`` seconds of its first byte (of the connection, for the first request): a client that drips
  headers or opens a connection and says nothing is closed. Idle keep-alive connections between requests are
  aiohttp's ``keepalive_timeout``; a body that stops arriving is the server's ``body_timeout`` (it reads the body).
- **No version banner**: ``Server: accelstack-gateway`` instead of aiohttp's ``Python/x.y aiohttp/x.y.z``.
- **One shutdown timeout** (issue 37.4): on cleanup a request in progress may finish for ``shutdown_timeout``
  seconds in all, then it is cancelled. aiohttp waited that long for it, then asked it to stop (it does not cancel
  the handler) and waited the same again: twice ``--shutdown-timeout``, past the shipped grace period; and a
  timeout of 0 meant no limit at all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("accelstack.gateway")

SERVER = "accelstack-gateway"
CANCEL_GRACE = 0.5  # seconds a cancelled handler has to close its upstream and record itself
MALFORMED_BODY = b'{"error": {"message": "Malformed HTTP request.", "type": "invalid_request_error", ' \
                 b'"param": null, "code": "bad_request"}}'


def _peer(handler: RequestHandler) -> str:
    peer = handler.transport.get_extra_info("peername") if handler.transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else ""


class _Handler(RequestHandler):
    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._disarm()  # a whole head arrived
        elif self._head_timer is None and not self._request_in_progress and not self._messages:
            self._arm()  # the first bytes of the next request's head

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """Let the request in progress finish within ``timeout`` seconds (0: not at all), then cancel it."""
        self._force_close = True  # no next request on this connection: the connection's task ends with this one
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
        task = self._task_handler
        if task is not None and not task.done() and self._request_in_progress:
            await asyncio.wait({task}, timeout=max(0.0, timeout or 0.0))  # never raises the task's outcome
        if task is not None and not task.done():
            task.cancel()  # the handler sees CancelledError: upstream closed, metrics and logs as a disconnect
            await asyncio.wait({task}, timeout=CANCEL_GRACE)
        self.force_close()

    def _arm(self) -> None:
        if self.header_timeout > 0 and self.transport is not None:
            self._head_timer = self._loop.call_later(self.header_timeout, self._head_overdue)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self._request_in_progress or self._messages or self.transport is None:
            return  # a request is being served (or its body lingers): not a head's business
        log.info("connection closed: no complete request head in time",
                 extra={"peer": _peer(self), "seconds": self.header_timeout})
        self.force_close()
        self.transport.close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # a bug of the gateway's own: the traceback is what finds it
            log.error("request failed", exc_info=exc, extra={"peer": _peer(self), "status": status})
        else:  # the client's bytes: one line, none of them quoted
            log.info("malformed request", extra={"peer": _peer(self), "status": status,
                                                 "error": type(exc).__name__ if exc is not None else ""})
        if request.writer.output_size > 0:
            raise ConnectionError("the response had begun; the connection is closed instead")
        body = MALFORMED_BODY if status < 500 else (
            b'{"error": {"message": "Internal error.", "type": "server_error", "param": null, "code": null}}')
        response = web.Response(status=status, body=body, content_type="application/json",
                                headers={"Server": SERVER})
        response.force_close()
        return response


class _Server(web.Server):
    header_timeout = 10.0

    def __call__(self) -> RequestHandler:
        handler = _Handler(self, loop=self._loop, **self._kwargs)
        handler.header_timeout = self.header_timeout
        return handler


async def _no_banner(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` with the listener above; ``keepalive_timeout`` (aiohttp's) is the idle timeout."""

    def __init__(self, app: web.Application, *, header_timeout: float = 10.0, **kwargs: Any) -> None:
        app.on_response_prepare.append(_no_banner)
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same object, handing out _Handler (aiohttp has no factory argument)
        assert isinstance(server, _Server)
        server.header_timeout = self.header_timeout
        return server
