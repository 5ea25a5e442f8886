"""Wire shapes of the kube-apiserver that the peer answers with: ``Status`` errors with the real reasons,
patches, managedFields entries, timestamps and continue tokens."""

from __future__ import annotations

import base64
import binascii
import copy
import datetime as dt
import json
from typing import Any

from aiohttp import web

# The reason the API server (and client-go's NewGenericServerResponse) gives each code.
REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
           406: "NotAcceptable", 409: "Conflict", 410: "Expired", 413: "RequestEntityTooLarge",
           415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
           502: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}

# What a proxy in front of the API server answers when the API server is away: HTML, not a Status.
PROXY_502_HTML = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway"
                  "</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")

TRUE = ("true", "1", "t")


class Refused(Exception):
    """A request the API server answers with an error Status."""

    def __init__(self, code: int, message: str, reason: str | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.reason, self.details = code, message, reason, details

    def response(self) -> web.Response:
        return status(self.code, self.reason, self.message, self.details)


def status_body(code: int, reason: str | None = None, message: str = "",
                details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": REASONS.get(code, "") if reason is None else reason,
                            "code": code}
    if details:
        body["details"] = details
    return body


def status(code: int, reason: str | None, message: str, details: dict[str, Any] | None = None,
           retry_after: int | None = None) -> web.Response:
    """An error answered as the API server does: a ``Status`` object, its ``reason`` and ``code``; with
    ``retry_after`` the ``Retry-After`` header and ``details.retryAfterSeconds`` (429 and 503 do this)."""
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
        details = {**(details or {}), "retryAfterSeconds": retry_after}
    return web.json_response(status_body(code, reason, message, details), status=code, headers=headers)


def group_of(resource: str) -> str:
    """'apis/accelstack.io/v1alpha1/gpuprovisioningrequests' -> 'accelstack.io'; core -> ''."""
    parts = resource.split("/")
    return parts[1] if parts[0] == "apis" else ""


def api_version_of(resource: str) -> str:
    parts = resource.split("/")
    return "/".join(parts[1:3]) if parts[0] == "apis" else parts[1]


def plural_of(resource: str) -> str:
    return resource.rsplit("/", 1)[-1]


def qualified(resource: str) -> str:
    """'pods' for core, 'gpuprovisioningrequests.accelstack.io' for a group, as the API server's messages say."""
    group = group_of(resource)
    return f"{plural_of(resource)}.{group}" if group else plural_of(resource)


def default_message(code: int, verb: str, resource: str, namespace: str, name: str) -> str:
    """The message a real API server sends for ``code`` on this request (close enough to read the same)."""
    what = f'{qualified(resource)} "{name}"' if name else qualified(resource)
    if code == 403:
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        return (f'{what} is forbidden: User "system:serviceaccount:accelstack:test" cannot {verb} resource '
                f'"{plural_of(resource)}" in API group "{group_of(resource)}" {scope}')
    if code == 404:
        return f"{what} not found" if name else "the server could not find the requested resource"
    if code == 409:
        return (f"Operation cannot be fulfilled on {what}: the object has been modified; please apply your "
                "changes to the latest version and try again")
    if code == 410:
        return "too old resource version"
    if code == 422:
        return f"{what} is invalid"
    if code == 429:
        return "Too many requests, please try again later."
    if code == 503:
        return "the server is currently unable to handle the request"
    if code == 504:
        return "Timeout: request did not complete within requested timeout - context deadline exceeded"
    if code >= 500:
        return "Internal error occurred: injected fault"
    return f"{REASONS.get(code, 'error')} ({code})"


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(when: dt.datetime) -> str:
    """A ``MicroTime`` (Lease renewTime/acquireTime) as the API server writes it."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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


def fields_v1(body: Any) -> dict[str, Any]:
    """The ``fieldsV1`` of a managedFields entry for the fields a request sent (maps as ``f:`` keys; lists and
    scalars as leaves): enough for a test to see which fields a manager wrote."""
    def walk(value: Any) -> dict[str, Any]:
        return {f"f:{k}": walk(v) for k, v in value.items()} if isinstance(value, dict) else {}

    if not isinstance(body, dict):
        return {}
    out = {f"f:{k}": walk(v) for k, v in body.items() if k not in ("apiVersion", "kind", "metadata")}
    meta = {f"f:{k}": walk(v) for k, v in (body.get("metadata") or {}).items()
            if k in ("labels", "annotations", "finalizers", "ownerReferences")}
    if meta:
        out["f:metadata"] = meta
    return out


def encode_continue(snapshot: str, rv: int, offset: int) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": offset, "snapshot": snapshot}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_continue(token: str) -> tuple[str, int, int]:
    """-> (snapshot id, resourceVersion, offset); ValueError for a token this server did not make."""
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return str(data["snapshot"]), int(data["rv"]), int(data["start"])
    except (binascii.Error, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"continue key is not valid: {exc}") from exc
