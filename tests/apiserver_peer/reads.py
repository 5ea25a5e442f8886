"""The read side of the API-server peer: selectors, paginated lists with resourceVersion semantics, and
watches (initial events, history, 410, bookmarks, timeouts)."""

from __future__ import annotations

import asyncio
import bisect
import functools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tests.apiserver_peer.wire import (
    TRUE,
    Refused,
    api_version_of,
    decode_continue,
    encode_continue,
    plural_of,
    status_body,
)


class Pulse:
    """Wakes every waiter at each change of the peer's state. No lock: an ``asyncio.Condition`` whose waiters are
    cancelled while the lock is handed over (every open watch at once, when the peer stops) could be left held,
    and every later write, which notifies under that lock, would wait for ever."""

    def __init__(self) -> None:
        self._next: asyncio.Future[None] | None = None

    def notify_all(self) -> None:
        waiting, self._next = self._next, None
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Until ``predicate()`` holds; TimeoutError after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            if self._next is None or self._next.done():
                self._next = loop.create_future()
            await asyncio.wait({self._next}, timeout=left)  # a cancelled waiter leaves the shared future alone

class Reads:
    """Mixed into APIServerPeer, whose state it reads."""

    objects: dict[tuple[str, str, str], dict[str, Any]]
    events: list[tuple[int, str, str, dict[str, Any]]]
    revision: int
    epoch: int
    changed: Pulse
    snapshots: dict[str, tuple[float, list[dict[str, Any]]]]
    continue_ttl: float | None
    too_large_rv_wait: float
    bookmark_interval: float
    watch_timeout: float
    kinds: dict[str, str]

    def _select(self, request: web.Request, obj: dict[str, Any]) -> bool:
        selector = request.query.get("labelSelector", "")
        labels = obj.get("metadata", {}).get("labels") or {}
        for term in filter(None, selector.split(",")):
            if "!=" in term:
                k, v = term.split("!=", 1)
                if labels.get(k) == v:
                    return False
            elif "=" in term:
                k, v = term.replace("==", "=").split("=", 1)
                if labels.get(k) != v:
                    return False
            elif labels.get(term) is None:
                return False
        for term in filter(None, request.query.get("fieldSelector", "").split(",")):
            negate = "!=" in term
            path, want = term.split("!=" if negate else "=", 1) if ("=" in term) else (term, "")
            value: Any = obj
            for part in path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            text = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            if (text == want.lstrip("=")) == negate:
                return False
        return True

    # -- list ----------------------------------------------------------------------------------------------
    def _newer(self, revision: int) -> bool:
        return self.revision > revision

    def _matching(self, request: web.Request, resource: str, namespace: str) -> list[dict[str, Any]]:
        return [o for (r, ns, _), o in sorted(self.objects.items()) if r == resource
                and (not namespace or ns == namespace) and self._select(request, o)]

    async def _list(self, request: web.Request, resource: str, namespace: str) -> web.Response:
        """A list: ``limit``/``continue`` pages from one snapshot (a continue token expires with 410 after
        ``compact()``, ``expire_continue_tokens()`` or ``continue_ttl``); ``resourceVersion`` unset or "0": the
        current state; N (NotOlderThan): waits up to ``too_large_rv_wait`` for N, else 504; Exact N: only the
        current revision (an older one answers 410 Expired, as after a compaction)."""
        q = request.query
        try:
            limit = int(q.get("limit") or 0)
        except ValueError:
            raise Refused(400, f"invalid limit {q.get('limit')!r}") from None
        token, rv, match = q.get("continue", ""), q.get("resourceVersion", ""), q.get("resourceVersionMatch", "")
        if match and not rv:
            raise Refused(422, "ListOptions.meta.k8s.io \"\" is invalid: resourceVersionMatch: Forbidden: "
                          "resourceVersionMatch is forbidden unless resourceVersion is provided", "Invalid")
        if match not in ("", "NotOlderThan", "Exact"):
            raise Refused(422, f'ListOptions.meta.k8s.io "" is invalid: resourceVersionMatch: Unsupported value: '
                          f'"{match}"', "Invalid")
        if token:
            if rv and rv != "0":
                raise Refused(422, 'ListOptions.meta.k8s.io "" is invalid: resourceVersion: Forbidden: specifying '
                              "resource version is not allowed when using continue", "Invalid")
            try:
                snapshot, list_rv, offset = decode_continue(token)
            except ValueError as exc:
                raise Refused(400, str(exc)) from None
            made_items = self.snapshots.get(snapshot)
            if made_items is None or (self.continue_ttl is not None
                                      and time.monotonic() - made_items[0] > self.continue_ttl):
                self.snapshots.pop(snapshot, None)
                raise Refused(410, "The provided continue parameter is too old to display a consistent list result. "
                              "You can start a new list without the continue parameter.", "Expired")
            items = made_items[1]
        else:
            offset, list_rv = 0, self.revision
            if rv and rv != "0":
                try:
                    wanted = int(rv)
                except ValueError:
                    raise Refused(400, f"invalid resourceVersion {rv!r}") from None
                if wanted > self.revision:
                    try:
                        await self.changed.wait_for(lambda: self.revision >= wanted, self.too_large_rv_wait)
                    except TimeoutError:
                        raise Refused(504, f"Too large resource version: {wanted}, current: {self.revision}",
                                      "Timeout", {"causes": [{"reason": "ResourceVersionTooLarge",
                                                              "message": "Too large resource version"}],
                                                  "retryAfterSeconds": 1}) from None
                list_rv = self.revision
                if match == "Exact" and wanted != self.revision:
                    raise Refused(410, f"too old resource version: {wanted} ({self.revision})", "Expired")
            items = self._matching(request, resource, namespace)
            snapshot = uuid.uuid4().hex
        meta: dict[str, Any] = {"resourceVersion": str(list_rv)}
        page = items[offset:offset + limit] if limit else items[offset:]
        if limit and offset + limit < len(items):
            if not token:
                self.snapshots[snapshot] = (time.monotonic(), items)
            meta["continue"] = encode_continue(snapshot, list_rv, offset + limit)
            meta["remainingItemCount"] = len(items) - offset - limit
        elif token:
            self.snapshots.pop(snapshot, None)
        kind = self.kinds.get(plural_of(resource))
        return web.json_response({"kind": f"{kind}List" if kind else "List",
                                  "apiVersion": api_version_of(resource), "metadata": meta, "items": page})

    # -- watch ---------------------------------------------------------------------------------------------
    def _shown(self, request: web.Request, kind: str, obj: dict[str, Any], visible: set[tuple[str, str]]) -> str:
        """The event type a selective watch shows for a change ('' for none), as the watch cache does: a
        change that makes an object match is ADDED, one that makes it stop matching is DELETED."""
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        was = key in visible
        if kind == "DELETED":
            visible.discard(key)
            return "DELETED" if was else ""
        if self._select(request, obj):
            visible.add(key)
            return "MODIFIED" if was and kind == "MODIFIED" else "ADDED"
        visible.discard(key)
        return "DELETED" if was else ""

    def _expired_event(self, message: str) -> bytes:
        return json.dumps({"type": "ERROR", "object": status_body(410, "Expired", message)}).encode() + b"\n"

    def _bookmark(self, resource: str, rv: int) -> bytes:
        kind = self.kinds.get(plural_of(resource), "Object")
        obj = {"kind": kind, "apiVersion": api_version_of(resource), "metadata": {"resourceVersion": str(rv)}}
        return json.dumps({"type": "BOOKMARK", "object": obj}).encode() + b"\n"

    async def _watch(self, request: web.Request, resource: str, namespace: str) -> web.StreamResponse:
        rv = request.query.get("resourceVersion", "")
        if rv not in ("", "0") and not rv.isdigit():
            raise Refused(400, f"invalid resourceVersion {rv!r}")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await self._stream(request, response, resource, namespace)
        return response

    async def _stream(self, request: web.Request, response: web.StreamResponse, resource: str, namespace: str,
                      until: float | None = None) -> None:
        """Write watch events to a prepared response until ``timeoutSeconds`` (or ``until``, a loop time).
        ``resourceVersion`` unset or "0": ADDED for every current object first; N: the changes after N (410
        Expired when N is older than the history). ``allowWatchBookmarks=true``: a BOOKMARK every
        ``bookmark_interval`` seconds. With a label or field selector an object that starts matching comes as
        ADDED and one that stops as DELETED (from N, what matched at N is taken to be what matches now)."""
        loop = asyncio.get_running_loop()
        q = request.query
        rv = q.get("resourceVersion", "")
        bookmarks = q.get("allowWatchBookmarks", "").lower() in TRUE
        timeout = float(q.get("timeoutSeconds") or self.watch_timeout)
        end = loop.time() + timeout if until is None else min(loop.time() + timeout, until)
        epoch = self.epoch
        try:
            # with a selector, what the client sees: an object entering it is ADDED, one leaving it DELETED
            selective = bool(q.get("labelSelector") or q.get("fieldSelector"))
            current = self._matching(request, resource, namespace)
            visible = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in current}
            if rv in ("", "0"):
                sent = self.revision
                for obj in current:
                    await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            else:
                sent = int(rv)
                oldest = self.events[0][0] if self.events else self.revision + 1
                if sent < oldest - 1 and sent < self.revision:
                    await response.write(self._expired_event(f"too old resource version: {sent} ({oldest - 1})"))
                    return
            next_bookmark = loop.time() + self.bookmark_interval if bookmarks else float("inf")
            while True:
                if epoch != self.epoch or (self.events and sent < self.events[0][0] - 1):  # expired: 410
                    await response.write(self._expired_event(f"too old resource version: {sent}"))
                    return
                start = bisect.bisect_right(self.events, sent, key=lambda e: e[0])
                for event_rv, res, kind, obj in self.events[start:]:
                    sent = max(sent, event_rv)
                    if res != resource or (namespace and obj["metadata"].get("namespace") != namespace):
                        continue
                    shown = self._shown(request, kind, obj, visible) if selective else kind
                    if shown:
                        await response.write(json.dumps({"type": shown, "object": obj}).encode() + b"\n")
                now = loop.time()
                if now >= end:
                    return
                if now >= next_bookmark:
                    await response.write(self._bookmark(resource, sent))  # every event up to ``sent`` is out
                    next_bookmark = now + self.bookmark_interval
                try:
                    await self.changed.wait_for(functools.partial(self._newer, sent), min(end, next_bookmark) - now)
                except TimeoutError:
                    pass
        except (ConnectionResetError, asyncio.CancelledError):
            pass

