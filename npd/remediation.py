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
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from kubeapi.client import KubeClient
from kubeapi.errors import ApiError, Conflict
from kubeapi.informer import Informer
from kubeapi.resources import EVENTS, NODES, PODS
from kubeapi.tasks import supervise

log = logging.getLogger("accelstack.npd.remediation")

FIELD_MANAGER = "accelstack-remediation"  # fieldManager of its writes, User-Agent and the Events' source
CORDON_ANNOTATION = "accelstack.io/cordoned-by-remediation"
SINCE_ANNOTATION = "accelstack.io/unhealthy-since"
HEALTHY_SINCE_ANNOTATION = "accelstack.io/healthy-since"

Node = dict[str, Any]  # a Node as the API server sends it


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


def node_resources(node: Node) -> set[str] | None:
    """The resources in the node's capacity or allocatable (a resource a device plugin ever registered stays there,
    at 0 when its devices are gone); None when the node reports none at all (then every condition counts)."""
    status = node.get("status") or {}
    found = set(status.get("capacity") or {}) | set(status.get("allocatable") or {})
    return found or None


TAINT_VALUE_MAX = 63  # a taint value is a label value: 63 bytes, alphanumerics at both ends


def taint_value(names: list[str]) -> str:
    """The True conditions joined with ``_`` (``GPUUnhealthy_NR1Unhealthy``), bounded to a valid label value:
    when they do not fit, as many whole names as fit and then ``<n>more`` (a longer value was refused with 422
    on every reconcile and the node never tainted). Characters a label value cannot hold are dropped."""
    clean = ["".join(ch for ch in n if ch.isascii() and (ch.isalnum() or ch in "-_.")).strip("-_.")
             for n in names]
    clean = [n[:TAINT_VALUE_MAX].rstrip("-_.") for n in clean if n]
    for kept in range(len(clean), -1, -1):
        rest = len(clean) - kept
        value = "_".join(clean[:kept] + ([f"{rest}more"] if rest else []))
        if len(value) <= TAINT_VALUE_MAX:
            return value
    return ""  # (not reached: "<n>more" alone fits)


def decide(conditions: list[dict[str, Any]], tainted: bool, watched: list[str], hold: float, now: float,
           healthy_since: float | None = None, resources: set[str] | None = None,
           about: Mapping[str, str] | None = None) -> Decision:
    """What the node's taint should be.

    ``conditions`` are the node's ``status.conditions`` (``type``, ``status``, ``lastTransitionTime``);
    ``healthy_since`` is the node's HEALTHY_SINCE_ANNOTATION (None: absent); ``resources`` the node's resources
    (None: unknown, every condition counts) and ``about`` the resource each condition is about."""
    about = about or {}
    present = {str(c.get("type")): c for c in conditions if c.get("type") in watched}
    true = sorted(t for t, c in present.items() if c.get("status") == "True")
    if true:
        return Decision(True, taint_value(true), why=f"{', '.join(true)} True")
    if not tainted:
        return Decision(None, why="healthy")
    if not present:
        return Decision(None, why="no watched condition on the node; keeping the taint")

    def counts(ctype: str) -> bool:
        resource = about.get(ctype)
        return resources is None or resource is None or resource in resources

    # Unknown about a resource the node does not have is ignored; everything else counts
    counted = {t: c for t, c in present.items() if c.get("status") == "False" or counts(t)}
    unknown = sorted(t for t, c in counted.items() if c.get("status") != "False")
    if unknown:
        return Decision(None, why=f"{', '.join(unknown)} Unknown; keeping the taint")
    if healthy_since is None:
        times = [_epoch(c.get("lastTransitionTime")) for c in counted.values()]
        if any(t is None for t in times):
            return Decision(False, why="conditions False (no transition time)")
        healthy_since = max((t for t in times if t is not None), default=now)
    left = healthy_since + hold - now
    if left > 0:
        return Decision(None, wake_in=left, healthy_since=healthy_since,
                        why=f"False for {now - healthy_since:.0f}s of the {hold:.0f}s hold")
    return Decision(False, why=f"False for {now - healthy_since:.0f}s (hold {hold:.0f}s)")


def _taint_dict(taint: Mapping[str, Any]) -> dict[str, Any]:
    out = {"key": taint.get("key"), "effect": taint.get("effect")}
    if taint.get("value"):
        out["value"] = taint["value"]
    if taint.get("timeAdded"):
        out["timeAdded"] = str(taint["timeAdded"])
    return out


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


class TaintController:
    """Keeps the taint of every Node in step with its conditions: an informer on Nodes feeds a view; one worker
    reconciles the nodes that changed, the nodes whose hold timer ran out, and every node each ``resync``."""

    def __init__(self, kube: KubeClient, values: Mapping[str, Any], clock: Callable[[], float] = time.time,
                 metrics: Any = None, *, watch_timeout: tuple[int, int] = (300, 600), read_margin: float = 30.0,
                 backoff: tuple[float, float] = (0.5, 30.0), rng: random.Random | None = None) -> None:
        self.kube = kube
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
        self.backoff = backoff
        self.wake: dict[str, float] = {}  # node -> clock time when its hold timer runs out
        self.tainted: set[str] = set()
        self.nodes: dict[str, Node] = {}  # the informer's view, by name
        self.pending: set[str] = set()  # nodes changed since the worker last looked
        self.changed = asyncio.Event()
        self.informer = Informer(kube, NODES, self._on_event, self._on_sync, name="remediation-nodes",
                                 watch_timeout=watch_timeout, read_margin=read_margin, backoff=backoff, rng=rng)

    def ready(self) -> bool:
        """/readyz: the nodes have been listed and the last list succeeded."""
        return self.informer.synced.is_set() and self.informer.healthy

    # -- one node ------------------------------------------------------------------------------------------
    async def reconcile(self, node: Node, attempts: int = 5) -> Decision:
        name = _name(node)
        for _attempt in range(attempts):
            meta = node.get("metadata") or {}
            taints = list((node.get("spec") or {}).get("taints") or [])
            mine = [t for t in taints if t.get("key") == self.key]
            annotations = meta.get("annotations") or {}
            decision = decide(list((node.get("status") or {}).get("conditions") or []), bool(mine),
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
                # carries metadata.resourceVersion: a retry after a lost answer is refused (409), never blind
                await self.kube.patch(NODES, name, patch, retry=True)
            except Conflict:
                log.info("node changed under us; reading again", extra={"node": name})
                node = await self.kube.get(NODES, name)
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

    async def _event(self, node: Node, reason: str, message: str, kind: str) -> None:
        """A core/v1 Event on the Node (``kubectl describe node`` shows it); failures only logged."""
        stamp = _stamp(self.clock())
        meta = node.get("metadata") or {}
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{meta.get('name')}.", "namespace": "default"},
                "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": meta.get("name"),
                                   "uid": meta.get("uid")},
                "reason": reason, "message": message[:1024], "type": kind,
                "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}
        try:
            await self.kube.create(EVENTS, body, "default")
        except ApiError as exc:
            log.info("event not recorded", extra={"node": meta.get("name"), "error": str(exc)[:200]})

    def _count_state(self, name: str, tainted: bool) -> None:
        (self.tainted.add if tainted else self.tainted.discard)(name)
        if self.metrics is not None:
            self.metrics.tainted.set(len(self.tainted))

    def _patch(self, node: Node, taints: list[dict[str, Any]], mine: list[dict[str, Any]],
               decision: Decision) -> dict[str, Any] | None:
        """The merge patch that makes the node match ``decision``; one without ``spec`` only keeps the
        healthy-since annotation, None when nothing is to change."""
        meta = node.get("metadata") or {}
        annotations = dict(meta.get("annotations") or {})
        rv = meta.get("resourceVersion")
        others = [_taint_dict(t) for t in taints if t.get("key") != self.key]
        recorded = annotations.get(HEALTHY_SINCE_ANNOTATION)
        if decision.taint:
            wanted = {"key": self.key, "value": decision.value, "effect": "NoSchedule"}
            current = [_taint_dict(t) for t in mine]
            cordon_needed = self.cordon and not (node.get("spec") or {}).get("unschedulable")
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
        pods, _ = await self.kube.list(PODS, field_selector=f"spec.nodeName={name}")
        for pod in pods:
            meta = pod.get("metadata") or {}
            if (pod.get("spec") or {}).get("nodeName") != name or not self._uses_managed(pod):
                continue
            if any(ref.get("kind") == "DaemonSet" for ref in (meta.get("ownerReferences") or [])):
                continue
            pod_name, namespace = meta.get("name"), meta.get("namespace")
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": pod_name, "namespace": namespace}}
            try:
                await self.kube.create(PODS, body, namespace, subresource="eviction", name=pod_name)
                log.warning("pod evicted", extra={"node": name, "pod": f"{namespace}/{pod_name}"})
                if self.metrics is not None:
                    self.metrics.actions.labels("evict").inc()
            except ApiError as exc:  # 429: a PDB forbids it now; the next resync tries again
                log.info("eviction refused", extra={"pod": pod_name, "error": str(exc)[:200]})

    def _uses_managed(self, pod: Mapping[str, Any]) -> bool:
        spec = pod.get("spec") or {}
        for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
            res = container.get("resources") or {}
            if (set(res.get("limits") or {}) | set(res.get("requests") or {})) & self.resources:
                return True
        return False

    # -- all nodes -----------------------------------------------------------------------------------------
    def _on_sync(self, items: list[Node]) -> None:
        """A (re)list: the view becomes exactly what the API server has; every node is looked at again."""
        view = {_name(n): n for n in items}
        for gone in set(self.nodes) - set(view):
            self._forget(gone)
        self.nodes = view
        self.pending |= set(view)
        self.changed.set()

    def _on_event(self, kind: str, obj: Node) -> None:
        name = _name(obj)
        if kind == "DELETED":
            self.nodes.pop(name, None)
            self.pending.discard(name)
            self._forget(name)
        else:
            self.nodes[name] = obj
            self.pending.add(name)
        self.changed.set()

    def _forget(self, name: str) -> None:
        self.wake.pop(name, None)
        self._count_state(name, False)

    def _next_wake(self) -> float:
        now = self.clock()
        soonest = min((t - now for t in self.wake.values()), default=self.resync)
        return max(0.05, min(self.resync, soonest))

    async def _work(self, stop: asyncio.Event) -> None:
        """Reconcile what changed, what a hold timer woke and, every ``resync``, everything in the view."""
        next_resync = self.clock() + self.resync
        while not stop.is_set():
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.changed.wait())]
            try:
                await asyncio.wait(waits, timeout=self._next_wake(), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if stop.is_set():
                return
            self.changed.clear()
            now = self.clock()
            names, self.pending = self.pending, set()
            due = {name for name, at in self.wake.items() if at <= now}
            for name in due:  # reconcile sets it again if the hold goes on; a failing node waits for resync
                del self.wake[name]
            names |= due
            if now >= next_resync:
                names |= set(self.nodes)
                next_resync = now + self.resync
            for name in sorted(names):
                node = self.nodes.get(name)
                if node is not None:
                    await self._safe(node)

    async def run(self, stop: asyncio.Event) -> None:
        """The informer and the worker, each supervised (a crash is logged and the task restarted), until
        ``stop`` (an open watch or a call in flight is cancelled then, not waited for)."""
        tasks = [asyncio.create_task(supervise("remediation-informer", self.informer.run, stop, backoff=self.backoff),
                                     name="remediation-informer"),
                 asyncio.create_task(supervise("remediation-worker", self._work, stop, backoff=self.backoff),
                                     name="remediation-worker")]
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _safe(self, node: Node) -> None:
        try:
            await self.reconcile(node)
        except (ApiError, RuntimeError) as exc:  # the next event or resync tries again
            log.error("reconcile failed", extra={"node": _name(node), "error": str(exc)[:300]})
        except Exception:  # a node this code cannot read must not stop the others
            log.exception("reconcile crashed", extra={"node": _name(node)})


class RemediationMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import Counter, Gauge

        self.registry = registry or CollectorRegistry()
        self.tainted = Gauge("accelstack_remediation_tainted_nodes", "Nodes carrying the unhealthy taint",
                             registry=self.registry)
        self.actions = Counter("accelstack_remediation_actions", "Taints added, lifted and pods evicted",
                               ["action"], registry=self.registry)


class RemediationProcess:
    """The controller plus /metrics, /healthz and /readyz (ready once the nodes are listed, and not while they
    cannot be)."""

    def __init__(self, kube: KubeClient, values: Mapping[str, Any], metrics: RemediationMetrics | None = None,
                 **controller_options: Any) -> None:
        self.values = values
        self.metrics = metrics or RemediationMetrics()
        self.controller = TaintController(kube, values, metrics=self.metrics, **controller_options)
        self.endpoint: Any = None

    async def run(self, stop: asyncio.Event) -> None:
        from typing import cast

        from service.observability import PluginMetrics, start_http

        self.endpoint = start_http(self.values["remediation.metricsAddress"], cast(PluginMetrics, self.metrics),
                                   self.controller.ready)
        try:
            await self.controller.run(stop)
        finally:
            if self.endpoint is not None:
                self.endpoint.close()


async def _amain(values: Mapping[str, Any]) -> None:
    import signal

    from prometheus_client import REGISTRY

    from kubeapi.client import from_config

    # one registry for the controller's, the client's and the task supervisor's metrics
    metrics = RemediationMetrics(REGISTRY)
    kube = await from_config(values["remediation.kubeconfig"], field_manager=FIELD_MANAGER, timeout=float(values["remediation.apiTimeout"]),
                             registry=REGISTRY)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    process = RemediationProcess(kube, values, metrics)
    try:
        task = asyncio.create_task(process.run(stop))
        await stop.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await kube.close()


def main(argv: list[str] | None = None) -> None:
    from device_plugin.config import ConfigError
    from npd.config import load, print_config
    from service.observability import setup_logging

    try:
        config, args = load(argv, prog="accelstack-remediation",
                            description="Taint nodes NoSchedule while NPD reports their devices unhealthy.")
    except ConfigError as exc:
        print(f"accelstack-remediation: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.print_config:
        print(print_config(config, "accelstack-remediation"), end="")
        return
    setup_logging(config["log.level"], config["log.format"])
    from kubeapi.client import ConfigMissing

    try:
        asyncio.run(_amain(config.values))
    except ConfigMissing as exc:  # one line naming what is missing, not a traceback
        log.error("cannot start", extra={"error": str(exc)})
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
