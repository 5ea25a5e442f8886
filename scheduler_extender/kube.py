"""Kubernetes API access for the extender and the controller, through ``kubernetes_asyncio``.

Objects are handled as plain dicts (``_preload_content=False`` + orjson): the hot paths (bind) skip the client's
model classes, and the policy code reads the same shapes the API server sends. ``Informer`` lists, then
watches from the list's ``resourceVersion``, resumes a watch from the last seen version after a timeout or a
dropped connection, and relists when the API server answers ``410 Gone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger("accelstack.extender.kube")

GROUP, VERSION = "accelstack.io", "v1alpha1"


class Conflict(Exception):
    """The object changed since it was read (409); re-read and retry."""


class NotFound(Exception):
    pass


async def _json(coro: Awaitable[Any]) -> dict[str, Any]:
    try:
        response = await coro
    except ApiException as exc:
        if exc.status == 409:
            raise Conflict(exc.reason or "conflict") from None
        if exc.status == 404:
            raise NotFound(exc.reason or "not found") from None
        raise
    body = await response.read()
    status = getattr(response, "status", 200)
    if status >= 300:  # with _preload_content=False the client leaves the status check to us
        try:
            message = orjson.loads(body).get("message", "") if body else ""
        except orjson.JSONDecodeError:
            message = body[:200].decode(errors="replace")
        if status == 409:
            raise Conflict(message or "conflict")
        if status == 404:
            raise NotFound(message or "not found")
        raise ApiException(status=status, reason=message)
    return orjson.loads(body) if body else {}


class Kube:
    """The API calls the extender and controller make (each one a single REST request)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.coordination = client.CoordinationV1Api(api_client)

    async def close(self) -> None:
        await self.api_client.close()

    # nodes and pods
    async def get_node(self, name: str) -> dict[str, Any]:
        return await _json(self.core.read_node(name, _preload_content=False))

    async def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Strategic-merge patch; a ``metadata.resourceVersion`` in the body makes it conditional (409 on change)."""
        return await _json(self.core.patch_node(name, body, _preload_content=False))

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await _json(self.core.read_namespaced_pod(name, namespace, _preload_content=False))

    async def patch_pod(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        return await _json(self.core.patch_namespaced_pod(name, namespace, body, _preload_content=False))

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        body: Any = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace, "uid": uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        await _json(self.core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False))

    async def evict(self, namespace: str, name: str, reason: str = "") -> None:
        """Eviction API (policy/v1): a PodDisruptionBudget refusal surfaces as ApiException 429, never bypassed."""
        body: Any = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        await _json(self.core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False))

    async def create_event(self, namespace: str, body: Any) -> None:
        with contextlib.suppress(ApiException):
            await _json(self.core.create_namespaced_event(namespace, body, _preload_content=False))

    # GPRs
    async def get_gpr(self, namespace: str, name: str) -> dict[str, Any]:
        return await _json(self.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, "gpuprovisioningrequests", name, _preload_content=False))

    async def replace_gpr_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT status with the object's resourceVersion: optimistic concurrency (Conflict on a stale read)."""
        return await _json(self.custom.replace_namespaced_custom_object_status(
            GROUP, VERSION, namespace, "gpuprovisioningrequests", name, body, _preload_content=False))

    async def create_gpr(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await _json(self.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "gpuprovisioningrequests", body, _preload_content=False))

    async def delete_gpr(self, namespace: str, name: str) -> dict[str, Any]:
        return await _json(self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, "gpuprovisioningrequests", name, _preload_content=False))

    async def list_gprs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        if namespace:
            body = await _json(self.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, "gpuprovisioningrequests", _preload_content=False))
        else:
            body = await _json(self.custom.list_cluster_custom_object(
                GROUP, VERSION, "gpuprovisioningrequests", _preload_content=False))
        return list(body.get("items") or [])

    # list + watch
    def lister(self, kind: str) -> Callable[..., Awaitable[Any]]:
        """The list call for an informer: 'nodes', 'pods' or 'gprs' (cluster-wide)."""
        if kind == "nodes":
            return self.core.list_node
        if kind == "pods":
            return self.core.list_pod_for_all_namespaces
        if kind == "gprs":
            async def list_gprs(**kwargs: Any) -> Any:
                return await self.custom.list_cluster_custom_object(GROUP, VERSION, "gpuprovisioningrequests",
                                                                    **kwargs)
            return list_gprs
        raise ValueError(kind)


Handler = Callable[[str, dict[str, Any]], None]  # (ADDED|MODIFIED|DELETED, object)


class Informer:
    """List then watch one kind, calling ``on_event`` for every change; ``on_sync`` gets each full list."""

    def __init__(self, name: str, list_call: Callable[..., Awaitable[Any]], on_event: Handler,
                 on_sync: Callable[[list[dict[str, Any]]], None], watch_timeout: int = 300,
                 retry_delay: float = 1.0) -> None:
        self.name = name
        self.list_call = list_call
        self.on_event = on_event
        self.on_sync = on_sync
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        self.synced = asyncio.Event()
        self.relists = 0
        self.resource_version = ""

    async def _list(self) -> None:
        response = await self.list_call(_preload_content=False)
        body = orjson.loads(await response.read())
        self.resource_version = body.get("metadata", {}).get("resourceVersion", "")
        self.on_sync(list(body.get("items") or []))
        self.relists += 1
        self.synced.set()

    async def _watch_once(self) -> int:
        """One watch request from ``resource_version`` until the server closes it; returns the events seen."""
        response = await self.list_call(watch=True, resource_version=self.resource_version,
                                        timeout_seconds=self.watch_timeout, allow_watch_bookmarks=True,
                                        _preload_content=False)
        seen = 0
        try:
            while True:
                line = await response.content.readline()
                if not line:
                    return seen
                seen += 1
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    raise ApiException(status=code, reason=f"{obj.get('reason')}: {obj.get('message')}")
                rv = obj.get("metadata", {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.on_event(kind, obj)
        finally:
            response.release()

    async def run(self, stop: asyncio.Event) -> None:
        need_list = True
        while not stop.is_set():
            try:
                if need_list:
                    await self._list()
                    need_list = False
                started = asyncio.get_running_loop().time()
                if not await self._watch_once() and asyncio.get_running_loop().time() - started < 1.0:
                    await self._pause(stop)  # a server closing empty watches at once: do not spin
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch expired; relisting", extra={"informer": self.name})
                    need_list = True
                    continue
                log.warning("list/watch failed; retrying", extra={"informer": self.name, "status": exc.status})
                await self._pause(stop)
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # connection refused/reset, bad JSON from a proxy
                log.warning("list/watch error; retrying", extra={"informer": self.name, "error": str(exc)[:200]})
                await self._pause(stop)

    async def _pause(self, stop: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), self.retry_delay)
