"""One label of this node, read from the API server with the standard library (the NPD plugin is started every
few seconds; a Kubernetes client library would cost more to import than the check itself).

In the cluster the pod's service-account token and CA are used with ``KUBERNETES_SERVICE_HOST``; an explicit
``node.apiServer`` URL (tests, out-of-cluster runs) is used without credentials. The value is cached in the
check's state for ``plugin.labelCacheTime`` so NPD's invocations do not become API traffic.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.parse
import urllib.request
from typing import Any

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def _in_cluster() -> tuple[str, dict[str, str], ssl.SSLContext | None] | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return None
    try:
        with open(os.path.join(SA_DIR, "token")) as handle:
            token = handle.read().strip()
    except OSError:
        return None
    context = ssl.create_default_context(cafile=os.path.join(SA_DIR, "ca.crt"))
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}", {"Authorization": f"Bearer {token}"}, context


def node_label(api_server: str, node: str, key: str, timeout: float) -> str | None:
    """The label's value, None when the node has no such label. Raises OSError/ValueError when it cannot tell."""
    headers: dict[str, str] = {}
    context: ssl.SSLContext | None = None
    if api_server:
        base = api_server.rstrip("/")
    else:
        found = _in_cluster()
        if found is None:
            raise OSError("no API server: not in a cluster and node.apiServer unset")
        base, headers, context = found
    url = f"{base}/api/v1/nodes/{urllib.parse.quote(node)}"
    request = urllib.request.Request(url, headers={**headers, "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        body: dict[str, Any] = json.loads(response.read())
    labels = (body.get("metadata") or {}).get("labels") or {}
    value = labels.get(key)
    return None if value is None else str(value)


def cached_label(state: dict[str, Any], api_server: str, node: str, key: str, timeout: float,
                 max_age: float, now: float | None = None) -> tuple[str | None, str]:
    """(value, error): the label from the cache in ``state`` when fresh, else from the API server. On an API
    error a cached value of any age is used; the error is returned for the message."""
    now = time.time() if now is None else now
    cache = state.setdefault("labels", {})
    entry = cache.get(key)
    if entry and now - float(entry.get("at", 0)) < max_age and entry.get("node") == node:
        return entry.get("value"), ""
    try:
        value = node_label(api_server, node, key, timeout)
    except (OSError, ValueError) as exc:
        return (entry.get("value") if entry else None), f"label {key} unreadable: {exc}"
    cache[key] = {"value": value, "at": now, "node": node}
    return value, ""
