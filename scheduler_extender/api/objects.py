"""The REST API's object endpoints: workspaces, GPR templates and template bindings (list, get, create, update,
delete), each authorised as the same action on the Kubernetes resource would be.

- ``GET|POST /api/v1/workspaces``,       ``GET|PUT|DELETE /api/v1/workspaces/{name}``
- ``GET|POST /api/v1/templates[?namespace=]``,        ``GET|PUT|DELETE /api/v1/templates/{namespace}/{name}``
- ``GET|POST /api/v1/templatebindings[?namespace=]``, ``GET|PUT|DELETE /api/v1/templatebindings/{namespace}/{name}``

A create takes ``{"name", "namespace" (namespaced kinds), "spec", "labels"?, "annotations"?}`` (or a whole
object with ``metadata``) and answers the created object (201). An update (PUT) takes the same body; the new
spec (and labels/annotations when given) replaces the stored one, guarded by ``metadata.resourceVersion`` when the
body carries one (409 when the object changed since), else by the version just read. The shape is checked here
(400 naming the field) before the API server, whose CRD schema checks the rest (422 passed on).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kubeapi.resources import GPR_TEMPLATE_BINDINGS, GPR_TEMPLATES, WORKSPACES, Resource
from scheduler_extender.api.http import (
    LIST_PAGE,
    Routes,
    api_call,
    api_error,
    api_items,
    error,
    json_response,
)
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.kube import ApiError, NotFound
from scheduler_extender.objects.workspaces import ROLES, SUBJECT_KINDS, parse_policy
from service.http_body import BodyError, closing

LABEL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # DNS-1123 label: namespaces, workspaces
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_name(value: Any, what: str, label: bool = False) -> str:
    limit, pattern = (63, LABEL_NAME) if label else (253, SUBDOMAIN)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what}: required string")
    if len(value) > limit or not pattern.match(value):
        raise ValueError(f"{what}: {value[:80]!r} is not a valid name (lower-case letters, digits and '-', "
                         f"at most {limit} characters)")
    return value


def _strings(value: Any, what: str, label: bool = True) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"{what}: must be a list of names")
    return [check_name(v, f"{what}[{i}]", label) for i, v in enumerate(value)]


def check_workspace(spec: dict[str, Any], name: str, namespace: str) -> None:
    if "namespaces" in spec:
        _strings(spec["namespaces"], "spec.namespaces")
    access = spec.get("access", [])
    if not isinstance(access, list):
        raise ValueError("spec.access: must be a list of {kind, name, role}")
    for i, rule in enumerate(access):
        where = f"spec.access[{i}]"
        if not isinstance(rule, dict):
            raise ValueError(f"{where}: must be an object {{kind, name, role}}")
        if rule.get("kind") not in SUBJECT_KINDS:
            raise ValueError(f"{where}.kind: must be one of {', '.join(SUBJECT_KINDS)}, got {rule.get('kind')!r}")
        if not isinstance(rule.get("name"), str) or not rule["name"]:
            raise ValueError(f"{where}.name: required string")
        if rule.get("role") not in ROLES:
            raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)}, got {rule.get('role')!r}")
        if rule["kind"] == "ServiceAccount":
            check_name(rule.get("namespace"), f"{where}.namespace (a ServiceAccount's namespace)", label=True)
    parse_policy(spec.get("policy"))  # PolicyError (a ValueError) naming the field, as the controller reads it
    if "defaultTemplate" in spec:
        tpl = spec["defaultTemplate"]
        if not isinstance(tpl, dict):
            raise ValueError("spec.defaultTemplate: must be an object {namespace, name}")
        check_name(tpl.get("namespace"), "spec.defaultTemplate.namespace", label=True)
        check_name(tpl.get("name"), "spec.defaultTemplate.name")


def check_template(spec: dict[str, Any], name: str, namespace: str) -> None:
    gr.template_spec({"metadata": {"name": name, "namespace": namespace}, "spec": spec})


def check_binding(spec: dict[str, Any], name: str, namespace: str) -> None:
    check_name(spec.get("template"), "spec.template")
    if spec.get("workspace") is not None:
        check_name(spec["workspace"], "spec.workspace", label=True)
    if "namespaces" in spec:
        _strings(spec["namespaces"], "spec.namespaces")
    if "workloadSelector" in spec and not isinstance(spec["workloadSelector"], dict):
        raise ValueError("spec.workloadSelector: must be a label selector {matchLabels, matchExpressions}")
    weight = spec.get("weight", 0)
    if not isinstance(weight, int) or isinstance(weight, bool):
        raise ValueError(f"spec.weight: must be an integer, got {weight!r}")


@dataclass(frozen=True)
class Kind:
    path: str  # /api/v1/<path>
    res: Resource
    check: Callable[[dict[str, Any], str, str], None]

    @property
    def attrs(self) -> dict[str, str]:
        return {"group": self.res.group, "resource": self.res.plural}


KINDS = (Kind("workspaces", WORKSPACES, check_workspace), Kind("templates", GPR_TEMPLATES, check_template),
         Kind("templatebindings", GPR_TEMPLATE_BINDINGS, check_binding))


class ObjectRoutes:
    """The five verbs of one kind, on the REST API's authorisation and body reading."""

    def __init__(self, api: Routes, kind: Kind) -> None:
        self.api, self.kind = api, kind

    def routes(self) -> list[web.RouteDef]:
        base = f"/api/v1/{self.kind.path}"
        one = f"{base}/{{namespace}}/{{name}}" if self.kind.res.namespaced else f"{base}/{{name}}"
        return [web.get(base, self.list), web.post(base, self.create), web.get(one, self.get),
                web.put(one, self.update), web.delete(one, self.delete)]

    def _where(self, request: web.Request) -> tuple[str, str]:
        return request.match_info.get("namespace", ""), request.match_info["name"]

    async def list(self, request: web.Request) -> web.StreamResponse:
        namespace = request.query.get("namespace", "") if self.kind.res.namespaced else ""
        denied = await self.api._denied(request, "list", namespace, self.kind.attrs)
        if denied is not None and denied.status == 403 and self.kind.res is WORKSPACES:
            return await self._member_list(request, denied)
        return denied or \
            await api_items(request, self.api.kube.list_objects(self.kind.res, namespace or None, page_size=LIST_PAGE))

    async def get(self, request: web.Request) -> web.Response:
        namespace, name = self._where(request)
        denied = await self.api._denied(request, "get", namespace, self.kind.attrs)
        if denied is not None and denied.status == 403 and self.kind.res is WORKSPACES:
            return await self._member_get(request, name, denied)
        return denied or await api_call(self.api.kube.get_object(self.kind.res, namespace or None, name))

    # Workspaces are cluster-scoped and the roles a workspace grants its members are namespaced, so RBAC alone
    # never lets a member read its own Workspace (issue 35.5). The REST API answers a caller without ``get`` /
    # ``list`` on workspaces for the Workspaces it is a member of: those in one of whose namespaces the caller may
    # list GPRs (a SubjectAccessReview per namespace, cached by the authorizer), read under the API's own account.
    # Nothing else is revealed: a workspace the caller is not a member of, or one that does not exist, is the
    # same 403 as before, and so is a list for a caller who is a member of none. No RBAC object is created for this, so no grant can escalate past the admission
    # policies that limit the workspace controller.
    async def _member_of(self, request: web.Request, obj: dict[str, Any]) -> bool:
        return await member_of(self.api, request, obj)

    async def _member_get(self, request: web.Request, name: str, denied: web.Response) -> web.Response:
        try:
            obj = await self.api.kube.get_object(WORKSPACES, None, name)
        except NotFound:
            return denied
        except ApiError as exc:
            return api_error(exc)
        return json_response(obj) if await self._member_of(request, obj) else denied

    async def _member_list(self, request: web.Request, denied: web.Response) -> web.StreamResponse:
        try:
            items = await self.api.kube.list_objects(WORKSPACES, None, page_size=LIST_PAGE)
        except ApiError as exc:
            return api_error(exc)
        mine = [obj for obj in items if await self._member_of(request, obj)]
        return await api_items(request, _ready(mine)) if mine else denied  # a stranger: RBAC's own 403

    def _object(self, body: dict[str, Any], namespace: str = "", name: str = "") -> tuple[dict[str, Any], str]:
        """The object the body describes, and the resourceVersion it was read at ("" when none)."""
        raw_meta = body.get("metadata")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        name = check_name(name or meta.get("name") or body.get("name"), "name", label=self.kind.res is WORKSPACES)
        if self.kind.res.namespaced:
            namespace = check_name(namespace or meta.get("namespace") or body.get("namespace"), "namespace",
                                   label=True)
        spec = body.get("spec", {})
        if not isinstance(spec, dict):
            raise ValueError("spec: must be an object")
        self.kind.check(spec, str(name), namespace)
        out_meta: dict[str, Any] = {"name": name, **({"namespace": namespace} if namespace else {})}
        for key in ("labels", "annotations"):
            value = meta.get(key, body.get(key))
            if value is not None:
                if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                    raise ValueError(f"{key}: must be an object of strings")
                out_meta[key] = value
        version = meta.get("resourceVersion") or body.get("resourceVersion") or ""
        obj = {"apiVersion": self.kind.res.api_version, "kind": self.kind.res.kind, "metadata": out_meta,
               "spec": spec}
        return obj, str(version)

    async def _read(self, request: web.Request, namespace: str = "",
                    name: str = "") -> tuple[web.Response | None, dict[str, Any], str]:
        unauthenticated = await self.api._unauthenticated(request)
        if unauthenticated:
            return unauthenticated, {}, ""
        try:
            obj, version = self._object(await self.api._body(request), namespace, name)
        except BodyError as exc:
            return await closing(request, error(exc.status, exc.message)), {}, ""
        except ValueError as exc:  # gr.SpecError included
            return error(400, str(exc)), {}, ""
        return None, obj, version

    async def create(self, request: web.Request) -> web.Response:
        refused, obj, _ = await self._read(request)
        if refused:
            return refused
        namespace = obj["metadata"].get("namespace", "")
        denied = await self.api._denied(request, "create", namespace, self.kind.attrs)
        return denied or await api_call(self.api.kube.create_object(self.kind.res, namespace or None, obj),
                                        created=True)

    async def update(self, request: web.Request) -> web.Response:
        namespace, name = self._where(request)
        refused, obj, version = await self._read(request, namespace, name)
        if refused:
            return refused
        denied = await self.api._denied(request, "update", namespace, self.kind.attrs)
        if denied:
            return denied
        try:
            current = await self.api.kube.get_object(self.kind.res, namespace or None, name)
        except NotFound as exc:
            return error(404, exc.message or "not found")
        except ApiError as exc:
            return api_error(exc)
        meta = dict(current.get("metadata") or {})
        for key in ("labels", "annotations"):
            if key in obj["metadata"]:
                meta[key] = obj["metadata"][key]
        meta["resourceVersion"] = version or meta.get("resourceVersion", "")
        new = {**current, "metadata": meta, "spec": obj["spec"]}
        return await api_call(self.api.kube.replace_object(self.kind.res, namespace or None, name, new))


    async def delete(self, request: web.Request) -> web.Response:
        namespace, name = self._where(request)
        denied = await self.api._denied(request, "delete", namespace, self.kind.attrs)
        return denied or await api_call(self.api.kube.delete_object(self.kind.res, namespace or None, name))


async def member_of(api: Routes, request: web.Request, obj: dict[str, Any]) -> bool:
    """Whether the caller may list GPRs in one of the Workspace's namespaces (a member, admin or viewer)."""
    for namespace in workspace_namespaces(obj):
        if await api._denied(request, "list", namespace, MEMBER_ATTRS) is None:
            return True
    return False


async def member_workspaces(api: Routes, request: web.Request) -> list[dict[str, Any]]:
    """The Workspaces the caller is a member of (:func:`member_of`), read under the API's own account; [] when
    the API server cannot be read (whoami then says what RBAC alone allows)."""
    try:
        items = await api.kube.list_objects(WORKSPACES, None, page_size=LIST_PAGE)
    except (ApiError, OSError, TimeoutError):
        return []
    return [obj for obj in items if await member_of(api, request, obj)]


MEMBER_ATTRS = {"group": gr.GROUP, "resource": gr.GPR_PLURAL}  # a member may list its namespaces' GPRs


def workspace_namespaces(obj: dict[str, Any]) -> list[str]:
    """The namespaces a Workspace holds: those its status reports (adopted and created), else those its spec asks
    for."""
    status, spec = obj.get("status") or {}, obj.get("spec") or {}
    names = [n.get("name") for n in status.get("namespaces") or [] if isinstance(n, dict)]
    names += [n for n in spec.get("namespaces") or [] if isinstance(n, str)]
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n))


async def _ready(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return items


def object_routes(api: Routes) -> list[web.RouteDef]:
    return [route for kind in KINDS for route in ObjectRoutes(api, kind).routes()]
