"""Feature discovery: publish what this node has as node labels, the way GPU feature discovery does.

The labeller owns the label keys under its prefixes (``nvidia.com/gpu.``, ``nvidia.com/cuda.``,
``accelstack.io/nr1.``): every ``interval`` it computes the labels from the backends (which re-query the
hardware), compares them with the Node's labels and sends one strategic-merge patch with what differs —
labels to set and stale ones as ``null``. It patches only its own Node (RBAC: ``get`` and ``patch`` on
nodes; the DaemonSet passes ``NODE_NAME`` from the downward API) through :class:`kubeapi.KubeClient`
(client-side timeouts, reads retried with backoff, field manager ``accelstack-device-plugin``). API errors are
logged and retried on the next round; they never stop the device plugin.

``kubeapi`` (and with it aiohttp) is imported only when the labeller runs: a node without it keeps the device
plugin's small footprint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubeapi.client import KubeClient

log = logging.getLogger("accelstack.device_plugin.labeller")

FIELD_MANAGER = "accelstack-device-plugin"
OWNED_PREFIXES = ("nvidia.com/gpu.", "nvidia.com/cuda.", "accelstack.io/nr1.")


def label_patch(current: dict[str, str], desired: dict[str, str]) -> dict[str, str | None]:
    """The labels to send: changed or new desired ones, and owned ones no longer desired as None."""
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    for key in current:
        if key.startswith(OWNED_PREFIXES) and key not in desired:
            patch[key] = None
    return patch


class NodeLabeller:
    """Labels from ``compute``; annotations from ``annotations`` (the pod-resources reports, handover.py), each
    written only when :func:`handover.unchanged` says the Node's value differs (its ``observedAt`` aside), in a
    patch of its own after the labels', so a refused annotation never holds the labels back."""

    def __init__(self, kube: KubeClient, node_name: str, compute: Callable[[], dict[str, str]],
                 interval: float = 60.0, annotations: Callable[[], dict[str, str]] | None = None) -> None:
        self.kube = kube
        self.node_name = node_name
        self.compute = compute
        self.annotations = annotations
        self.interval = interval
        self.patches = 0
        self.annotation_patches = 0

    async def reconcile(self) -> dict[str, str | None]:
        from kubeapi.resources import NODES

        node = await self.kube.get(NODES, self.node_name)
        current = dict((node.get("metadata") or {}).get("labels") or {})
        patch = label_patch(current, self.compute())
        if patch:
            # the same labels whatever the node had: safe to send again after a lost answer
            await self.kube.patch(NODES, self.node_name, {"metadata": {"labels": patch}}, patch_type="strategic",
                                  retry=True)
            self.patches += 1
            log.info("node labels updated", extra={"node": self.node_name, "changed": sorted(patch)})
        if self.annotations is not None:
            await self._annotate(node)
        return patch

    async def _annotate(self, node: dict[str, Any]) -> None:
        from device_plugin.handover import unchanged
        from kubeapi.resources import NODES

        assert self.annotations is not None
        current = dict((node.get("metadata") or {}).get("annotations") or {})
        patch = {k: v for k, v in self.annotations().items() if not unchanged(current.get(k), v)}
        if patch:
            await self.kube.patch(NODES, self.node_name, {"metadata": {"annotations": patch}},
                                  patch_type="strategic", retry=True)
            self.annotation_patches += 1
            log.info("node annotations updated", extra={"node": self.node_name, "changed": sorted(patch)})

    async def run(self, stop: asyncio.Event, poke: asyncio.Event | None = None) -> None:
        """Reconcile now, then every ``interval`` or when ``poke`` is set, until ``stop``."""
        poke = poke or asyncio.Event()
        while not stop.is_set():
            try:
                await self.reconcile()
            except Exception as exc:  # API server away, RBAC, admission policy, conflict: retry next round
                # the API server's answer whole (kubeapi caps it at 1000 characters): an admission policy's
                # reason comes after some 150 characters of preamble and the node's name
                log.warning("labelling failed; will retry", extra={"node": self.node_name, "error": str(exc)[:1200]})
            poke.clear()
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(poke.wait())]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), self.interval)
            for task in waits:
                task.cancel()


async def in_cluster_client(registry: Any = None, timeout: float = 10.0) -> KubeClient:
    """A client from the pod's service account, or from KUBECONFIG / ~/.kube/config outside a cluster."""
    from kubeapi.client import from_config

    return await from_config(field_manager=FIELD_MANAGER, registry=registry, timeout=timeout)
