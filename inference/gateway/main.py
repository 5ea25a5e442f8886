"""``accelstack-gateway``: the OpenAI-compatible gateway of the inference endpoints.

Every flag has an environment variable (``ACCELSTACK_GW_<FLAG>``); a flag wins over its variable. Bad values
stop the process with exit code 2 and a message naming the flag and, where it came from there, the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from device_plugin.observability import setup_logging
from inference.gateway.server import POLICIES, Gateway, Settings
from inference.routing import EjectionPolicy

log = logging.getLogger("accelstack.gateway")
ENV = "ACCELSTACK_GW_"


class UsageError(ValueError):
    pass


def _env_name(flag: str) -> str:
    return ENV + flag.upper().replace("-", "_")


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accelstack-gateway",
        description="OpenAI-compatible gateway for accelstack inference endpoints: routes by model to the ready "
                    "replicas (least outstanding requests, power of two choices), queues, retries, ejects failing "
                    f"replicas, enforces API keys and access. Each flag can also be set with {ENV}<FLAG>; the flag "
                    "wins.")

    def add(flag: str, default: str, help_text: str) -> None:
        p.add_argument(f"--{flag}", default=environ.get(_env_name(flag), default),
                       help=f"{help_text} [env {_env_name(flag)}; default {default!r}]")

    add("listen", ":8080", "host:port of the OpenAI API, /metrics, /healthz and /readyz")
    add("objects", "", "YAML file of InferenceEndpoints, EndpointSlices and API-key Secrets to serve instead of "
                       "watching the API server (re-read when it changes)")
    add("kubeconfig", "", "kubeconfig file; empty: in-cluster service account, then ~/.kube/config")
    add("namespaces", "", "watch only these namespaces (comma-separated); empty: all")
    add("auth", "true", "require an API key (Authorization: Bearer) on every API call")
    add("policy", "least-request", f"balancing policy: {', '.join(POLICIES)}")
    add("request-timeout", "300", "seconds to the whole answer (JSON) or to the first chunk (stream)")
    add("idle-timeout", "60", "seconds a stream may stay silent before the gateway ends it")
    add("connect-timeout", "2", "seconds to connect to a replica")
    add("queue-timeout", "30", "seconds a request may wait for a replica with room before 429")
    add("retries", "1", "tries on another replica when one fails before anything reached the client")
    add("max-body-bytes", str(8 * 1024 * 1024), "largest request body accepted (413 above)")
    add("eject-after", "3", "consecutive failures that eject a replica")
    add("eject-seconds", "10", "first ejection time in seconds (multiplied by the number of ejections)")
    add("eject-max-seconds", "300", "longest ejection in seconds")
    add("eject-max-fraction", "0.5", "largest fraction of a model's replicas ejected at once")
    add("queue-metric", "vllm:num_requests_waiting", "the runtimes' gauge of waiting requests (from /metrics)")
    add("load-poll-interval", "1", "seconds between reads of the runtimes' queue metric (replicas without it count 0); 0: off")
    add("drain-seconds", "5", "after SIGTERM, seconds to answer /readyz 503 while still serving")
    add("shutdown-timeout", "30", "after draining, seconds to let requests in flight finish")
    add("log-level", "info", "debug, info, warning or error")
    add("log-format", "json", "json or text")
    return p


def _number(args: argparse.Namespace, flag: str, cast: type = float, minimum: float = 0,
            maximum: float | None = None) -> Any:
    value = getattr(args, flag.replace("-", "_"))
    where = f"--{flag} (env {_env_name(flag)})"
    try:
        number = cast(value)
    except ValueError:
        raise UsageError(f"{where}: not a number: {value!r}") from None
    if number < minimum or (maximum is not None and number > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise UsageError(f"{where}: must be {bound}, got {value!r}")
    return number


def _bool(args: argparse.Namespace, flag: str) -> bool:
    value = str(getattr(args, flag.replace("-", "_"))).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"--{flag} (env {_env_name(flag)}): not a boolean (true/false): {value!r}")


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    args = build_parser(environ).parse_args(argv)
    host, sep, port = args.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen (env {_env_name('listen')}): must be host:port or :port, got {args.listen!r}")
    for flag in ("objects", "kubeconfig"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise UsageError(f"--{flag} (env {_env_name(flag)}): no such file: {path}")
    if args.policy not in POLICIES:
        raise UsageError(f"--policy (env {_env_name('policy')}): one of {', '.join(POLICIES)}; got {args.policy!r}")
    if args.log_level not in ("debug", "info", "warning", "error"):
        raise UsageError(f"--log-level (env {_env_name('log-level')}): debug, info, warning or error; "
                         f"got {args.log_level!r}")
    if args.log_format not in ("json", "text"):
        raise UsageError(f"--log-format (env {_env_name('log-format')}): json or text; got {args.log_format!r}")
    settings = Settings(
        auth=_bool(args, "auth"), policy=args.policy,
        request_timeout=_number(args, "request-timeout", float, 0.001),
        idle_timeout=_number(args, "idle-timeout", float, 0.001),
        connect_timeout=_number(args, "connect-timeout", float, 0.001),
        queue_timeout=_number(args, "queue-timeout", float, 0),
        retries=_number(args, "retries", int, 0, 5),
        max_body=_number(args, "max-body-bytes", int, 1024),
        ejection=EjectionPolicy(consecutive_failures=_number(args, "eject-after", int, 1),
                                base_seconds=_number(args, "eject-seconds", float, 0),
                                max_seconds=_number(args, "eject-max-seconds", float, 0),
                                max_fraction=_number(args, "eject-max-fraction", float, 0, 1)),
        drain_seconds=_number(args, "drain-seconds", float, 0),
        shutdown_timeout=_number(args, "shutdown-timeout", float, 0),
        queue_metric=args.queue_metric, load_poll_interval=_number(args, "load-poll-interval", float, 0))
    namespaces = tuple(n.strip() for n in args.namespaces.split(",") if n.strip())
    return {"host": host or "0.0.0.0", "port": int(port), "settings": settings,
            "objects": Path(args.objects) if args.objects else None, "kubeconfig": args.kubeconfig,
            "namespaces": namespaces, "log_level": args.log_level, "log_format": args.log_format}


async def serve(opts: dict[str, Any]) -> None:
    settings: Settings = opts["settings"]
    gateway = Gateway(settings)
    tasks: list[asyncio.Task[Any]] = []
    cleanup: list[Any] = []
    if opts["objects"] is not None:
        from inference.gateway.sources import FileSource

        source = FileSource(opts["objects"], gateway)
        source.load()
        tasks.append(asyncio.create_task(source.run()))
    else:
        from inference.gateway.kube_source import KubeSource

        kube_source = await KubeSource.connect(gateway, opts["kubeconfig"], opts["namespaces"])
        tasks.append(asyncio.create_task(kube_source.run()))
        cleanup.append(kube_source.close)
    runner = web.AppRunner(gateway.app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=settings.shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, opts["host"], opts["port"], backlog=1024)
    await site.start()
    log.info("serving", extra={"listen": f"{opts['host']}:{opts['port']}", "policy": settings.policy,
                               "auth": settings.auth})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        gateway.draining = True
        log.info("draining", extra={"seconds": settings.drain_seconds, "inflight": gateway.inflight})
        await asyncio.sleep(settings.drain_seconds)
    finally:
        await runner.cleanup()  # stops accepting, lets requests in flight finish within shutdown_timeout
        for task in tasks:
            task.cancel()
        for close in cleanup:
            await close()
        log.info("stopped")


def run_loop(coro: Any) -> None:
    """uvloop where it is installed (Linux, a dependency): it halves the gateway's cost per proxied request
    (bench/bench_gateway.py); asyncio otherwise."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse(argv)
    except UsageError as exc:
        print(f"accelstack-gateway: {exc}", file=sys.stderr)
        return 2
    setup_logging(opts["log_level"], opts["log_format"])
    try:
        run_loop(serve(opts))
    except OSError as exc:
        log.error("cannot serve", extra={"error": str(exc)})
        return 1
    except ValueError as exc:  # a malformed objects file, a bad kubeconfig
        log.error("cannot start", extra={"error": str(exc)[:500]})
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
