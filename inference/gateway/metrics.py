"""The gateway's Prometheus metrics (prefix ``accelstack_gateway_``); names and labels are in docs/metrics.md.

``replica_inflight`` is the per-pod metric the CG Deployments' HorizontalPodAutoscalers read through the
Prometheus Adapter: its ``replica_namespace``/``replica_pod`` labels name the CG pod (not the gateway's own pod,
which Prometheus labels ``namespace``/``pod``), and the adapter rule maps them to the pod resource.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inference.names import METRIC_PREFIX as P
from inference.routing import Replica

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# past the default --queue-timeout (30 s), so a queue timeout shows as its own bucket rather than +Inf
_QUEUE = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 120, 300)
_TTFB = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def replica_label(replica: Replica) -> str:
    """The replica's pod name, or its host:port when discovery gave none."""
    return replica.spec.pod or replica.url.removeprefix("http://")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(P + "requests_total", "Requests answered, by model, replica and HTTP status",
                                ["model", "replica", "code"], registry=r)
        self.errors = Counter(P + "errors_total", "Requests that failed, by model and reason "
                              "(unauthorized, forbidden, model_not_found, rate_limited, queue_full, queue_timeout, "
                              "upstream_error, upstream_timeout, stream_interrupted, client_disconnected, bad_request, body_too_large)",
                              ["model", "reason"], registry=r)
        self.retries = Counter(P + "retries_total", "Requests retried on another replica", ["model"], registry=r)
        self.latency = Histogram(P + "request_seconds", "Time from the request to the last byte of the answer",
                                 ["model", "replica"], buckets=_LATENCY, registry=r)
        self.ttfb = Histogram(P + "time_to_first_byte_seconds", "Time from the request to the first byte of the "
                              "answer's body", ["model", "replica"], buckets=_TTFB, registry=r)
        self.inflight = Gauge(P + "inflight_requests", "Requests being served, by model", ["model"], registry=r)
        self.replica_inflight = Gauge(P + "replica_inflight", "Requests outstanding at a replica (the HPA's "
                                      "per-pod metric)", ["model", "replica_namespace", "replica_pod"], registry=r)
        self.queue_depth = Gauge(P + "queue_depth", "Requests waiting for a replica with room", ["model"],
                                 registry=r)
        self.queue_seconds = Histogram(P + "queue_seconds", "Time requests waited for a replica", ["model"],
                                       buckets=_QUEUE, registry=r)
        self.queue_stalled = Gauge(P + "queue_stalled", "Queued requests that a replica with room could serve "
                                   "but nobody woke (a watchdog: always 0 unless the queue's accounting leaked)",
                                   ["model"], registry=r)
        self.tokens = Counter(P + "tokens_total", "Tokens the runtimes reported in usage, by model and kind "
                              "(prompt, completion); rate() gives tokens/s", ["model", "kind"], registry=r)
        self.replicas = Gauge(P + "replicas", "Replicas known for a model, by pool and state (ready, ejected)",
                              ["model", "pool", "state"], registry=r)
        self.ejections = Counter(P + "ejections_total", "Replicas ejected after consecutive failures",
                                 ["model", "replica"], registry=r)
        self.bursting = Gauge(P + "bursting", "1 while the latest request of a model went to its burst pool", ["model"],
                              registry=r)
        self.config_errors = Gauge(P + "config_errors", "Malformed API-key Secrets and model conflicts in the "
                                   "last discovery pass", registry=r)
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
