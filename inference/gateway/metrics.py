"""The gateway's Prometheus metrics (prefix ``accelstack_gateway_``); names and labels are in docs/metrics.md.

``replica_inflight`` is the per-pod metric the CG Deployments' HorizontalPodAutoscalers read through the
Prometheus Adapter: its ``replica_namespace``/``replica_pod`` labels name the CG pod (not the gateway's own pod,
which Prometheus labels ``namespace``/``pod``), and the adapter rule maps them to the pod resource.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from inference.names import METRIC_PREFIX as P
from inference.routing import Replica

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# past the default --queue-timeout (30 s), so a queue timeout shows as its own bucket rather than +Inf
_QUEUE = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 120, 300)
_TTFB = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def replica_label(replica: Replica) -> str:
    """The replica's pod name, or its host:port when discovery gave none."""
    return replica.spec.pod or replica.url.removeprefix("http://")


class _Value:
    """A counter's or gauge's value: a plain number (the gateway serves on one event loop, and ``/metrics`` is
    answered on that loop too, so no lock)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _Buckets:
    """A histogram child: per-bucket counts (not cumulative until scraped) and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus' "le"
        self.sum += value


class HotMetric:
    """A metric touched on every proxied request (counter, gauge or histogram), exposed exactly as
    prometheus_client would expose it (``_total``/``_created``, ``_bucket``/``_count``/``_sum``) but updated
    without prometheus_client's per-value lock and checks: those were about 8 us of the gateway's CPU per
    request. Children are made on first use with :meth:`labels`, as prometheus_client's are."""

    def __init__(self, kind: str, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: tuple[float, ...] = ()) -> None:
        self.kind, self.documentation, self.labelnames = kind, documentation, tuple(labelnames)
        self._name = name.removesuffix("_total") if kind == "counter" else name
        self.buckets = buckets
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self._name}: expected {len(self.labelnames)} label values, got {len(values)}")
            child = self._children[values] = _Buckets(self.buckets) if self.kind == "histogram" else _Value()
        return child

    def remove(self, *values: str) -> None:
        del self._children[values]

    def clear(self) -> None:
        self._children.clear()

    def families(self) -> Iterator[Metric]:
        name, names = self._name, self.labelnames
        main = Metric(name, self.documentation, self.kind)
        created = Metric(f"{name}_created", self.documentation, "gauge")
        les = [floatToGoString(b) for b in self.buckets] + ["+Inf"]
        for values, child in self._children.items():
            labels = dict(zip(names, values, strict=True))
            if self.kind == "counter":
                main.add_sample(f"{name}_total", labels, child.value)
            elif self.kind == "gauge":
                main.add_sample(name, labels, child.value)
                continue
            else:
                total = 0
                for le, count in zip(les, child.counts, strict=True):
                    total += count
                    main.add_sample(f"{name}_bucket", {**labels, "le": le}, float(total))
                main.add_sample(f"{name}_count", labels, float(total))
                main.add_sample(f"{name}_sum", labels, child.sum)
            created.add_sample(f"{name}_created", labels, child.created)
        yield main
        if self.kind != "gauge":
            yield created


class _HotCollector:
    def __init__(self, metrics: list[HotMetric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield from metric.families()


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # the metrics every proxied request touches: plain numbers (HotMetric), the rest prometheus_client's
        self.requests = HotMetric("counter", P + "requests_total", "Requests answered, by model, replica and HTTP "
                                  "status", ["model", "replica", "code"])
        self.errors = Counter(P + "errors_total", "Requests that failed, by model and reason "
                              "(unauthorized, forbidden, model_not_found, rate_limited, queue_full, queue_timeout, "
                              "upstream_error, upstream_timeout, stream_interrupted, client_disconnected, bad_request, body_too_large)",
                              ["model", "reason"], registry=r)
        self.retries = Counter(P + "retries_total", "Requests retried on another replica", ["model"], registry=r)
        self.latency = HotMetric("histogram", P + "request_seconds", "Time from the request to the last byte of the "
                                 "answer", ["model", "replica"], buckets=_LATENCY)
        self.ttfb = HotMetric("histogram", P + "time_to_first_byte_seconds", "Time from the request to the first "
                              "byte of the answer's body", ["model", "replica"], buckets=_TTFB)
        self.inflight = HotMetric("gauge", P + "inflight_requests", "Requests being served, by model", ["model"])
        self.replica_inflight = HotMetric("gauge", P + "replica_inflight", "Requests outstanding at a replica (the "
                                          "HPA's per-pod metric)", ["model", "replica_namespace", "replica_pod"])
        self.queue_depth = Gauge(P + "queue_depth", "Requests waiting for a replica with room", ["model"],
                                 registry=r)
        self.queue_seconds = HotMetric("histogram", P + "queue_seconds", "Time requests waited for a replica",
                                       ["model"], buckets=_QUEUE)
        self.queue_stalled = Gauge(P + "queue_stalled", "Queued requests that a replica with room could serve "
                                   "but nobody woke (a watchdog: always 0 unless the queue's accounting leaked)",
                                   ["model"], registry=r)
        self.tokens = HotMetric("counter", P + "tokens_total", "Tokens the runtimes reported in usage, by model and "
                                "kind (prompt, completion); rate() gives tokens/s", ["model", "kind"])
        self.replicas = Gauge(P + "replicas", "Replicas known for a model, by pool and state (ready, ejected)",
                              ["model", "pool", "state"], registry=r)
        self.ejections = Counter(P + "ejections_total", "Replicas ejected after consecutive failures",
                                 ["model", "replica"], registry=r)
        self.bursting = Gauge(P + "bursting", "1 while the latest request of a model went to its burst pool", ["model"],
                              registry=r)
        self.config_errors = Gauge(P + "config_errors", "Malformed API-key Secrets and model conflicts in the "
                                   "last discovery pass", registry=r)
        r.register(_HotCollector([self.requests, self.latency, self.ttfb, self.inflight, self.replica_inflight,  # type: ignore[arg-type]
                                  self.tokens, self.queue_seconds]))
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """A labelled child, cached: ``labels()`` costs a lock and a dict lookup on every request otherwise."""
        key = (metric._name, *labels)
        found = self._children.get(key)
        if found is None:
            found = metric.labels(*labels)
            self._children[key] = found
        return found

    def forget_replica(self, model: str, replica: Replica) -> None:
        """Drop the series of a replica that left (pods come and go: their series must not pile up)."""
        label = replica_label(replica)
        for metric in (self.latency, self.ttfb, self.ejections):
            self._remove(metric, model, label)
        for key in [k for k in self._children if k[0] == self.requests._name and k[1:3] == (model, label)]:
            self._remove(self.requests, *key[1:])
        self._remove(self.replica_inflight, model, replica.spec.namespace, label)

    def _remove(self, metric: Any, *labels: str) -> None:
        self._children.pop((metric._name, *labels), None)
        try:
            metric.remove(*labels)
        except KeyError:
            pass
