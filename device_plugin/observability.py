"""Structured logs, Prometheus metrics and the health endpoints of the device plugin process."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

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


async def start_http(address: str, metrics: PluginMetrics, ready: Callable[[], bool]) -> web.AppRunner | None:
    """Serve /metrics, /healthz (process alive) and /readyz (every resource registered) on ``address``."""
    if not address:
        return None

    async def metrics_handler(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n") if ready() else web.Response(status=503, text="not registered\n")

    app = web.Application(client_max_size=1024)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = address.rpartition(":")
    site = web.TCPSite(runner, host or None, int(port))
    await site.start()
    return runner
