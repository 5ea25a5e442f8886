"""Feature discovery: publish what this node has as node labels, the way GPU feature discovery does.

The labeller owns the label keys under its prefixes (``nvidia.com/gpu.``, ``nvidia.com/cuda.``,
``accelstack.io/nr1.``): every ``interval`` it computes the labels from the backends (which re-query the
hardware), compares them with the Node's labels and sends one strategic-merge patch with what differs —
labels to set and stale ones as ``null``. It patches only its own Node (RBAC: ``get`` and ``patch`` on
nodes; the DaemonSet passes ``NODE_NAME`` from the downward API). API errors are logged and retried on the
next round; they never stop the device plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("accelstack.device_plugin.labeller")

OWNED_PREFIXES = ("nvidia.com/gpu.", "nvidia.com/cuda.", "accelstack.io/nr1.")


def label_patch(current: dict[str, str], desired: dict[str, str]) -> dict[str, str | None]:
    """The labels to send: changed or new desired ones, and owned ones no longer desired as None."""
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    for key in current:
        if key.startswith(OWNED_PREFIXES) and key not in desired:
            patch[key] = None
    return patch


class NodeLabeller:
    def __init__(self, core_api: Any, node_name: str, compute: Callable[[], dict[str, str]],
                 interval: float = 60.0) -> None:
        self.api = core_api  # kubernetes_asyncio CoreV1Api
        self.node_name = node_name
        self.compute = compute
        self.interval = interval
        self.patches = 0

    async def reconcile(self) -> dict[str, str | None]:
        node = await self.api.read_node(self.node_name)
        current = dict(node.metadata.labels or {})
        patch = label_patch(current, self.compute())
        if patch:
            await self.api.patch_node(self.node_name, {"metadata": {"labels": patch}})
            self.patches += 1
            log.info("node labels updated", extra={"node": self.node_name, "changed": sorted(patch)})
        return patch

    async def run(self, stop: asyncio.Event, poke: asyncio.Event | None = None) -> None:
        """Reconcile now, then every ``interval`` or when ``poke`` is set, until ``stop``."""
        poke = poke or asyncio.Event()
        while not stop.is_set():
            try:
                await self.reconcile()
            except Exception as exc:  # API server away, RBAC, conflict: retry next round
                log.warning("labelling failed; will retry", extra={"node": self.node_name, "error": str(exc)[:300]})
            poke.clear()
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(poke.wait())]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), self.interval)
            for task in waits:
                task.cancel()


async def in_cluster_core_api() -> tuple[Any, Any]:
    """(ApiClient, CoreV1Api) from the pod's service account, or from KUBECONFIG outside a cluster."""
    from kubernetes_asyncio import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    api_client = client.ApiClient()
    return api_client, client.CoreV1Api(api_client)
