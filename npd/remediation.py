"""Remediation controller (``accelstack-remediation``): taint nodes whose devices NPD reports unhealthy.

NPD sets node conditions (``GPUUnhealthy``, ``NR1Unhealthy``) but does not act on them. This controller watches
Nodes and keeps the taint ``accelstack.io/unhealthy:NoSchedule`` on a node while any watched condition is True.
The taint is lifted only when every watched condition that counts on the node has been False, without a break,
for ``remediation.holdTime`` (hysteresis: a device that flaps does not bounce pods on and off the node).

The hold is judged from the annotation ``accelstack.io/healthy-since``, which the controller writes on a tainted
node the first time it sees every counted condition False (taking the latest ``lastTransitionTime`` then, so a
controller restart does not reset the clock either), and removes when it sees one True or Unknown again. The
conditions' own transition times are not enough: node-problem-detector sets every condition to False with a
fresh ``lastTransitionTime`` when it starts (``initialConditions``), so a rollout of the NPD DaemonSet would
otherwise restart the hold on every node. A flap that starts and ends while the controller is not watching
(down, or the API unreachable for longer than NPD's check interval) is not seen; the hold then runs from the
earlier recovery.

Unknown (NPD cannot tell) never adds a taint: a cluster-wide cause (a driver upgrade, the API server) would
otherwise taint every node at once. On a node that has the condition's resource (``remediation.conditionResources``:
the resource is in the node's capacity, even at 0) Unknown keeps an existing taint and breaks the hold, since the
device's recovery cannot be confirmed. On a node without that resource (an NR1-only node whose GPU check runs
without NVML) an Unknown condition is ignored: it neither taints nor keeps a taint. True taints whatever the
resources. A node without any watched condition keeps whatever state it has.

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
HEALTHY_SINCE_ANNOTATION = "accelstack.io/healthy-since"


@dataclass(frozen=True)
class Decision:
    taint: bool | None  # True: must be tainted, False: must not be, None: leave as it is
    value: str = ""  # taint value: the True conditions
    wake_in: float | None = None  # seconds until the decision may change without an event (hold timer)
    why: str = ""
    healthy_since: float | None = None  # what HEALTHY_SINCE_ANNOTATION must say on a node that stays tainted


def _epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value.timestamp()
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_resources(pairs: list[str]) -> dict[str, str]:
    """``["GPUUnhealthy=nvidia.com/gpu", ...]`` (config) -> {condition: resource}."""
    return dict(pair.split("=", 1) for pair in pairs)


def node_resources(node: Any) -> set[str] | None:
    """The resources in the node's capacity or allocatable (a resource a device plugin ever registered stays there,
    at 0 when its devices are gone); None when the node reports none at all (then every condition counts)."""
    status = getattr(node, "status", None)
    found = set(getattr(status, "capacity", None) or {}) | set(getattr(status, "allocatable", None) or {})
    return found or None


def decide(conditions: list[Any], tainted: bool, watched: list[str], hold: float, now: float,
           healthy_since: float | None = None, resources: set[str] | None = None,
           about: Mapping[str, str] | None = None) -> Decision:
    """What the node's taint should be.

    ``conditions`` are V1NodeCondition-like (type, status, last_transition_time); ``healthy_since`` is the
    node's HEALTHY_SINCE_ANNOTATION (None: absent); ``resources`` the node's resources (None: unknown, every
    condition counts) and ``about`` the resource each condition is about."""
    about = about or {}
    present = {c.type: c for c in conditions if c.type in watched}
    true = sorted(t for t, c in present.items() if c.status == "True")
    if true:
        return Decision(True, "_".join(true), why=f"{', '.join(true)} True")
    if not tainted:
        return Decision(None, why="healthy")
    if not present:
        return Decision(None, why="no watched condition on the node; keeping the taint")

    def counts(ctype: str) -> bool:
        resource = about.get(ctype)
        return resources is None or resource is None or resource in resources

    # Unknown about a resource the node does not have is ignored; everything else counts
    counted = {t: c for t, c in present.items() if c.status == "False" or counts(t)}
    unknown = sorted(t for t, c in counted.items() if c.status != "False")
    if unknown:
        return Decision(None, why=f"{', '.join(unknown)} Unknown; keeping the taint")
    if healthy_since is None:
        times = [_epoch(c.last_transition_time) for c in counted.values()]
        if any(t is None for t in times):
            return Decision(False, why="conditions False (no transition time)")
        healthy_since = max((t for t in times if t is not None), default=now)
    left = healthy_since + hold - now
    if left > 0:
        return Decision(None, wake_in=left, healthy_since=healthy_since,
                        why=f"False for {now - healthy_since:.0f}s of the {hold:.0f}s hold")
    return Decision(False, why=f"False for {now - healthy_since:.0f}s (hold {hold:.0f}s)")


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
        self.about = condition_resources(values["remediation.conditionResources"])
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
            annotations = (node.metadata.annotations or {}) if node.metadata else {}
            decision = decide(list((node.status.conditions if node.status else None) or []), bool(mine),
                              self.watched, self.hold, self.clock(),
                              healthy_since=_epoch(annotations.get(HEALTHY_SINCE_ANNOTATION)),
                              resources=node_resources(node), about=self.about)
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
            if "spec" not in patch:  # only the healthy-since annotation changed
                self._count_state(name, bool(mine))
                return decision
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
        stamp = _stamp(self.clock())
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
        """The merge patch that makes the node match ``decision``; one without ``spec`` only keeps the
        healthy-since annotation, None when nothing is to change."""
        annotations = dict(node.metadata.annotations or {})
        rv = node.metadata.resource_version
        others = [_taint_dict(t) for t in taints if t.key != self.key]
        recorded = annotations.get(HEALTHY_SINCE_ANNOTATION)
        if decision.taint:
            wanted = {"key": self.key, "value": decision.value, "effect": "NoSchedule"}
            current = [_taint_dict(t) for t in mine]
            cordon_needed = self.cordon and not (node.spec and node.spec.unschedulable)
            if current == [wanted] and not cordon_needed:
                if recorded is None:
                    return None
                return {"metadata": {"resourceVersion": rv, "annotations": {HEALTHY_SINCE_ANNOTATION: None}}}
            patch: dict[str, Any] = {"metadata": {"resourceVersion": rv}, "spec": {"taints": [*others, wanted]}}
            notes: dict[str, Any] = {}
            if not mine:
                notes[SINCE_ANNOTATION] = _stamp(self.clock())
            if recorded is not None:
                notes[HEALTHY_SINCE_ANNOTATION] = None
            if cordon_needed:
                patch["spec"]["unschedulable"] = True
                notes[CORDON_ANNOTATION] = "true"
            if notes:
                patch["metadata"]["annotations"] = notes
            return patch
        if decision.taint is False and mine:
            patch = {"metadata": {"resourceVersion": rv, "annotations": {SINCE_ANNOTATION: None}},
                     "spec": {"taints": others or None}}
            if recorded is not None:
                patch["metadata"]["annotations"][HEALTHY_SINCE_ANNOTATION] = None
            if annotations.get(CORDON_ANNOTATION) == "true":
                patch["spec"]["unschedulable"] = None
                patch["metadata"]["annotations"][CORDON_ANNOTATION] = None
            return patch
        if decision.taint is None and mine:
            stamp = None if decision.healthy_since is None else _stamp(decision.healthy_since)
            if stamp != recorded:
                return {"metadata": {"resourceVersion": rv, "annotations": {HEALTHY_SINCE_ANNOTATION: stamp}}}
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
