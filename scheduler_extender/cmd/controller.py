"""``accelstack-controller``: the leader-elected GPR controller and ledger sweep as a process of its own.

It keeps its own informers (nodes, pods, GPRs; and for the workspace controller, which runs under the same
leader election: Workspaces, Namespaces and the Roles, RoleBindings and ServiceAccounts it manages), so its
CPU-bound passes never share an interpreter with the
extender that answers kube-scheduler and the webhooks. It serves ``/healthz``, ``/readyz`` (false while a
resource cannot be listed) and ``/metrics``. Every flag has an environment variable (``ACCELSTACK_CTL_<FLAG>``);
a flag wins over its variable. Bad values stop the process with exit code 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from scheduler_extender.cmd.extender import POLICIES, RESOURCE_NAMES, resource_names
from scheduler_extender.core.eviction import EVICTION_COST_RATIO, EVICTION_MAX_WAIT_S
from scheduler_extender.core.scheduler import SchedulerConfig
from scheduler_extender.objects.accelerator_nodes import parse_grace, parse_selector, vendor_id
from scheduler_extender.objects.cluster import LEDGER_SOURCES
from service.flags import Checked, Parser, UsageError, add_api_flags, add_logging_flags, adder, run_service
from service.http_listener import DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT, Limits, serve_app
from service.probes import informer_problems, probe_routes, serve_until_signal

log = logging.getLogger("accelstack.controller")
ENV = "ACCELSTACK_CTL_"


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = Parser(
        prog="accelstack-controller",
        description="The accelstack GPR controller (leader-elected): admits, requeues and evicts GPUProvisioning"
                    "Requests from the API server's state, lifts their pods' scheduling gates, keeps node ledgers "
                    f"in step. Each flag can also be set with {ENV}<FLAG>; the flag wins.")

    add = adder(p, environ, ENV)
    add("listen", ":8081", "host:port for /healthz, /readyz and /metrics")
    add("header-timeout", f"{DEFAULT_HEADER_TIMEOUT:g}", "seconds a connection may take to send a whole request "
        "head (from accept, or from the first byte of a later request); closed after")
    add("idle-timeout", f"{DEFAULT_IDLE_TIMEOUT:g}", "seconds a kept-alive connection may wait for its next request")
    add("resources", ",".join(RESOURCE_NAMES), "managed extended resources, comma-separated")
    add_api_flags(add, environ, lease_name="accelstack-gpr-controller")
    add("ledger", "node", "where each node's device ledger is read: node (the Node's accelstack.io/ledger "
        "annotation, which this controller's leader also sweeps) or memory (the pods bound there); the same as the "
        "extender's --ledger")
    add("policy", "bestfit", "placement policy of the policy core: bestfit, fgd or random")
    add("resync", "5", "seconds between passes when nothing changes")
    add("estimate-every", "30", "seconds between refreshes of queue positions and wait estimates")
    add("concurrency", "16", "API writes (status, ungate, evict) in flight at once")
    add("refresh-qps", "20", "status writes per second that only move a queued GPR's position or wait estimate "
                             "(the rest wait for a later refresh, those nearest the head of the queue first)")
    add("refresh-burst", "100", "such writes at once after a quiet spell")
    add("eviction-cost-ratio", f"{EVICTION_COST_RATIO:g}", "evict lower-priority work for a GPR only when the "
        "GPU-hours the victims have run (and lose) are at most this many times the GPU-hours of waiting it is "
        "spared (its GPUs x its predicted wait); off: whenever eviction makes room")
    add("eviction-max-wait", f"{EVICTION_MAX_WAIT_S:g}", "seconds: a GPR with enableEviction that would otherwise "
        "wait this long in all (waited + predicted) evicts whatever the cost: the priority guarantee")
    add("min-pass-gap", "0.25", "least seconds between a pass and the next one that events ask for (a burst of "
                                "events makes fewer, larger passes: bounded CPU, decisions at most this much later)")
    add("nr1-vendor-ids", "", "NR1 modules' PCI vendor IDs as lspci -nn shows them (comma-separated, the device "
        "plugin's nr1.vendorIDs): node-feature-discovery's PCI labels of these vendors mark a node as an NR1 node")
    add("onboard-selector", "", "label selector (a=b,c!=d,e,!f) of accelerator nodes to onboard without being asked: "
        "labelled so the DaemonSets land, then Managed once accelstack's plugin serves them; empty: only nodes "
        "onboarded with kubectl accelstack node onboard (or labelled by hand) and those its plugin serves already")
    add("onboard-timeout", "15m", "how long onboarding may take before the AcceleratorNode says Failed (it still "
        "turns Managed once done): a duration like 15m")
    add("node-usage-qps", "5", "AcceleratorNode status writes per second that change only the pods holding a node's "
        "devices (the rest follow in later passes; phases, conditions and deboard steps are never held back); 0: no "
        "limit")
    add("node-usage-burst", "50", "such writes at once after a quiet spell")
    add_logging_flags(add)
    return p


def nr1_vendor_ids(value: str) -> tuple[str, ...]:
    """``--nr1-vendor-ids``: PCI vendor IDs, comma-separated (none: NR1 nodes are found by resource and labels)."""
    try:
        return tuple(vendor_id(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise UsageError(f"--nr1-vendor-ids: {exc}") from None


def onboard_selector(value: str) -> str:
    """``--onboard-selector``: checked here (one line naming the bad part), kept as text for the controller."""
    try:
        parse_selector(value)
    except ValueError as exc:
        raise UsageError(f"--onboard-selector: {exc}") from None
    return value


def duration(flag: str, value: str) -> float:
    try:
        seconds = parse_grace(value)
    except ValueError as exc:
        raise UsageError(f"--{flag}: {exc}") from None
    if seconds <= 0:
        raise UsageError(f"--{flag}: must be longer than 0s: {value!r}")
    return seconds


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    flags = Checked.parse(build_parser(environ), argv, ENV)
    args = flags.args
    host, port = flags.listen()
    flags.existing_file("kubeconfig")
    resources = resource_names(args.resources)
    flags.one_of("policy", POLICIES)
    flags.one_of("ledger", LEDGER_SOURCES)
    log_level, log_format = flags.logging()
    cost_ratio = None if flags.raw("eviction-cost-ratio").strip().lower() == "off" else flags.number(
        "eviction-cost-ratio", float, 0)
    return {"host": host, "port": port, "kubeconfig": args.kubeconfig, "resources": resources,
            "lease_namespace": args.lease_namespace, "lease_name": args.lease_name, "identity": args.identity,
            "lease_seconds": flags.number("lease-seconds", float, 2), "policy": args.policy, "ledger": args.ledger,
            "resync": flags.number("resync", float, 0.05),
            "estimate_every": flags.number("estimate-every", float, 1),
            "concurrency": flags.number("concurrency", int, 1),
            "refresh_qps": flags.number("refresh-qps", float, 0.1),
            "refresh_burst": flags.number("refresh-burst", int, 1),
            "min_gap": flags.number("min-pass-gap", float, 0.0, 60.0),
            "eviction_cost_ratio": cost_ratio,
            "eviction_max_wait_s": flags.number("eviction-max-wait", float, 0),
            "nr1_vendors": nr1_vendor_ids(args.nr1_vendor_ids),
            "onboard_selector": onboard_selector(args.onboard_selector),
            "onboard_timeout": duration("onboard-timeout", args.onboard_timeout),
            "node_usage_qps": flags.number("node-usage-qps", float, 0),
            "node_usage_burst": flags.number("node-usage-burst", int, 1),
            "api_timeout": flags.number("api-timeout", float, 0.1),
            "limits": Limits(header_timeout=flags.number("header-timeout", float, 0.1, 3600),
                             idle_timeout=flags.number("idle-timeout", float, 0.1, 86400)),
            "log_level": log_level, "log_format": log_format}


class ControllerProcess:
    """Informers + :class:`ControllerService` + a small health/metrics server."""

    def __init__(self, kube: Any, opts: dict[str, Any]) -> None:
        from scheduler_extender.cmd.server import ControllerService, make_informers
        from scheduler_extender.objects.cluster import ClusterView

        self.kube = kube
        self.view = ClusterView(opts["resources"], ledger=opts.get("ledger", "node"))
        self.registry = CollectorRegistry()
        self.service = ControllerService(kube, self.view, lease_namespace=opts["lease_namespace"],
                                         lease_name=opts["lease_name"], identity=opts["identity"],
                                         policy=opts["policy"], resync=opts["resync"],
                                         lease_seconds=opts["lease_seconds"], registry=self.registry,
                                         estimate_every=opts["estimate_every"], concurrency=opts["concurrency"],
                                         refresh_qps=opts["refresh_qps"], refresh_burst=opts["refresh_burst"],
                                         min_gap=opts["min_gap"], nr1_vendors=opts.get("nr1_vendors", ()),
                                         onboard_selector=opts.get("onboard_selector", ""),
                                         onboard_timeout=opts.get("onboard_timeout", 900.0),
                                         node_usage_qps=opts.get("node_usage_qps", 5.0),
                                         node_usage_burst=opts.get("node_usage_burst", 50),
                                         config=SchedulerConfig(
                                             eviction_cost_ratio=opts.get("eviction_cost_ratio", EVICTION_COST_RATIO),
                                             eviction_max_wait_s=opts.get("eviction_max_wait_s", EVICTION_MAX_WAIT_S)))
        self.informers = make_informers(kube, self.view, self.service.node_event, self.service.pod_event, self._on_gpr,
                                        self._sync_gprs, sync_nodes=self.service.sync_nodes) + self.service.informers
        self.limits: Limits = opts.get("limits") or Limits()
        self.stop_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    def _on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        self.view.on_gpr(kind, obj)
        self.service.on_gpr(kind, obj)

    def _sync_gprs(self, items: Sequence[dict[str, Any]]) -> None:
        objects = list(items)  # decoded once (a Listed decodes at each read), for the view and the controller
        self.view.sync_gprs(objects)
        self.service.sync_gprs(objects)

    def ready(self) -> bool:
        return all(i.synced.is_set() and i.healthy for i in self.informers)

    async def start(self, host: str = "127.0.0.1", port: int = 0, sync_timeout: float = 30.0) -> None:
        from scheduler_extender.cmd.server import wait_synced

        self._tasks = [asyncio.create_task(i.run(self.stop_event), name=f"informer-{i.name}") for i in self.informers]
        await wait_synced(self.informers, sync_timeout)
        self.service.start(self.stop_event)
        app = web.Application()
        app.add_routes(probe_routes(lambda: informer_problems(self.informers), [self.registry]))
        # the same listener as the extender's: fixed answers to malformed HTTP, header and idle timeouts
        self._runner, self.port = await serve_app(app, host, port, limits=self.limits)

    async def stop(self) -> None:
        self.stop_event.set()
        await self.service.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()



async def serve(opts: dict[str, Any]) -> None:
    from kubeapi.client import from_config
    from scheduler_extender.objects.kube import Kube

    kube = Kube(await from_config(opts["kubeconfig"], field_manager="accelstack-gpr-controller",
                                  timeout=opts["api_timeout"]))
    process = ControllerProcess(kube, opts)

    async def stop() -> None:
        await process.stop()
        await kube.close()

    await serve_until_signal(lambda: process.start(opts["host"], opts["port"]), stop,
                             lambda: log.info("controller started", extra={"port": process.port}), log)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("accelstack-controller", argv, parse, serve, log, fast_loop=True)


if __name__ == "__main__":
    raise SystemExit(main())
