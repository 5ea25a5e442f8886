"""``accelstack-gateway``: the OpenAI-compatible gateway of the inference endpoints.

Every flag has an environment variable (``ACCELSTACK_GW_<FLAG>``); a flag wins over its variable. Bad values
stop the process with exit code 2 and a message naming the flag and, where it came from there, the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inference.gateway.listener import Listener
from inference.gateway.server import POLICIES, Gateway, Settings
from inference.routing import EjectionPolicy
from service.flags import Checked, Parser, UsageError, add_api_flags, add_logging_flags, adder, run_loop
from service.observability import setup_logging

log = logging.getLogger("accelstack.gateway")
ENV = "ACCELSTACK_GW_"


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = Parser(
        prog="accelstack-gateway",
        description="OpenAI-compatible gateway for accelstack inference endpoints: routes by model to the ready "
                    "replicas (least outstanding requests, power of two choices), queues, retries, ejects failing "
                    f"replicas, enforces API keys and access. Each flag can also be set with {ENV}<FLAG>; the flag "
                    "wins.")

    add = adder(p, environ, ENV)
    add("listen", ":8080", "host:port of the OpenAI API, /metrics, /healthz and /readyz")
    add("objects", "", "YAML file of InferenceEndpoints, EndpointSlices and API-key Secrets to serve instead of "
                       "watching the API server (re-read when it changes)")
    add_api_flags(add, environ, api_timeout=False)
    add("namespaces", "", "watch only these namespaces (comma-separated); empty: all")
    add("key-namespaces", "", "read API-key Secrets only in these namespaces (comma-separated; the account needs "
                              "list,watch of Secrets there and nowhere else); empty: those of --namespaces")
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
    add("client-header-timeout", "10", "seconds a client has to send a request's line and headers (from its first "
                                       "byte, or from connecting); then the connection is closed")
    add("client-body-timeout", "60", "seconds a client has to send a request's whole body (408 and close after)")
    add("client-idle-timeout", "75", "seconds an idle keep-alive connection stays open between requests")
    add("queue-metric", "vllm:num_requests_waiting", "the runtimes' gauge of waiting requests (from /metrics)")
    add("load-poll-interval", "1", "seconds between reads of the runtimes' queue metric (replicas without it count 0); 0: off")
    add("access-log", "false", "log one line per API request (request id, caller, model, status, duration; "
                               "never the key) on the logger accelstack.gateway.access")
    add("drain-seconds", "5", "after SIGTERM, seconds to answer /readyz 503 while still serving")
    add("shutdown-timeout", "30", "after draining, seconds to let requests in flight finish")
    add_logging_flags(add)
    return p


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    flags = Checked.parse(build_parser(environ), argv, ENV, name_env=True)
    args = flags.args
    host, port = flags.listen()
    for flag in ("objects", "kubeconfig"):
        flags.existing_file(flag)
    flags.one_of("policy", POLICIES)
    log_level, log_format = flags.logging()
    settings = Settings(
        auth=flags.boolean("auth"), policy=args.policy,
        request_timeout=flags.number("request-timeout", float, 0.001),
        idle_timeout=flags.number("idle-timeout", float, 0.001),
        connect_timeout=flags.number("connect-timeout", float, 0.001),
        queue_timeout=flags.number("queue-timeout", float, 0),
        retries=flags.number("retries", int, 0, 5),
        max_body=flags.number("max-body-bytes", int, 1024),
        ejection=EjectionPolicy(consecutive_failures=flags.number("eject-after", int, 1),
                                base_seconds=flags.number("eject-seconds", float, 0),
                                max_seconds=flags.number("eject-max-seconds", float, 0),
                                max_fraction=flags.number("eject-max-fraction", float, 0, 1)),
        drain_seconds=flags.number("drain-seconds", float, 0),
        shutdown_timeout=flags.number("shutdown-timeout", float, 0),
        body_timeout=flags.number("client-body-timeout", float, 0.001),
        queue_metric=args.queue_metric, load_poll_interval=flags.number("load-poll-interval", float, 0),
        access_log=flags.boolean("access-log"))
    namespaces, key_namespaces = namespace_list(flags, "namespaces"), namespace_list(flags, "key-namespaces")
    return {"host": host, "port": port, "settings": settings,
            "objects": Path(args.objects) if args.objects else None, "kubeconfig": args.kubeconfig,
            "namespaces": namespaces, "key_namespaces": key_namespaces, "log_level": log_level, "log_format": log_format,
            "header_timeout": flags.number("client-header-timeout", float, 0.001),
            "keepalive_timeout": flags.number("client-idle-timeout", float, 0.001)}


NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def namespace_list(flags: Checked, flag: str) -> tuple[str, ...]:
    """A comma-separated list of namespace names (DNS labels), in order, without repeats."""
    names = tuple(dict.fromkeys(n.strip() for n in flags.raw(flag).split(",") if n.strip()))
    bad = [n for n in names if not NAMESPACE.fullmatch(n)]
    if bad:
        raise UsageError(f"{flags.label(flag)}: not a namespace name: {bad[0][:80]!r}")
    return names


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

        kube_source = await KubeSource.connect(gateway, opts["kubeconfig"], opts["namespaces"],
                                               opts["key_namespaces"])
        tasks.append(asyncio.create_task(kube_source.run()))
        cleanup.append(kube_source.close)
    listener = Listener(gateway.handle, header_timeout=opts["header_timeout"], idle_timeout=opts["keepalive_timeout"])
    await gateway.start()
    try:
        await listener.start(opts["host"], opts["port"], backlog=1024)
    except OSError:
        await gateway.stop()
        raise
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
        await listener.close(settings.shutdown_timeout)  # stops accepting, lets requests finish within the timeout
        await gateway.stop()
        for task in tasks:
            task.cancel()
        for close in cleanup:
            await close()
        log.info("stopped")


def return_big_buffers_to_the_os() -> bool:
    """Fix glibc's mmap threshold at 64 KiB, so every request body (and every chunk of one) of that size or more is
    its own mapping that free() hands back to the kernel.

    glibc raises the threshold to the size of the largest mapping freed so far (up to 32 MiB): after a few 8 MiB
    bodies, later ones came from the heap, fragmented it, and the gateway kept tens of MiB per burst of large
    bodies for good (measured: +86 MiB after 32 chunked 9 MiB bodies; +32 MiB with the threshold at 256 KiB, where
    the socket's chunks still came from the heap; +4 MiB at 64 KiB). A fixed value turns the adjustment off.
    False where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 64 * 1024))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse(argv)
    except UsageError as exc:
        print(f"accelstack-gateway: {exc}", file=sys.stderr)
        return 2
    setup_logging(opts["log_level"], opts["log_format"])
    return_big_buffers_to_the_os()
    from kubeapi.client import ConfigMissing

    try:
        run_loop(serve(opts))
    except ConfigMissing as exc:  # no kubeconfig and not in a cluster: one line naming it, not a traceback
        log.error("cannot start", extra={"error": str(exc)})
        return 1
    except OSError as exc:
        log.error("cannot serve", extra={"error": str(exc)})
        return 1
    except ValueError as exc:  # a malformed objects file, a bad kubeconfig
        log.error("cannot start", extra={"error": str(exc)[:500]})
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
