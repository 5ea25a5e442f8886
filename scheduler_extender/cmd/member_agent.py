"""``accelstack-member-agent``: a member cluster's agent (docs/multicluster.md). It reads its own cluster (Nodes,
AcceleratorNodes, GPRs) and writes its ``Cluster`` status on the hub with a token scoped to that one object and
its own hub namespace; it follows the GPRs the hub dispatched there (creates them in its cluster, mirrors their
status back, deletes them when the hub's dispatch is gone), and the Workspaces the hub carried there the same way.

It serves ``/healthz``, ``/readyz`` (200 once every informer of the member is synced and the last status write
reached the hub) and ``/metrics``; SIGTERM stops it cleanly. Every flag has an environment variable
(``ACCELSTACK_AGENT_<FLAG>``); a flag wins over its variable. Bad values stop the process with exit code 2 and
a message naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from scheduler_extender.cmd.extender import RESOURCE_NAMES, resource_names
from scheduler_extender.multicluster.agent import HUB_SECRET, MemberAgent, token_times
from scheduler_extender.multicluster.clusters import check_name, member_namespace
from scheduler_extender.multicluster.follow import DispatchFollower
from scheduler_extender.multicluster.kubeconfig import KubeconfigMinter
from scheduler_extender.multicluster.workspaces import WorkspaceFollower
from service.flags import Checked, Parser, UsageError, add_api_flags, add_logging_flags, adder, run_service
from service.http_listener import Limits, serve_app
from service.probes import informer_problems, probe_routes, serve_until_signal

log = logging.getLogger("accelstack.member_agent")
ENV = "ACCELSTACK_AGENT_"
HUB_KUBECONFIG = "/etc/accelstack/hub/kubeconfig"  # the Secret accelstack-hub-kubeconfig, mounted


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = Parser(prog="accelstack-member-agent",
               description="A member cluster's agent: pushes its inventory summary and heartbeat to its Cluster "
                           "object on the hub, and runs the GPRs the hub dispatched to it through its own cluster's "
                           f"controller, mirroring their status back. Each flag can also be set with {ENV}<FLAG>; the flag wins.")
    add = adder(p, environ, ENV)
    add("listen", ":8082", "host:port for /healthz, /readyz and /metrics")
    add_api_flags(add, environ)
    add("hub-kubeconfig", HUB_KUBECONFIG, "kubeconfig for the hub (cluster join writes it into the member's Secret "
        f"{HUB_SECRET}): a token that may touch only this member's Cluster, its own ServiceAccount's token and "
        "the GPRs dispatched into its hub namespace")
    add("cluster", "", "this member's name on the hub (cluster join writes it into the Secret as key cluster)")
    add("heartbeat", "10", "seconds between status writes when nothing changes (the hub judges Lost by them)")
    add("min-write-gap", "1", "least seconds between two status writes that changes ask for")
    add("resync", "30", "seconds between passes over the hub's dispatched GPRs when nothing changes")
    add("resources", ",".join(RESOURCE_NAMES), "extended resources to count, comma-separated")
    add("secret-namespace", environ.get("POD_NAMESPACE", "accelstack-system"),
        "namespace of the Secret the renewed hub token is written into (empty: not written)")
    add("secret-name", HUB_SECRET, "name of that Secret")
    add_logging_flags(add)
    return p


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    flags = Checked.parse(build_parser(environ), argv, ENV)
    args = flags.args
    host, port = flags.listen()
    flags.existing_file("kubeconfig")
    if not args.hub_kubeconfig:
        raise UsageError("--hub-kubeconfig: required (the kubeconfig cluster join made)")
    flags.existing_file("hub-kubeconfig")
    try:
        cluster = check_name(args.cluster)
    except ValueError as exc:
        raise UsageError(f"--cluster: {exc}") from None
    heartbeat = flags.number("heartbeat", float, 0.1, 3600)
    log_level, log_format = flags.logging()
    return {"host": host, "port": port, "kubeconfig": args.kubeconfig, "hub_kubeconfig": args.hub_kubeconfig,
            "cluster": cluster, "heartbeat": heartbeat, "resync": flags.number("resync", float, 0.05),
            "min_gap": flags.number("min-write-gap", float, 0.0, heartbeat),
            "resources": resource_names(args.resources), "secret_namespace": args.secret_namespace,
            "secret_name": args.secret_name, "api_timeout": flags.number("api-timeout", float, 0.1),
            "log_level": log_level, "log_format": log_format}


def accelstack_version() -> str:
    try:
        return metadata.version("accelstack")
    except metadata.PackageNotFoundError:
        return "unknown"


class AgentProcess:
    """The agent, its informers and a small health/metrics server."""

    def __init__(self, agent: MemberAgent, follower: DispatchFollower | None = None,
                 workspaces: WorkspaceFollower | None = None, kubeconfigs: KubeconfigMinter | None = None) -> None:
        self.agent, self.follower, self.workspaces = agent, follower, workspaces
        self.kubeconfigs = kubeconfigs
        self.registry = CollectorRegistry()
        self.hub_ok = Gauge("accelstack_member_agent_hub_ok", "1 while the last status write reached the hub",
                            registry=self.registry)
        self.writes = Gauge("accelstack_member_agent_status_writes", "Status writes to the hub since the start",
                            registry=self.registry)
        self.stop_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int, limits: Limits | None = None) -> None:
        from kubeapi.tasks import supervise

        informers = [*self.agent.informers, *self._followers_informers()]
        self._tasks = [asyncio.create_task(i.run(self.stop_event), name=f"informer-{i.name}") for i in informers]
        self._tasks.append(asyncio.create_task(supervise("member-agent", self.agent.run, self.stop_event)))
        if self.follower is not None:
            self._tasks.append(asyncio.create_task(supervise("dispatches", self.follower.run, self.stop_event)))
        if self.workspaces is not None:
            self._tasks.append(asyncio.create_task(supervise("workspaces", self.workspaces.run, self.stop_event)))
        if self.kubeconfigs is not None:
            self._tasks.append(asyncio.create_task(supervise("kubeconfigs", self.kubeconfigs.run, self.stop_event)))
        app = web.Application()
        app.add_routes(probe_routes(self._problems, [self.registry], self._scrape))
        self._runner, self.port = await serve_app(app, host, port, limits=limits or Limits())

    async def stop(self) -> None:
        self.stop_event.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    def _followers_informers(self) -> list[Any]:
        return [*(self.follower.informers if self.follower else []),
                *(self.workspaces.informers if self.workspaces else []),
                *(self.kubeconfigs.informers if self.kubeconfigs else [])]

    def _problems(self) -> list[str]:
        broken = informer_problems(self._followers_informers())
        return broken if self.agent.ready() else [self.agent.not_ready_because(), *broken]

    def _scrape(self) -> None:
        self.hub_ok.set(1 if self.agent.hub_ok else 0)
        self.writes.set(self.agent.writes)

async def serve(opts: dict[str, Any]) -> None:
    from kubeapi.client import from_config

    member = await from_config(opts["kubeconfig"], field_manager="accelstack-member-agent",
                               timeout=opts["api_timeout"])
    hub = await from_config(opts["hub_kubeconfig"], field_manager="accelstack-member-agent",
                            timeout=opts["api_timeout"])
    agent = MemberAgent(member, hub, opts["cluster"], resources=opts["resources"], heartbeat=opts["heartbeat"],
                        min_gap=opts["min_gap"], hub_namespace=member_namespace(opts["cluster"]),
                        secret_namespace=opts["secret_namespace"], secret_name=opts["secret_name"],
                        token=token_times(opts["hub_kubeconfig"]))
    await agent.load_versions(accelstack_version())
    follower = DispatchFollower(member, hub, member_namespace(opts["cluster"]), resync=opts["resync"])
    workspaces = WorkspaceFollower(member, hub, member_namespace(opts["cluster"]), resync=opts["resync"])
    kubeconfigs = KubeconfigMinter(member, hub, member_namespace(opts["cluster"]), resync=opts["resync"])
    process = AgentProcess(agent, follower, workspaces, kubeconfigs)

    async def stop() -> None:
        await process.stop()
        await member.close()
        await hub.close()

    await serve_until_signal(lambda: process.start(opts["host"], opts["port"]), stop,
                             lambda: log.info("member agent started", extra={"port": process.port,
                                                                             "cluster": opts["cluster"],
                                                                             "hub": hub.host}), log)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("accelstack-member-agent", argv, parse, serve, log, fast_loop=True)


if __name__ == "__main__":
    raise SystemExit(main())
