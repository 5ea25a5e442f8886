"""``accelstack-hub``: the hub's controller (docs/multicluster.md), leader-elected on a Lease like the GPR
controller. It judges every member ``Cluster`` Ready or Lost by its heartbeats, on the hub's clock alone, and
exports ``accelstack_hub_cluster_ready{cluster}`` and the members' devices on ``/metrics``; it places hub GPRs on
members and carries Workspaces with ``spec.clusters`` to the listed members.

It serves ``/healthz``, ``/readyz`` (200 once Clusters can be listed) and ``/metrics``; SIGTERM gives the Lease
up. Every flag has an environment variable (``ACCELSTACK_HUB_<FLAG>``); a flag wins over its variable. Bad values
stop the process with exit code 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from scheduler_extender.cmd.controller import duration
from scheduler_extender.multicluster.dispatch import Dispatcher
from scheduler_extender.multicluster.hub import HubController
from scheduler_extender.multicluster.workspaces import WorkspaceDispatcher
from service.flags import Checked, Parser, add_api_flags, add_logging_flags, adder, run_service
from service.http_listener import Limits, serve_app
from service.probes import informer_problems, probe_routes, serve_until_signal

log = logging.getLogger("accelstack.hub")
ENV = "ACCELSTACK_HUB_"


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = Parser(prog="accelstack-hub",
               description="The hub controller (leader-elected): marks member Clusters Ready while their agents' "
                           "heartbeats come and Lost when none came for --lost-after. Each flag can also be set "
                           f"with {ENV}<FLAG>; the flag wins.")
    add = adder(p, environ, ENV)
    add("listen", ":8083", "host:port for /healthz, /readyz and /metrics")
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
    flags.existing_file("kubeconfig")
    log_level, log_format = flags.logging()
    return {"host": host, "port": port, "kubeconfig": args.kubeconfig, "lease_namespace": args.lease_namespace,
            "lease_name": args.lease_name, "identity": args.identity or f"{socket.gethostname()}-{os.getpid()}",
            "lease_seconds": flags.number("lease-seconds", float, 2),
            "lost_after": duration("lost-after", args.lost_after),
            "resync": flags.number("resync", float, 0.05), "api_timeout": flags.number("api-timeout", float, 0.1),
            "log_level": log_level, "log_format": log_format}


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
        self.stop_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
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

    async def stop(self) -> None:
        self.stop_event.set()
        # the elector gives the Lease up on its way out; the rest is cancelled
        await asyncio.wait(self._tasks[:1], timeout=5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

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

    await serve_until_signal(lambda: process.start(opts["host"], opts["port"]), stop,
                             lambda: log.info("hub started", extra={"port": process.port,
                                                                    "lost_after_s": opts["lost_after"]}), log)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("accelstack-hub", argv, parse, serve, log, fast_loop=True)


if __name__ == "__main__":
    raise SystemExit(main())
