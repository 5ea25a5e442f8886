"""``accelstack-inference-operator``: the CG operator (leader-elected), with /healthz, /readyz and /metrics.

Every flag has an environment variable (``ACCELSTACK_IO_<FLAG>``); a flag wins over its variable. Bad values
stop the process with exit code 2 and a message naming the flag and its variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from inference.operator.objects import OperatorSettings
from service.flags import Checked, Parser, UsageError, add_api_flags, add_logging_flags, adder, run_service
from service.http_listener import Limits, serve_app

log = logging.getLogger("accelstack.inference.operator")
ENV = "ACCELSTACK_IO_"


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = Parser(
        prog="accelstack-inference-operator",
        description="The CG operator: reconciles InferenceEndpoints into Deployments, Services, GPRs, "
                    "PodDisruptionBudgets, NetworkPolicies and HorizontalPodAutoscalers (leader-elected). Each flag "
                    f"can also be set with {ENV}<FLAG>; the flag wins.")

    add = adder(p, environ, ENV)
    add("listen", ":8082", "host:port for /healthz, /readyz and /metrics")
    add_api_flags(add, environ, lease_name="accelstack-inference-operator", identity=False)
    add("gateway-namespace", "accelstack-system", "namespace of accelstack-gateway (NetworkPolicies admit it)")
    add("gateway-url", "http://accelstack-gateway.accelstack-system.svc/v1", "the gateway's URL, shown in "
        "each endpoint's status")
    add("resync", "30", "seconds between passes over every endpoint when nothing changes")
    add_logging_flags(add)
    return p


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    flags = Checked.parse(build_parser(environ), argv, ENV, name_env=True)
    args = flags.args
    host, port = flags.listen()
    flags.existing_file("kubeconfig")
    log_level, log_format = flags.logging()
    if not args.gateway_url.startswith(("http://", "https://")):
        raise UsageError(f"{flags.label('gateway-url')}: an http(s) URL, got {args.gateway_url!r}")
    return {"host": host, "port": port, "kubeconfig": args.kubeconfig,
            "lease_namespace": args.lease_namespace, "lease_name": args.lease_name,
            "lease_seconds": flags.number("lease-seconds", float, 3), "resync": flags.number("resync", float, 1),
            "api_timeout": flags.number("api-timeout", float, 0.1),
            "identity": environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
            "settings": OperatorSettings(gateway_namespace=args.gateway_namespace, gateway_url=args.gateway_url),
            "log_level": log_level, "log_format": log_format}


async def serve(opts: dict[str, Any]) -> None:
    from inference.operator.controller import FIELD_MANAGER, Operator
    from kubeapi.client import from_config
    from kubeapi.leader import LeaderElector
    from kubeapi.tasks import supervise, while_leading

    kube = await from_config(opts["kubeconfig"], field_manager=FIELD_MANAGER, timeout=opts["api_timeout"])
    operator = Operator(kube, opts["settings"], resync=opts["resync"], identity=opts["identity"])
    lease = opts["lease_seconds"]
    elector = LeaderElector(kube, opts["lease_namespace"], opts["lease_name"], opts["identity"],
                            lease_duration=lease, renew_deadline=lease * 2 / 3, retry_period=lease * 2 / 15)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if operator.healthy():
            return web.Response(text="ok\n")
        broken = ", ".join(f"{i.name}: {i.last_error or 'not synced'}" for i in operator.informers if not i.healthy)
        return web.Response(status=503, text=f"not ready: {broken}\n")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(operator.registry) + generate_latest(REGISTRY),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics)])
    # the bounds every accelstack listener has (request-head and idle timeouts, a quiet fixed answer to
    # malformed HTTP, no version banner: service/http_listener.py)
    runner, _ = await serve_app(app, opts["host"], opts["port"], limits=Limits())
    log.info("started", extra={"listen": f"{opts['host']}:{opts['port']}", "identity": opts["identity"]})
    leading = asyncio.create_task(elector.run(stop))
    tasks = [asyncio.create_task(supervise("informers", operator.run_informers, stop)),
             asyncio.create_task(while_leading(elector, stop, {"reconcile": operator.run_workers}))]
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        for task in tasks:  # open watches would otherwise hold the exit until the server ends them
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.wait([leading], timeout=opts["api_timeout"] + 1)  # it releases the Lease on its way out
        leading.cancel()
        await runner.cleanup()
        await kube.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("accelstack-inference-operator", argv, parse, serve, log)


if __name__ == "__main__":
    raise SystemExit(main())
