"""The gateway's per-request metrics are plain numbers (HotMetric) but must read exactly as prometheus_client's."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inference.gateway.metrics import GatewayMetrics, HotMetric, _HotCollector

BUCKETS = (0.005, 0.1, 1, 2.5)


def exposition(registry: CollectorRegistry) -> list[str]:
    """Sorted lines, creation times masked (they differ by the microseconds between the two objects)."""
    text = generate_latest(registry).decode()
    return sorted(re.sub(r"^(\w+_created\S*) \S+$", r"\1 T", line) for line in text.splitlines())


def test_hot_metrics_expose_what_prometheus_client_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hot = [HotMetric("counter", "x_requests_total", "doc", ["model", "code"]),
           HotMetric("gauge", "x_inflight", "doc", ["model"]),
           HotMetric("histogram", "x_seconds", "doc", ["model"], buckets=BUCKETS)]
    ours.register(_HotCollector(hot))  # type: ignore[arg-type]
    ref = (Counter("x_requests_total", "doc", ["model", "code"], registry=theirs),
           Gauge("x_inflight", "doc", ["model"], registry=theirs),
           Histogram("x_seconds", "doc", ["model"], buckets=BUCKETS, registry=theirs))
    for metrics in (hot, ref):
        counter, gauge, histogram = metrics
        counter.labels("m", "200").inc()
        counter.labels("m", "200").inc(2)
        counter.labels("n", "500").inc()
        gauge.labels("m").inc()
        gauge.labels("m").inc()
        gauge.labels("m").dec()
        gauge.labels("n").set(4)
        for value in (0.001, 0.005, 0.0051, 0.1, 3, 1e9):  # on a bound counts in its bucket ("le")
            histogram.labels("m").observe(value)
    assert exposition(ours) == exposition(theirs)
    hot[0].remove("n", "500")
    with pytest.raises(KeyError):
        hot[0].remove("n", "500")
    assert not any('model="n",code="500"' in line for line in exposition(ours))
    with pytest.raises(ValueError, match="expected 2 label values"):
        hot[0].labels("m")


def test_forgetting_a_replica_drops_its_hot_series() -> None:
    from inference.routing import Replica, ReplicaSpec

    metrics = GatewayMetrics()
    replica = Replica(ReplicaSpec(url="http://10.0.0.1:8000", pod="llm-0", namespace="team-a"))
    metrics.child(metrics.latency, "m", "llm-0").observe(0.2)
    metrics.child(metrics.requests, "m", "llm-0", "200").inc()
    metrics.child(metrics.replica_inflight, "m", "team-a", "llm-0").inc()
    assert 'replica="llm-0"' in generate_latest(metrics.registry).decode()
    metrics.forget_replica("m", replica)
    text = generate_latest(metrics.registry).decode()
    assert "llm-0" not in text
