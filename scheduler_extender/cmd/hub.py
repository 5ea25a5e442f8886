"""``accelstack-hub``: the hub's controller (docs/multicluster.md), leader-elected on a Lease like the GPR
controller. It judges every member ``Cluster`` Ready or Lost by its heartbeats, on the hub's clock alone, and
exports ``accelstack_hub_cluster_ready{cluster}`` and the members' devices on ``/metrics``; it places hub GPRs on
members and carries Workspaces with ``spec.clusters`` to the listed members.

It serves ``/healthz``, ``/readyz`` (200 once Clusters can be listed) and ``/metrics`` on ``--listen``, without
authentication, and the REST API's read views over every member (:mod:`scheduler_extender.api.hub`: inventory,
queue, usage with ``?cluster=``, and the portal) on a second listener, ``--api-listen`` (off when empty;
manifests/hub serves it on :8443), where every call needs a bearer token the hub's API server reviews: a token is
never sent to the probe port, and a Service can expose the API without exposing the probes. Every replica serves
the views (from its own informers), not only the leader. SIGTERM gives the Lease up. Every flag has an environment
variable (``ACCELSTACK_HUB_<FLAG>``); a flag wins over its variable. Bad values
stop the process with exit code 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from scheduler_extender.api.app import RateLimiter
from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.hub import HubAPI
from scheduler_extender.api.kubeconfig import KubeconfigAPI
from scheduler_extender.cmd.controller import duration
from scheduler_extender.multicluster import view
from scheduler_extender.multicluster.dispatch import Dispatcher
from scheduler_extender.multicluster.hub import HubController
from scheduler_extender.multicluster.kubeconfig import KubeconfigError, KubeconfigIssuer, parse_expiry
from scheduler_extender.multicluster.workspaces import WorkspaceDispatcher
from scheduler_extender.objects.kube import Kube
from service.flags import Checked, Parser, UsageError, add_api_flags, add_logging_flags, adder, run_service
from service.http_listener import Limits, serve_app, server_tls
from service.probes import informer_problems, probe_routes, serve_until_signal

log = logging.getLogger("accelstack.hub")
ENV = "ACCELSTACK_HUB_"


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = Parser(prog="accelstack-hub",
               description="The hub controller (leader-elected): marks member Clusters Ready while their agents' "
                           "heartbeats come and Lost when none came for --lost-after. Each flag can also be set "
                           f"with {ENV}<FLAG>; the flag wins.")
    add = adder(p, environ, ENV)
    add("listen", ":8083", "host:port for /healthz, /readyz and /metrics (no authentication)")
    add("api-listen", "", "host:port for the REST API's views over every member (inventory, queue, usage with "
        "?cluster=) and the portal; every call needs a bearer token (TokenReview, then SubjectAccessReview on the "
        "hub's API server). Must differ from --listen. Empty: not served (manifests/hub sets :8443)")
    add("tls-cert-file", "", "serve --api-listen over HTTPS with this certificate (PEM); needs --tls-key-file. "
        "Without it the API is plain HTTP (for a loopback or a mesh that terminates TLS)")
    add("tls-key-file", "", "private key for --tls-cert-file (PEM)")
    add_api_flags(add, environ, lease_name="accelstack-hub")
    add("lost-after", "15m", "a member whose heartbeat the hub has not seen change for this long is Lost (the "
        "hub's clock; a duration like 15m, as MultiKueue's workerLostTimeout)")
    add("resync", "30", "seconds between passes when nothing changes")
    add_logging_flags(add)
    return p


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    flags = Checked.parse(build_parser(environ), argv, ENV)
    args = flags.args
    host, port = flags.listen()
    api_host, api_port = flags.listen("api-listen") if args.api_listen else ("", -1)
    if (api_host, api_port) == (host, port) and port:
        raise UsageError("--api-listen: must differ from --listen")
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise UsageError("--tls-cert-file and --tls-key-file: give both or neither")
    for flag in ("tls-cert-file", "tls-key-file"):
        flags.existing_file(flag)
    flags.existing_file("kubeconfig")
    log_level, log_format = flags.logging()
    return {"host": host, "port": port, "api_host": api_host, "api_port": api_port, "cert": args.tls_cert_file,
            "key": args.tls_key_file, "kubeconfig": args.kubeconfig, "lease_namespace": args.lease_namespace,
            "lease_name": args.lease_name, "identity": args.identity or f"{socket.gethostname()}-{os.getpid()}",
            "lease_seconds": flags.number("lease-seconds", float, 2),
            "lost_after": duration("lost-after", args.lost_after),
            "resync": flags.number("resync", float, 0.05), "api_timeout": flags.number("api-timeout", float, 0.1),
            "log_level": log_level, "log_format": log_format}


class HubViews:
    """The hub API's :class:`~scheduler_extender.api.hub.HubSource`: :mod:`.view` over this process's caches."""

    def __init__(self, process: HubProcess, clock: Any = time.time) -> None:
        self.process, self.clock = process, clock

    def inventory(self, cluster: str) -> dict[str, Any]:
        return view.inventory(self.process.controller.clusters, cluster, self.clock())

    def queue(self, cluster: str, namespace: str, phases: tuple[str, ...]) -> dict[str, Any]:
        return view.queue(list(self.process.dispatcher.origins.values()), self.process.controller.clusters,
                          cluster=cluster, namespace=namespace, phases=phases, now=self.clock())

    def usage(self, cluster: str, workspace: str) -> dict[str, Any]:
        return view.usage(list(self.process.workspaces.workspaces.values()), self.process.controller.clusters,
                          cluster=cluster, workspace=workspace)


class HubProcess:
    def __init__(self, client: Any, opts: dict[str, Any]) -> None:
        from kubeapi.leader import LeaderElector

        self.registry = CollectorRegistry()
        self.controller = HubController(client, lost_after=opts["lost_after"], resync=opts["resync"],
                                        registry=self.registry)
        self.dispatcher = Dispatcher(client, lambda: self.controller.clusters, resync=opts["resync"])
        self.controller.listeners.append(self.dispatcher.changed)
        self.workspaces = WorkspaceDispatcher(client, lambda: self.controller.clusters, resync=opts["resync"])
        self.controller.listeners.append(self.workspaces.changed)
        lease = opts["lease_seconds"]
        self.elector = LeaderElector(client, opts["lease_namespace"], opts["lease_name"], opts["identity"],
                                     lease_duration=lease, renew_deadline=lease * 2 / 3, retry_period=lease * 2 / 15)
        self.registry.register(view.ViewCollector(lambda: self.controller.clusters,
                                                  lambda: list(self.dispatcher.origins.values()), time.time))
        self.api = HubAPI(HubViews(self), Authorizer(Kube(client)) if opts.get("api_auth", True) else None,
                          RateLimiter())
        # workspace kubeconfigs for a member (issue 40.2): the same listener, authentication and rate limit
        self.kubeconfigs = KubeconfigAPI(KubeconfigIssuer(client, lambda: self.controller.clusters),
                                         self.api.authorizer, parse_expiry, KubeconfigError, self.api.limiter)
        self.tls: ssl.SSLContext | None = None
        if opts.get("cert"):
            self.tls = server_tls(opts["cert"], opts["key"])
        self.stop_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self._api_runner: web.AppRunner | None = None
        self.port, self.api_port = 0, -1

    async def start(self, host: str, port: int, api_host: str = "", api_port: int = -1) -> None:
        """Probes and /metrics on ``host:port``; the views on ``api_host:api_port`` (port -1: not served)."""
        from kubeapi.tasks import while_leading

        informer = self.controller.informer
        self._tasks = [asyncio.create_task(self.elector.run(self.stop_event), name="leader"),
                       asyncio.create_task(informer.run(self.stop_event), name="informer-clusters"),
                       asyncio.create_task(self.dispatcher.informer.run(self.stop_event), name="informer-gprs"),
                       *(asyncio.create_task(i.run(self.stop_event), name=f"informer-{i.name}")
                         for i in self.workspaces.informers),
                       asyncio.create_task(while_leading(self.elector, self.stop_event,
                                                         {"hub": self.controller.run,
                                                          "gprs": self._dispatch,
                                                          "workspaces": self._workspaces}), name="hub")]
        app = web.Application()
        app.add_routes(probe_routes(
            lambda: informer_problems((self.controller.informer, self.dispatcher.informer,
                                        *self.workspaces.informers)), [self.registry]))
        self._runner, self.port = await serve_app(app, host, port, limits=Limits())
        if api_port >= 0:
            api_app = web.Application()
            api_app.add_routes(self.api.routes())
            api_app.add_routes(self.kubeconfigs.routes())
            self._api_runner, self.api_port = await serve_app(api_app, api_host, api_port, limits=Limits(),
                                                              ssl_context=self.tls)

    async def stop(self) -> None:
        self.stop_event.set()
        # the elector gives the Lease up on its way out; the rest is cancelled
        await asyncio.wait(self._tasks[:1], timeout=5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for runner in (self._runner, self._api_runner):
            if runner is not None:
                await runner.cleanup()

    async def _dispatch(self, stop: asyncio.Event) -> None:
        await self.controller.informer.synced.wait()  # place only over the members' inventories as stored
        await self.dispatcher.run(stop)

    async def _workspaces(self, stop: asyncio.Event) -> None:
        await self.controller.informer.synced.wait()  # a member not joined is told apart from one not seen yet
        await self.workspaces.run(stop)



async def serve(opts: dict[str, Any]) -> None:
    from kubeapi.client import from_config

    client = await from_config(opts["kubeconfig"], field_manager="accelstack-hub", timeout=opts["api_timeout"])
    process = HubProcess(client, opts)

    async def stop() -> None:
        await process.stop()
        await client.close()

    await serve_until_signal(lambda: process.start(opts["host"], opts["port"], opts["api_host"], opts["api_port"]),
                             stop, lambda: log.info("hub started", extra={
                                 "port": process.port, "api_port": process.api_port, "tls": process.tls is not None,
                                 "lost_after_s": opts["lost_after"]}), log)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("accelstack-hub", argv, parse, serve, log, fast_loop=True)


if __name__ == "__main__":
    raise SystemExit(main())
