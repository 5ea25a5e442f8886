"""Fault injection and the request log of the API-server peer: what to match and what to do instead."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Responder = Callable[[web.Request], "web.StreamResponse | Awaitable[web.StreamResponse | None] | None"]
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
WATCH_ERROR_REASONS = {410: "Expired", 500: "InternalError", 504: "Timeout", 403: "Forbidden"}


@dataclasses.dataclass
class RequestInfo:
    """What a request addresses, as the API server's RequestInfo has it."""

    method: str
    path: str
    query: dict[str, str]
    resource: str  # full path, e.g. 'apis/accelstack.io/v1alpha1/gpuprovisioningrequests' ('' if no route)
    namespace: str
    name: str
    subresource: str
    verb: str  # get, list, watch, create, update, patch, delete, deletecollection

    @property
    def plural(self) -> str:
        return self.resource.rsplit("/", 1)[-1]

    @property
    def watch(self) -> bool:
        return self.verb == "watch"


@dataclasses.dataclass
class RequestRecord(RequestInfo):
    """One request in ``peer.log``: ``status`` is None while it is being answered (a hang, an open watch);
    ``started``/``finished`` are ``time.monotonic()``."""

    started: float = 0.0
    finished: float | None = None
    status: int | None = None
    user_agent: str = ""
    fault: Fault | None = None


def matches(info: RequestInfo, method: str | None = None, resource: str | None = None,
            namespace: str | None = None, name: str | None = None, subresource: str | None = None,
            watch: bool | None = None, verb: str | None = None) -> bool:
    """None matches anything; ``resource`` is a plural ('pods') or a full path ('api/v1/pods');
    ``name=""``/``subresource=""`` match only collections/the main resource; ``watch=False`` is every request
    but a watch (so ``method='GET', watch=False`` is get and list)."""
    if method is not None and info.method != method.upper():
        return False
    if resource is not None and resource not in (info.plural, info.resource):
        return False
    if namespace is not None and info.namespace != namespace:
        return False
    if name is not None and info.name != name:
        return False
    if subresource is not None and info.subresource != subresource:
        return False
    if watch is not None and info.watch != watch:
        return False
    return verb is None or info.verb == verb


class Fault:
    """One injected misbehaviour (see the package docstring). ``hits`` counts the requests it took;
    ``remove()`` (or leaving its ``with`` block) ends it; ``times=N`` ends it after N hits."""

    def __init__(self, registry: list[Fault], *, method: str | None = None, resource: str | None = None,
                 namespace: str | None = None, name: str | None = None, subresource: str | None = None,
                 watch: bool | None = None, verb: str | None = None,
                 status: int | None = None, reason: str | None = None, message: str | None = None,
                 retry_after: int | None = None, details: dict[str, Any] | None = None,
                 body: str | bytes | None = None, content_type: str = "text/html",
                 delay: float = 0.0, hang: bool = False, half_open: bool = False, watch_error: int | None = None,
                 close: bool = False, after: float = 0.0, respond: Responder | None = None, lands: bool = False,
                 when: Callable[[web.Request], bool] | None = None, times: int | None = None) -> None:
        if verb is not None and verb not in VERBS:
            raise ValueError(f"verb must be one of {VERBS}, not {verb!r}")
        actions = [status is not None or body is not None, hang, half_open, watch_error is not None, close,
                   respond is not None]
        if sum(actions) > 1:
            raise ValueError("a fault does one thing: status/body, hang, half_open, watch_error, close or respond")
        if not any(actions) and not delay:
            raise ValueError("a fault needs an action: status, body, delay, hang, half_open, watch_error, close "
                             "or respond")
        if (half_open or watch_error is not None or close) and watch is False:
            raise ValueError("half_open, watch_error and close are watch faults; they cannot match watch=False")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 (or None for until removed)")
        if lands and (watch or not (hang or status is not None) or method in (None, "GET")):
            raise ValueError("lands is for writes (a method other than GET) answered with a status or a hang")
        self.registry = registry
        self.match: dict[str, Any] = {"method": method, "resource": resource, "namespace": namespace, "name": name,
                      "subresource": subresource, "watch": True if (half_open or watch_error is not None or close) else watch,
                      "verb": verb}
        self.status = 502 if body is not None and status is None else status
        self.reason, self.message, self.retry_after, self.details = reason, message, retry_after, details
        self.body, self.content_type = body, content_type
        self.delay, self.hang, self.half_open, self.watch_error, self.close = delay, hang, half_open, watch_error, close
        self.after, self.respond, self.when, self.times = after, respond, when, times
        self.lands = lands
        self.hits = 0
        self.created = time.monotonic()
        registry.append(self)

    @property
    def active(self) -> bool:
        return self in self.registry

    def remove(self) -> None:
        if self in self.registry:
            self.registry.remove(self)

    def __enter__(self) -> Fault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def applies(self, info: RequestInfo, request: web.Request) -> bool:
        return matches(info, **self.match) and (self.when is None or bool(self.when(request)))

    def take(self) -> None:
        """Count one hit; a fault with ``times`` removes itself after its last one."""
        self.hits += 1
        if self.times is not None and self.hits >= self.times:
            self.remove()

    def __repr__(self) -> str:
        match = ", ".join(f"{k}={v!r}" for k, v in self.match.items() if v is not None)
        return f"Fault({match}, hits={self.hits}, times={self.times})"
