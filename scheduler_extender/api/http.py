"""The REST API's response shapes, shared by its route modules: JSON bodies, and errors as ``{"error": ...}``
with the HTTP status of the cause."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from aiohttp import web

from scheduler_extender.api.auth import Authorizer
from scheduler_extender.objects.cluster import ClusterView
from scheduler_extender.objects.kube import ApiError, Conflict, Kube, NotFound
from service.loop import slices


class Routes(Protocol):
    """What the route modules (:mod:`.objects`, :mod:`.views`) use of the REST API that registers them
    (:class:`.app.RestAPI`): handed to them, never imported — the API imports its route modules, not the other way."""

    kube: Kube
    view: ClusterView
    authorizer: Authorizer | None
    clock: Callable[[], float]

    async def _denied(self, request: web.Request, verb: str, namespace: str = "",
                      attrs: dict[str, str] | None = None) -> web.Response | None: ...

    async def _unauthenticated(self, request: web.Request) -> web.Response | None: ...

    async def _body(self, request: web.Request) -> dict[str, Any]: ...


LIST_PAGE = 100  # objects per page when the REST API lists from the API server (each page is decoded at once)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def error(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status)


async def api_call(coro: Any, created: bool = False) -> web.Response:
    """The API server's answer to ``coro`` as the REST API's: 404, 409, 400/403/422 passed on, 502 otherwise."""
    try:
        return json_response(await coro, 201 if created else 200)
    except ApiError as exc:
        return api_failure(exc)


async def api_items(request: web.Request, listing: Awaitable[list[dict[str, Any]]]) -> web.StreamResponse:
    """``{"items": [...]}`` of a list from the API server, encoded and sent in slices (:mod:`.loop`): 10,000 GPRs
    are 4 MB, 12 ms of encoding in one piece on the loop that answers the scheduler. Errors as :func:`api_call`."""
    try:
        items = await listing
    except ApiError as exc:
        return api_failure(exc)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    opening = b'{"items":['
    async for part in slices(items):
        await response.write(opening + b",".join(orjson.dumps(item) for item in part))
        opening = b","
    await response.write(b'{"items":[]}' if opening != b"," else b"]}")
    await response.write_eof()
    return response


def api_failure(exc: ApiError) -> web.Response:
    """The answer's status says 404 or 409 once: the message is the API server's words alone (with the
    exception's "404 NotFound: " in front, the portal and the plugin, which print the status first, showed
    "404 404 NotFound: ...")."""
    if isinstance(exc, NotFound):
        return error(404, exc.message or "not found")
    if isinstance(exc, Conflict):
        return error(409, exc.message or "conflict")
    return api_error(exc)


def api_error(exc: ApiError) -> web.Response:
    """400/403/404/409/422 passed on; the API server throttling (429, after the client's own retries) 503 with
    its ``Retry-After``; no answer 504; any other failure 502."""
    if exc.status in (400, 403, 404, 409, 422):  # the answer's status is the API server's: not said twice
        return error(exc.status, f"API server: {exc.message or exc.reason}")
    if exc.status == 429:
        response = error(503, f"API server is throttling requests: {exc.message or exc.reason}; retry later")
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after or 1)))
        return response
    if not exc.status:
        return error(504, f"API server: no answer ({exc.message or exc.reason})")
    return error(502, f"API server: {exc.status} {exc.message or exc.reason}")


def query_int(query: Any, key: str, default: int, low: int, high: int) -> int:
    """An integer query parameter within [low, high]; ValueError naming it otherwise."""
    raw = query.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{key}: must be an integer, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{key}: must be between {low} and {high}, got {value}")
    return value
