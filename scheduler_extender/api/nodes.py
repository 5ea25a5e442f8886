"""The REST API's node life-cycle routes: ask for a node to be onboarded (``kubectl accelstack node onboard
NODE``) or deboarded, or take a deboard request back (``kubectl accelstack node deboard NODE [--grace D]
[--abort]``).

``POST /api/v1/acceleratornodes/{name}/onboard`` (body optional: ``{"adoptPods": true}``) sets the AcceleratorNode's
``spec.onboard`` (now as ``requestedAt``; an existing request is kept, ``changed`` false); a node being deboarded is a 409 that says to
abort the deboard first. Same rights and conditional update as below.

``POST /api/v1/acceleratornodes/{name}/deboard`` with ``{"grace": "10m"}`` sets the AcceleratorNode's
``spec.deboard`` (the grace and now as ``requestedAt``); ``DELETE`` on the same path removes it (abort). The caller
must be allowed to ``patch acceleratornodes.accelstack.io`` (a SubjectAccessReview, before the body is read); the
write is a conditional update (the object's resourceVersion), so a concurrent change is a 409, never lost. What
deboarding then does is the controller's (:mod:`scheduler_extender.controller.accelerator_nodes`, docs/nodes.md).

``GET /api/v1/acceleratornodes/{name}/check`` is the node preflight (``kubectl accelstack node check NODE``,
docs/nr1-nodes.md): the caller must be allowed to ``get nodes`` (a SubjectAccessReview, before anything is read);
then the Node, accelstack's own DaemonSet pods bound to it (label ``app.kubernetes.io/part-of=accelstack``: no
workload pod is read or shown) and its AcceleratorNode are read live and judged by
:func:`scheduler_extender.objects.node_check.check`. A node that does not exist is a 404.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from aiohttp import web

from kubeapi.resources import ACCELERATOR_NODES, PODS
from scheduler_extender.api.http import Routes, api_error, error, json_response
from scheduler_extender.objects.accelerator_nodes import parse_grace
from scheduler_extender.objects.kube import ApiError, NotFound
from scheduler_extender.objects.node_check import check as node_check
from service.http_body import BodyError, closing

ATTRS = {"group": ACCELERATOR_NODES.group, "resource": ACCELERATOR_NODES.plural}
DEFAULT_GRACE = "10m"
NODE_ATTRS = {"group": "", "resource": "nodes"}
OUR_PODS = "app.kubernetes.io/part-of=accelstack"


def node_routes(api: Routes) -> list[web.RouteDef]:
    path = "/api/v1/acceleratornodes/{name}/deboard"
    return [web.post(path, functools.partial(deboard, api)), web.delete(path, functools.partial(abort, api)),
            web.post("/api/v1/acceleratornodes/{name}/onboard", functools.partial(onboard, api)),
            web.get("/api/v1/acceleratornodes/{name}/check", functools.partial(check, api))]


async def check(api: Routes, request: web.Request) -> web.Response:
    name = request.match_info["name"]
    denied = await api._denied(request, "get", attrs={**NODE_ATTRS, "name": name})
    if denied is not None:
        return denied
    try:
        node = await api.kube.get_node(name)
    except NotFound:
        return error(404, f"node {name!r} not found")
    except ApiError as exc:
        return api_error(exc)
    try:
        pods, _ = await api.kube.client.list(PODS, None, label_selector=OUR_PODS,
                                             field_selector=f"spec.nodeName={name}")
        try:
            accelerator_node: dict[str, Any] | None = await api.kube.get_object(ACCELERATOR_NODES, None, name)
        except NotFound:
            accelerator_node = None
    except ApiError as exc:
        return api_error(exc)
    return json_response(node_check(node, pods, accelerator_node, api.clock()))


async def _set(api: Routes, name: str, request_value: dict[str, Any] | None, key: str = "deboard") -> web.Response:
    """Set (or, with None, remove) ``spec.<key>`` with a conditional update; an onboard request already there is
    kept (its ``requestedAt`` dates the onboarding), and one on a node being deboarded is refused."""
    try:
        obj = await api.kube.get_object(ACCELERATOR_NODES, None, name)
        spec = dict(obj.get("spec") or {})
        if request_value is None:
            if key not in spec:
                return json_response({"node": name, key: None, "changed": False})
            spec.pop(key)
        elif key == "onboard" and isinstance(spec.get("deboard"), dict):
            return error(409, f"node {name} is being deboarded: abort that first "
                              f"(kubectl accelstack node deboard {name} --abort)")
        elif key == "onboard" and isinstance(spec.get("onboard"), dict) and (
                spec["onboard"].get("adoptPods") or not request_value.get("adoptPods")):
            return json_response({"node": name, key: spec["onboard"], "changed": False})
        elif key == "onboard" and isinstance(spec.get("onboard"), dict):  # asked again, now to adopt its pods
            request_value = spec[key] = {**spec["onboard"], "adoptPods": True}
        else:
            spec[key] = request_value
        obj["spec"] = spec
        await api.kube.replace_object(ACCELERATOR_NODES, None, name, obj)
    except NotFound:
        return error(404, f"no AcceleratorNode {name!r}: the node does not exist or shows no GPUs or NR1 modules "
                          "(kubectl get acceleratornodes lists those found)")
    except ApiError as exc:
        return api_error(exc)
    return json_response({"node": name, key: request_value, "changed": True})


async def _request_body(api: Routes, request: web.Request) -> dict[str, Any] | web.Response:
    """The caller may patch AcceleratorNodes (asked before the body is read), then the body (none: ``{}``); or
    the refusal to answer with."""
    denied = await api._denied(request, "patch", attrs=ATTRS)
    if denied is not None:
        return await closing(request, denied)
    try:
        return await api._body(request) if request.can_read_body else {}
    except BodyError as exc:
        return await closing(request, error(exc.status, exc.message))


async def onboard(api: Routes, request: web.Request) -> web.Response:
    body = await _request_body(api, request)
    if isinstance(body, web.Response):
        return body
    adopt = body.get("adoptPods", False)
    if not isinstance(adopt, bool):
        return error(400, f"adoptPods: a boolean, not {adopt!r}"[:200])
    requested = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(api.clock()))
    value: dict[str, Any] = {"requestedAt": requested, **({"adoptPods": True} if adopt else {})}
    return await _set(api, request.match_info["name"], value, "onboard")


async def deboard(api: Routes, request: web.Request) -> web.Response:
    name = request.match_info["name"]
    body = await _request_body(api, request)
    if isinstance(body, web.Response):
        return body
    grace = str(body.get("grace") or DEFAULT_GRACE)
    try:
        parse_grace(grace)
    except ValueError as exc:
        return error(400, f"grace: {exc}")
    requested = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(api.clock()))
    return await _set(api, name, {"grace": grace, "requestedAt": requested})


async def abort(api: Routes, request: web.Request) -> web.Response:
    denied = await api._denied(request, "patch", attrs=ATTRS)
    if denied is not None:
        return await closing(request, denied)
    return await _set(api, request.match_info["name"], None)
