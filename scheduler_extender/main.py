"""``accelstack-extender``: the scheduler extender, GPR controller, REST API and admission webhook in one process.

Every flag has an environment variable (``ACCELSTACK_EXT_<FLAG>``); a flag wins over its variable. Bad values
stop the process with exit code 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import ssl
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from device_plugin.observability import setup_logging
from scheduler_extender.http_body import DEFAULT_BODY_TIMEOUT

log = logging.getLogger("accelstack.extender")
ENV = "ACCELSTACK_EXT_"
RESOURCE_NAMES = ("nvidia.com/gpu", "neureality.com/nr1")


def _env(environ: Mapping[str, str], flag: str, default: str) -> str:
    return environ.get(ENV + flag.upper().replace("-", "_"), default)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accelstack-extender",
        description="kube-scheduler extender (filter, prioritize, preempt, bind), GPR controller (leader-elected), "
                    "REST API and admission webhook for accelstack. Each flag can also be set with the environment "
                    f"variable {ENV}<FLAG> (e.g. {ENV}LISTEN); the flag wins.")

    def add(flag: str, default: str, help_text: str, **kw: Any) -> None:
        p.add_argument(f"--{flag}", default=_env(environ, flag, default),
                       help=f"{help_text} [env {ENV}{flag.upper().replace('-', '_')}; default {default!r}]", **kw)

    add("listen", ":8443", "host:port to serve on")
    add("tls-cert-file", "", "serve HTTPS with this certificate (PEM); needs --tls-key-file")
    add("tls-key-file", "", "private key for --tls-cert-file (PEM)")
    add("url-prefix", "/scheduler", "path prefix of the extender verbs (the scheduler's urlPrefix path)")
    add("resources", ",".join(RESOURCE_NAMES), "managed extended resources, comma-separated")
    add("require-gpr", "false", "refuse managed pods without the accelstack.io/gpr label in filter")
    add("max-body-bytes", str(4 * 1024 * 1024), "largest request body accepted (413 above)")
    add("body-timeout", f"{DEFAULT_BODY_TIMEOUT:g}", "seconds a request body may take to arrive; a slower or "
        "truncated body (less than its Content-Length) is answered 408 and the connection closed")
    add("kubeconfig", "", "kubeconfig file; empty: in-cluster service account, then ~/.kube/config")
    add("lease-namespace", environ.get("POD_NAMESPACE", "accelstack-system"), "namespace of the leader Lease")
    add("lease-name", "accelstack-gpr-controller", "name of the leader Lease")
    add("identity", environ.get("POD_NAME", ""), "leader-election identity (default: host-pid)")
    add("lease-seconds", "15", "leader lease duration in seconds")
    add("policy", "bestfit", "placement policy of the policy core: bestfit, fgd or random")
    add("resync", "5", "seconds between controller passes when nothing changes")
    add("controller", "true", "run the leader-elected GPR controller inside this process (its passes run in a worker "
        "thread); false when it runs as its own process, accelstack-controller, as the manifests ship it")
    add("api-timeout", "10", "seconds before an API server call is abandoned (reads are retried with backoff)")
    add("waittime-qps", "10", "REST API: wait-time estimates per second per caller (bursts of twice that); 429 above")
    add("webhook", "true", "serve the admission webhook (POST /mutate-pods, /validate-gprs)")
    add("auto-gpr", "false", "webhook: create a GPR from the namespace's default template for unlabelled pods")
    add("log-level", "info", "debug, info, warning or error")
    add("log-format", "json", "json or text")
    return p


class UsageError(ValueError):
    pass


def _bool(name: str, value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"--{name}: not a boolean: {value!r}")


def _number(name: str, value: str, cast: type = float, minimum: float = 0) -> Any:
    try:
        number = cast(value)
    except ValueError:
        raise UsageError(f"--{name}: not a number: {value!r}") from None
    if number < minimum:
        raise UsageError(f"--{name}: must be >= {minimum}, got {value!r}")
    return number


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    args = build_parser(environ).parse_args(argv)
    host, sep, port = args.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen: must be host:port or :port, got {args.listen!r}")
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise UsageError("--tls-cert-file and --tls-key-file: give both or neither")
    for path_flag in ("tls_cert_file", "tls_key_file", "kubeconfig"):
        path = getattr(args, path_flag)
        if path and not os.path.isfile(path):
            raise UsageError(f"--{path_flag.replace('_', '-')}: no such file: {path}")
    resources = tuple(r.strip() for r in args.resources.split(",") if r.strip())
    if not resources or any("/" not in r for r in resources):
        raise UsageError(f"--resources: extended resource names like vendor.com/device, got {args.resources!r}")
    if args.policy not in ("bestfit", "fgd", "random"):
        raise UsageError(f"--policy: one of bestfit, fgd, random; got {args.policy!r}")
    if args.log_level not in ("debug", "info", "warning", "error") or args.log_format not in ("json", "text"):
        raise UsageError("--log-level / --log-format: debug|info|warning|error and json|text")
    if not args.url_prefix.startswith("/"):
        raise UsageError(f"--url-prefix: must start with '/', got {args.url_prefix!r}")
    return {
        "host": host or "0.0.0.0", "port": int(port), "cert": args.tls_cert_file, "key": args.tls_key_file,
        "prefix": args.url_prefix, "resources": resources, "require_gpr": _bool("require-gpr", args.require_gpr),
        "max_body": _number("max-body-bytes", args.max_body_bytes, int, 1024), "kubeconfig": args.kubeconfig,
        "body_timeout": _number("body-timeout", args.body_timeout, float, 0.01),
        "lease_namespace": args.lease_namespace, "lease_name": args.lease_name, "identity": args.identity,
        "lease_seconds": _number("lease-seconds", args.lease_seconds, int, 2), "policy": args.policy,
        "resync": _number("resync", args.resync, float, 0.05), "controller": _bool("controller", args.controller),
        "webhook": _bool("webhook", args.webhook), "auto_gpr": _bool("auto-gpr", args.auto_gpr),
        "log_level": args.log_level, "log_format": args.log_format,
        "api_timeout": _number("api-timeout", args.api_timeout, float, 0.1),
        "waittime_qps": _number("waittime-qps", args.waittime_qps, float, 0.1),
    }


async def serve(opts: dict[str, Any]) -> None:
    from kubeapi.client import from_config
    from scheduler_extender.kube import Kube
    from scheduler_extender.server import ExtenderServer

    kube = Kube(await from_config(opts["kubeconfig"], field_manager="accelstack-extender",
                                  timeout=opts["api_timeout"]))
    server = ExtenderServer(kube, opts["resources"], opts["prefix"], opts["require_gpr"], opts["max_body"], None,
                            run_controller=opts["controller"], lease_namespace=opts["lease_namespace"],
                            lease_name=opts["lease_name"], identity=opts["identity"], policy=opts["policy"],
                            resync=opts["resync"], lease_seconds=opts["lease_seconds"],
                            waittime_qps=opts["waittime_qps"], body_timeout=opts["body_timeout"])
    if opts["webhook"]:
        add_webhook = webhook_routes(kube, opts, server.view)
        if add_webhook is not None:
            add_webhook(server.app)
    context = None
    if opts["cert"]:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(opts["cert"], opts["key"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start(opts["host"], opts["port"], context)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await server.stop()
        await kube.close()


def webhook_routes(kube: Any, opts: dict[str, Any], view: Any = None) -> Any:
    """The admission webhook's routes, when this build has the webhook module."""
    try:
        webhook: Any = importlib.import_module("scheduler_extender.webhook")
    except ImportError:
        log.warning("webhook module not available; admission endpoints not served")
        return None

    def add(app: Any) -> None:
        handler = webhook.Webhook(webhook.KubeLookup(kube), resources=opts["resources"],
                                  auto_gpr=opts["auto_gpr"], body_timeout=opts["body_timeout"], view=view)
        webhook.add_webhook_routes(app, handler)

    return add


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse(argv)
    except UsageError as exc:
        print(f"accelstack-extender: {exc}", file=sys.stderr)
        return 2
    setup_logging(opts["log_level"], opts["log_format"])
    try:
        asyncio.run(serve(opts))
    except (OSError, ssl.SSLError) as exc:
        log.error("cannot serve", extra={"error": str(exc)})
        return 1
    except Exception as exc:  # kubeconfig missing, API server unreachable at start
        log.error("cannot start", extra={"error": f"{type(exc).__name__}: {exc}"[:500]})
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
