"""Reading a request body on the extender process's HTTP surfaces (extender verbs, admission webhooks, REST API):
within a size limit and a time limit, and as JSON nested no deeper than an API object can be.

A refused body raises :class:`BodyError` with the HTTP status to answer, which each surface renders in its own
documented shape (extender: ``Error``; webhook: a ``Status``; REST API: ``{"error": ...}``):

- 408 when the body did not arrive within the timeout (a client that sends less than its ``Content-Length``,
  or sends it slowly, must not hold a handler): answer it through :func:`closing`, which closes the connection;
- 413 over the size limit;
- 400 when the client went away half way, or when the JSON is nested deeper than :data:`MAX_JSON_DEPTH`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

DEFAULT_BODY_TIMEOUT = 10.0  # seconds for a whole body; the scheduler and the API server send theirs at once
# No API object nests this deep: a pod with affinity and managedFields inside an AdmissionReview reaches about
# 20 levels. Deeper JSON is refused before any code walks it recursively.
MAX_JSON_DEPTH = 100


class BodyError(Exception):
    """A request body that is refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: web.Request, timeout: float, limit: int | None = None) -> bytes:
    """The whole body, read within ``timeout`` seconds and at most ``limit`` bytes (``None``: the
    application's ``client_max_size``); :class:`BodyError` otherwise."""
    limit = request.client_max_size if limit is None else limit
    if request.content_length is not None and limit and request.content_length > limit:
        raise BodyError(413, f"request body of {request.content_length} bytes is over the size limit of {limit} bytes")
    try:
        async with asyncio.timeout(timeout):
            chunks, size = [], 0
            async for chunk in request.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if limit and size > limit:
                    raise BodyError(413, f"request body is over the size limit of {limit} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except TimeoutError:
        raise BodyError(408, f"request body not received within {timeout:g}s (Content-Length "
                             f"{request.content_length}); the connection is closed") from None
    except web.HTTPRequestEntityTooLarge:
        raise BodyError(413, f"request body is over the size limit of {limit} bytes") from None
    except (ConnectionError, HttpProcessingError) as exc:
        raise BodyError(400, f"request body incomplete: {type(exc).__name__}: {exc}") from None


async def closing(request: web.Request, response: web.Response) -> web.Response:
    """``response``; a 408 is sent at once and the connection closed after it: the rest of that body may still
    be on its way, so the connection cannot carry another request, and waiting for it (aiohttp's lingering
    close) would hold the connection for the slow client."""
    if response.status == 408:
        await response.prepare(request)
        await response.write_eof()
        request.protocol.force_close()  # the transport flushes what was written, then closes
    return response


def loads(raw: bytes) -> Any:
    """``raw`` as JSON (UTF-8, no NaN, integers within 64 bits, at most :data:`MAX_JSON_DEPTH` levels);
    :class:`BodyError` (400) saying what is wrong."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):
            raise BodyError(400, f"body is JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        raise BodyError(400, f"body is not JSON: {exc}") from None
    if not within_depth(value, MAX_JSON_DEPTH):
        raise BodyError(400, f"body is JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def within_depth(value: Any, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) nests at most ``limit`` arrays/objects deep; iterative, so any depth is
    safe to ask about."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return True
