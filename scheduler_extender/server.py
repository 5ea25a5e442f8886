"""One extender process: informers feeding the cluster view, the extender verbs, the binder, the REST API, the
admission webhook and the (leader-elected) GPR controller, on one aiohttp server.

``ExtenderServer`` is what ``accelstack-extender`` runs and what the tests start against the API-server peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from scheduler_extender.auth import Authorizer
from scheduler_extender.binder import Binder
from scheduler_extender.cluster import ClusterView
from scheduler_extender.controller import GPRController
from scheduler_extender.extender import Extender, ExtenderMetrics
from scheduler_extender.kube import Informer, Kube
from scheduler_extender.leader import LeaderElector
from scheduler_extender.rest_api import RestAPI

log = logging.getLogger("accelstack.extender.server")
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # 5,000 node names and a pod fit in well under 1 MiB


class ExtenderServer:
    def __init__(self, kube: Kube, resources: tuple[str, ...] = ("nvidia.com/gpu", "neureality.com/nr1"),
                 prefix: str = "/scheduler", require_gpr: bool = False, max_body: int = DEFAULT_MAX_BODY,
                 extra_routes: Callable[[web.Application], None] | None = None, run_controller: bool = True,
                 lease_namespace: str = "accelstack-system", lease_name: str = "accelstack-gpr-controller",
                 identity: str = "", policy: str = "bestfit", resync: float = 5.0, lease_seconds: int = 15,
                 sweep_every: float = 60.0, rest_auth: bool = True) -> None:
        self.kube = kube
        self.view = ClusterView(resources)
        self.binder = Binder(kube, self.view)
        self.metrics = ExtenderMetrics()
        self.controller = GPRController(kube, self.view, policy=policy, resync=resync)
        self.run_controller = run_controller
        self.elector = LeaderElector(kube, lease_namespace, lease_name, identity or f"{socket.gethostname()}-{os.getpid()}"
                                     f"-{id(self):x}", lease_seconds=lease_seconds,
                                     renew_every=max(0.2, lease_seconds / 3))
        self.sweep_every = sweep_every
        self.informers = [
            Informer("nodes", kube.lister("nodes"), self._on_node, self.view.sync_nodes),
            Informer("pods", kube.lister("pods"), self._on_pod, self.view.sync_pods),
            Informer("gprs", kube.lister("gprs"), self._on_gpr, self._sync_gprs),
        ]
        self.extender = Extender(self.view, self.binder, self.metrics, require_gpr, ready=self.ready)
        self.rest = RestAPI(kube, self.view, self.controller, authorizer=Authorizer(kube) if rest_auth else None)
        self.app = web.Application(client_max_size=max_body)
        self.app.add_routes(self.extender.routes(prefix))
        self.app.add_routes(self.rest.routes())
        if extra_routes is not None:
            extra_routes(self.app)
        self.stop_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._releases: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.released: list[str] = []  # ledger entries given back by garbage collection (uids)

    def ready(self) -> bool:
        return all(i.synced.is_set() for i in self.informers)

    def _on_node(self, kind: str, obj: dict[str, Any]) -> None:
        self.view.on_node(kind, obj)
        self.controller.changed()

    def _on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        self.view.on_gpr(kind, obj)
        self.controller.on_gpr(kind, obj)

    def _sync_gprs(self, items: list[dict[str, Any]]) -> None:
        self.view.sync_gprs(items)
        self.controller.sync_gprs(items)

    def _on_pod(self, kind: str, obj: dict[str, Any]) -> None:
        self.view.on_pod(kind, obj)
        self.controller.changed()
        phase = (obj.get("status") or {}).get("phase")
        if kind == "DELETED" or phase in ("Succeeded", "Failed"):
            uid = obj.get("metadata", {}).get("uid", "")
            node = (obj.get("spec") or {}).get("nodeName") or ""
            view = self.view.nodes.get(node)
            if view is not None and uid in view.ledger:
                task = asyncio.create_task(self._release(node, uid))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

    async def _release(self, node: str, uid: str) -> None:
        """A pod that ended gives its devices back to the node's ledger."""
        try:
            if await self.binder.release(node, [uid]):
                self.released.append(uid)
        except Exception as exc:
            log.warning("ledger release failed; the next sweep retries", extra={"node": node, "error": str(exc)[:200]})

    async def sweep(self, now: float | None = None, unbound_ttl: float = 600.0,
                    unseen_grace: float = 120.0) -> tuple[int, int]:
        """Make every node's ledger match the pods: give back entries of pods that ended, are bound elsewhere,
        were never bound within ``unbound_ttl`` (a bind that crashed half way) or are gone — the last only once
        the entry is older than ``unseen_grace``, because a pod bound a moment ago may not have reached this
        replica's informer yet. Adopt bound pods a ledger lacks. Returns (released, adopted)."""
        now = time.time() if now is None else now
        released = adopted = 0
        bound: dict[str, list[Any]] = {}
        for p in self.view.pods.values():
            if p.node and p.phase not in ("Succeeded", "Failed"):
                bound.setdefault(p.node, []).append(p)
        for node in list(self.view.nodes.values()):
            stale = []
            for uid, entry in node.ledger.items():
                holder = self.view.pods.get(uid)
                if holder is None:
                    if now - entry.since > unseen_grace:
                        stale.append(uid)
                elif holder.phase in ("Succeeded", "Failed") or holder.node not in ("", node.name) \
                        or (not holder.node and now - entry.since > unbound_ttl):
                    stale.append(uid)
            if stale:
                released += await self.binder.release(node.name, stale)
            if bound.get(node.name):
                adopted += await self.binder.adopt(node.name, bound[node.name])
        return released, adopted

    async def _sweeper(self) -> None:
        while not self.stop_event.is_set():
            waits = [asyncio.create_task(self.stop_event.wait()), asyncio.create_task(self.elector.leading.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)  # sweep as soon as this replica leads
            for task in waits:
                task.cancel()
            if self.elector.leading.is_set() and not self.stop_event.is_set():
                try:
                    released, adopted = await self.sweep()
                    if released or adopted:
                        log.info("ledger sweep", extra={"released": released, "adopted": adopted})
                except Exception as exc:
                    log.warning("ledger sweep failed", extra={"error": str(exc)[:200]})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), self.sweep_every)

    async def start(self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None,
                    sync_timeout: float = 30.0) -> None:
        self._tasks = [asyncio.create_task(i.run(self.stop_event), name=f"informer-{i.name}") for i in self.informers]
        try:
            await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in self.informers)), sync_timeout)
        except TimeoutError:
            missing = [i.name for i in self.informers if not i.synced.is_set()]
            await self.stop()
            hint = " (is the GPUProvisioningRequest CRD installed?)" if "gprs" in missing else ""
            raise RuntimeError(f"could not list {', '.join(missing)} from the API server in {sync_timeout:g}s"
                               f"{hint}; check the address, credentials and RBAC") from None
        gc.freeze()  # the synced cluster view is long-lived: keep it out of the collector's full passes
        if self.run_controller:
            self._tasks.append(asyncio.create_task(self.elector.run(self.stop_event), name="leader-election"))
            self._tasks.append(asyncio.create_task(self.controller.run(self.stop_event, self.elector.leading),
                                                   name="gpr-controller"))
            self._tasks.append(asyncio.create_task(self._sweeper(), name="ledger-sweep"))
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context, backlog=1024)
        await site.start()
        server = getattr(site, "_server", None)
        self.port = server.sockets[0].getsockname()[1] if server is not None else port
        log.info("extender serving", extra={"port": self.port, "tls": ssl_context is not None})

    async def stop(self) -> None:
        self.stop_event.set()
        if self.elector.leading.is_set():
            self.elector.leading.clear()
            await self.elector.release()
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
