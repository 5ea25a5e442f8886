"""The kubelet's view of which devices pods hold, and the guard that keeps a handover from double-booking.

Why: when accelstack's plugin registers a resource name that another plugin (NVIDIA's) served, the kubelet's
device manager swaps the endpoint but keeps every running pod's devices in its checkpoint under the IDs the *old*
plugin reported. With the same IDs (GPU UUIDs, NVIDIA's plugin without MIG or sharing) nothing changes for those
pods and the kubelet never hands their devices out again. With other IDs (MIG, time-slicing ``<uuid>::<k>``,
another naming) the kubelet holds the old IDs as assigned and counts every new ID as free: a GPU a running pod
uses could go to a new pod.

So the plugin reads the kubelet's pod-resources API (v1 ``List`` on ``podResources.socket``) at each
registration, every ``podResources.interval`` and shortly after each ``Allocate``, and for each resource it
serves:

* publishes one JSON annotation on its Node through the labeller (``accelstack.io/pod-resources`` for the
  NVIDIA backend, ``accelstack.io/pod-resources-nr1`` for the NR1 backend)::

    {"resource": "nvidia.com/gpu", "devices": 8, "inUse": 6, "unknownIDs": 0, "observedAt": "2026-12-03T22:00:00Z"}

  ``devices``: the IDs this plugin advertises; ``inUse``: distinct IDs of the resource the kubelet lists as
  assigned to pods; ``unknownIDs``: how many of those this plugin does not advertise. When the API cannot be
  read: ``{"resource", "devices", "error": "<one line>", "observedAt"}`` (and a warning and the counter
  ``accelstack_device_plugin_pod_resources_errors_total``), never a count of 0. The value is rewritten only
  when something other than ``observedAt`` changes (:func:`unchanged`), so pod churn that leaves the counts
  alone does not write the Node;
* while ``unknownIDs > 0``, reports every device none of whose IDs is assigned to a pod as Unhealthy in
  ``ListAndWatch`` (``DeviceTable.set_fenced``): the kubelet's allocatable drops to what running pods hold, no
  new pod gets a device, one warning says why and names the pods; once those pods end the devices are
  reported with their own health again. Running pods are never touched. A failed read keeps the guard as it
  was: an unreadable API neither lifts it nor raises it.

Nothing is read before the first registration: without a kubelet there is nothing to compare with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from device_plugin.devices import DeviceTable, describe_ids

log = logging.getLogger("accelstack.device_plugin.handover")

ANNOTATION = "accelstack.io/pod-resources"
NR1_ANNOTATION = "accelstack.io/pod-resources-nr1"
ALLOCATE_SETTLE_S = 1.0  # the kubelet records an allocation in its checkpoint after Allocate answers
READ_TIMEOUT_S = 5.0
MAX_NAMED_PODS = 10


class PodResourcesError(RuntimeError):
    """The pod-resources API could not be read; the message is one line naming the socket and the reason."""


async def assigned_ids(socket_path: str, resources: Iterable[str],
                       timeout: float = READ_TIMEOUT_S) -> dict[str, dict[str, set[str]]]:
    """{resource: {device ID: {"namespace/pod", ...}}} for the given resources, from one v1 ``List``.

    A fresh channel per read: a restarted kubelet re-creates its socket, and a read every 30 s costs little."""
    from protos.podresources.v1 import api_pb2, api_pb2_grpc

    wanted = set(resources)
    if not os.path.exists(socket_path):
        raise PodResourcesError(f"pod-resources socket {socket_path} does not exist (is /var/lib/kubelet/"
                                "pod-resources mounted, and the kubelet running?)")
    out: dict[str, dict[str, set[str]]] = {r: {} for r in wanted}
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
            response = await api_pb2_grpc.PodResourcesListerStub(channel).List(
                api_pb2.ListPodResourcesRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        details = " ".join((exc.details() or "").split())[:300]
        raise PodResourcesError(f"pod-resources List on {socket_path} failed: {exc.code().name}: {details}") from None
    for pod in response.pod_resources:
        holder = f"{pod.namespace}/{pod.name}"
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name in wanted:
                    for device in devices.device_ids:
                        out[devices.resource_name].setdefault(device, set()).add(holder)
    return out


def observed_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Report:
    """One resource's annotation value; ``error`` set when the API could not be read."""

    resource: str
    devices: int
    in_use: int = 0
    unknown: int = 0
    error: str = ""
    observed_at: str = ""

    def to_json(self) -> str:
        body: dict[str, Any] = {"resource": self.resource, "devices": self.devices}
        if self.error:
            body["error"] = self.error
        else:
            body.update(inUse=self.in_use, unknownIDs=self.unknown)
        body["observedAt"] = self.observed_at
        return json.dumps(body, separators=(",", ":"))


def unchanged(current: str | None, desired: str) -> bool:
    """Whether a Node's annotation value already says what ``desired`` says, ``observedAt`` aside."""
    if current is None:
        return False
    try:
        a, b = json.loads(current), json.loads(desired)
    except ValueError:
        return current == desired
    if not isinstance(a, dict) or not isinstance(b, dict):
        return bool(a == b)
    a.pop("observedAt", None)
    b.pop("observedAt", None)
    return bool(a == b)


class HandoverMetrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        p = "accelstack_device_plugin_"
        self.errors = Counter(p + "pod_resources_errors_total", "Failed reads of the kubelet pod-resources API",
                              registry=registry)
        self.unknown = Gauge(p + "pod_resources_unknown_ids",
                             "Device IDs the kubelet lists as assigned to pods that this plugin does not serve "
                             "(> 0: free devices reported Unhealthy)", ["resource"], registry=registry)


class PodResourcesWatch:
    """Reads the pod-resources API for every resource of the process; see the module docstring.

    ``tables``: resource -> its DeviceTable; ``keys``: resource -> annotation key; ``on_change`` is called (on the
    event loop) when an annotation's value changed other than in ``observedAt`` (the labeller's poke) and
    ``on_fence`` when a resource's fenced set changed (the devices gauge)."""

    def __init__(self, socket_path: str, interval: float, tables: Mapping[str, DeviceTable], keys: Mapping[str, str],
                 registry: Any, on_change: Callable[[], None] | None = None,
                 on_fence: Callable[[str], None] | None = None, settle: float = ALLOCATE_SETTLE_S) -> None:
        self.socket_path = socket_path
        self.interval = interval
        self.tables = tables
        self.keys = keys
        self.metrics = HandoverMetrics(registry)
        self.on_change = on_change
        self.on_fence = on_fence
        self.settle = settle
        self.reports: dict[str, Report] = {}
        self.reads = 0
        self._poke = asyncio.Event()
        self._started = False  # set by the first registration
        self._last_error = ""

    # -- triggers -------------------------------------------------------------------------------------------
    def registered(self) -> None:
        """A runner registered with the kubelet: read now (the first one starts the periodic reads)."""
        self._started = True
        self._poke.set()

    def allocated(self) -> None:
        """An Allocate was answered: read once the kubelet has had time to record it."""
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to wake
            asyncio.get_running_loop().call_later(self.settle, self._poke.set)

    def annotations(self) -> dict[str, str]:
        """The labeller's view: annotation key -> JSON value, for every resource read at least once."""
        return {self.keys[r]: report.to_json() for r, report in sorted(self.reports.items())}

    # -- the loop -------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Wait for the first registration, then read on every trigger and every ``interval`` until ``stop``."""
        while not stop.is_set():
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._poke.wait())]
            timeout = self.interval if self._started else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), timeout)
            for task in waits:
                task.cancel()
            if stop.is_set():
                return
            self._poke.clear()
            if self._started:
                try:
                    await self.observe()
                except Exception:  # a bug here must not end the reads: the next trigger tries again
                    log.exception("pod-resources read crashed; will retry", extra={"socket": self.socket_path})

    async def observe(self) -> None:
        """One read of the API and what follows from it: reports, the guard, logs and metrics."""
        self.reads += 1
        observed = observed_now()
        try:
            held = await assigned_ids(self.socket_path, self.tables)
        except PodResourcesError as exc:
            self._failed(str(exc), observed)
            return
        if self._last_error:
            log.info("pod-resources API read again", extra={"socket": self.socket_path})
            self._last_error = ""
        for resource, table in self.tables.items():
            ids = held.get(resource, {})
            unknown = sorted(i for i in ids if i not in table.advertised)
            self.metrics.unknown.labels(resource).set(len(unknown))
            self._guard(resource, table, ids, unknown)
            self._publish(Report(resource, len(table.advertised), len(ids), len(unknown), observed_at=observed))

    def _failed(self, error: str, observed: str) -> None:
        self.metrics.errors.inc()
        if error != self._last_error:  # one warning per distinct failure, not one every period
            log.warning("cannot read the kubelet pod-resources API; the Node annotation carries the error and the "
                        "handover guard stays as it was", extra={"socket": self.socket_path, "error": error})
            self._last_error = error
        for resource, table in self.tables.items():
            self._publish(Report(resource, len(table.advertised), error=error, observed_at=observed))

    def _publish(self, report: Report) -> None:
        old = self.reports.get(report.resource)
        self.reports[report.resource] = report
        if (old is None or not unchanged(old.to_json(), report.to_json())) and self.on_change:
            self.on_change()

    def _guard(self, resource: str, table: DeviceTable, ids: Mapping[str, set[str]], unknown: list[str]) -> None:
        if unknown:
            used = {table.advertised[i] for i in ids if i in table.advertised}
            fenced = set(table.physical) - used
        else:
            fenced = set()
        was = table.fenced
        if not table.set_fenced(fenced):
            return
        if self.on_fence:
            self.on_fence(resource)
        if fenced or unknown:
            pods = sorted({p for i in unknown for p in ids[i]})
            log.warning(
                "the kubelet lists device IDs this plugin does not serve as assigned to running pods (another "
                "plugin's naming: MIG, time-slicing or other IDs): reporting every free device Unhealthy so that no "
                "new pod is given a device a running pod may hold; back to normal once those pods end (drain them, "
                "or run the other plugin without MIG/sharing naming before the handover)",
                extra={"resource": resource, "unknown_ids": describe_ids(unknown), "pods": pods[:MAX_NAMED_PODS],
                       "pods_total": len(pods), "fenced": len(fenced), "devices": len(table.physical)})
        elif was:
            log.info("no pod holds a device ID this plugin does not serve any more: devices reported with their "
                     "own health again", extra={"resource": resource, "devices": len(table.physical)})
