"""The API calls the extender, binder, controller and REST API make, on the shared client layer (:mod:`kubeapi`):
every call has a client-side timeout, its HTTP status checked and the component's field manager.

Objects are plain dicts (orjson): the hot paths (bind) skip model classes, and the policy code reads the same
shapes the API server sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kubeapi import AlreadyExists, ApiError, Conflict, KubeClient, NotFound, TransportError
from kubeapi.resources import (
    CONFIGMAPS,
    EVENTS,
    GPR_TEMPLATES,
    GPRS,
    NAMESPACES,
    NODES,
    PODS,
    SUBJECT_ACCESS_REVIEWS,
    TOKEN_REVIEWS,
    Resource,
)

log = logging.getLogger("accelstack.extender.kube")

GROUP, VERSION = GPRS.group, GPRS.version
__all__ = ["AlreadyExists", "ApiError", "Conflict", "Kube", "NotFound", "TransportError"]
T = TypeVar("T")


class Kube:
    """One REST request per method (reads retried on transient errors by the client layer)."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self._webhooked: asyncio.Semaphore | None = None

    async def _admitted(self, call: Callable[[], Awaitable[T]]) -> T:
        """A write the API server sends to accelstack's own admission webhooks (GPRs; workspaces, templates and
        bindings through the REST API) before answering. The webhook is this very process, and its lookups take
        a connection of this client's pool: writes holding every connection would wait for webhook answers that
        wait for a connection, until the webhook's timeout. Such writes take at most half the pool."""
        if self._webhooked is None:
            limit = int(getattr(getattr(self.client.session, "connector", None), "limit", 0) or 0)
            self._webhooked = asyncio.Semaphore(max(1, limit // 2) if limit else 1 << 30)
        async with self._webhooked:
            return await call()

    async def close(self) -> None:
        await self.client.close()

    # nodes and pods
    async def get_node(self, name: str) -> dict[str, Any]:
        return await self.client.get(NODES, name)

    async def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Merge patch; a ``metadata.resourceVersion`` in the body makes it conditional (409 on change), and so
        safe to retry after a transient failure (one that landed makes the retry answer 409)."""
        conditional = bool((body.get("metadata") or {}).get("resourceVersion"))
        return await self.client.patch(NODES, name, body, patch_type="strategic", retry=conditional)

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.client.get(PODS, name, namespace)

    async def patch_pod(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        kind = "json" if isinstance(body, list) else "strategic"
        return await self.client.patch(PODS, name, body, namespace, patch_type=kind)

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> None:
        await self.client.delete(PODS, name, namespace, uid=uid)

    async def bind(self, namespace: str, name: str, uid: str, node: str,
                   annotations: dict[str, str] | None = None) -> None:
        """pods/binding with a UID precondition; the API server copies ``annotations`` onto the pod."""
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
        if annotations:
            meta["annotations"] = annotations
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        await self.client.create(PODS, body, namespace, subresource="binding", name=name)

    async def evict(self, namespace: str, name: str, reason: str = "") -> None:
        """Eviction API (policy/v1): a PodDisruptionBudget refusal surfaces as TooManyRequests (429), never
        bypassed."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        await self.client.create(PODS, body, namespace, subresource="eviction", name=name)

    async def create_event(self, namespace: str, body: Any) -> None:
        try:
            await self.client.create(EVENTS, body, namespace)
        except ApiError as exc:  # events are best effort; the status carries the truth
            log.debug("event not recorded", extra={"error": str(exc)[:200]})

    # GPRs
    async def get_gpr(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.client.get(GPRS, name, namespace)

    async def replace_gpr_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT status with the object's resourceVersion: optimistic concurrency (Conflict on a stale read)."""
        return await self.client.replace(GPRS, name, body, namespace, subresource="status")

    async def create_gpr(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._admitted(lambda: self.client.create(GPRS, body, namespace))

    async def delete_gpr(self, namespace: str, name: str, uid: str | None = None) -> dict[str, Any]:
        return await self.client.delete(GPRS, name, namespace, uid=uid)

    async def list_gprs(self, namespace: str | None = None, page_size: int = 500) -> list[dict[str, Any]]:
        items, _ = await self.client.list(GPRS, namespace, page_size=page_size)
        return items

    async def get_template(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.client.get(GPR_TEMPLATES, name, namespace)

    # the REST API's object endpoints (workspaces, templates, bindings) and the portal's lookups
    async def list_objects(self, res: Resource, namespace: str | None = None,
                           page_size: int = 500) -> list[dict[str, Any]]:
        items, _ = await self.client.list(res, namespace, page_size=page_size)
        return items

    async def get_object(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        return await self.client.get(res, name, namespace)

    async def create_object(self, res: Resource, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        return await self._admitted(lambda: self.client.create(res, body, namespace))

    async def replace_object(self, res: Resource, namespace: str | None, name: str,
                             body: dict[str, Any]) -> dict[str, Any]:
        """PUT with the body's resourceVersion: Conflict when the object changed since it was read."""
        return await self._admitted(lambda: self.client.replace(res, name, body, namespace))

    async def delete_object(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        return await self.client.delete(res, name, namespace)

    async def list_events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        """The core/v1 Events about one object."""
        items, _ = await self.client.list(EVENTS, namespace, field_selector=f"involvedObject.kind={kind},"
                                                                              f"involvedObject.name={name}")
        return items

    async def list_namespaces(self, label_selector: str = "") -> list[dict[str, Any]]:
        items, _ = await self.client.list(NAMESPACES, label_selector=label_selector)
        return items

    # the controller's duration history (scheduler_extender.controller.predictor_store)
    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.client.get(CONFIGMAPS, name, namespace)

    async def put_configmap(self, namespace: str, name: str, data: dict[str, str],
                            labels: dict[str, str] | None = None) -> dict[str, Any]:
        """Create the ConfigMap, or replace its data (the last writer wins: one leader writes it)."""
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace, "labels": labels or {}}, "data": data}
        try:
            return await self.client.replace(CONFIGMAPS, name, body, namespace)
        except NotFound:
            return await self.client.create(CONFIGMAPS, body, namespace)

    # authentication and authorisation of REST API callers
    async def token_review(self, token: str) -> dict[str, Any]:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        return (await self.client.create(TOKEN_REVIEWS, body, retry=True)).get("status") or {}

    async def access_review(self, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        return (await self.client.create(SUBJECT_ACCESS_REVIEWS, body, retry=True)).get("status") or {}
