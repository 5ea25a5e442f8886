"""Admission webhooks: hold pods that ask for accelerators until their GPR is admitted, and keep GPRs within the
limits their namespace sets.

``POST /mutate-pods`` (mutating, pods CREATE): a pod that requests a managed resource (containers or init
containers, requests or limits) gets the scheduling gate ``accelstack.io/gpr`` and must carry the label
``accelstack.io/gpr: <GPR name>``. A pod without the label gets a GPR made from its namespace's default template
(namespace annotation ``accelstack.io/default-template``) when auto-GPR is enabled, named after the pod's owner
(or the pod); otherwise it is refused with a message saying what to do.

``POST /validate-gprs`` (validating, GPRs CREATE and UPDATE): the spec must pass :func:`gpr_resource.from_object`
and be one a cluster can serve (:func:`cluster_refusal`: no fraction of a device), and the
namespace's annotations may narrow it: ``accelstack.io/priority-range: "1-200"``,
``accelstack.io/max-gprs: "10"`` (unfinished GPRs in the namespace) and ``accelstack.io/max-exit-duration: "24h"``.

Both answer ``admission.k8s.io/v1`` ``AdmissionReview`` objects, echoing the request's ``uid``. A body that is not
an AdmissionReview (bad JSON, JSON nested deeper than an API object can be, wrong types, missing fields) is
answered with HTTP 400 and a ``Status`` saying what is wrong; a body over the size limit with 413; a body that
does not arrive within the body-read timeout with 408 (and the connection is closed).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import math
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import ClientError, web
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from kubeapi import AlreadyExists as KubeAlreadyExists
from kubeapi import ApiError, NotFound
from kubeapi.resources import (
    CRON_JOBS,
    DAEMON_SETS,
    DEPLOYMENTS,
    GPR_TEMPLATE_BINDINGS,
    JOBS,
    NAMESPACES,
    REPLICA_SETS,
    STATEFUL_SETS,
    WORKSPACES,
    Resource,
)
from scheduler_extender.admission.workspaces import (
    adoption_questions,
    adoption_refusal,
    binding_refusal,
    choose_template,
    gpr_refusal,
    member_of,
    needs_owner_labels,
    on_behalf,
    review_spec,
    unfinished,
    workspace_label,
    workspace_refusal,
)
from scheduler_extender.core.gpr import GPR
from scheduler_extender.core.inventory import GPU, MILLI_PER_DEVICE, NR1
from scheduler_extender.objects.cluster import DIRECT_LABEL, ClusterView, model_of, pinned_node, pod_view
from scheduler_extender.objects.gpr_codec import (
    GPR_LABEL,
    GPR_PLURAL,
    MAX_NAME,
    SCHEDULING_GATE,
    SpecError,
    check_spec,
    cluster_refusal,
    format_duration,
    from_object,
    is_terminal,
    new_object,
    parse_duration,
    template_spec,
)
from scheduler_extender.objects.kube import Kube
from scheduler_extender.objects.narrowing import narrow_affinity, ungate_patch
from scheduler_extender.objects.podfit import HOSTNAME_LABEL, Constraints, why_not
from scheduler_extender.objects.resources import host_requests, pod_requests
from scheduler_extender.objects.workspaces import (
    BINDING_PLURAL,
    ROLE_TEMPLATES,
    WORKSPACE_PLURAL,
    Workspace,
    parse_templates,
    parse_workspace,
)
from service.http_body import DEFAULT_BODY_TIMEOUT, BodyError, closing, read_body
from service.http_body import loads as json_loads

log = logging.getLogger("accelstack.extender.webhook")

ADMISSION_VERSION = "admission.k8s.io/v1"
DEFAULT_TEMPLATE_ANNOTATION = "accelstack.io/default-template"
PRIORITY_RANGE_ANNOTATION = "accelstack.io/priority-range"
MAX_GPRS_ANNOTATION = "accelstack.io/max-gprs"
MAX_EXIT_DURATION_ANNOTATION = "accelstack.io/max-exit-duration"
AUTO_LABEL = "accelstack.io/auto-gpr"  # on GPRs the webhook created: "true"
BINDING_ANNOTATION = "accelstack.io/template-binding"  # on those GPRs: the GPRTemplateBinding that chose the template
# owners whose labels a binding's workloadSelector reads (a ReplicaSet's Deployment, a Job's CronJob are read too)
OWNER_KINDS: dict[tuple[str, str], Resource] = {
    (r.api_version, r.kind): r for r in (JOBS, CRON_JOBS, REPLICA_SETS, DEPLOYMENTS, STATEFUL_SETS, DAEMON_SETS)}
CREATED_FOR_ANNOTATION = "accelstack.io/created-for"  # on those GPRs: "<kind>/<name>" of the pod or its owner
DEFAULT_MAX_BODY = 3 * 1024 * 1024  # an AdmissionReview carries the object (and oldObject): etcd keeps <= 1.5 MiB
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # a DNS subdomain (length checked apart)


DIRECT_SCAN = 256  # nodes a direct admission looks at, from the last one it chose, before leaving it to a GPR
# DIRECT_LABEL's value on a pod a replica that does not answer the verbs held at the gate for the one that does
HANDED_OVER = "pending"
HAND_OFFS_AT_ONCE = 16  # handed-over pods the binder settles together (their patches in flight at once)


@dataclass(frozen=True)
class Direct:
    """An unlabelled pod admitted at once without a GPR (``auto_gpr_direct``): the node it is pinned to, the
    template that allowed it and the pod's run-time bound from the template's exitDuration (None: none)."""

    node: str
    template: str
    deadline: int | None


class BadReview(ValueError):
    """The request body is not a usable AdmissionReview (answered with HTTP 400)."""


class AlreadyExists(Exception):
    """``create_gpr`` found a GPR of that name already there (409)."""


class Lookup(Protocol):
    """What the webhook reads and writes in the cluster."""

    async def get_namespace(self, name: str) -> dict[str, Any] | None: ...

    async def get_template(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def get_workspace(self, name: str) -> dict[str, Any] | None: ...

    async def list_workspaces(self) -> list[dict[str, Any]]: ...

    async def list_bindings(self) -> list[dict[str, Any]]:
        """Every GPRTemplateBinding in the cluster ([] when the CRD is not installed)."""
        ...

    async def get_owner(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        """A pod's owner (Job, ReplicaSet, Deployment, ...), None when it is gone or of a kind not read."""
        ...

    async def list_gprs(self, namespace: str) -> list[dict[str, Any]]: ...

    async def get_gpr(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def create_gpr(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create and return the stored object; raise :class:`AlreadyExists` on a name clash."""
        ...

    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The workspace role templates' ConfigMap (None when there is none: the built-in templates)."""
        ...

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A pod read afresh (None when it is gone): a pod handed over for admission at once."""
        ...

    async def patch_pod(self, namespace: str, name: str, patch: Any) -> None:
        """A JSON patch (a list) or a merge patch of a pod handed over for admission at once."""
        ...

    async def access_review(self, spec: dict[str, Any]) -> bool:
        """A SubjectAccessReview: whether its user may do what its attributes say."""
        ...


class KubeLookup(Lookup):
    """:class:`Lookup` on the API server through the shared client layer (timeouts, status checks, retries)."""

    def __init__(self, kube: Kube, ttl: float = 2.5, clock: Callable[[], float] = time.monotonic,
                 max_stale: float = 5.0) -> None:
        self.kube = kube
        self.ttl = ttl  # namespaces and templates change rarely: a burst of pod creations reads them once
        # past its TTL a value is still answered (and read again meanwhile) until this old, never older: the
        # docs promise a binding, template or workspace change reaches pods within 5 s (it was 60 s, so a
        # binding deleted a minute ago still chose templates); reading again from half of it on keeps a
        # burst of pod creations from waiting on a refresh as long as a read takes under 2.5 s
        self.max_stale = max_stale
        self.clock = clock
        self._cache: dict[tuple[str, str, str], tuple[float, dict[str, Any] | None]] = {}
        # reads under way: a burst of pod creations that all miss (the first ones, or the TTL just passed)
        # waits for one read instead of each making its own (hundreds of GETs of one template otherwise)
        self._reading: dict[tuple[str, str, str], asyncio.Task[dict[str, Any] | None]] = {}

    async def _cached(self, key: tuple[str, str, str], read: Callable[[], Any],
                      keep: bool = True) -> dict[str, Any] | None:
        """``read()`` (None for NotFound), kept ``ttl`` seconds when ``keep``; either way, callers that come
        while a read of ``key`` is under way share it. A kept value past its TTL (up to ``max_stale``) is
        answered at once while it is read again: no webhook request waits for a refresh."""
        hit = self._cache.get(key) if keep else None
        age = self.clock() - hit[0] if hit is not None else 0.0
        if hit is not None and age < self.ttl:
            return hit[1]
        task = self._reading.get(key)
        if task is None:
            task = self._reading[key] = asyncio.ensure_future(self._read(key, read, keep))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen, even if every caller left
        if hit is not None and age < self.max_stale:
            return hit[1]
        # shielded: a caller that goes (its webhook request cancelled) does not cancel the others' read
        return await asyncio.shield(task)

    async def _read(self, key: tuple[str, str, str], read: Callable[[], Any], keep: bool) -> dict[str, Any] | None:
        now = self.clock()
        try:
            try:
                value = await read()
            except NotFound:
                value = None
            if keep:
                if len(self._cache) > 4096:
                    self._cache.clear()
                self._cache[key] = (now, value)
            return value
        finally:
            self._reading.pop(key, None)

    async def get_namespace(self, name: str) -> dict[str, Any] | None:
        return await self._cached(("ns", "", name), lambda: self.kube.client.get(NAMESPACES, name))

    async def get_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._cached(("tpl", namespace, name), lambda: self.kube.get_template(namespace, name))

    async def get_workspace(self, name: str) -> dict[str, Any] | None:
        return await self._cached(("ws", "", name), lambda: self.kube.client.get(WORKSPACES, name))

    async def _list(self, key: str, resource: Resource) -> list[dict[str, Any]]:
        async def read() -> dict[str, Any]:
            items, _ = await self.kube.client.list(resource)
            return {"items": items}

        return list(((await self._cached(("list", "", key), read)) or {}).get("items") or [])

    async def list_workspaces(self) -> list[dict[str, Any]]:
        items, _ = await self.kube.client.list(WORKSPACES)  # not cached: it judges a namespace's second claimant
        return items

    async def list_bindings(self) -> list[dict[str, Any]]:
        return await self._list(BINDING_PLURAL, GPR_TEMPLATE_BINDINGS)

    async def get_owner(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        resource = OWNER_KINDS.get((api_version, kind))
        if resource is None:
            return None
        return await self._cached((kind, namespace, name), lambda: self.kube.client.get(resource, name, namespace))

    async def list_gprs(self, namespace: str) -> list[dict[str, Any]]:
        return await self.kube.list_gprs(namespace)

    async def get_gpr(self, namespace: str, name: str) -> dict[str, Any] | None:
        # not kept (a GPR's phase matters now), but shared: a Job's pods arriving together before the informer
        # has their new GPR read it once
        return await self._cached(("gpr", namespace, name), lambda: self.kube.get_gpr(namespace, name), keep=False)

    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._cached(("cm", namespace, name), lambda: self.kube.get_configmap(namespace, name))

    async def access_review(self, spec: dict[str, Any]) -> bool:
        return bool((await self.kube.access_review(spec)).get("allowed"))

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.kube.get_pod(namespace, name)
        except NotFound:
            return None

    async def patch_pod(self, namespace: str, name: str, patch: Any) -> None:
        await self.kube.patch_pod(namespace, name, patch)

    async def create_gpr(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        try:  # (at most half the client's connections: see Kube._admitted)
            return await self.kube.create_gpr(namespace, body)
        except KubeAlreadyExists as exc:
            raise AlreadyExists(exc.message or "already exists") from None


# ---- AdmissionReview in and out -----------------------------------------------------------------------------
# seconds kept between our answer and the API server's deadline: it states the time left rounded up to whole
# seconds (``r.Timeout`` in k8s.io/apiserver's webhook dispatchers), and the answer needs its way back
ANSWER_MARGIN = 1.0


def _unreadable(review: dict[str, Any], endpoint: str, exc: BaseException) -> dict[str, Any]:
    """The answer when a lookup failed: refused (fail closed), 503, with the cause."""
    cause = str(exc)[:300] or type(exc).__name__
    log.warning("admission lookup failed", extra={"endpoint": endpoint, "error": cause})
    return review_response(review["uid"], False, code=503, reason="ServiceUnavailable",
                           message=f"accelstack admission could not read the cluster: {cause}")


def answer_within(timeout: str | None) -> float | None:
    """Seconds a webhook may work on a request: the API server gives the time left to its own deadline as the
    ``timeout`` query parameter of the webhook URL (``?timeout=5s`` for timeoutSeconds 5); ANSWER_MARGIN less,
    at least half of it. None when the request carries none (or an unreadable one): no deadline of ours."""
    if not timeout:
        return None
    try:
        seconds = parse_duration(timeout)
    except SpecError:
        return None
    return max(seconds / 2, seconds - ANSWER_MARGIN) if seconds > 0 else None


def _json(value: Any, status: int = 200) -> web.Response:
    """``value`` as a JSON answer (orjson: an AdmissionReview a pod is answered with is encoded per pod)."""
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")


def _bad(message: str, code: int = 400) -> web.Response:
    reason = {400: "BadRequest", 408: "Timeout", 413: "RequestEntityTooLarge"}.get(code, "BadRequest")
    return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}, status=code)


def parse_review(raw: bytes, resource: str) -> dict[str, Any]:
    """The ``request`` of an AdmissionReview for ``resource`` (``pods`` or ``gpuprovisioningrequests``);
    :class:`BadReview` saying what is wrong."""
    try:
        review = json_loads(raw)
    except BodyError as exc:
        raise BadReview(exc.message) from None
    if not isinstance(review, dict):
        raise BadReview(f"body must be an AdmissionReview object, got {type(review).__name__}")
    if review.get("apiVersion") != ADMISSION_VERSION or review.get("kind") != "AdmissionReview":
        raise BadReview(f"want apiVersion {ADMISSION_VERSION} kind AdmissionReview, got apiVersion "
                        f"{review.get('apiVersion')!r} kind {review.get('kind')!r}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReview("request: must be an object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid: must be a non-empty string")
    operation = request.get("operation")
    if operation not in ("CREATE", "UPDATE", "DELETE", "CONNECT"):
        raise BadReview(f"request.operation: must be CREATE, UPDATE, DELETE or CONNECT, got {operation!r}")
    kind = request.get("resource")
    if not isinstance(kind, dict) or not isinstance(kind.get("resource"), str):
        raise BadReview("request.resource: must be an object with a resource name")
    if kind["resource"] != resource:
        raise BadReview(f"request.resource.resource: this endpoint admits {resource}, got {kind['resource']!r}")
    for key in ("object", "oldObject"):
        value = request.get(key)
        if value is not None and not isinstance(value, dict):
            raise BadReview(f"request.{key}: must be an object or null, got {type(value).__name__}")
    if operation in ("CREATE", "UPDATE") and not isinstance(request.get("object"), dict):
        raise BadReview(f"request.object: required for {operation}")
    namespace = request.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise BadReview("request.namespace: must be a string")
    if "dryRun" in request and not isinstance(request["dryRun"], bool):
        raise BadReview("request.dryRun: must be a boolean")
    return request


def spec_written(req: dict[str, Any]) -> bool:
    """Whether a validating webhook has a spec to judge: a CREATE, or an UPDATE that changes the spec."""
    if req["operation"] not in ("CREATE", "UPDATE"):
        return False
    old = req.get("oldObject")
    return not (req["operation"] == "UPDATE" and isinstance(old, dict) and old.get("spec") == req["object"].get("spec"))


def review_response(uid: str, allowed: bool, *, patch: list[dict[str, Any]] | None = None, code: int = 0,
                    message: str = "", reason: str = "", warnings: list[str] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(orjson.dumps(patch)).decode()
    if not allowed:
        response["status"] = {"code": code or 403, "message": message, "reason": reason or "Forbidden",
                              "status": "Failure", "metadata": {}}
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": ADMISSION_VERSION, "kind": "AdmissionReview", "response": response}


def _forget(running: dict[str, Any], uid: str, _: Any) -> None:
    running.pop(uid, None)


def _gated(spec: dict[str, Any]) -> bool:
    """Whether the pod carries accelstack's scheduling gate."""
    gates = spec.get("schedulingGates")
    return isinstance(gates, list) and any(isinstance(g, dict) and g.get("name") == SCHEDULING_GATE for g in gates)


def handed_over(obj: dict[str, Any]) -> bool:
    """A pod held at accelstack's gate by a replica that does not answer the verbs, for the one that does to admit
    at once (label ``accelstack.io/direct: pending``, no GPR label, not bound, not being deleted)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    labels = meta.get("labels") or {}
    return (labels.get(DIRECT_LABEL) == HANDED_OVER and GPR_LABEL not in labels and not spec.get("nodeName")
            and not meta.get("deletionTimestamp") and _gated(spec))


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _owner_name(meta: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None]:
    """(name for the GPR, what it was made for, owner reference for the GPR or None)."""
    owners = meta.get("ownerReferences")
    if isinstance(owners, list) and owners and isinstance(owners[0], dict) and isinstance(owners[0].get("name"), str):
        owner = owners[0]
        ref = None
        if all(isinstance(owner.get(k), str) and owner.get(k) for k in ("apiVersion", "kind", "name", "uid")):
            ref = {k: owner[k] for k in ("apiVersion", "kind", "name", "uid")}
            ref["blockOwnerDeletion"] = False
        return owner["name"], f"{owner.get('kind', 'owner')}/{owner['name']}", ref
    name = meta.get("name") if isinstance(meta.get("name"), str) else ""
    if name:
        return name, f"Pod/{name}", None
    generate = meta.get("generateName")
    generate = generate if isinstance(generate, str) else ""
    return generate.rstrip("-."), f"Pod/{generate}*", None


class Webhook:
    """The two admission endpoints. ``lookup`` reaches the cluster (:class:`KubeLookup` in production).

    ``resources``: the managed resources; ``auto_gpr``: make a GPR from the namespace's default template for a
    pod without the GPR label (when the namespace names one) instead of refusing the pod; ``max_body``: the
    request-size limit in bytes; ``body_timeout``: seconds a request body may take to arrive; ``clock``: epoch
    seconds (tests pass their own)."""

    def __init__(self, lookup: Lookup, *, resources: tuple[str, ...] = (GPU, NR1), auto_gpr: bool = True,
                 max_body: int = DEFAULT_MAX_BODY, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 clock: Callable[[], float] = time.time, registry: CollectorRegistry | None = None,
                 view: ClusterView | None = None, own_namespace: str = "accelstack-system",
                 pin: Callable[[], bool] | None = None, auto_gpr_direct: bool = False) -> None:
        self.lookup = lookup
        # admit an unlabelled pod at once, with no GPR object, when nothing waits and its template asks for no
        # more than one node's free devices (only where ``pin`` says this replica's view holds every claim)
        self.auto_gpr_direct = auto_gpr_direct
        # the nodes in name order, and where each is in it, for the view's node_names_version
        self._direct_order: tuple[int, list[str], dict[str, int]] = (-1, [], {})
        self._direct_hint: dict[str, str] = {}  # resource -> the node the last direct admission chose
        # (namespace, pod name or "~" generateName, node) -> until when a reinvocation for it gets that node again
        self._direct_given: dict[tuple[str, str, str], float] = {}
        # pods held at the gate by the other replica for this one to admit at once (pod UID -> namespace, name)
        self._handed: dict[str, tuple[str, str, dict[str, Any] | None]] = {}
        self._retry_at: dict[str, float] = {}
        self._wake = asyncio.Event()
        # whether this replica pins a pod of an admitted GPR to one reserved node (it answers the verbs, so its
        # view holds every claim and pin): a pod of one node term, not one a reserved node
        self.pin = pin
        self.own_namespace = own_namespace  # no workspace may own it
        self.view = view  # the extender's informer view: GPRs looked up without an API call
        self.latency = webhook_latency(registry)
        self.bare_pods = bare_pods_counter(registry)
        self.resources = tuple(resources)
        self.auto_gpr = auto_gpr
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.clock = clock
        self.counts: dict[str, int] = {}  # "<endpoint> <outcome>" -> requests (for tests and metrics)

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    async def _serve(self, request: web.Request, resource: str, endpoint: str,
                     decide: Callable[[dict[str, Any]], Any]) -> web.StreamResponse:
        started = time.perf_counter()
        response, outcome = await self._answer(request, resource, endpoint, decide)
        self._count(f"{endpoint} {outcome}")
        self.latency.labels(endpoint, outcome).observe(time.perf_counter() - started)
        return response

    async def _answer(self, request: web.Request, resource: str, endpoint: str,
                      decide: Callable[[dict[str, Any]], Any]) -> tuple[web.StreamResponse, str]:
        try:
            raw = await read_body(request, self.body_timeout, self.max_body)
        except BodyError as exc:  # the body never arrived whole: one line, no traceback
            log.warning("request refused", extra={"endpoint": endpoint, "status": exc.status, "error": exc.message,
                                                  "remote": request.remote or ""})
            return await closing(request, _bad(exc.message, exc.status)), (
                "too-large" if exc.status == 413 else "bad-body")
        try:
            review = parse_review(raw, resource)
        except BadReview as exc:
            return _bad(str(exc)), "bad-request"
        allowed = answer_within(request.query.get("timeout"))
        deadline = asyncio.timeout(allowed)
        try:
            async with deadline:
                answer = await decide(review)
        except BadReview as exc:
            return _bad(str(exc)), "bad-request"
        except TimeoutError as exc:
            if not deadline.expired():  # a lookup's own timeout: as any failed lookup
                return _json(_unreadable(review, endpoint, exc)), "denied"
            # ours: answer while the API server still listens, with a reason, rather than let it time out
            # ("context deadline exceeded"); a GPR create that was under way may still land, and an automatic
            # GPR whose pod was never created is deleted by the controller
            log.warning("admission deadline", extra={"endpoint": endpoint, "seconds": allowed})
            answer = review_response(review["uid"], False, code=503, reason="ServiceUnavailable", message=(
                f"accelstack admission could not finish within the webhook's timeout ({request.query['timeout'][:16]}): "
                "the API server answered its calls too slowly; retry (a workload controller retries on its own)"))
            return _json(answer), "deadline"
        except (ApiError, ClientError, OSError) as exc:  # a lookup failed: fail closed
            answer = _unreadable(review, endpoint, exc)
        except Exception as exc:  # a bug: refuse this one request and say so, never a 500 or a crash
            log.exception("admission failed", extra={"endpoint": endpoint})
            answer = review_response(review["uid"], False, code=500, reason="InternalError",
                                     message=f"accelstack admission failed: {type(exc).__name__}: {str(exc)[:300]}")
        return _json(answer), "allowed" if answer["response"]["allowed"] else "denied"

    async def mutate_pods(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "pods", "mutate-pods", self._mutate_pod)

    async def validate_gprs(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, GPR_PLURAL, "validate-gprs", self._validate_gpr)

    # ---- pods ------------------------------------------------------------------------------------------------
    async def _mutate_pod(self, req: dict[str, Any]) -> dict[str, Any]:
        uid = req["uid"]
        if req["operation"] != "CREATE" or req.get("subResource"):
            return review_response(uid, True)
        pod = req["object"]
        meta = pod.get("metadata") if pod.get("metadata") is not None else {}
        spec = pod.get("spec")
        if not isinstance(meta, dict):
            raise BadReview("request.object.metadata: must be an object")
        if not isinstance(spec, dict):
            raise BadReview("request.object.spec: must be an object")
        for key in ("containers", "initContainers"):
            value = spec.get(key)
            if value is not None and (not isinstance(value, list) or not all(isinstance(c, dict) for c in value)):
                raise BadReview(f"request.object.spec.{key}: must be a list of objects")
            for i, container in enumerate(value or []):
                res = container.get("resources")
                if res is not None and (not isinstance(res, dict) or any(
                        res.get(k) is not None and not isinstance(res.get(k), dict) for k in ("requests", "limits"))):
                    raise BadReview(f"request.object.spec.{key}[{i}].resources: requests and limits must be maps")
        try:
            wanted = pod_requests(spec, self.resources)
        except ValueError as exc:
            return review_response(uid, False, code=422, reason="Invalid", message=f"pod resources: {exc}")
        if not wanted:
            return review_response(uid, True)
        namespace = req.get("namespace") or meta.get("namespace") or "default"
        if len(wanted) > 1:
            return review_response(uid, False, code=403, message=(
                f"the pod requests {' and '.join(sorted(wanted))}; a GPR reserves one resource, so a pod may request "
                "only one managed resource"))
        ((resource, count),) = wanted.items()
        labels = meta.get("labels")
        if labels is not None and not isinstance(labels, dict):
            raise BadReview("request.object.metadata.labels: must be a map")
        gpr_name = (labels or {}).get(GPR_LABEL)
        warnings: list[str] = []
        if gpr_name is not None:
            if not isinstance(gpr_name, str) or not _NAME.match(gpr_name) or len(gpr_name) > MAX_NAME:
                return review_response(uid, False, code=422, reason="Invalid", message=(
                    f"label {GPR_LABEL}: {gpr_name!r} is not a GPR name (lower-case DNS name, at most "
                    f"{MAX_NAME} characters)"))
            denied = await self._check_link(uid, namespace, gpr_name, resource, count, warnings)
            if denied is not None:
                return denied
        else:
            if (self.auto_gpr_direct and (labels or {}).get(DIRECT_LABEL) == HANDED_OVER and _gated(spec)
                    and not (self.pin is not None and self.pin())):
                return review_response(uid, True)  # handed over already (reinvoked): the binder admits it
            made = await self._auto_gpr(req, namespace, meta, resource, count, warnings)
            if isinstance(made, dict):
                return made
            if isinstance(made, Direct):
                self.bare_pods.labels("admitted" if made.node else "held").inc()
                return review_response(uid, True, patch=self._direct_patch(meta, spec, made), warnings=warnings)
            gpr_name = made
        patch: list[dict[str, Any]] = []
        if labels is None:
            patch.append({"op": "add", "path": "/metadata/labels", "value": {GPR_LABEL: gpr_name}})
        elif GPR_LABEL not in labels:
            patch.append({"op": "add", "path": f"/metadata/labels/{_escape(GPR_LABEL)}", "value": gpr_name})
        gates = spec.get("schedulingGates")
        if gates is not None and not isinstance(gates, list):
            raise BadReview("request.object.spec.schedulingGates: must be a list")
        held = self._reserved(namespace, gpr_name, resource)
        already_gated = isinstance(gates, list) and any(isinstance(g, dict) and g.get("name") == SCHEDULING_GATE
                                                        for g in gates)
        if spec.get("nodeName"):
            warnings.append(f"the pod names its node ({spec['nodeName']}), so it cannot be held by the scheduling "
                            f"gate {SCHEDULING_GATE}; its devices are not reserved through GPR {gpr_name}")
        elif held and not already_gated and self._can_run_on(spec, held):
            # its GPR is admitted already (a Job's pods, a restart): no gate, straight to the reserved nodes (a pod
            # that cannot run on any of them is gated instead: the controller moves a GPR none of whose pods has
            # run to where its pods can, or says why it cannot)
            affinity = spec.get("affinity")
            one = pinned_node(affinity)  # called again (reinvoked) for a pod it pinned: the same pin, not a second
            if one not in held:
                one = self._pin_to(namespace, gpr_name, resource, count, spec, held) \
                    if self.pin is not None and not req.get("dryRun") and self.pin() else ""
            nodes = [one] if one else held
            patch += narrow_affinity(affinity if isinstance(affinity, dict) else None, nodes, self._hostnames(nodes))
        elif gates is None:
            patch.append({"op": "add", "path": "/spec/schedulingGates", "value": [{"name": SCHEDULING_GATE}]})
        elif not any(isinstance(g, dict) and g.get("name") == SCHEDULING_GATE for g in gates):
            patch.append({"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": SCHEDULING_GATE}})
        return review_response(uid, True, patch=patch, warnings=warnings)

    def _can_run_on(self, spec: dict[str, Any], nodes: list[str], waiting: bool = False) -> bool:
        """Whether kube-scheduler's own filters (taints, nodeSelector, node affinity; CPU and memory beside what the
        pods bound there request) let the pod go to one of ``nodes``, as the informer holds them, the node
        lifecycle's passing taints aside (as the controller judges where a GPR may go); true when that cannot be
        judged: no view, no such node yet. ``waiting``: count the CPU and memory of the pods admitted directly to a
        node and not bound there yet too."""
        known = self.view.nodes if self.view is not None else {}
        views = [v for n in nodes if (v := known.get(n)) is not None]
        constraints = Constraints.of_spec(spec)
        if not views or constraints is None or self.view is None:
            return True
        cpu, mem = host_requests(spec)
        used = self.view.host_used
        for v in views:
            if why_not(constraints, v, lifecycle=False):  # a cordon, a pressure: passes
                continue
            if v.host is None or not (cpu or mem):
                return True
            have = used.get(v.name, (0, 0))
            if waiting:
                more = self.view.pinned_host(v.name)
                have = (have[0] + more[0], have[1] + more[1])
            if have[0] + cpu <= v.host[0] and have[1] + mem <= v.host[1]:
                return True
        return False

    def _pin_to(self, namespace: str, gpr_name: str, resource: str, count: int, spec: dict[str, Any],
                held: list[str]) -> str:
        """The reserved node a new pod of the GPR is pinned to, "" for none (narrowed to all of them then): the one
        whose share of the GPR has least left that still fits the pod (as the filter picks), counting its bound
        pods, the pods in flight and the pods pinned there already (those this webhook pinned and has not seen
        yet too), among the nodes the pod can run on; its share there is the pod's from now on."""
        view = self.view
        key = f"{namespace}/{gpr_name}"
        g = view.gprs.get(key) if view is not None else None
        if view is None or g is None:
            return ""
        fits: list[tuple[int, str]] = []
        for name in held:
            node = view.nodes.get(name)
            if node is None or node.health_reason(resource) or node.ledger_error:
                continue
            left = (g.reservation.get(name, 0) - node.used_by.get((key, resource), 0)
                    - view.claimed_share(name, key, resource) - view.pinned_share(name, key, resource))
            if left >= count:
                fits.append((left, name))
        for _, name in sorted(fits):
            if self._can_run_on(spec, [name]):
                view.pin_ahead(name, key, {resource: count})
                return name
        return ""

    def _hostnames(self, nodes: list[str]) -> dict[str, str]:
        """The nodes' ``kubernetes.io/hostname`` labels, as the informer holds them."""
        known = self.view.nodes if self.view is not None else {}
        return {n: node.labels.get(HOSTNAME_LABEL, "") for n in nodes if (node := known.get(n)) is not None}

    def _reserved(self, namespace: str, gpr_name: str, resource: str) -> list[str]:
        """The nodes reserved for the GPR when the informer says it is Admitted or Running, else []."""
        seen = self.view.gprs.get(f"{namespace}/{gpr_name}") if self.view is not None else None
        if seen is None or seen.phase not in ("Admitted", "Running") or seen.resource != resource:
            return []
        return sorted(seen.reservation)

    async def _check_link(self, uid: str, namespace: str, gpr_name: str, resource: str, count: int,
                          warnings: list[str]) -> dict[str, Any] | None:
        """A labelled pod: refuse it when its GPR can never hold it; warn when the GPR is missing or finished."""
        seen = self.view.gprs.get(f"{namespace}/{gpr_name}") if self.view is not None else None
        if seen is not None:  # what the informer holds: no API call on the admission path
            if seen.resource != resource:
                return review_response(uid, False, code=403, message=(
                    f"the pod requests {resource} but GPR {namespace}/{gpr_name} reserves {seen.resource}"))
            if count > seen.devices:
                return review_response(uid, False, code=403, message=(
                    f"the pod requests {count} {resource} but GPR {namespace}/{gpr_name} reserves "
                    f"{seen.devices} per node; raise spec.devicesPerNode or lower the pod's request"))
            if seen.phase in ("Complete", "Cancelled", "Failed"):
                warnings.append(f"GPR {namespace}/{gpr_name} has finished; the pod stays gated")
            return None
        try:
            gpr = await self.lookup.get_gpr(namespace, gpr_name)
        except Exception as exc:  # only a check: the controller holds the pod until its GPR is admitted anyway
            warnings.append(f"could not check GPR {namespace}/{gpr_name}: {str(exc)[:200]}")
            return None
        if gpr is None:
            warnings.append(f"GPR {namespace}/{gpr_name} does not exist (yet); the pod stays gated until it is "
                            "created and admitted")
            return None
        try:
            g = from_object(gpr, self.clock())
        except SpecError as exc:
            warnings.append(f"GPR {namespace}/{gpr_name} is invalid ({exc}); the pod stays gated")
            return None
        if g.resource != resource:
            return review_response(uid, False, code=403, message=(
                f"the pod requests {resource} but GPR {namespace}/{gpr_name} reserves {g.resource}"))
        if count > g.devices_per_node:
            return review_response(uid, False, code=403, message=(
                f"the pod requests {count} {resource} but GPR {namespace}/{gpr_name} reserves "
                f"{g.devices_per_node} per node; raise spec.devicesPerNode or lower the pod's request"))
        if is_terminal(gpr):
            warnings.append(f"GPR {namespace}/{gpr_name} has finished; the pod stays gated")
        return None

    async def _auto_gpr(self, req: dict[str, Any], namespace: str, meta: dict[str, Any], resource: str, count: int,
                        warnings: list[str]) -> str | dict[str, Any] | Direct:
        """The GPR name for an unlabelled pod (made from the default template), a refusal, or with
        ``auto_gpr_direct`` the pod's admission at once without a GPR (:meth:`_direct_node`)."""
        uid = req["uid"]
        how = (f"label the pod with {GPR_LABEL}: <name of an existing GPUProvisioningRequest in {namespace}>")
        if not self.auto_gpr:
            return review_response(uid, False, code=403, message=(
                f"pods requesting {resource} must belong to a GPR: {how} (automatic GPRs are disabled)"))
        ns = await self.lookup.get_namespace(namespace)
        annotation = ((ns or {}).get("metadata", {}).get("annotations") or {}).get(DEFAULT_TEMPLATE_ANNOTATION)
        ws = await self._workspace_of(namespace, ns)
        bindings = await self.lookup.list_bindings()
        workload = await self._workload_labels(namespace, meta, warnings) if needs_owner_labels(bindings) else None
        choice = choose_template(bindings, namespace, ws, workload, annotation if isinstance(annotation, str) else None)
        if choice is None:
            return review_response(uid, False, code=403, message=(
                f"pods requesting {resource} must belong to a GPR: {how}, or set the namespace annotation "
                f"{DEFAULT_TEMPLATE_ANNOTATION}: <GPRTemplate name> so one is made for them (or bind a template "
                "with a GPRTemplateBinding)"))
        template_name = choice.template
        template = await self.lookup.get_template(choice.namespace, template_name)
        if template is None:
            if not choice.binding and choice.namespace == namespace:
                return review_response(uid, False, code=403, message=(
                    f"namespace {namespace} names the default template {template_name!r} "
                    f"({DEFAULT_TEMPLATE_ANNOTATION}), but there is no GPRTemplate {namespace}/{template_name}: "
                    f"create it, or {how}"))
            return review_response(uid, False, code=403, message=(
                f"{choice.why} names the template {template_name!r}, but there is no GPRTemplate "
                f"{choice.namespace}/{template_name}: create it, or {how}"))
        try:
            spec = template_spec(template)
            unsupported = cluster_refusal(GPR(name=f"{namespace}/{template_name}", **check_spec(spec)))
        except SpecError as exc:
            return review_response(uid, False, code=403, message=f"default template is not a valid GPR spec: {exc}")
        if unsupported:
            return review_response(uid, False, code=403, message=(
                f"default template {template_name!r} cannot make a GPR on a cluster: {unsupported}"))
        name, made_for, owner_ref = _owner_name(meta)
        if len(name) > MAX_NAME:  # keep it a valid label value: shorten, with a hash of the whole name
            digest = hashlib.sha256(name.encode()).hexdigest()[:6]
            name = f"{name[:MAX_NAME - 7].rstrip('-.')}-{digest}"
        if not name or not _NAME.match(name):
            return review_response(uid, False, code=403, message=(
                f"cannot name a GPR for this pod (owner or pod name {name!r}): {how}"))
        # the template gives the shape; the pod's request gives the resource and the count
        spec["resource"] = resource
        spec["devicesPerNode"] = max(count, int(spec.get("devicesPerNode", 1)))
        try:
            check_spec(spec)
        except SpecError as exc:
            return review_response(uid, False, code=403, message=f"GPR from template {template_name!r}: {exc}")
        # one look in the informer's view, no API call; a GPR it has not seen yet answers AlreadyExists below
        # (listing the namespace here made each pod creation cost O(GPRs): webhook timeouts under load)
        if self.view is not None and f"{namespace}/{name}" in self.view.gprs:
            warnings.append(f"linked to the existing GPR {namespace}/{name}")
            return name
        if req.get("dryRun"):
            warnings.append(f"dry run: GPR {namespace}/{name} would be created from template {template_name!r}")
            return name
        annotations = {CREATED_FOR_ANNOTATION: made_for, DEFAULT_TEMPLATE_ANNOTATION: template_name}
        if choice.binding:
            annotations[BINDING_ANNOTATION] = choice.binding
        body = new_object(namespace, name, spec, labels={AUTO_LABEL: "true"}, annotations=annotations)
        if owner_ref is not None:
            body["metadata"]["ownerReferences"] = [owner_ref]
        # judged here, as /validate-gprs would judge it (namespace and workspace limits): the shipped webhook
        # configuration does not send the extender's own automatic GPRs back to it (a round trip a pod less)
        verdict = (await self._validate_gpr({"uid": uid, "operation": "CREATE", "object": body,
                                             "namespace": namespace, "name": name}))["response"]
        if not verdict["allowed"]:
            return review_response(uid, False, code=403, message=(
                f"could not create GPR {namespace}/{name} from template {template_name!r}: "
                f"{verdict['status']['message']}"))
        pod_spec = req["object"].get("spec") or {}
        if self.auto_gpr_direct and self.pin is not None:
            pinning = self.pin()
            node = self._direct_node(namespace, ns, ws, spec, pod_spec, meta, resource, count, pinning)
            if node:
                exit_s = parse_duration(spec["exitDuration"]) if spec.get("exitDuration") else None
                deadline = math.ceil(exit_s) if exit_s else None
                if not pinning:  # this replica's view lacks the binder's pins: the binder pins it (hand_offs)
                    warnings.append(f"held for admission at once without a GPR: nothing waits for {resource} and "
                                    f"template {template_name!r} allows it; the replica that answers the verbs "
                                    "pins it to a node (accelstack-extender --auto-gpr-direct)")
                    return Direct("", template_name, deadline)
                warnings.append(f"admitted at once on node {node} without a GPR: nothing waits for {resource} and "
                                f"template {template_name!r} allows it (accelstack-extender --auto-gpr-direct)")
                log.debug("admitted a pod at once without a GPR", extra={"pod": f"{namespace}/{made_for}",
                                                                         "node": node, "template": template_name})
                return Direct(node, template_name, deadline)
        try:
            await self.lookup.create_gpr(namespace, body)
        except AlreadyExists:
            warnings.append(f"linked to the existing GPR {namespace}/{name}")
            return name
        except ApiError as exc:
            return review_response(uid, False, code=403, message=(
                f"could not create GPR {namespace}/{name} from template {template_name!r}: {exc.message or exc}"))
        warnings.append(f"created GPR {namespace}/{name} from template {template_name!r}"
                        + (f" ({choice.why})" if choice.binding or choice.namespace != namespace else ""))
        log.info("created GPR from default template", extra={"gpr": f"{namespace}/{name}", "for": made_for})
        return name

    def _direct_node(self, namespace: str, ns: dict[str, Any] | None, ws: Workspace | None, spec: dict[str, Any],
                     pod_spec: dict[str, Any], meta: dict[str, Any], resource: str, count: int,
                     commit: bool = True) -> str:
        """The node an unlabelled pod is admitted to at once, without a GPR, or "" (a GPR is made as usual).

        Only what a GPR made for it would be given straight away, and only where a GPR would add nothing: this
        replica's view holds every claim and pin (``pin``); no GPR of the resource waits for devices (Queued, but
        for a quota, too big for the cluster or backing off: the controller admits others past those), so nobody
        is passed; the pod has no node name and no scheduling gate of its own; the template asks for one node of
        whole devices and is not preemptible (nothing could evict the pod: it has no GPR), with no idle
        enforcement, no retry on failure and no device-memory bound; neither the namespace nor its workspace
        limits unfinished GPRs or devices (they count GPRs); and a node the pod can run on (healthy, of a model
        the template allows, its taints, selectors, CPU and memory, those of the pods admitted there and not bound
        yet counted) has ``count`` devices free of reservations, bound pods, pods in flight and pods pinned there.
        The nodes are looked at from the last one chosen on (packing it first), at most :data:`DIRECT_SCAN` of
        them. The node's devices are the pod's from now on (a pin ahead, as for a pod of an admitted GPR). Not for
        a dry run (the caller makes none). Called again for a pod it admitted (reinvoked after a later webhook changed
        it: labelled, pinned to the node it gave a pod of that name in that namespace within the pin's lifetime),
        the same node and no second pin; a pod that comes labelled and pinned otherwise is judged afresh.
        ``commit`` false (a replica that does not answer the verbs): only whether its view has such a node, nothing
        pinned: the pod is handed over to the binder (:meth:`hand_offs`), whose view holds every pin."""
        view = self.view
        gates = pod_spec.get("schedulingGates")
        if (view is None or pod_spec.get("nodeName") or view.waiting.get(resource) or not view.nodes
                or (gates and any(not isinstance(g, dict) or g.get("name") != SCHEDULING_GATE for g in gates))):
            return ""
        try:
            g = check_spec(spec)
        except SpecError:
            return ""
        if (g["node_count"] != 1 or g["milli_per_device"] != MILLI_PER_DEVICE or g["preemptible"]
                or g["enforce_idle_timeout"] or g["requeue_on_failure"] or g["memory_mib_per_device"]):
            return ""
        annotations = ((ns or {}).get("metadata", {}).get("annotations") or {})
        if MAX_GPRS_ANNOTATION in annotations:
            return ""
        if ws is not None and (ws.policy.max_gprs is not None
                               or any(q.resource == resource for q in ws.policy.devices)):
            return ""
        who = (namespace, str(meta.get("name") or "~" + str(meta.get("generateName") or "")))
        own = pinned_node(pod_spec.get("affinity")) if (meta.get("labels") or {}).get(DIRECT_LABEL) == "true" else ""
        if commit and own and self._direct_given.get((*who, own), 0.0) > time.monotonic():
            return own  # reinvoked for a pod of this name it admitted there (one of the same namespace alone)
        models = set(g["models"])
        nodes = view.nodes
        now = time.monotonic()
        names_version, order, where = self._direct_order
        if names_version != view.node_names_version:  # a node came or went: the order is made again
            order = sorted(nodes)
            where = {name: i for i, name in enumerate(order)}
            self._direct_order = (view.node_names_version, order, where)
        start = where.get(self._direct_hint.get(resource, ""), 0)
        for k in range(min(DIRECT_SCAN, len(order))):
            name = order[(start + k) % len(order)]
            node = nodes.get(name)
            if (node is None or node.closed or node.ledger_error or node.health_reason(resource)
                    or (models and model_of(node, resource) not in models)):
                continue
            free = (view.free_for(node, resource, "") - view.claimed_share(name, "", resource)
                    - view.pinned_share(name, "", resource))
            if free < count or not self._can_run_on(pod_spec, [name], waiting=True):
                continue
            if not commit:
                return name
            view.pin_ahead(name, "", {resource: count}, host_requests(pod_spec))
            self._direct_hint[resource] = name
            if len(self._direct_given) > 4096:
                self._direct_given = {k: t for k, t in self._direct_given.items() if t > now}
            self._direct_given[(*who, name)] = now + view.pin_ttl
            return name
        return ""

    def _direct_patch(self, meta: dict[str, Any], spec: dict[str, Any], made: Direct) -> list[dict[str, Any]]:
        """JSON-patch ops for a pod admitted at once: the label that says so, the template's name, its node
        affinity narrowed to the node (our gate off, should it carry it), and the template's exitDuration as
        ``activeDeadlineSeconds`` (the kubelet ends it then, as the controller ends a GPR; a shorter one of the
        pod's own stays). Handed over (no node): the label says ``pending`` and the pod gets our gate instead."""
        labels = meta.get("labels")
        value = "true" if made.node else HANDED_OVER
        patch: list[dict[str, Any]] = []
        if labels is None:
            patch.append({"op": "add", "path": "/metadata/labels", "value": {DIRECT_LABEL: value}})
        else:
            patch.append({"op": "add", "path": f"/metadata/labels/{_escape(DIRECT_LABEL)}", "value": value})
        gates = spec.get("schedulingGates") or []
        if made.node and _gated(spec):
            patch.append({"op": "replace", "path": "/spec/schedulingGates",
                          "value": [g for g in gates if g.get("name") != SCHEDULING_GATE]})
        elif not made.node and not _gated(spec):
            patch.append({"op": "add", "path": "/spec/schedulingGates",
                          "value": [*gates, {"name": SCHEDULING_GATE}]})
        annotations = meta.get("annotations")
        if not isinstance(annotations, dict):
            patch.append({"op": "add", "path": "/metadata/annotations",
                          "value": {DEFAULT_TEMPLATE_ANNOTATION: made.template}})
        else:
            patch.append({"op": "add", "path": f"/metadata/annotations/{_escape(DEFAULT_TEMPLATE_ANNOTATION)}",
                          "value": made.template})
        affinity = spec.get("affinity")
        if made.node:
            patch += narrow_affinity(affinity if isinstance(affinity, dict) else None, [made.node],
                                     self._hostnames([made.node]))
        own = spec.get("activeDeadlineSeconds")
        if made.deadline is not None and not (isinstance(own, int) and 0 < own <= made.deadline):
            patch.append({"op": "add", "path": "/spec/activeDeadlineSeconds", "value": made.deadline})
        return patch

    # ---- pods handed over to the binder ------------------------------------------------------------------------
    def on_pod(self, kind: str, obj: dict[str, Any]) -> None:
        """The extender's pod informer: keep the pods handed over for admission at once, as the event shows them
        (every replica keeps them, so a new binder starts with them)."""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if kind != "DELETED" and handed_over(obj):
            self._handed[uid] = (str(meta.get("namespace") or ""), str(meta.get("name") or ""), obj)
            self._wake.set()
        else:
            self._handed.pop(uid, None)
            self._retry_at.pop(uid, None)

    async def hand_offs(self, stop: asyncio.Event, every: float = 5.0, at_once: int = HAND_OFFS_AT_ONCE) -> None:
        """While this replica pins (it answers the verbs): admit the pods the other replica's webhook held at the
        gate for it (:func:`handed_over`), each judged as the webhook judges a new pod: pinned to a node with the
        gate lifted in one patch, or given a GPR (made or linked, the pod relabelled; the controller admits it
        and lifts the gate). Up to ``at_once`` pods are under way together (their patches in flight; the
        decisions, made between two awaits, see each other's pins). Level-triggered: the pods come from the
        informer's events and, every ``every`` seconds, from the view itself (a relist brings no events: those
        are read afresh); one that fails is tried again ``every`` seconds later."""
        scanned = -math.inf
        slots = asyncio.Semaphore(at_once)
        running: dict[str, asyncio.Task[None]] = {}
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), every)
                self._wake.clear()
                if self.pin is None or not self.pin() or self.view is None:
                    continue
                now = time.monotonic()
                if now - scanned >= every:
                    scanned = now
                    for uid, p in self.view.pods.items():
                        if (p.labels.get(DIRECT_LABEL) == HANDED_OVER and not p.gpr and not p.node and p.live
                                and not p.terminating and SCHEDULING_GATE in p.gates):
                            self._handed.setdefault(uid, (p.namespace, p.name, None))
                for uid, (namespace, name, obj) in list(self._handed.items()):
                    if uid in running or self._retry_at.get(uid, 0.0) > now:
                        continue
                    task = asyncio.create_task(self._settle(uid, namespace, name, obj, slots, every))
                    running[uid] = task
                    task.add_done_callback(functools.partial(_forget, running, uid))
        finally:
            for task in list(running.values()):
                task.cancel()

    async def _settle(self, uid: str, namespace: str, name: str, obj: dict[str, Any] | None,
                      slots: asyncio.Semaphore, every: float) -> None:
        async with slots:
            try:
                done = await self._hand_off(uid, namespace, name, obj)
            except Exception as exc:  # an API error (a test op failed: the pod changed): tried again later
                done, why = False, str(exc)[:300]
            else:
                why = "" if done else "neither admitted at once nor given a GPR now"
        held = self._handed.get(uid)
        if done:
            if held is not None and held[2] is obj:  # an event since brought a newer version: that one is due
                self._handed.pop(uid, None)
            self._retry_at.pop(uid, None)
        else:
            if held is not None:
                self._handed[uid] = (namespace, name, None)  # read afresh next time
            self._retry_at[uid] = time.monotonic() + every
            log.warning("a pod held for admission at once waits", extra={"pod": f"{namespace}/{name}", "error": why})

    async def _hand_off(self, uid: str, namespace: str, name: str, obj: dict[str, Any] | None = None) -> bool:
        """One handed-over pod (``obj``: as an event showed it; None: read afresh): True when it is settled
        (admitted at once, given a GPR, or no longer waiting)."""
        if obj is None:
            obj = await self.lookup.get_pod(namespace, name)
        if obj is None or (obj.get("metadata") or {}).get("uid") != uid or not handed_over(obj):
            return True
        meta, spec = obj["metadata"], obj.get("spec") or {}
        wanted = pod_requests(spec, self.resources)
        if len(wanted) != 1:
            return True  # the webhook refuses such pods: it was not handed over by it
        ((resource, count),) = wanted.items()
        req = {"uid": f"hand-off-{uid}", "operation": "CREATE", "namespace": namespace, "object": obj}
        made = await self._auto_gpr(req, namespace, meta, resource, count, [])
        if isinstance(made, Direct) and made.node:
            view = pod_view(obj, self.resources)
            patch = ungate_patch(view, [made.node], SCHEDULING_GATE, self._hostnames([made.node])) \
                if view is not None else None
            if patch is None:
                return True
            patch.append({"op": "replace", "path": f"/metadata/labels/{_escape(DIRECT_LABEL)}", "value": "true"})
            await self.lookup.patch_pod(namespace, name, patch)
            self.bare_pods.labels("handed-admitted").inc()
            log.debug("admitted a handed-over pod at once", extra={"pod": f"{namespace}/{name}", "node": made.node})
            return True
        if isinstance(made, str):
            await self.lookup.patch_pod(namespace, name, {"metadata": {"labels": {GPR_LABEL: made, DIRECT_LABEL: None}}})
            self.bare_pods.labels("handed-gpr").inc()
            return True
        if isinstance(made, dict):
            raise RuntimeError(str(((made.get("response") or {}).get("status") or {}).get("message") or made))
        return False

    async def _workspace_of(self, namespace: str, ns: dict[str, Any] | None) -> Workspace | None:
        """The namespace's workspace: its label names one that lists it (cached lookups, no list)."""
        label = workspace_label(ns)
        if not label:
            return None
        return member_of(ns or {"metadata": {"name": namespace}}, await self.lookup.get_workspace(label))

    async def _workload_labels(self, namespace: str, meta: dict[str, Any],
                               warnings: list[str]) -> dict[str, str] | None:
        """Labels of the pod's owning workload (a ReplicaSet's Deployment, a Job's CronJob), the pod's own
        when it has no owner; None (selectors match nothing) when the owner cannot be read."""
        owners = meta.get("ownerReferences")
        if not isinstance(owners, list) or not owners or not isinstance(owners[0], dict):
            labels = meta.get("labels")
            return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}
        ref = owners[0]
        obj: dict[str, Any] | None = None
        for _ in range(2):  # the owner, then its own owner when it is a ReplicaSet or a Job made by a CronJob
            try:
                obj = await self.lookup.get_owner(namespace, str(ref.get("apiVersion") or ""),
                                                  str(ref.get("kind") or ""), str(ref.get("name") or ""))
            except ApiError as exc:
                warnings.append(f"could not read the pod's owner {ref.get('kind')}/{ref.get('name')} for "
                                f"GPRTemplateBinding selectors: {exc.message or exc}"[:300])
                return None
            if obj is None:
                warnings.append(f"the pod's owner {ref.get('kind')}/{ref.get('name')} could not be read; "
                                "GPRTemplateBinding workload selectors were not applied")
                return None
            up = (obj.get("metadata") or {}).get("ownerReferences")
            if ref.get("kind") in ("ReplicaSet", "Job") and isinstance(up, list) and up and isinstance(up[0], dict) \
                    and up[0].get("kind") in ("Deployment", "CronJob"):
                ref = up[0]
                continue
            break
        labels = ((obj or {}).get("metadata") or {}).get("labels")
        return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}

    async def _unfinished(self, namespaces: Collection[str], exclude: str) -> int:
        """Unfinished GPRs across ``namespaces``, ``exclude`` (namespace/name) left out: from the informer's view
        when there is one (no API call: a burst of automatic GPRs in a namespace with a limit would otherwise list
        the namespace once per GPR, on the path that answers the API server), else a list per namespace. Either
        can miss a GPR created at the same moment, so a burst may go over by the GPRs in flight; a ResourceQuota
        on ``count/gpuprovisioningrequests.accelstack.io`` is exact (but counts finished GPRs too)."""
        if self.view is not None:
            return self.view.unfinished_in(namespaces, exclude)
        phases = []
        for ns in namespaces:
            phases += [str((o.get("status") or {}).get("phase") or "Queued") for o in await self.lookup.list_gprs(ns)
                       if f"{ns}/{(o.get('metadata') or {}).get('name')}" != exclude]
        return unfinished(phases)

    # ---- GPRs ------------------------------------------------------------------------------------------------
    async def _validate_gpr(self, req: dict[str, Any]) -> dict[str, Any]:
        uid = req["uid"]
        if not spec_written(req):
            return review_response(uid, True)  # metadata or status only: limits set later must not block them
        obj = req["object"]
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            raise BadReview("request.object.metadata: must be an object")
        namespace = req.get("namespace") or meta.get("namespace") or "default"
        obj = {**obj, "metadata": {**meta, "namespace": namespace}}
        if not meta.get("name") and isinstance(req.get("name"), str) and req["name"]:
            obj["metadata"]["name"] = req["name"]
        if not obj["metadata"].get("name"):  # generateName: the name may not be chosen yet; the spec is what counts
            obj["metadata"]["name"] = str(meta.get("generateName") or "")[:MAX_NAME - 5] + "xxxxx"  # as the server
        try:
            g = from_object(obj, self.clock())
        except SpecError as exc:
            return review_response(uid, False, code=422, reason="Invalid", message=str(exc))
        unsupported = cluster_refusal(g)  # accepted by the core (the simulator), not on a cluster
        if unsupported:
            return review_response(uid, False, code=422, reason="Invalid", message=unsupported)
        ns = await self.lookup.get_namespace(namespace)
        annotations = ((ns or {}).get("metadata", {}).get("annotations") or {})
        where = f"namespace {namespace}"
        text = annotations.get(PRIORITY_RANGE_ANNOTATION)
        if text is not None:
            m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(text))
            if m is None or int(m.group(1)) > int(m.group(2)):
                return review_response(uid, False, code=403, message=(
                    f"{where} annotation {PRIORITY_RANGE_ANNOTATION}: {text!r} is not LOW-HIGH (e.g. \"1-200\"); "
                    "ask the namespace's administrator to fix it"))
            lo, hi = int(m.group(1)), int(m.group(2))
            if not lo <= g.priority <= hi:
                return review_response(uid, False, code=403, message=(
                    f"spec.priority: {g.priority} is outside {lo}-{hi}, the range {where} allows "
                    f"({PRIORITY_RANGE_ANNOTATION})"))
        text = annotations.get(MAX_EXIT_DURATION_ANNOTATION)
        if text is not None:
            try:
                limit = parse_duration(text)
            except SpecError:
                return review_response(uid, False, code=403, message=(
                    f"{where} annotation {MAX_EXIT_DURATION_ANNOTATION}: {text!r} is not a duration; ask the "
                    "namespace's administrator to fix it"))
            if g.exit_duration_s is None:
                return review_response(uid, False, code=403, message=(
                    f"spec.exitDuration: required in {where}, at most {format_duration(limit)} "
                    f"({MAX_EXIT_DURATION_ANNOTATION})"))
            if g.exit_duration_s > limit:
                return review_response(uid, False, code=403, message=(
                    f"spec.exitDuration: {format_duration(g.exit_duration_s)} is over {format_duration(limit)}, the "
                    f"most {where} allows ({MAX_EXIT_DURATION_ANNOTATION})"))
        text = annotations.get(MAX_GPRS_ANNOTATION)
        if text is not None and req["operation"] == "CREATE":
            if not str(text).strip().isdigit():
                return review_response(uid, False, code=403, message=(
                    f"{where} annotation {MAX_GPRS_ANNOTATION}: {text!r} is not a whole number; ask the "
                    "namespace's administrator to fix it"))
            limit_n = int(str(text).strip())
            live = await self._unfinished({namespace}, f"{namespace}/{obj['metadata'].get('name')}")
            if live + 1 > limit_n:
                return review_response(uid, False, code=403, message=(
                    f"{where} already has {live} unfinished GPRs, the most it allows is {limit_n} "
                    f"({MAX_GPRS_ANNOTATION}); delete finished or unneeded GPRs first"))
        # the workspace's policy applies as well (the stricter of the two wins: both must pass)
        ws = await self._workspace_of(namespace, ns)
        if ws is not None:
            count = None
            if req["operation"] == "CREATE" and ws.policy.max_gprs is not None:
                count = await self._unfinished(ws.namespaces, f"{namespace}/{obj['metadata'].get('name')}")
            refusal = gpr_refusal(g, ws, count)
            if refusal:
                return review_response(uid, False, code=403, message=refusal)
        return review_response(uid, True)

    # ---- Workspaces and GPRTemplateBindings ------------------------------------------------------------------
    async def validate_workspaces(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, WORKSPACE_PLURAL, "validate-workspaces", self._validate_workspace)

    async def validate_bindings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, BINDING_PLURAL, "validate-gprtemplatebindings", self._validate_binding)

    async def _validate_workspace(self, req: dict[str, Any]) -> dict[str, Any]:
        uid = req["uid"]
        if not spec_written(req):
            return review_response(uid, True)  # status or metadata only
        obj = req["object"]
        refusal = workspace_refusal(obj, await self.lookup.list_workspaces(), self.own_namespace)
        if refusal:
            return review_response(uid, False, code=422, reason="Invalid", message=refusal)
        # an existing namespace adopted: the writer must hold, there, what the workspace hands out
        # (workspace_admission.adoption_questions)
        names = sorted(set(parse_workspace(obj).namespaces))
        found = await asyncio.gather(*(self.lookup.get_namespace(n) for n in names))
        rules, _ = parse_templates(await self.lookup.get_configmap(self.own_namespace, ROLE_TEMPLATES))
        questions = adoption_questions(obj, dict(zip(names, found, strict=True)), rules)
        raw_user = req.get("userInfo")
        user: dict[str, Any] = raw_user if isinstance(raw_user, dict) else {}
        denied: list[Any] = []
        if questions and not on_behalf(user, self.own_namespace):
            answers = await asyncio.gather(*(self.lookup.access_review(review_spec(user, q)) for q in questions))
            denied = [q for q, ok in zip(questions, answers, strict=True) if not ok]
        refusal = adoption_refusal(user, questions, denied, self.own_namespace)
        if refusal:
            return review_response(uid, False, code=403, reason="Forbidden", message=refusal)
        return review_response(uid, True)

    async def _validate_binding(self, req: dict[str, Any]) -> dict[str, Any]:
        uid = req["uid"]
        if req["operation"] not in ("CREATE", "UPDATE"):
            return review_response(uid, True)
        obj = req["object"]
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        namespace = req.get("namespace") or meta.get("namespace") or "default"
        obj = {**obj, "metadata": {**meta, "namespace": namespace}}
        ns = await self.lookup.get_namespace(namespace)
        refusal = binding_refusal(obj, await self._workspace_of(namespace, ns))
        if refusal:
            return review_response(uid, False, code=403, message=refusal)
        return review_response(uid, True)


# (id of a registry, metric name) -> (that registry, the metric made in it): each metric once per registry
_METRICS: dict[tuple[int, str], tuple[CollectorRegistry, Any]] = {}


def _once(registry: CollectorRegistry | None, name: str, make: Callable[[CollectorRegistry], Any]) -> Any:
    """The metric ``name`` of ``registry`` (default: the global one), made by ``make`` the first time: every
    Webhook of a process shares it, as a second registration of the same name would be refused."""
    registry = registry or REGISTRY
    known = _METRICS.get((id(registry), name))
    if known is not None and known[0] is registry:
        return known[1]
    metric = make(registry)
    _METRICS[(id(registry), name)] = (registry, metric)
    return metric


def webhook_latency(registry: CollectorRegistry | None = None) -> Histogram:
    """``accelstack_webhook_request_seconds{endpoint, outcome}``, one per registry."""
    histogram: Histogram = _once(registry, "latency", lambda r: Histogram(
        "accelstack_webhook_request_seconds", "Admission webhook answer time (the API server gives up after the "
        "webhook's timeoutSeconds)", ["endpoint", "outcome"],
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r))
    return histogram


def bare_pods_counter(registry: CollectorRegistry | None = None) -> Counter:
    """``accelstack_webhook_bare_pods_total{how}``, one per registry: the pods ``--auto-gpr-direct`` admitted with no
    GPR (``admitted``: pinned by the binder's webhook; ``held``: held at the gate by another replica;
    ``handed-admitted`` / ``handed-gpr``: a held pod the binder then pinned, or gave a GPR)."""
    counter: Counter = _once(registry, "bare_pods", lambda r: Counter(
        "accelstack_webhook_bare_pods", "Pods without a GPR label the webhook admitted at once, held for the binder, "
        "or the binder then settled (--auto-gpr-direct)", ["how"], registry=r))
    return counter


def add_webhook_routes(app: web.Application, handler: Webhook) -> None:
    """``POST /mutate-pods``, ``/validate-gprs``, ``/validate-workspaces`` and ``/validate-gprtemplatebindings``
    on ``app``."""
    app.router.add_post("/mutate-pods", handler.mutate_pods)
    app.router.add_post("/validate-gprs", handler.validate_gprs)
    app.router.add_post("/validate-workspaces", handler.validate_workspaces)
    app.router.add_post("/validate-gprtemplatebindings", handler.validate_bindings)
