"""A Kubernetes API-server peer for tests: the REST and watch protocol for the resources the stack uses.

It speaks the real wire protocol over real HTTP (aiohttp), so the official clients (``kubernetes_asyncio``)
talk to it unchanged:

- paths ``/api/v1/...`` (core) and ``/apis/<group>/<version>/...``, namespaced and cluster-scoped, with
  subresources ``status``, ``binding`` (sets ``spec.nodeName`` once, honours a UID precondition) and
  ``eviction`` (deletes the pod, or 429 while a test's PodDisruptionBudget blocks it), and test hooks;
- GET (object, list with ``resourceVersion`` in ``metadata``, ``labelSelector`` equality terms), POST,
  PUT (optimistic concurrency: a stale ``metadata.resourceVersion`` answers 409 Conflict), PATCH
  (``merge-patch+json`` and ``strategic-merge-patch+json`` as map merges where null deletes, and
  ``json-patch+json``), DELETE;
- ``?watch=true`` streams ``{"type": ..., "object": ...}`` lines from a ``resourceVersion``; one older than
  the retained history gets a 410 Gone ERROR event, as a real API server does after compaction.

Errors are ``Status`` objects with the real ``reason`` and ``code``. Product code never imports this.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import functools
import json
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

CLUSTER_SCOPED = {"nodes", "namespaces", "priorityclasses"}


def status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.json_response(body, status=code)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch (strategic merge behaves the same for the maps the stack patches)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1]
        if op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if op["op"] == "add":
                    parent.insert(index, op["value"])
                else:
                    parent[index] = op["value"]
            else:
                parent[last] = op["value"]
        elif op["op"] == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            else:
                parent.pop(last)
        elif op["op"] == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return doc


class APIServerPeer:
    def __init__(self, history: int = 100_000) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource path, namespace, name) -> obj
        self.revision = 0
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, resource path, type, object)
        self.history = history
        self.changed = asyncio.Condition()
        self.requests: list[tuple[str, str]] = []
        self.hooks: dict[str, Callable[[web.Request, dict[str, Any]], Any]] = {}
        self.epoch = 0  # bumped by compact(): open watches end with 410
        self.tokens: dict[str, dict[str, Any]] = {}  # bearer token -> TokenReview user
        self.grants: set[tuple[str, str, str, str, str]] = set()  # (user, verb, group, resource, namespace)
        self.bindings: list[tuple[str, str, str]] = []  # (namespace, pod, node) per Binding created
        self.evicted: list[str] = []
        self.pdb_blocks: set[str] = set()  # "ns/name" of pods whose eviction a PDB refuses
        self.runner: web.AppRunner | None = None
        self.url = ""

    # -- storage -------------------------------------------------------------------------------------------
    def _bump(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        self.events.append((self.revision, resource, kind, copy.deepcopy(obj)))
        del self.events[:-self.history]

    async def put_object(self, resource: str, obj: dict[str, Any], event: str = "ADDED") -> dict[str, Any]:
        """Store an object as the server would (used by tests to seed state); returns the stored copy."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", "2026-11-30T00:00:00Z")
        key = (resource, meta.get("namespace", ""), meta["name"])
        self.objects[key] = obj
        self._bump(resource, event, obj)
        async with self.changed:
            self.changed.notify_all()
        return copy.deepcopy(obj)

    async def delete_object(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.pop((resource, namespace, name), None)
        if obj is not None:
            self._bump(resource, "DELETED", obj)
            async with self.changed:
                self.changed.notify_all()
        return obj

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((resource, namespace, name))

    def compact(self) -> None:
        """Forget all watch history and expire open watches, as a compaction or an API-server restart does:
        open watches and older resourceVersions now get 410 Gone."""
        self.events.clear()
        self.epoch += 1

    # -- HTTP ----------------------------------------------------------------------------------------------
    @staticmethod
    def _parse(path: str) -> tuple[str, str, str, str] | None:
        """-> (resource path e.g. 'api/v1/pods', namespace, name, subresource)."""
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 2:
            prefix, rest = "/".join(parts[:2]), parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            prefix, rest = "/".join(parts[:3]), parts[3:]
        else:
            return None
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":  # /namespaces/<ns>/<resource>[/<name>[/<sub>]]
            namespace, rest = rest[1], rest[2:]
        if not rest:
            return None
        resource = f"{prefix}/{rest[0]}"
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        return resource, namespace, name, sub

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        parsed = self._parse(request.path)
        if parsed is None:
            return status(404, "NotFound", f"no route for {request.path}")
        resource, namespace, name, sub = parsed
        hook = self.hooks.get(f"{request.method} {resource.rsplit('/', 1)[1]}/{sub}" if sub else "")
        if hook is not None:
            body = await request.json() if request.can_read_body else {}
            result = hook(request, body)
            return await result if asyncio.iscoroutine(result) else result
        if request.method == "POST" and resource.endswith(("/tokenreviews", "/subjectaccessreviews")):
            return await self._review(request, resource)
        if request.method == "POST" and resource.endswith("/pods") and sub in ("binding", "eviction"):
            return await (self._binding if sub == "binding" else self._eviction)(request, namespace, name)
        if request.method == "GET" and not name:
            if request.query.get("watch", "").lower() in ("true", "1", "t"):
                return await self._watch(request, resource, namespace)
            return self._list(request, resource, namespace)
        key = (resource, namespace, name)
        if request.method == "GET":
            obj = self.objects.get(key)
            return web.json_response(obj) if obj else status(404, "NotFound", f'{resource} "{name}" not found')
        if request.method == "POST":
            try:
                obj = await request.json()
            except json.JSONDecodeError:
                return status(400, "BadRequest", "body is not JSON")
            obj.setdefault("metadata", {})
            if namespace:
                obj["metadata"]["namespace"] = namespace
            if not obj["metadata"].get("name") and obj["metadata"].get("generateName"):
                obj["metadata"]["name"] = obj["metadata"]["generateName"] + uuid.uuid4().hex[:5]
            if (resource, namespace, obj["metadata"].get("name", "")) in self.objects:
                return status(409, "AlreadyExists", f'{resource} "{obj["metadata"]["name"]}" already exists')
            return web.json_response(await self.put_object(resource, obj), status=201)
        current = self.objects.get(key)
        if current is None:
            return status(404, "NotFound", f'{resource} "{name}" not found')
        if request.method == "DELETE":
            return web.json_response(await self.delete_object(resource, namespace, name))
        if request.method == "PUT":
            obj = await request.json()
            sent_rv = obj.get("metadata", {}).get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                return status(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": the object '
                              "has been modified; please apply your changes to the latest version and try again")
            if sub == "status":
                new = copy.deepcopy(current)
                new["status"] = obj.get("status", {})
            else:
                new = obj
                new["metadata"] = {**current["metadata"], **obj.get("metadata", {})}
                if "status" in current:
                    new["status"] = current["status"]
            return web.json_response(await self.put_object(resource, new, "MODIFIED"))
        if request.method == "PATCH":
            ctype = request.content_type
            patch = await request.json()
            try:
                if ctype == "application/json-patch+json":
                    new = json_patch(current, patch)
                elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                    sent_rv = (patch.get("metadata") or {}).get("resourceVersion")
                    if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                        return status(409, "Conflict", f'the object "{name}" has been modified')
                    new = merge_patch(current, patch)
                else:
                    return status(415, "UnsupportedMediaType", f"unsupported patch type {ctype}")
            except (ValueError, KeyError, IndexError) as exc:
                return status(422, "Invalid", f"patch failed: {exc}")
            return web.json_response(await self.put_object(resource, new, "MODIFIED"))
        return status(405, "MethodNotAllowed", request.method)

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
        return True

    async def _review(self, request: web.Request, resource: str) -> web.Response:
        """TokenReview (``tokens``: token -> user info) and SubjectAccessReview (``grants``: (user, verb, group,
        resource, namespace), namespace "" = every namespace), answered in the API server's shapes."""
        body = await request.json()
        spec = body.get("spec") or {}
        if resource.endswith("/tokenreviews"):
            user = self.tokens.get(spec.get("token", ""))
            status_ = {"authenticated": True, "user": user} if user else {"authenticated": False,
                                                                         "error": "invalid bearer token"}
        else:
            attrs = spec.get("resourceAttributes") or {}
            wanted = (spec.get("user"), attrs.get("verb"), attrs.get("group", ""), attrs.get("resource"))
            allowed = any(g[:4] == wanted and g[4] in ("", attrs.get("namespace", "")) for g in self.grants)
            status_ = {"allowed": allowed, **({} if allowed else {"reason": "no RBAC rule allows it"})}
        return web.json_response({**body, "status": status_}, status=201)

    async def _binding(self, request: web.Request, namespace: str, name: str) -> web.Response:
        """pods/binding as the API server does it: sets spec.nodeName once; a UID precondition is honoured."""
        body = await request.json()
        pod = self.objects.get(("api/v1/pods", namespace, name))
        if pod is None:
            return status(404, "NotFound", f'pods "{name}" not found')
        uid = (body.get("metadata") or {}).get("uid")
        if uid and uid != pod["metadata"]["uid"]:
            return status(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                          f"{pod['metadata']['uid']}")
        if pod.get("spec", {}).get("nodeName"):
            return status(409, "Conflict", f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        new = copy.deepcopy(pod)
        new.setdefault("spec", {})["nodeName"] = body["target"]["name"]
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        if annotations:  # the real server copies the Binding's annotations onto the pod
            new["metadata"]["annotations"] = {**(new["metadata"].get("annotations") or {}), **annotations}
        await self.put_object("api/v1/pods", new, "MODIFIED")
        self.bindings.append((namespace, name, body["target"]["name"]))
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "code": 201}, status=201)

    async def _eviction(self, request: web.Request, namespace: str, name: str) -> web.Response:
        """pods/eviction (policy/v1): 429 while ``pdb_blocks`` names the pod, else the pod is deleted."""
        if ("api/v1/pods", namespace, name) not in self.objects:
            return status(404, "NotFound", f'pods "{name}" not found')
        if f"{namespace}/{name}" in self.pdb_blocks:
            return status(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.")
        self.evicted.append(f"{namespace}/{name}")
        await self.delete_object("api/v1/pods", namespace, name)
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "code": 201}, status=201)

    def _newer(self, revision: int) -> bool:
        return self.revision > revision

    def _list(self, request: web.Request, resource: str, namespace: str) -> web.Response:
        items = [o for (r, ns, _), o in sorted(self.objects.items()) if r == resource
                 and (not namespace or ns == namespace) and self._select(request, o)]
        return web.json_response({"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.revision)},
                                  "items": items})

    async def _watch(self, request: web.Request, resource: str, namespace: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.revision)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        oldest = self.events[0][0] if self.events else self.revision + 1
        if since < oldest - 1 and since < self.revision:
            gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                "message": f"too old resource version: {since} ({oldest - 1})",
                                                "reason": "Expired", "code": 410}}
            await response.write(json.dumps(gone).encode() + b"\n")
            return response
        epoch = self.epoch
        timeout = float(request.query.get("timeoutSeconds", 30))
        deadline = asyncio.get_running_loop().time() + timeout
        sent = since
        try:
            while True:
                if epoch != self.epoch or (self.events and sent < self.events[0][0] - 1):  # expired: 410
                    gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                        "message": f"too old resource version: {sent}",
                                                        "reason": "Expired", "code": 410}}
                    await response.write(json.dumps(gone).encode() + b"\n")
                    break
                start = bisect.bisect_right(self.events, sent, key=lambda e: e[0])
                for rv, res, kind, obj in self.events[start:]:
                    if res == resource and (not namespace or obj["metadata"].get("namespace") == namespace) \
                            and self._select(request, obj):
                        await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                    sent = max(sent, rv)
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                async with self.changed:
                    try:
                        await asyncio.wait_for(self.changed.wait_for(functools.partial(self._newer, sent)), remaining)
                    except TimeoutError:
                        break
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    async def start(self) -> str:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)  # open watches end at stop
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
