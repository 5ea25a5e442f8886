"""``accelstack-extender``: the scheduler extender, GPR controller, REST API and admission webhook in one process.

Every flag has an environment variable (``ACCELSTACK_EXT_<FLAG>``); a flag wins over its variable. Bad values
stop the process with exit code 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_extender.api.views import DEFAULT_GROUP_LABEL
from scheduler_extender.objects.cluster import LEDGER_SOURCES
from service.flags import Checked, Parser, UsageError, add_api_flags, add_logging_flags, adder, run_service
from service.http_body import DEFAULT_BODY_TIMEOUT
from service.http_listener import DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT, Limits, server_tls

log = logging.getLogger("accelstack.extender")
ENV = "ACCELSTACK_EXT_"
RESOURCE_NAMES = ("nvidia.com/gpu", "neureality.com/nr1")
POLICIES = ("bestfit", "fgd", "random")


def resource_names(value: str) -> tuple[str, ...]:
    """``--resources``: managed extended resource names, comma-separated."""
    resources = tuple(r.strip() for r in value.split(",") if r.strip())
    if not resources or any("/" not in r for r in resources):
        raise UsageError(f"--resources: extended resource names like vendor.com/device, got {value!r}")
    return resources


def node_group_label(value: str) -> str:
    """``--node-group-label``: a label key (``[prefix/]name``)."""
    name = value.rsplit("/", 1)[-1]
    if not value or not name or len(name) > 63 or any(c.isspace() for c in value):
        raise UsageError(f"--node-group-label: a node label key such as {DEFAULT_GROUP_LABEL}, got {value!r}")
    return value


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = Parser(
        prog="accelstack-extender",
        description="kube-scheduler extender (filter, prioritize, preempt, bind), GPR controller (leader-elected), "
                    "REST API and admission webhook for accelstack. Each flag can also be set with the environment "
                    f"variable {ENV}<FLAG> (e.g. {ENV}LISTEN); the flag wins.")

    add = adder(p, environ, ENV)
    add("listen", ":8443", "host:port to serve on")
    add("tls-cert-file", "", "serve HTTPS with this certificate (PEM); needs --tls-key-file")
    add("tls-key-file", "", "private key for --tls-cert-file (PEM)")
    add("url-prefix", "/scheduler", "path prefix of the extender verbs (the scheduler's urlPrefix path)")
    add("scheduler-listen", "", "host:port of a listener of their own for the extender verbs, which then only it "
        "serves; it requires a client certificate signed by --scheduler-client-ca-file (kube-scheduler presents one "
        "through the extender's tlsConfig). Empty: the process refuses to start unless --insecure-verbs says to serve "
        "them on --listen")
    add("insecure-verbs", "false", "serve the extender verbs (bind included) on --listen without client "
        "authentication, to anyone who reaches it (a test, a network only the scheduler reaches); off by default: "
        "use --scheduler-listen")
    add("scheduler-client-ca-file", "", "CA bundle (PEM) that signs kube-scheduler's client certificate for "
        "--scheduler-listen")
    add("scheduler-client-names", "accelstack-scheduler", "common names (comma-separated) a client certificate on "
        "--scheduler-listen must carry (403 otherwise); empty: any certificate the CA signed")
    add("scheduler-http2", "false", "offer HTTP/2 on --scheduler-listen (ALPN h2; HTTP/1.1 is always served). Off: "
        "the shipped profile sends the filter verb alone, one pod at a time, which one kept-alive HTTP/1.1 "
        "connection carries at less CPU; on for a profile that names bindVerb: its binds run in parallel, and over "
        "HTTP/1.1 kube-scheduler opens a TLS connection for each bind in flight beyond two")
    add("resources", ",".join(RESOURCE_NAMES), "managed extended resources, comma-separated")
    add("require-gpr", "false", "refuse managed pods without the accelstack.io/gpr label in filter")
    add("max-body-bytes", str(4 * 1024 * 1024), "largest request body accepted (413 above)")
    add("body-timeout", f"{DEFAULT_BODY_TIMEOUT:g}", "seconds a request body may take to arrive; a slower or "
        "truncated body (less than its Content-Length) is answered 408 and the connection closed")
    add("header-timeout", f"{DEFAULT_HEADER_TIMEOUT:g}", "seconds a connection may take to send a whole request "
        "head (from accept, or from the first byte of a later request; the TLS handshake too); closed after")
    add("idle-timeout", f"{DEFAULT_IDLE_TIMEOUT:g}", "seconds a kept-alive connection may wait for its next request")
    add_api_flags(add, environ, lease_name="accelstack-gpr-controller")
    add("ledger", "node", "where each node's device ledger is kept: node (the Node's accelstack.io/ledger "
        "annotation, written with a conditional patch before each Binding of the bind verb, which the profile must "
        "then name: any number of replicas bind at once) or memory (one replica answers the verbs at a time, the "
        "holder of the Lease --binder-lease: the ledger is the pods bound and those it sent to a node and has not "
        "seen bound yet; the others answer the verbs 503 and the verbs Service routes to the pod it labels "
        "accelstack.io/binder=true; the controller must run with the same --ledger)")
    add("binder-lease", "accelstack-binder", "with --ledger=memory: the Lease (in --lease-namespace) whose holder "
        "answers the scheduler's verbs")
    add("pod-name", environ.get("POD_NAME", ""), "with --ledger=memory: this replica's pod, which the holder of "
        "--binder-lease labels accelstack.io/binder=true while it holds it (the downward API's metadata.name; "
        "default $POD_NAME); empty: no label")
    add("policy", "bestfit", "placement policy of the policy core: bestfit, fgd or random")
    add("resync", "5", "seconds between controller passes when nothing changes")
    add("controller", "true", "run the leader-elected GPR controller inside this process (its passes run in a worker "
        "thread); false when it runs as its own process, accelstack-controller, as the manifests ship it")
    add("waittime-qps", "10", "REST API: wait-time estimates per second per caller (bursts of twice that); 429 above")
    add("node-group-label", DEFAULT_GROUP_LABEL, "REST API and portal: the node label whose values group nodes in "
        "the inventory summary (with the device model)")
    add("webhook", "true", "serve the admission webhook (POST /mutate-pods, /validate-gprs)")
    add("auto-gpr", "false", "webhook: create a GPR from the namespace's default template for unlabelled pods")
    add("auto-gpr-direct", "false", "webhook, with --auto-gpr and --ledger=memory: admit an unlabelled pod at once, "
        "pinned to a node with free devices and with no GPR object, when no GPR of its resource waits and its "
        "template is one node, whole devices and not preemptible (docs/gpr.md)")
    add_logging_flags(add)
    return p


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    flags = Checked.parse(build_parser(environ), argv, ENV)
    args = flags.args
    host, port = flags.listen()
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise UsageError("--tls-cert-file and --tls-key-file: give both or neither")
    for flag in ("tls-cert-file", "tls-key-file", "kubeconfig", "scheduler-client-ca-file"):
        flags.existing_file(flag)
    verbs_host, verbs_port = flags.listen("scheduler-listen") if args.scheduler_listen else ("", 0)
    if args.scheduler_listen and not (args.tls_cert_file and args.scheduler_client_ca_file):
        raise UsageError("--scheduler-listen: needs --tls-cert-file and --scheduler-client-ca-file (the verbs' own "
                         "listener only takes clients with a certificate)")
    if args.scheduler_client_ca_file and not args.scheduler_listen:
        raise UsageError("--scheduler-client-ca-file: needs --scheduler-listen")
    if args.scheduler_listen and (verbs_host, verbs_port) == (host, port):
        raise UsageError("--scheduler-listen: must differ from --listen")
    resources = resource_names(args.resources)
    if flags.boolean("auto-gpr-direct") and not flags.boolean("auto-gpr"):
        raise UsageError("--auto-gpr-direct: needs --auto-gpr=true (it admits the pods a GPR would be made for)")
    if flags.boolean("auto-gpr-direct") and args.ledger != "memory":
        raise UsageError("--auto-gpr-direct: needs --ledger=memory (the one replica that binds pins the pods it "
                         "admits; with --ledger=node none does)")
    if flags.boolean("auto-gpr-direct") and flags.boolean("require-gpr"):
        raise UsageError("--auto-gpr-direct: the pods it admits have no GPR, which --require-gpr=true refuses")
    flags.one_of("policy", POLICIES)
    flags.one_of("ledger", LEDGER_SOURCES)
    log_level, log_format = flags.logging()
    if not args.url_prefix.startswith("/"):
        raise UsageError(f"--url-prefix: must start with '/', got {args.url_prefix!r}")
    opts = {
        "host": host, "port": port, "cert": args.tls_cert_file, "key": args.tls_key_file,
        "prefix": args.url_prefix, "resources": resources, "require_gpr": flags.boolean("require-gpr"),
        "max_body": flags.number("max-body-bytes", int, 1024), "kubeconfig": args.kubeconfig,
        "body_timeout": flags.number("body-timeout", float, 0.01),
        "lease_namespace": args.lease_namespace, "lease_name": args.lease_name, "identity": args.identity,
        "lease_seconds": flags.number("lease-seconds", int, 2), "policy": args.policy,
        "resync": flags.number("resync", float, 0.05), "controller": flags.boolean("controller"),
        "webhook": flags.boolean("webhook"), "auto_gpr": flags.boolean("auto-gpr"),
        "auto_gpr_direct": flags.boolean("auto-gpr-direct"),
        "log_level": log_level, "log_format": log_format,
        "api_timeout": flags.number("api-timeout", float, 0.1),
        "waittime_qps": flags.number("waittime-qps", float, 0.1),
        "node_group_label": node_group_label(args.node_group_label),
        "verbs_host": verbs_host, "verbs_port": verbs_port, "client_ca": args.scheduler_client_ca_file,
        "client_names": tuple(n.strip() for n in args.scheduler_client_names.split(",") if n.strip()),
        "ledger": args.ledger, "binder_lease": args.binder_lease, "pod_name": args.pod_name,
        "verbs_http2": flags.boolean("scheduler-http2"),
        "limits": Limits(header_timeout=flags.number("header-timeout", float, 0.1, 3600),
                         idle_timeout=flags.number("idle-timeout", float, 0.1, 86400)),
    }
    insecure_verbs = flags.boolean("insecure-verbs")  # checked last: other flags' errors come first
    if not args.scheduler_listen and not insecure_verbs:
        raise UsageError("--scheduler-listen: the extender verbs need a listener of their own that takes only "
                         "kube-scheduler's client certificate (with --scheduler-client-ca-file); "
                         "--insecure-verbs serves them on --listen to anyone instead")
    if args.scheduler_listen and insecure_verbs:
        raise UsageError("--insecure-verbs: not with --scheduler-listen (the verbs are served there only)")
    return opts


async def serve(opts: dict[str, Any]) -> None:
    from kubeapi.client import from_config
    from scheduler_extender.cmd.server import ExtenderServer
    from scheduler_extender.objects.kube import Kube

    kube = Kube(await from_config(opts["kubeconfig"], field_manager="accelstack-extender",
                                  timeout=opts["api_timeout"]))
    server = ExtenderServer(kube, opts["resources"], opts["prefix"], opts["require_gpr"], opts["max_body"], None,
                            run_controller=opts["controller"], lease_namespace=opts["lease_namespace"],
                            lease_name=opts["lease_name"], identity=opts["identity"], policy=opts["policy"],
                            resync=opts["resync"], lease_seconds=opts["lease_seconds"],
                            waittime_qps=opts["waittime_qps"], body_timeout=opts["body_timeout"],
                            node_group_label=opts["node_group_label"], verbs_apart=bool(opts.get("verbs_host")),
                            verbs_clients=opts.get("client_names", ()), limits=opts.get("limits", Limits()),
                            ledger=opts.get("ledger", "node"), binder_lease=opts.get("binder_lease", "accelstack-binder"),
                            pod_name=opts.get("pod_name", ""), pod_namespace=os.environ.get("POD_NAMESPACE", ""),
                            verbs_http2=opts.get("verbs_http2", False))
    if opts["webhook"]:
        # the replica that answers the verbs (ledger "memory") pins each pod of an admitted GPR to one node
        # (once its term's hand-over wait is over: ``binding`` turns True only then)
        add_webhook = webhook_routes(kube, opts, server.view,
                                     pin=lambda: server.view.ledger_source == "memory" and server.binding,
                                     server=server)
        if add_webhook is not None:
            add_webhook(server.app)
    context = server_tls(opts["cert"], opts["key"]) if opts["cert"] else None
    verbs_context = None
    if opts.get("verbs_host"):  # a client certificate from that CA or no TLS session at all
        verbs_context = server_tls(opts["cert"], opts["key"], client_ca=opts["client_ca"])
    else:
        log.warning("--insecure-verbs: the extender verbs (bind included) are served on --listen without client "
                    "authentication: anyone who reaches it can call them")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start(opts["host"], opts["port"], context, verbs_host=opts.get("verbs_host") or "127.0.0.1",
                       verbs_port=opts.get("verbs_port", 0), verbs_ssl=verbs_context)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await server.stop()
        await kube.close()


def webhook_routes(kube: Any, opts: dict[str, Any], view: Any = None, pin: Any = None, server: Any = None) -> Any:
    """The admission webhook's routes, when this build has the webhook module; with ``--auto-gpr-direct`` and the
    ``server`` whose informer feeds ``view``, the loop that admits the pods the other replica handed over."""
    try:
        webhook: Any = importlib.import_module("scheduler_extender.admission.webhook")
    except ImportError:
        log.warning("webhook module not available; admission endpoints not served")
        return None

    def add(app: Any) -> None:
        handler = webhook.Webhook(webhook.KubeLookup(kube), resources=opts["resources"],
                                  auto_gpr=opts["auto_gpr"], body_timeout=opts["body_timeout"], view=view,
                                  own_namespace=opts.get("lease_namespace") or "accelstack-system", pin=pin,
                                  auto_gpr_direct=opts.get("auto_gpr_direct", False))
        webhook.add_webhook_routes(app, handler)
        if server is not None and handler.auto_gpr_direct:
            server.pod_listeners.append(handler.on_pod)

            tasks: list[asyncio.Task[None]] = []

            async def start(app: Any) -> None:
                tasks.append(asyncio.create_task(handler.hand_offs(server.stop_event), name="hand-offs"))

            async def stop(app: Any) -> None:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

            app.on_startup.append(start)
            app.on_cleanup.append(stop)

    return add


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("accelstack-extender", argv, parse, serve, log, fast_loop=True)


if __name__ == "__main__":
    raise SystemExit(main())
