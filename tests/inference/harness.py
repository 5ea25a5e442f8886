"""Build the objects a cluster would hold for an endpoint (InferenceEndpoint, EndpointSlices, key Secrets) and run
the gateway on them in-process, in front of runtime peers."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from inference.gateway.listener import Listener
from inference.gateway.server import Gateway, Settings
from inference.gateway.sources import apply_objects
from inference.names import GROUP, KIND, LABEL_API_KEY, LABEL_ENDPOINT, LABEL_POOL, POOL_PRIMARY, VERSION

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"


def endpoint(name: str, namespace: str = "team-a", models: Sequence[str] = ("m",), access: dict[str, Any] | None = None,
             max_inflight: int = 64, max_queue: int = 256, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": {"models": list(models), "access": access or {},
                     "gateway": {"maxInflightPerReplica": max_inflight, "maxQueue": max_queue}}}


def slices(name: str, urls: Sequence[str], namespace: str = "team-a", pool: str = POOL_PRIMARY,
           ready: bool = True) -> list[dict[str, Any]]:
    """One EndpointSlice per replica URL (each peer listens on its own port of 127.0.0.1)."""
    out = []
    for i, url in enumerate(urls):
        parts = urlsplit(url)
        out.append({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                    "metadata": {"name": f"{name}-{pool}-{i}", "namespace": namespace,
                                 "labels": {LABEL_ENDPOINT: name, LABEL_POOL: pool,
                                            "kubernetes.io/service-name": f"{name}-{pool}"}},
                    "ports": [{"name": "http", "port": parts.port, "protocol": "TCP"}],
                    "endpoints": [{"addresses": [parts.hostname], "conditions": {"ready": ready},
                                   "nodeName": "node-1",
                                   "targetRef": {"kind": "Pod", "namespace": namespace, "name": f"{name}-{pool}-{i}"}}]})
    return out


def key_secret(name: str, namespace: str, token: str, rate: float = 0, burst: float | None = None,
               workspace: str | None = None) -> dict[str, Any]:
    notes: dict[str, str] = {}
    if rate:
        notes["accelstack.io/rate-limit"] = str(rate)
    if burst is not None:
        notes["accelstack.io/rate-limit-burst"] = str(burst)
    if workspace:
        notes["accelstack.io/workspace"] = workspace
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_API_KEY: "true"},
                         "annotations": notes},
            "data": {"key": base64.b64encode(token.encode()).decode()}}


CLIENTS: list[Any] = []  # openai clients a test made; conftest closes them

DEFAULT_KEYS = [key_secret("app", "team-a", KEY_A), key_secret("app", "team-b", KEY_B)]


class RunningGateway:
    def __init__(self, settings: Settings | None = None, header_timeout: float = 10.0,
                 keepalive_timeout: float = 75.0) -> None:
        self.gateway = Gateway(settings or Settings(request_timeout=5, idle_timeout=5, queue_timeout=5))
        self.header_timeout, self.keepalive_timeout = header_timeout, keepalive_timeout
        self.listener: Listener | None = None
        self.url = ""

    def load(self, endpoints: Sequence[dict[str, Any]], endpoint_slices: Sequence[dict[str, Any]],
             secrets: Sequence[dict[str, Any]] = tuple(DEFAULT_KEYS)) -> None:
        apply_objects(self.gateway, endpoints, endpoint_slices, secrets)

    async def start(self) -> str:
        self.listener = Listener(self.gateway.handle, header_timeout=self.header_timeout,
                                 idle_timeout=self.keepalive_timeout)
        await self.gateway.start()
        port = await self.listener.start("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.close(self.gateway.settings.shutdown_timeout)
            await self.gateway.stop()


async def eventually(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Wait for ``condition`` with a deadline (no sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
