"""Structured logs, Prometheus metrics and the health endpoints of the device plugin process."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, msg and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class PluginMetrics:
    """The device plugin's Prometheus metrics (prefix ``accelstack_device_plugin_``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        p = "accelstack_device_plugin_"
        self.devices = Gauge(p + "devices", "Advertised devices by health", ["resource", "health"],
                             registry=self.registry)
        self.allocations = Counter(p + "allocations_total", "Allocate calls by result", ["resource", "result"],
                                   registry=self.registry)
        self.allocate_seconds = Histogram(p + "allocate_seconds", "Allocate handling time", ["resource"],
                                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
                                          registry=self.registry)
        self.registrations = Counter(p + "registrations_total", "Registrations with the kubelet by result",
                                     ["resource", "result"], registry=self.registry)
        self.health_changes = Counter(p + "health_transitions_total", "Device health transitions",
                                      ["resource", "to"], registry=self.registry)
        self.registered = Gauge(p + "registered", "1 while registered with the kubelet", ["resource"],
                                registry=self.registry)


READ_TIMEOUT = 10.0  # seconds a read of a request on the metrics listener may wait


class HttpEndpoint:
    """/metrics, /healthz (process alive) and /readyz (``ready()``) on a stdlib WSGI server in a daemon thread.

    The device plugin runs on every node, so it avoids an HTTP framework here: prometheus_client's WSGI app
    plus two tiny routes keep the resident size and start-up time down (see bench/bench_device_plugin.py).
    """

    def __init__(self, address: str, metrics: PluginMetrics, ready: Callable[[], bool],
                 timeout: float = READ_TIMEOUT) -> None:
        host, _, port = address.rpartition(":")
        metrics_app = make_wsgi_app(metrics.registry)

        def app(environ: dict[str, Any], respond: Callable[..., Any]) -> list[bytes]:
            def start_response(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
                # wsgiref would name itself and the Python version in Server
                return respond(status, [*headers, ("Server", "accelstack")], *exc)

            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                start_response("200 OK", [("Content-Type", "text/plain")])
                return [b"ok\n"]
            if path == "/readyz":
                ok = ready()
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"ok\n" if ok else b"not ready\n"]
            if path == "/metrics":
                return list(metrics_app(environ, start_response))
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]

        class QuietHandler(WSGIRequestHandler):
            # a thread per connection: a client that sends nothing, or drips its request, is dropped once a read
            # waits ``timeout`` (one request per connection, HTTP/1.0: no idle keep-alive to bound); the Server
            # header of an error answer names no Python version either
            server_version, sys_version = "accelstack", ""

            def log_message(self, format: str, *args: Any) -> None:
                return None

        QuietHandler.timeout = timeout  # StreamRequestHandler sets it on each connection's socket
        self.server = make_server(host or "0.0.0.0", int(port), app, ThreadingWSGIServer, handler_class=QuietHandler)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_http(address: str, metrics: PluginMetrics, ready: Callable[[], bool]) -> HttpEndpoint | None:
    """Serve the HTTP endpoints on ``address`` ('host:port' or ':port'); None when the address is empty."""
    return HttpEndpoint(address, metrics, ready) if address else None
