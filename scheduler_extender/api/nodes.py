"""The REST API's node life-cycle routes: ask for a node to be deboarded, or take the request back
(``kubectl accelstack node deboard NODE [--grace D] [--abort]``).

``POST /api/v1/acceleratornodes/{name}/deboard`` with ``{"grace": "10m"}`` sets the AcceleratorNode's
``spec.deboard`` (the grace and now as ``requestedAt``); ``DELETE`` on the same path removes it (abort). The caller
must be allowed to ``patch acceleratornodes.accelstack.io`` (a SubjectAccessReview, before the body is read); the
write is a conditional update (the object's resourceVersion), so a concurrent change is a 409, never lost. What
deboarding then does is the controller's (:mod:`scheduler_extender.controller.accelerator_nodes`, docs/nodes.md).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from aiohttp import web

from kubeapi.resources import ACCELERATOR_NODES
from scheduler_extender.api.http import Routes, api_error, error, json_response
from scheduler_extender.objects.accelerator_nodes import parse_grace
from scheduler_extender.objects.kube import ApiError
from service.http_body import BodyError, closing

ATTRS = {"group": ACCELERATOR_NODES.group, "resource": ACCELERATOR_NODES.plural}
DEFAULT_GRACE = "10m"


def node_routes(api: Routes) -> list[web.RouteDef]:
    path = "/api/v1/acceleratornodes/{name}/deboard"
    return [web.post(path, functools.partial(deboard, api)), web.delete(path, functools.partial(abort, api))]


async def _set(api: Routes, name: str, request_value: dict[str, Any] | None) -> web.Response:
    try:
        obj = await api.kube.get_object(ACCELERATOR_NODES, None, name)
        spec = dict(obj.get("spec") or {})
        if request_value is None:
            if "deboard" not in spec:
                return json_response({"node": name, "deboard": None, "changed": False})
            spec.pop("deboard")
        else:
            spec["deboard"] = request_value
        obj["spec"] = spec
        await api.kube.replace_object(ACCELERATOR_NODES, None, name, obj)
    except ApiError as exc:
        return api_error(exc)
    return json_response({"node": name, "deboard": request_value, "changed": True})


async def deboard(api: Routes, request: web.Request) -> web.Response:
    name = request.match_info["name"]
    denied = await api._denied(request, "patch", attrs=ATTRS)
    if denied is not None:
        return await closing(request, denied)
    try:
        body = await api._body(request) if request.can_read_body else {}
    except BodyError as exc:
        return await closing(request, error(exc.status, exc.message))
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
