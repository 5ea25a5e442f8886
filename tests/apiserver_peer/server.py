"""The API-server peer itself: storage, routing, the REST verbs, list pagination, watches, faults, the log."""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime as dt
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import yaml
from aiohttp import web

from tests.apiserver_peer.admission import Admission
from tests.apiserver_peer.faults import WATCH_ERROR_REASONS, Fault, RequestInfo, RequestRecord, matches
from tests.apiserver_peer.pods import validate_create, validate_update
from tests.apiserver_peer.reads import Pulse, Reads
from tests.apiserver_peer.schemas import CustomSchemas, warning_header
from tests.apiserver_peer.wire import (
    REASONS,
    TRUE,
    Refused,
    default_message,
    fields_v1,
    json_patch,
    merge_patch,
    micro_time,
    now_rfc3339,
    plural_of,
    qualified,
    status,
    status_body,
)

CLUSTER_SCOPED = {"nodes", "namespaces", "priorityclasses"}
# Built-in kinds the stack's controllers create and update (the inference operator, the workspace controller),
# checked against the Kubernetes OpenAPI schema (kubernetes-validate, strict: unknown fields are errors) as the API
# server decodes them. Not the busy kinds (pods, nodes, leases, events: their rules are in pods.py, or nothing a
# schema would catch): a check costs ~20 ms.
SCHEMA_CHECKED = {"deployments", "services", "horizontalpodautoscalers", "poddisruptionbudgets", "networkpolicies",
                  "roles", "rolebindings", "clusterroles", "clusterrolebindings", "serviceaccounts", "configmaps",
                  "resourcequotas", "limitranges", "secrets"}
KUBERNETES_VERSION = "1.37.0"
# Resources whose status is written only through /status: their main endpoint keeps the stored status.
STATUS_SUBRESOURCES = {"pods", "nodes", "namespaces", "jobs", "deployments", "replicasets", "statefulsets",
                       "daemonsets", "poddisruptionbudgets", "gpuprovisioningrequests", "workspaces",
                       "inferenceendpoints"}
KINDS = {"pods": "Pod", "nodes": "Node", "namespaces": "Namespace", "leases": "Lease", "events": "Event",
         "gpuprovisioningrequests": "GPUProvisioningRequest", "jobs": "Job", "configmaps": "ConfigMap",
         "priorityclasses": "PriorityClass", "poddisruptionbudgets": "PodDisruptionBudget"}
NOT_SPEC = ("apiVersion", "kind", "metadata", "status")
PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json",
               "application/strategic-merge-patch+json", "application/apply-patch+yaml")


def _spec(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in NOT_SPEC}


def _is_custom(resource: str) -> bool:
    """A custom resource: a group of its own ('accelstack.io'), not a built-in one ('apps', '*.k8s.io')."""
    parts = resource.split("/")
    return parts[0] == "apis" and "." in parts[1] and not parts[1].endswith(".k8s.io")


class _Changed(Exception):
    """The object an update was computed from changed while admission webhooks judged the update."""


class APIServerPeer(Reads):
    def __init__(self, history: int = 100_000, bookmark_interval: float = 2.0, watch_timeout: float = 30.0,
                 log_limit: int = 1_000_000) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource path, namespace, name) -> obj
        self.revision = 0
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, resource path, type, object)
        self.history = history
        self.changed = Pulse()
        self.requests: list[tuple[str, str]] = []  # (method, path?query) of every request
        # the same requests with what they addressed, status and times (the newest ``log_limit``)
        self.log: collections.deque[RequestRecord] = collections.deque(maxlen=log_limit)
        self.faults: list[Fault] = []
        self.hooks: dict[str, Callable[[web.Request, dict[str, Any]], Any]] = {}
        self.admission = Admission()  # validating webhooks called on CREATE and UPDATE
        self.epoch = 0  # bumped by compact(): open watches end with 410
        self.bookmark_interval = bookmark_interval  # seconds between BOOKMARKs on watches that allow them
        self.watch_timeout = watch_timeout  # a watch without timeoutSeconds ends after this
        self.too_large_rv_wait = 3.0  # a list at a future resourceVersion waits this long, then 504
        self.continue_ttl: float | None = None  # continue tokens older than this answer 410 Expired
        self.status_subresources = set(STATUS_SUBRESOURCES)
        self.snapshots: dict[str, tuple[float, list[dict[str, Any]]]] = {}  # continue snapshot -> (made, items)
        self.tokens: dict[str, dict[str, Any]] = {}  # bearer token -> TokenReview user
        self.grants: set[tuple[str, str, str, str, str]] = set()  # (user, verb, group, resource, namespace)
        self.bindings: list[tuple[str, str, str]] = []  # (namespace, pod, node) per Binding created
        self.evicted: list[str] = []
        self.pdb_blocks: set[str] = set()  # "ns/name" of pods whose eviction a PDB refuses
        # A bound pod that has not finished is deleted gracefully, as the API server does (the kubelet stops it):
        # DELETE or an eviction sets deletionTimestamp and deletionGracePeriodSeconds (MODIFIED) and the pod goes
        # (DELETED) this many seconds later, as its kubelet confirms. None: at once (unbound pods always are).
        self.pod_grace: float | None = None
        # accelstack's CRDs (manifests/crds): custom resources pruned, defaulted and validated as the API server
        # does with their schemas and CEL rules. None: stored as sent (a benchmark's peer: the CEL rules cost
        # ~5 ms a GPR create in Python, where a real API server spends microseconds)
        self.schemas: CustomSchemas | None = CustomSchemas()
        self._terminating: set[asyncio.Task[None]] = set()
        self.kinds = dict(KINDS)  # plural -> Kind, for BOOKMARK objects and messages
        self.runner: web.AppRunner | None = None
        self.url = ""
        self._closing = False

    # -- storage -------------------------------------------------------------------------------------------
    def _bump(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        self.events.append((self.revision, resource, kind, copy.deepcopy(obj)))
        if len(self.events) > self.history:
            del self.events[:-self.history]

    async def put_object(self, resource: str, obj: dict[str, Any], event: str = "ADDED") -> dict[str, Any]:
        """Store an object as the server would (used by tests to seed state); returns the stored copy. A
        MODIFIED object whose spec changed gets the next ``metadata.generation`` (when it has one and the
        caller did not set another)."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", "2026-11-30T00:00:00Z")
        key = (resource, meta.get("namespace", ""), meta["name"])
        current = self.objects.get(key)
        if current is not None and current is not obj:
            generation = current["metadata"].get("generation")
            if generation is not None and meta.get("generation", generation) == generation \
                    and _spec(current) != _spec(obj):
                meta["generation"] = generation + 1
        if obj.get("kind"):
            self.kinds.setdefault(plural_of(resource), obj["kind"])
        self.objects[key] = obj
        self._bump(resource, event, obj)
        self.changed.notify_all()
        return copy.deepcopy(obj)

    async def delete_object(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Remove an object at once (finalizers are not consulted: the HTTP DELETE honours them)."""
        obj = self.objects.pop((resource, namespace, name), None)
        if obj is not None:
            self._bump(resource, "DELETED", obj)
            self.changed.notify_all()
        return obj

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((resource, namespace, name))

    def compact(self) -> None:
        """Forget all watch history and expire open watches and continue tokens, as a compaction or an
        API-server restart does: open watches, older resourceVersions and continue tokens now get 410."""
        self.events.clear()
        self.snapshots.clear()
        self.epoch += 1

    def expire_continue_tokens(self) -> None:
        """Every continue token handed out so far answers 410 Expired from now on."""
        self.snapshots.clear()

    async def put_lease(self, namespace: str, name: str, holder: str, renew_time: dt.datetime | None = None,
                        skew: float = 0.0, duration: int = 15, transitions: int = 0) -> dict[str, Any]:
        """Store a coordination.k8s.io/v1 Lease held by ``holder``, renewed at ``renew_time`` (default now)
        shifted by ``skew`` seconds (negative: in the past, as a dead holder; positive: a holder whose clock
        runs ahead)."""
        when = (renew_time or dt.datetime.now(dt.UTC)) + dt.timedelta(seconds=skew)
        current = self.objects.get(("apis/coordination.k8s.io/v1/leases", namespace, name))
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {**(current or {}).get("metadata", {}), "name": name, "namespace": namespace},
                 "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration,
                          "acquireTime": micro_time(when), "renewTime": micro_time(when),
                          "leaseTransitions": transitions}}
        return await self.put_object("apis/coordination.k8s.io/v1/leases", lease,
                                     "MODIFIED" if current else "ADDED")

    # -- faults and the request log ------------------------------------------------------------------------
    def inject(self, method: str | None = None, resource: str | None = None, **kwargs: Any) -> Fault:
        """Misbehave on matching requests; see the package docstring. Returns the Fault (``.remove()``)."""
        return Fault(self.faults, method=method, resource=resource, **kwargs)

    def clear_faults(self) -> None:
        self.faults.clear()

    def calls(self, method: str | None = None, resource: str | None = None, *, namespace: str | None = None,
              name: str | None = None, subresource: str | None = None, watch: bool | None = None,
              verb: str | None = None, status: int | None = None, since: float | None = None,
              until: float | None = None) -> list[RequestRecord]:
        """The logged requests that match (same matching as ``inject``), started within [since, until)
        (``time.monotonic()`` values, e.g. from ``peer.mark()``)."""
        return [r for r in self.log
                if matches(r, method, resource, namespace, name, subresource, watch, verb)
                and (status is None or r.status == status)
                and (since is None or r.started >= since) and (until is None or r.started < until)]

    def count(self, method: str | None = None, resource: str | None = None, **match: Any) -> int:
        return len(self.calls(method, resource, **match))

    def rate(self, method: str | None = None, resource: str | None = None, window: float = 1.0,
             **match: Any) -> float:
        """Matching requests per second over the last ``window`` seconds."""
        return self.count(method, resource, since=time.monotonic() - window, **match) / window

    def max_rate(self, method: str | None = None, resource: str | None = None, window: float = 1.0,
                 **match: Any) -> float:
        """The most matching requests started in any ``window`` seconds (sliding), per second: a retry
        storm shows here even when it is over."""
        starts = [r.started for r in self.calls(method, resource, **match)]
        best, lo = 0, 0
        for hi, t in enumerate(starts):
            while t - starts[lo] >= window:
                lo += 1
            best = max(best, hi - lo + 1)
        return best / window

    @staticmethod
    def mark() -> float:
        """Now, for ``since=`` in calls/count/max_rate."""
        return time.monotonic()

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

    @classmethod
    def _info(cls, request: web.Request) -> RequestInfo:
        resource, namespace, name, sub = cls._parse(request.path) or ("", "", "", "")
        method = request.method
        if method == "GET":
            verb = ("watch" if request.query.get("watch", "").lower() in TRUE else "list") if not name else "get"
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                    "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())
        return RequestInfo(method, request.path, dict(request.query), resource, namespace, name, sub, verb)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        info = self._info(request)
        record = RequestRecord(**vars(info), started=time.monotonic(),
                               user_agent=request.headers.get("User-Agent", ""))
        self.log.append(record)
        response: web.StreamResponse | None = None
        try:
            fault = next((f for f in list(self.faults) if f.applies(info, request)), None)
            if fault is not None:
                fault.take()
                record.fault = fault
                response = await self._fault(fault, request, info)
            else:
                response = await self._dispatch(request, info)
            return response
        finally:
            record.finished = time.monotonic()
            record.status = response.status if response is not None else 499  # 499: the client went away

    async def _until_gone(self, request: web.Request) -> None:
        """Wait until the client disconnects (or the peer stops)."""
        while not self._closing and request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.05)

    async def _fault(self, fault: Fault, request: web.Request, info: RequestInfo) -> web.StreamResponse:
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.respond is not None:
            result = fault.respond(request)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                result = await result
            if isinstance(result, web.StreamResponse):
                return result
        elif fault.hang:
            if fault.lands:
                await request.read()  # the body arrived; the answer never will
            await self._until_gone(request)
            if fault.lands:  # made once the client has given up on it (and, likely, already looked again)
                await self._dispatch(request, info)
            return web.Response(status=499)
        elif fault.body is not None:
            body = fault.body.encode() if isinstance(fault.body, str) else fault.body
            assert fault.status is not None
            return web.Response(status=fault.status, body=body, content_type=fault.content_type)
        elif fault.status is not None:
            if fault.lands:  # made, then answered as failed
                await self._dispatch(request, info)
            message = fault.message or default_message(fault.status, info.verb, info.resource, info.namespace,
                                                       info.name)
            details = fault.details or ({"name": info.name, "group": info.resource.split("/")[1]
                                         if info.resource.startswith("apis/") else "", "kind": info.plural}
                                        if info.resource else None)
            return status(fault.status, fault.reason, message, details, fault.retry_after)
        elif fault.half_open or fault.close or fault.watch_error is not None:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            if fault.after:
                await self._stream(request, response, info.resource, info.namespace,
                                   until=asyncio.get_running_loop().time() + fault.after)
            if fault.half_open:
                await self._until_gone(request)
            elif fault.watch_error is not None:
                code = fault.watch_error
                message = fault.message or (f"too old resource version: 1 ({self.revision})" if code == 410
                                            else default_message(code, "watch", info.resource, info.namespace, ""))
                reason = fault.reason or WATCH_ERROR_REASONS.get(code, REASONS.get(code, ""))
                event = {"type": "ERROR", "object": status_body(code, reason, message)}
                await response.write(json.dumps(event).encode() + b"\n")
            return response
        return await self._dispatch(request, info)  # a delay only: then answer normally

    async def _dispatch(self, request: web.Request, info: RequestInfo) -> web.StreamResponse:
        if not info.resource:
            return status(404, "NotFound", f"no route for {request.path}")
        for _ in range(10):
            try:
                return await self._serve(request, info)
            except Refused as exc:
                return exc.response()
            except _Changed:  # the object changed while a webhook judged the write: again, on the new one
                continue
        return status(409, "Conflict", "the object kept changing while admission webhooks were called")

    @staticmethod
    async def _body(request: web.Request, required: bool = True) -> Any:
        raw = await request.read()
        if not raw and not required:
            return {}
        try:
            if request.content_type == "application/apply-patch+yaml":
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise Refused(400, f"the body of the request was in an unknown format: {exc}") from exc

    async def _serve(self, request: web.Request, info: RequestInfo) -> web.StreamResponse:
        resource, namespace, name, sub = info.resource, info.namespace, info.name, info.subresource
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
            if info.watch:
                return await self._watch(request, resource, namespace)
            return await self._list(request, resource, namespace)
        key = (resource, namespace, name)
        if request.method == "GET":
            obj = self.objects.get(key)
            if not obj:
                raise Refused(404, f'{qualified(resource)} "{name}" not found', "NotFound",
                              {"name": name, "kind": plural_of(resource)})
            return web.json_response(obj)
        dry = self._dry_run(request, info.verb)
        if request.method == "POST":
            return await self._create(request, resource, namespace, dry)
        current = self.objects.get(key)
        if request.method == "PATCH" and request.content_type == "application/apply-patch+yaml" and current is None:
            return await self._create(request, resource, namespace, dry, name=name)
        if current is None:
            raise Refused(404, f'{qualified(resource)} "{name}" not found', "NotFound",
                          {"name": name, "kind": plural_of(resource)})
        if request.method == "DELETE":
            return await self._delete(request, resource, current, dry)
        if request.method == "PUT":
            obj = await self._body(request)
            if not isinstance(obj, dict):
                raise Refused(400, "the body of the request is not an object")
            self._check_name(obj, name, namespace)
            meta = obj.get("metadata") or {}
            if meta.get("uid") and meta["uid"] != current["metadata"].get("uid"):
                raise Refused(409, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: "
                              f"{current['metadata'].get('uid')}", "Conflict")
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                raise Refused(409, f'Operation cannot be fulfilled on {qualified(resource)} "{name}": the object '
                              "has been modified; please apply your changes to the latest version and try again",
                              "Conflict", {"name": name, "kind": plural_of(resource)})
            if sub == "status":
                new = copy.deepcopy(current)
                new["status"] = obj.get("status", {})
            else:
                new = obj
                new["metadata"] = {**current["metadata"], **meta}
                if "status" in current:
                    new["status"] = current["status"]
            return await self._update(request, resource, current, new, sub, "Update", obj, dry)
        if request.method == "PATCH":
            return await self._patch(request, resource, current, sub, dry)
        raise Refused(405, request.method, "MethodNotAllowed")

    @staticmethod
    def _dry_run(request: web.Request, verb: str) -> bool:
        values = request.query.getall("dryRun", [])
        for value in values:
            if value != "All":
                kind = {"create": "CreateOptions", "delete": "DeleteOptions", "patch": "PatchOptions"}.get(
                    verb, "UpdateOptions")
                raise Refused(422, f'{kind}.meta.k8s.io "" is invalid: dryRun: Unsupported value: "{value}": '
                              'supported values: "All"', "Invalid")
        return bool(values)

    @staticmethod
    def _check_name(obj: dict[str, Any], name: str, namespace: str) -> None:
        """As the API server's checkName: the body must name the object the URL names (400 BadRequest)."""
        meta = obj.get("metadata") or {}
        if name and meta.get("name") != name:
            raise Refused(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                          f"({name})")
        if namespace and meta.get("namespace") not in (None, "", namespace):
            raise Refused(400, f"the namespace of the object ({meta['namespace']}) does not match the namespace "
                          f"on the request ({namespace})")

    def _manage(self, request: web.Request, obj: dict[str, Any], operation: str, sub: str, sent: Any) -> None:
        """Record the writer in metadata.managedFields: ``fieldManager`` or, like the API server, the
        User-Agent up to its first '/'."""
        manager = request.query.get("fieldManager") or request.headers.get("User-Agent", "").split("/")[0][:128]
        meta = obj["metadata"]
        entries = [e for e in meta.get("managedFields") or []
                   if (e.get("manager"), e.get("operation"), e.get("subresource", "")) != (manager, operation, sub)]
        entry = {"manager": manager, "operation": operation, "apiVersion": obj.get("apiVersion", ""),
                 "time": now_rfc3339(), "fieldsType": "FieldsV1", "fieldsV1": fields_v1(sent)}
        if sub:
            entry["subresource"] = sub
        meta["managedFields"] = [*entries, entry]

    async def _create(self, request: web.Request, resource: str, namespace: str, dry: bool,
                      name: str = "") -> web.Response:
        obj = await self._body(request)
        if not isinstance(obj, dict):
            raise Refused(400, "the body of the request is not an object")
        sent = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if namespace and meta.get("namespace") not in (None, "", namespace):
            raise Refused(400, "the namespace of the provided object does not match the namespace sent on the "
                          "request")
        if name:  # server-side apply of an object that does not exist yet
            if not request.query.get("fieldManager"):
                raise Refused(422, 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is '
                              "required for apply patch", "Invalid")
            self._check_name(obj, name, namespace)
        if namespace:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        kind = obj.get("kind") or self.kinds.get(plural_of(resource), "Object")
        if not meta.get("name"):
            raise Refused(422, f'{kind} "" is invalid: metadata.name: Required value: name or generateName is '
                          "required", "Invalid", {"kind": kind})
        if (resource, namespace, meta["name"]) in self.objects:
            raise Refused(409, f'{qualified(resource)} "{meta["name"]}" already exists', "AlreadyExists",
                          {"name": meta["name"], "kind": plural_of(resource)})
        meta.pop("resourceVersion", None)
        meta["creationTimestamp"] = now_rfc3339()
        if _is_custom(resource):
            meta["generation"] = 1
            if plural_of(resource) in self.status_subresources:
                obj.pop("status", None)
        self._manage(request, obj, "Apply" if name else "Update", "", sent)
        if resource == "api/v1/pods":
            validate_create(obj)
        warnings = self.schemas.admit(resource, obj, None, "", field_validation=self._field_validation(request)) \
            if self.schemas is not None else []
        self._check_builtin(resource, obj)
        await self._admit(request, resource, "CREATE", obj, None, dry)
        if (resource, namespace, meta["name"]) in self.objects:  # created while the webhooks judged this one
            raise Refused(409, f'{qualified(resource)} "{meta["name"]}" already exists', "AlreadyExists",
                          {"name": meta["name"], "kind": plural_of(resource)})
        if dry:
            meta.setdefault("uid", str(uuid.uuid4()))
            return self._answer(obj, warnings, 201)
        return self._answer(await self.put_object(resource, obj), warnings, 201)

    async def _update(self, request: web.Request, resource: str, current: dict[str, Any], new: dict[str, Any],
                      sub: str, operation: str, sent: Any, dry: bool) -> web.Response:
        """The rules every write of an existing object goes through: the URL's name, status only through
        /status, generation on spec changes, finalizers while deleting, managedFields, dry runs."""
        new = {**new, "metadata": dict(new.get("metadata") or {})}  # a patch shares unpatched parts: copy what
        meta = new["metadata"]                                       # is written here, not the stored object's
        cur_meta = current["metadata"]
        self._check_name(new, cur_meta["name"], cur_meta.get("namespace", ""))
        for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"):
            if field in cur_meta:
                meta[field] = cur_meta[field]
            else:
                meta.pop(field, None)
        if sub == "status":
            status_ = new.get("status")
            new = copy.deepcopy(current)
            if status_ is None:
                new.pop("status", None)
            else:
                new["status"] = status_
            meta = new["metadata"]
        elif plural_of(resource) in self.status_subresources:
            if "status" in current:
                new["status"] = current["status"]
            else:
                new.pop("status", None)
        warnings = self.schemas.admit(resource, new, current, sub, field_validation=self._field_validation(request)) \
            if self.schemas is not None else []
        if not sub:
            self._check_builtin(resource, new)
        meta = new["metadata"]
        generation = cur_meta.get("generation")
        if generation is not None:
            meta["generation"] = generation + 1 if _spec(new) != _spec(current) else generation
        if cur_meta.get("deletionTimestamp") and \
                set(meta.get("finalizers") or []) - set(cur_meta.get("finalizers") or []):
            raise Refused(422, f'{self.kinds.get(plural_of(resource), "Object")} "{cur_meta["name"]}" is invalid: '
                          "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being "
                          "deleted", "Invalid")
        self._manage(request, new, operation, sub, sent)
        if not sub and resource == "api/v1/pods":
            validate_update(new, current)
        if not sub:
            key = (resource, cur_meta.get("namespace", ""), cur_meta["name"])
            await self._admit(request, resource, "UPDATE", new, current, dry)
            if self.objects.get(key) is not current:
                raise _Changed
        if dry:
            return self._answer(new, warnings)
        if cur_meta.get("deletionTimestamp") and not meta.get("finalizers"):
            stored = await self.put_object(resource, new, "MODIFIED")
            await self.delete_object(resource, cur_meta.get("namespace", ""), cur_meta["name"])
            return self._answer(stored, warnings)
        return self._answer(await self.put_object(resource, new, "MODIFIED"), warnings)

    def _check_builtin(self, resource: str, obj: dict[str, Any]) -> None:
        """A built-in object of :data:`SCHEMA_CHECKED` that the Kubernetes schema refuses: 422 (a real API server
        answers 400 for an undecodable body and 422 for an invalid one; both say which field)."""
        if self.schemas is None or plural_of(resource) not in SCHEMA_CHECKED or _is_custom(resource) \
                or not obj.get("apiVersion") or not obj.get("kind"):
            return
        import kubernetes_validate

        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = (obj.get("metadata") or {}).get("name", "")
            where = ".".join(str(p) for p in exc.path) if getattr(exc, "path", None) else ""
            raise Refused(422, f'{obj["kind"]} "{name}" is invalid: {where + ": " if where else ""}{exc.message}',
                          "Invalid", {"name": name, "kind": plural_of(resource)}) from None

    @staticmethod
    def _field_validation(request: web.Request) -> str:
        return request.query.get("fieldValidation", "Warn")

    @staticmethod
    def _answer(obj: dict[str, Any], warnings: list[str], code: int = 200) -> web.Response:
        """The stored object, with the API server's ``Warning`` headers (unknown fields pruned)."""
        response = web.json_response(obj, status=code)
        for text in warnings:
            response.headers.add("Warning", warning_header(text))
        return response

    async def _admit(self, request: web.Request, resource: str, operation: str, obj: dict[str, Any],
                     old: dict[str, Any] | None, dry: bool) -> None:
        if not self.admission.validating:
            return
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        user = self.tokens.get(token) or {"username": "system:anonymous", "groups": ["system:unauthenticated"]}
        kind = obj.get("kind") or self.kinds.get(plural_of(resource), "Object")
        await self.admission.admit(request, user, resource, operation, copy.deepcopy(obj),
                                   copy.deepcopy(old) if old is not None else None, kind, dry)

    async def _patch(self, request: web.Request, resource: str, current: dict[str, Any], sub: str,
                     dry: bool) -> web.Response:
        ctype = request.content_type
        if ctype not in PATCH_TYPES:
            raise Refused(415, f"the body of the request was in an unknown format - accepted media types include: "
                          f"{', '.join(PATCH_TYPES)}", "UnsupportedMediaType")
        patch = await self._body(request)
        name = current["metadata"]["name"]
        try:
            if ctype == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise Refused(400, "json patch must be a list of operations")
                new = json_patch(current, patch)
            else:
                if not isinstance(patch, dict):
                    raise Refused(400, "patch must be an object")
                if ctype == "application/apply-patch+yaml" and not request.query.get("fieldManager"):
                    raise Refused(422, 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is '
                                  "required for apply patch", "Invalid")
                sent_rv = (patch.get("metadata") or {}).get("resourceVersion")
                if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                    raise Refused(409, f'Operation cannot be fulfilled on {qualified(resource)} "{name}": the '
                                  "object has been modified; please apply your changes to the latest version and "
                                  "try again", "Conflict", {"name": name, "kind": plural_of(resource)})
                new = merge_patch(current, patch)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise Refused(422, f"patch failed: {exc}", "Invalid") from exc
        operation = "Apply" if ctype == "application/apply-patch+yaml" else "Update"
        return await self._update(request, resource, current, new, sub, operation, patch, dry)

    async def _delete(self, request: web.Request, resource: str, current: dict[str, Any], dry: bool) -> web.Response:
        options = await self._body(request, required=False)
        meta = current["metadata"]
        pre = (options or {}).get("preconditions") or {} if isinstance(options, dict) else {}
        if pre.get("uid") and pre["uid"] != meta.get("uid"):
            raise Refused(409, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: "
                          f"{meta.get('uid')}", "Conflict")
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta.get("resourceVersion"):
            raise Refused(409, f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                          f"ResourceVersion in object meta: {meta.get('resourceVersion')}", "Conflict")
        if dry:
            return web.json_response(current)
        if resource == "api/v1/pods" and self._graceful(current):
            grace = (options or {}).get("gracePeriodSeconds") if isinstance(options, dict) else None
            return web.json_response(await self._terminate(current, grace))
        if meta.get("finalizers"):  # deletion waits for the finalizers to be removed
            if not meta.get("deletionTimestamp"):
                new = copy.deepcopy(current)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                if "generation" in meta:
                    new["metadata"]["generation"] = meta["generation"] + 1
                return web.json_response(await self.put_object(resource, new, "MODIFIED"))
            return web.json_response(current)
        return web.json_response(await self.delete_object(resource, meta.get("namespace", ""), meta["name"]))

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
        if pod["metadata"].get("deletionTimestamp"):  # not a StatusError upstream: answered as an internal error
            return status(500, "InternalError", f"Internal error occurred: pod {name} is being deleted, cannot be "
                          "assigned to a host")
        if pod.get("spec", {}).get("nodeName"):
            return status(409, "Conflict", f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        if pod.get("spec", {}).get("schedulingGates"):
            return status(500, "InternalError", f"Internal error occurred: pod {name} has non-empty "
                          ".spec.schedulingGates")
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
        pod = self.objects[("api/v1/pods", namespace, name)]
        if self._graceful(pod):
            await self._terminate(pod, None)
        else:
            await self.delete_object("api/v1/pods", namespace, name)
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "code": 201}, status=201)

    def _graceful(self, pod: dict[str, Any]) -> bool:
        """Whether deleting this pod waits for its kubelet: bound, not finished (the pod strategy's
        CheckGracefulDelete), and graceful deletion switched on (``pod_grace``)."""
        return (self.pod_grace is not None and bool((pod.get("spec") or {}).get("nodeName"))
                and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))

    async def _terminate(self, pod: dict[str, Any], grace: Any) -> dict[str, Any]:
        """Graceful deletion: deletionTimestamp now + the grace period (the DeleteOptions', else the pod's
        terminationGracePeriodSeconds, else 30), then gone ``pod_grace`` seconds later. A pod already terminating
        is left as it is."""
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            return copy.deepcopy(pod)
        if not isinstance(grace, int) or isinstance(grace, bool) or grace < 0:
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        if grace == 0:
            deleted = await self.delete_object("api/v1/pods", meta.get("namespace", ""), meta["name"])
            return deleted or pod
        new = copy.deepcopy(pod)
        new["metadata"]["deletionTimestamp"] = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=grace)).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        stored = await self.put_object("api/v1/pods", new, "MODIFIED")

        async def kubelet_confirms() -> None:
            await asyncio.sleep(self.pod_grace or 0.0)
            key = ("api/v1/pods", meta.get("namespace", ""), meta["name"])
            current = self.objects.get(key)
            if current is not None and current["metadata"].get("uid") == meta.get("uid"):
                await self.delete_object(*key)

        task = asyncio.create_task(kubelet_confirms())
        self._terminating.add(task)
        task.add_done_callback(self._terminating.discard)
        return stored

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self, port: int = 0) -> str:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)  # open watches end at stop
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._closing = False
        return self.url

    async def stop(self) -> None:
        self._closing = True
        for task in list(self._terminating):
            task.cancel()
        await self.admission.close()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
