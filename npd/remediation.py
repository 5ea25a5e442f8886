"""Remediation controller (``accelstack-remediation``): taint nodes whose devices NPD reports unhealthy.

NPD sets node conditions (``GPUUnhealthy``, ``NR1Unhealthy``) but does not act on them. This controller watches
Nodes and keeps the taint ``accelstack.io/unhealthy:NoSchedule`` on a node while any watched condition is True.
The taint is lifted only when every watched condition present on the node has been False for
``remediation.holdTime`` (hysteresis: a device that flaps does not bounce pods on and off the node). The time is
taken from the condition's ``lastTransitionTime``, so a controller restart does not reset the clock. A condition
that is Unknown (NPD cannot tell) or a node without any watched condition keeps whatever state the node has.

Optional, off by default: ``remediation.cordon`` also marks the node unschedulable (and undoes only a cordon it
made itself, remembered in an annotation); ``remediation.drain`` evicts, through the Eviction API (so
PodDisruptionBudgets apply), the pods on the node that use the managed resources.

Each taint added or lifted is recorded as an Event on the Node. Writes are merge patches carrying
``metadata.resourceVersion``: the API server rejects a patch made from a stale read with 409 Conflict, and the
controller reads again and retries (taints are a list the API replaces whole, so a blind patch could drop a
taint someone else just added).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("accelstack.npd.remediation")

CORDON_ANNOTATION = "accelstack.io/cordoned-by-remediation"
SINCE_ANNOTATION = "accelstack.io/unhealthy-since"


@dataclass(frozen=True)
class Decision:
    taint: bool | None  # True: must be tainted, False: must not be, None: leave as it is
    value: str = ""  # taint value: the True conditions
    wake_in: float | None = None  # seconds until the decision may change without an event (hold timer)
    why: str = ""


def _epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value.timestamp()
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def decide(conditions: list[Any], tainted: bool, watched: list[str], hold: float, now: float) -> Decision:
    """What the node's taint should be; ``conditions`` are V1NodeCondition-like (type, status,
    last_transition_time)."""
    present = {c.type: c for c in conditions if c.type in watched}
    true = sorted(t for t, c in present.items() if c.status == "True")
    if true:
        return Decision(True, "_".join(true), why=f"{', '.join(true)} True")
    if not tainted:
        return Decision(None, why="healthy")
    if not present:
        return Decision(None, why="no watched condition on the node; keeping the taint")
    unknown = sorted(t for t, c in present.items() if c.status != "False")
    if unknown:
        return Decision(None, why=f"{', '.join(unknown)} Unknown; keeping the taint")
    times = [_epoch(c.last_transition_time) for c in present.values()]
    if any(t is None for t in times):
        return Decision(False, why="conditions False (no transition time)")
    false_since = max(t for t in times if t is not None)
    left = false_since + hold - now
    if left > 0:
        return Decision(None, wake_in=left, why=f"False for {now - false_since:.0f}s of the {hold:.0f}s hold")
    return Decision(False, why=f"False for {now - false_since:.0f}s (hold {hold:.0f}s)")


def _taint_dict(taint: Any) -> dict[str, Any]:
    out = {"key": taint.key, "effect": taint.effect}
    if getattr(taint, "value", None):
        out["value"] = taint.value
    if getattr(taint, "time_added", None):
        added = taint.time_added
        out["timeAdded"] = added.strftime("%Y-%m-%dT%H:%M:%SZ") if isinstance(added, dt.datetime) else str(added)
    return out


class TaintController:
    def __init__(self, core_api: Any, values: Mapping[str, Any], clock: Callable[[], float] = time.time,
                 metrics: Any = None) -> None:
        self.api = core_api  # kubernetes_asyncio CoreV1Api
        self.watched: list[str] = list(values["remediation.conditions"])
        self.key: str = values["remediation.taintKey"]
        self.hold = float(values["remediation.holdTime"])
        self.resync = float(values["remediation.resync"])
        self.cordon = bool(values["remediation.cordon"])
        self.drain = bool(values["remediation.drain"])
        self.resources = set(values["remediation.resources"])
        self.clock = clock
        self.metrics = metrics
        self.wake: dict[str, float] = {}  # node -> clock time when its hold timer runs out
        self.tainted: set[str] = set()

    # -- one node ------------------------------------------------------------------------------------------
    async def reconcile(self, node: Any, attempts: int = 5) -> Decision:
        name = node.metadata.name
        for _attempt in range(attempts):
            taints = list(node.spec.taints or []) if node.spec else []
            mine = [t for t in taints if t.key == self.key]
            decision = decide(list((node.status.conditions if node.status else None) or []), bool(mine),
                              self.watched, self.hold, self.clock())
            if decision.wake_in is not None:
                self.wake[name] = self.clock() + decision.wake_in
            else:
                self.wake.pop(name, None)
            patch = self._patch(node, taints, mine, decision)
            if patch is None:
                self._count_state(name, bool(mine) if decision.taint is None else decision.taint)
                return decision
            try:
                await self.api.patch_node(name, patch, _content_type="application/merge-patch+json")
            except Exception as exc:
                if getattr(exc, "status", None) != 409:
                    raise
                log.info("node changed under us; reading again", extra={"node": name})
                node = await self.api.read_node(name)
                continue
            action = "taint" if decision.taint else "untaint"
            log.warning("node %s", "tainted" if decision.taint else "untainted",
                        extra={"node": name, "why": decision.why, "taint": self.key})
            if self.metrics is not None:
                self.metrics.actions.labels(action).inc()
            await self._event(node, "AccelstackTainted" if decision.taint else "AccelstackUntainted",
                              f"{'added' if decision.taint else 'removed'} taint {self.key}:NoSchedule: "
                              f"{decision.why}", "Warning" if decision.taint else "Normal")
            self._count_state(name, bool(decision.taint))
            if decision.taint and not mine and self.drain:
                await self._drain(name)
            return decision
        raise RuntimeError(f"node {name}: still conflicting after {attempts} attempts")

    async def _event(self, node: Any, reason: str, message: str, kind: str) -> None:
        """A core/v1 Event on the Node (``kubectl describe node`` shows it); failures only logged."""
        stamp = dt.datetime.fromtimestamp(self.clock(), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{node.metadata.name}.", "namespace": "default"},
                "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node.metadata.name,
                                   "uid": node.metadata.uid},
                "reason": reason, "message": message[:1024], "type": kind,
                "source": {"component": "accelstack-remediation"}, "reportingComponent": "accelstack-remediation",
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}
        try:
            await self.api.create_namespaced_event("default", body)
        except Exception as exc:
            log.info("event not recorded", extra={"node": node.metadata.name, "error": str(exc)[:200]})

    def _count_state(self, name: str, tainted: bool) -> None:
        (self.tainted.add if tainted else self.tainted.discard)(name)
        if self.metrics is not None:
            self.metrics.tainted.set(len(self.tainted))

    def _patch(self, node: Any, taints: list[Any], mine: list[Any], decision: Decision) -> dict[str, Any] | None:
        annotations = dict(node.metadata.annotations or {})
        rv = node.metadata.resource_version
        others = [_taint_dict(t) for t in taints if t.key != self.key]
        if decision.taint:
            wanted = {"key": self.key, "value": decision.value, "effect": "NoSchedule"}
            current = [_taint_dict(t) for t in mine]
            cordon_needed = self.cordon and not (node.spec and node.spec.unschedulable)
            if current == [wanted] and not cordon_needed:
                return None
            patch: dict[str, Any] = {"metadata": {"resourceVersion": rv}, "spec": {"taints": [*others, wanted]}}
            if not mine:
                stamp = dt.datetime.fromtimestamp(self.clock(), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                patch["metadata"]["annotations"] = {SINCE_ANNOTATION: stamp}
            if cordon_needed:
                patch["spec"]["unschedulable"] = True
                patch["metadata"].setdefault("annotations", {})[CORDON_ANNOTATION] = "true"
            return patch
        if decision.taint is False and mine:
            patch = {"metadata": {"resourceVersion": rv, "annotations": {SINCE_ANNOTATION: None}},
                     "spec": {"taints": others or None}}
            if annotations.get(CORDON_ANNOTATION) == "true":
                patch["spec"]["unschedulable"] = None
                patch["metadata"]["annotations"][CORDON_ANNOTATION] = None
            return patch
        return None

    async def _drain(self, name: str) -> None:
        pods = await self.api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}")
        for pod in pods.items:
            if pod.spec.node_name != name or not self._uses_managed(pod):
                continue
            if any(ref.kind == "DaemonSet" for ref in (pod.metadata.owner_references or [])):
                continue
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": pod.metadata.name, "namespace": pod.metadata.namespace}}
            try:
                await self.api.create_namespaced_pod_eviction(pod.metadata.name, pod.metadata.namespace, body)
                log.warning("pod evicted", extra={"node": name, "pod": f"{pod.metadata.namespace}/{pod.metadata.name}"})
                if self.metrics is not None:
                    self.metrics.actions.labels("evict").inc()
            except Exception as exc:  # 429: a PDB forbids it now; the next resync tries again
                log.info("eviction refused", extra={"pod": pod.metadata.name, "error": str(exc)[:200]})

    def _uses_managed(self, pod: Any) -> bool:
        for container in [*(pod.spec.containers or []), *(pod.spec.init_containers or [])]:
            res = container.resources
            names = set((res.limits or {}) if res else {}) | set((res.requests or {}) if res else {})
            if names & self.resources:
                return True
        return False

    # -- all nodes -----------------------------------------------------------------------------------------
    def _next_wake(self) -> float:
        now = self.clock()
        soonest = min((t - now for t in self.wake.values()), default=self.resync)
        return max(0.2, min(self.resync, soonest))

    async def run(self, stop: asyncio.Event) -> None:
        """List and reconcile every node, then watch until the next hold timer or resync; repeat."""
        from kubernetes_asyncio import watch

        while not stop.is_set():
            try:
                nodes = await self.api.list_node()
                for node in nodes.items:
                    await self._safe(node)
                rv = nodes.metadata.resource_version
                timeout = self._next_wake()
                w = watch.Watch()
                stream = w.stream(self.api.list_node, resource_version=rv, timeout_seconds=math.ceil(timeout))
                deadline = self.clock() + timeout
                async with contextlib.AsyncExitStack() as stack:
                    stack.push_async_callback(w.close)
                    while not stop.is_set() and self.clock() < deadline:
                        try:
                            event = await asyncio.wait_for(stream.__anext__(), max(0.05, deadline - self.clock()))
                        except (StopAsyncIteration, TimeoutError):
                            break
                        if event["type"] in ("ADDED", "MODIFIED"):
                            await self._safe(event["object"])
                            if self.wake:  # a hold timer started: relist when it runs out
                                deadline = min(deadline, min(self.wake.values()) + 0.05)
                        elif event["type"] == "DELETED":
                            self.wake.pop(event["object"].metadata.name, None)
                            self._count_state(event["object"].metadata.name, False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API away, 410 Gone: list again
                log.warning("node watch interrupted; listing again", extra={"error": str(exc)[:300]})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    async def _safe(self, node: Any) -> None:
        try:
            await self.reconcile(node)
        except Exception as exc:
            log.error("reconcile failed", extra={"node": node.metadata.name, "error": str(exc)[:300]})


class RemediationMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.tainted = Gauge("accelstack_remediation_tainted_nodes", "Nodes carrying the unhealthy taint",
                             registry=self.registry)
        self.actions = Counter("accelstack_remediation_actions", "Taints added, lifted and pods evicted",
                               ["action"], registry=self.registry)


async def _amain(values: Mapping[str, Any]) -> None:
    import signal
    from typing import cast

    from kubernetes_asyncio import client, config

    from device_plugin.observability import PluginMetrics, start_http

    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    metrics = RemediationMetrics()
    endpoint = start_http(values["remediation.metricsAddress"], cast(PluginMetrics, metrics), lambda: True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with client.ApiClient() as api_client:
        controller = TaintController(client.CoreV1Api(api_client), values, metrics=metrics)
        task = asyncio.create_task(controller.run(stop))
        await stop.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if endpoint is not None:
        endpoint.close()


def main(argv: list[str] | None = None) -> None:
    from device_plugin.config import ConfigError
    from device_plugin.observability import setup_logging
    from npd.config import SCHEMA, load

    try:
        config, args = load(argv, prog="accelstack-remediation",
                            description="Taint nodes NoSchedule while NPD reports their devices unhealthy.")
    except ConfigError as exc:
        print(f"accelstack-remediation: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.print_config:
        print(SCHEMA.print_tree(config), end="")
        return
    setup_logging(config["log.level"], config["log.format"])
    asyncio.run(_amain(config.values))


if __name__ == "__main__":
    main(sys.argv[1:])
