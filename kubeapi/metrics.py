"""Prometheus metrics of the client layer, one set per registry (a process may expose several registries), and
the process's garbage-collector pauses (``accelstack_gc_pause_seconds``): a full collection over the informers'
objects stops the event loop that answers the scheduler and the webhooks, and shows there first."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class ApiMetrics:
    latency: Histogram
    retries: Counter
    watch_seconds: Histogram
    informer_healthy: Gauge
    relists: Counter
    task_restarts: Counter
    leader: Gauge
    gc_pause: Histogram


_SETS: dict[int, tuple[CollectorRegistry, ApiMetrics]] = {}


def api_metrics(registry: CollectorRegistry | None = None) -> ApiMetrics:
    registry = registry or REGISTRY
    known = _SETS.get(id(registry))
    if known is not None and known[0] is registry:
        return known[1]
    p = "accelstack_kube_"
    metrics = ApiMetrics(
        latency=Histogram(p + "request_seconds", "API server calls by verb, resource and HTTP status "
                          "(timeout/error when no answer came)", ["verb", "resource", "code"], buckets=_BUCKETS,
                          registry=registry),
        retries=Counter(p + "retries_total", "API calls retried after a transient failure", ["verb", "resource"],
                        registry=registry),
        watch_seconds=Histogram(p + "watch_seconds", "How long watch requests stayed open, by end",
                                ["resource", "code"], buckets=(1, 10, 60, 300, 600, 1800), registry=registry),
        informer_healthy=Gauge(p + "informer_healthy", "1 while the informer's last list succeeded and its watch runs",
                               ["informer"], registry=registry),
        relists=Counter(p + "informer_lists_total", "Full lists made by informers", ["informer"], registry=registry),
        task_restarts=Counter("accelstack_task_restarts_total", "Background tasks restarted after a crash",
                              ["task"], registry=registry),
        leader=Gauge("accelstack_leader", "1 while this replica holds the leader Lease", ["lease"],
                     registry=registry),
        gc_pause=Histogram("accelstack_gc_pause_seconds", "Pauses of the cyclic garbage collector by generation",
                           ["generation"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                           registry=registry),
    )
    _SETS[id(registry)] = (registry, metrics)
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    return metrics


_gc_started = 0.0


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
        return
    pause = time.perf_counter() - _gc_started
    generation = str(info.get("generation", ""))
    for _, metrics in _SETS.values():
        metrics.gc_pause.labels(generation).observe(pause)
