"""A Kubernetes API-server peer for tests: the REST and watch protocol for the resources the stack uses, and
the ways a real kube-apiserver misbehaves, on demand.

It speaks the real wire protocol over real HTTP (aiohttp), so the official clients (``kubernetes_asyncio``)
talk to it unchanged. Product code never imports this.

Protocol
--------
- paths ``/api/v1/...`` (core) and ``/apis/<group>/<version>/...``, namespaced and cluster-scoped (any
  resource, e.g. ``coordination.k8s.io/v1`` leases), subresources ``status``, ``binding`` (sets
  ``spec.nodeName`` once, honours a UID precondition; a pod being deleted or still gated: 500, as the real
  server's plain errors answer), ``eviction`` (deletes the pod, or 429 while ``peer.pdb_blocks`` names it),
  TokenReview/SubjectAccessReview (``peer.tokens``, ``peer.grants``);
- pods: graceful deletion when ``peer.pod_grace`` is set (seconds): DELETE or an eviction of a bound pod that
  has not finished sets ``deletionTimestamp`` and ``deletionGracePeriodSeconds`` (MODIFIED) and the pod goes
  (DELETED) ``pod_grace`` seconds later, as its kubelet confirms; unbound or finished pods go at once. The pod
  validation a real server applies to accelstack's writes (``tests/apiserver_peer/pods.py``): node field
  selectors take one value; spec updates only where Kubernetes allows them (while gated: node affinity
  narrowing, KEP-3838); 422 ``Invalid`` with the real field paths;
- custom resources of accelstack's CRDs (``manifests/crds``, ``tests/apiserver_peer/schemas.py``): unknown
  fields pruned (a ``Warning`` header each; ``fieldValidation=Strict``: 400), schema defaults applied, the
  OpenAPI schema and CEL rules (``oldSelf`` on updates) judged on creates, updates, patches and ``/status``
  writes: 422 ``Invalid`` with the API server's words. ``peer.schemas = None`` stores them as sent;
- built-in objects the controllers write (Deployments, HPAs, PDBs, NetworkPolicies, Roles, RoleBindings, ...:
  ``SCHEMA_CHECKED``) are checked against the Kubernetes OpenAPI schema (kubernetes-validate, strict) on
  creates and updates: 422 ``Invalid`` (also off with ``peer.schemas = None``);
- errors are ``Status`` objects with the real ``reason`` and ``code``;
- GET; list with ``labelSelector``/``fieldSelector`` equality terms, ``limit`` + ``continue`` (pages of one
  snapshot, ``metadata.continue`` and ``remainingItemCount``; a token answers 410 ``Expired`` after
  ``peer.compact()``, ``peer.expire_continue_tokens()`` or ``peer.continue_ttl`` seconds; a token this server
  did not make: 400), ``resourceVersion`` ("" / "0": current state; N: not older than N, a future N waits
  ``peer.too_large_rv_wait`` s then 504 ``Timeout``; ``resourceVersionMatch=Exact``: only the current revision,
  older: 410 ``Expired``);
- watch (``?watch=true``): ``resourceVersion`` ""/"0" sends ADDED for every current object first; N streams
  the changes after N (older than the history: an ERROR event 410 ``Expired``; ``peer.compact()`` ends open
  watches the same way); ``timeoutSeconds`` ends the stream (default ``peer.watch_timeout`` = 30 s);
  ``allowWatchBookmarks=true``: a ``BOOKMARK`` event every ``peer.bookmark_interval`` s (default 2) whose
  object has only ``kind``, ``apiVersion`` and ``metadata.resourceVersion``; none unless asked for; with a
  label/field selector an object entering it comes as ADDED and one leaving it as DELETED;
- POST (create): ``generateName``; 409 ``AlreadyExists``; 422 ``Invalid`` without a name; a body whose
  namespace differs from the URL's: 400 ``BadRequest`` (the real checkName answer; so is PUT's name mismatch);
  custom resources get ``metadata.generation`` 1 (and, with a status subresource, their ``status`` dropped);
- PUT: a stale ``metadata.resourceVersion`` or a different ``metadata.uid``: 409 ``Conflict``;
- PATCH: ``json-patch+json``, ``merge-patch+json``, ``strategic-merge-patch+json`` (as a merge patch),
  ``apply-patch+yaml`` (server-side apply as a merge, creates when missing; needs ``fieldManager``, else 422);
- every write: ``status`` only through ``/status`` for ``peer.status_subresources`` (pods, nodes, GPRs, ...),
  ``/status`` writes change only ``status``; ``metadata.generation`` (where the object has one) +1 when
  anything outside metadata/status changed; ``metadata.managedFields`` gets an entry per (manager,
  operation, subresource) with ``manager`` = the ``fieldManager`` query parameter or, as the API server does,
  the User-Agent up to its first '/' (kubernetes_asyncio: ``OpenAPI-Generator``), ``operation``
  Update/Apply, ``time`` and ``fieldsV1`` of the fields sent; ``dryRun=All`` answers without storing (other
  values: 422);
- DELETE: ``preconditions`` (``uid``, ``resourceVersion``) answer 409 ``Conflict`` on mismatch; an object with
  ``metadata.finalizers`` gets ``deletionTimestamp`` (MODIFIED) and goes (DELETED) when a write removes the
  last finalizer; new finalizers on it: 422.
  ``peer.delete_object()`` removes at once.
- validating admission webhooks (``peer.admission.validating.append(ValidatingWebhook(name, url,
  frozenset({plural}), operations=..., timeout=5.0, failure_policy="Fail"))``): called on CREATE and UPDATE of
  the main resource (not ``/status``) with an ``admission.k8s.io/v1`` AdmissionReview (``object``,
  ``oldObject``, ``userInfo`` of the bearer token in ``peer.tokens`` or anonymous) before the object is
  stored; a refusal answers the webhook's code (400 when below) and ``admission webhook "NAME" denied the
  request: MESSAGE``; a webhook that fails or outlives its timeout answers 500 ``InternalError`` under Fail and
  lets the write through under Ignore. An update whose object changed while a webhook judged it is made again
  on the new object (as the API server's update loop does).

Test-side state: ``peer.put_object(resource_path, obj, event="ADDED"|"MODIFIED")``,
``peer.delete_object(resource_path, ns, name)``, ``peer.get(resource_path, ns, name)``, ``peer.objects``,
``peer.compact()``, ``peer.put_lease(ns, name, holder, renew_time=None, skew=0.0, duration=15,
transitions=0)`` (a Lease held by another identity; ``skew`` seconds shift ``renewTime``: -60 a dead holder,
+30 a clock ahead), ``peer.hooks["POST pods/eviction"] = fn(request, body)``.
Resource paths are ``"api/v1/pods"``, ``"apis/accelstack.io/v1alpha1/gpuprovisioningrequests"``, ...

Faults
------
``fault = peer.inject(method=None, resource=None, *, namespace=None, name=None, subresource=None, watch=None,
verb=None, <one action>, delay=0.0, times=None, when=None)`` -> ``Fault``.

Matching (None = any): ``method`` "GET"/"POST"/...; ``resource`` a plural ("gpuprovisioningrequests") or a
path; ``name=""`` only collections; ``subresource`` "status"/"binding"/"eviction" ("" only the main
resource); ``watch`` True = watches, False = everything else (``method="GET", watch=False``: get and list);
``verb`` one of get, list, watch, create, update, patch, delete, deletecollection; ``when(request) -> bool``
for anything else. The first matching fault, in injection order, takes the request.

Actions (one per fault):
- ``status=403|404|409|410|422|429|500|502|503|504`` - a ``Status`` body with the real reason and message
  (override with ``reason=``, ``message=``, ``details=``); ``retry_after=N`` adds the ``Retry-After`` header
  and ``details.retryAfterSeconds`` (what 429 and 503 carry);
- ``body="..."`` (+ ``status``, default 502; ``content_type``, default text/html) - a non-JSON answer, e.g.
  ``body=PROXY_502_HTML`` (a proxy's HTML 502);
- ``delay=seconds`` - wait, then do the action (or, alone, answer normally: a slow server);
- ``hang=True`` - never answer (no headers) until the client disconnects;
- ``half_open=True`` - a watch: 200 and headers, then silence, never closing (until the client goes);
- ``watch_error=410|500|...`` - a watch: 200, then one ``ERROR`` event (410 ``Expired``, 500
  ``InternalError``), then the stream ends;
- ``close=True`` - a watch: 200, then the stream ends at once;
- ``after=seconds`` (with half_open/watch_error/close) - the watch first streams normally that long;
- ``respond=fn(request) -> response | awaitable | None`` - anything else (None: answer normally).

``lands=True`` (a write, with ``status`` or ``hang``): the write is made all the same - with ``status``
before the error is answered, with ``hang`` once the client has given up (after, most likely, it looked
again) - as a real API server does when etcd committed and the answer timed out or was lost on the way.

Lifetime: ``times=N`` takes N requests then the fault removes itself; ``None`` until ``fault.remove()``,
``peer.clear_faults()`` or the end of ``with peer.inject(...):``. ``fault.hits`` counts the requests taken.

Examples::

    peer.inject("GET", "gpuprovisioningrequests", watch=False, status=404)       # CRD missing: list 404
    peer.inject("GET", "nodes", verb="list", status=429, retry_after=1, times=3)
    peer.inject("PUT", "leases", status=500, times=1)                           # one failed renewal
    peer.inject("PUT", "leases", hang=True)                                     # a hung renewal
    peer.inject("POST", "pods", subresource="binding", hang=True, lands=True)   # bound, answer lost
    peer.inject("GET", "pods", watch=True, half_open=True)                      # a silent watch
    peer.inject("GET", "pods", watch=True, watch_error=410, after=0.5, times=1)
    peer.inject(resource="pods", verb="list", body=PROXY_502_HTML)
    peer.inject("PATCH", "gpuprovisioningrequests", subresource="status", status=409, times=1)

Request log
-----------
``peer.requests``: ``(method, path?query)`` per request (kept for older tests). ``peer.log``: a
``RequestRecord`` per request (``method, path, query, resource, plural, namespace, name, subresource, verb,
watch, status`` (None while still being answered, 499 when the client left), ``started``/``finished``
(``time.monotonic()``), ``user_agent``, ``fault``). ``peer.calls(method, resource, *, namespace, name,
subresource, watch, verb, status, since, until)`` -> records; ``peer.count(...)`` -> int;
``peer.rate(..., window=1.0)`` -> requests/s over the last window; ``peer.max_rate(..., window=1.0,
since=peer.mark())`` -> the highest requests/s in any sliding window (a retry storm, even an old one).
"""

from tests.apiserver_peer.faults import Fault, RequestInfo, RequestRecord
from tests.apiserver_peer.server import CLUSTER_SCOPED, STATUS_SUBRESOURCES, APIServerPeer
from tests.apiserver_peer.wire import (
           PROXY_502_HTML,
           REASONS,
           Refused,
           json_patch,
           merge_patch,
           status,
           status_body,
)

__all__ = ["CLUSTER_SCOPED", "PROXY_502_HTML", "REASONS", "STATUS_SUBRESOURCES", "APIServerPeer", "Fault",
           "Refused", "RequestInfo", "RequestRecord", "json_patch", "merge_patch", "status", "status_body"]
