"""Per-device Prometheus exporter (``accelstack-device-exporter``): GPUs through NVML, NR1 modules through sysfs,
and this node's device allocation from the kubelet's pod-resources API. Metric names and labels are listed in
``docs/metrics.md``; every name starts with ``accelstack_``.

Values are read when Prometheus scrapes (no stale cache), in a worker thread with a deadline
(``exporter.collectTimeout``): a hung NVML call or sysfs read costs that scrape its device metrics
(``accelstack_exporter_collect_timeouts_total`` counts it) and never blocks /metrics; while such a read is still
stuck, later scrapes answer at once without them. XIDs are counted from NVML events by a background thread, the way
the device plugin watches them, because a scrape cannot see events that happened between scrapes.

GPU discovery is the device plugin's (``NvmlBackend``), NR1 discovery ``nr1_sysfs``, the per-module health
check ``NR1Backend.check``; the HTTP server is the device plugin's stdlib WSGI endpoint.
"""

from __future__ import annotations

import glob
import logging
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("accelstack.npd.exporter")

GPU_LABELS = ["node", "gpu", "uuid"]
NR1_LABELS = ["node", "nr1", "pci_bus_id"]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class Allocation:
    """This node's allocatable and allocated devices per resource, from the kubelet's pod-resources API."""

    def __init__(self, socket_path: str, resources: list[str], timeout: float = 1.0) -> None:
        self.socket_path = socket_path
        self.resources = set(resources)
        self.timeout = timeout
        self._channel: Any = None
        self._stub: Any = None

    def _client(self) -> Any:
        if self._stub is None:
            import grpc

            from protos.podresources.v1 import api_pb2_grpc

            self._channel = grpc.insecure_channel("unix:" + self.socket_path)
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def read(self) -> tuple[dict[str, int], list[tuple[str, str, str, str, str]]]:
        """({resource: allocatable count}, [(resource, device, namespace, pod, container)])."""
        from protos.podresources.v1 import api_pb2

        stub = self._client()
        allocatable: dict[str, int] = dict.fromkeys(self.resources, 0)
        for devices in stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(),
                                                    timeout=self.timeout).devices:
            if devices.resource_name in self.resources:
                allocatable[devices.resource_name] += len(devices.device_ids)
        allocated: list[tuple[str, str, str, str, str]] = []
        for pod in stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout).pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    if devices.resource_name in self.resources:
                        allocated.extend((devices.resource_name, device, pod.namespace, pod.name, container.name)
                                         for device in devices.device_ids)
        return allocatable, allocated

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


class DeviceCollector(Collector):
    """The exporter's metrics, computed at scrape time; see the module docstring."""

    def __init__(self, values: Mapping[str, Any], nvml: Any = None, allocation: Allocation | None = None) -> None:
        self.values = values
        self.node = values["node.name"]
        self.sysfs_root = values["node.sysfsRoot"]
        self.nvml = nvml
        self.allocation = allocation
        self.timeout = float(values["exporter.collectTimeout"])
        self.lock = threading.Lock()
        self.xids: Counter[tuple[str, int]] = Counter()
        self.last_critical: dict[str, float] = {}
        self.timeouts = 0
        self.errors: Counter[str] = Counter()
        self.worker: threading.Thread | None = None
        self.inflight = threading.Event()  # set while the reader works on a scrape's request
        self.requests: queue.Queue[tuple[list[list[Metric]], threading.Event]] = queue.Queue()
        self.stopped = threading.Event()
        self.gpu_backend: Any = None
        self.gpu_error = ""
        self.gpu_attempt: float | None = None
        self.nr1_backend: Any = None
        self.event_thread: threading.Thread | None = None

    # -- start and stop ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Prepare the NR1 side; the GPUs are discovered by the reader thread on the first scrape (and retried
        every ``exporter.nvmlRetry`` while NVML is unavailable, e.g. before the driver has loaded), so a hung
        NVML never blocks start-up or the endpoint."""
        if self.values["exporter.nr1"]:
            from device_plugin.nr1_backend import NR1Backend
            from npd.nr1_check import backend_settings

            self.nr1_backend = NR1Backend(backend_settings(self.values), sysfs_root=self.sysfs_root)

    def close(self) -> None:
        self.stopped.set()
        if self.event_thread is not None:
            self.event_thread.join(2.0)
        if self.gpu_backend is not None:
            self.gpu_backend.close()
        if self.allocation is not None:
            self.allocation.close()

    def _watch_xids(self) -> None:
        nvml = self.gpu_backend.nvml
        xid_type = int(getattr(nvml, "nvmlEventTypeXidCriticalError", 0x8))
        critical = set(self.values["gpu.criticalXids"])
        event_set = nvml.nvmlEventSetCreate()
        try:
            for device in self.gpu_backend.devices:
                try:
                    handle = nvml.nvmlDeviceGetHandleByUUID(device.id)
                    supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                    nvml.nvmlDeviceRegisterEvents(handle, xid_type & supported, event_set)
                except Exception as exc:
                    log.warning("no XID events for GPU", extra={"uuid": device.id, "error": str(exc)})
            while not self.stopped.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, 500)
                except Exception as exc:
                    if getattr(exc, "value", None) != getattr(nvml, "NVML_ERROR_TIMEOUT", 10):
                        self.errors["nvml_events"] += 1
                        self.stopped.wait(0.5)
                    continue
                if int(data.eventType) != xid_type:
                    continue
                try:
                    uuid = nvml.nvmlDeviceGetUUID(data.device)
                    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                except Exception:
                    uuid = ""
                xid = int(data.eventData)
                with self.lock:
                    self.xids[(uuid, xid)] += 1
                    if not critical or xid in critical:
                        self.last_critical[uuid] = time.monotonic()
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception:
                pass

    # -- scrape --------------------------------------------------------------------------------------------
    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected on scrape only (registering must not touch the hardware)

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        families: list[Metric] = []
        if self.inflight.is_set():
            self.timeouts += 1  # the previous read is still stuck: answer now, do not queue behind it
        else:
            if self.worker is None or not self.worker.is_alive():
                self.worker = threading.Thread(target=self._serve_reads, name="device-reads", daemon=True)
                self.worker.start()
            box: list[list[Metric]] = []
            done = threading.Event()
            self.inflight.set()
            self.requests.put((box, done))
            if done.wait(self.timeout):
                families = box[0]
            else:
                self.timeouts += 1
                log.warning("device collection timed out", extra={"timeout": self.timeout})
        yield from families
        yield from self._allocation()
        yield from self._self_metrics(time.perf_counter() - started)

    def _serve_reads(self) -> None:
        """One long-lived reader thread (cheaper than a thread per scrape); a hung read blocks only it."""
        while True:
            box, done = self.requests.get()
            try:
                box.append(self._devices())
            except Exception as exc:
                self.errors["collect"] += 1
                log.error("device collection failed", extra={"error": str(exc)[:300]})
                box.append([])
            finally:
                self.inflight.clear()
                done.set()

    def _self_metrics(self, seconds: float) -> Iterator[Metric]:
        up = _gauge("accelstack_exporter_gpu_up", "1 when NVML is initialised; error says why not", ["node", "error"])
        if self.values["exporter.gpu"]:
            up.add_metric([self.node, self.gpu_error[:200]], 0 if self.gpu_backend is None else 1)
        yield up
        duration = _gauge("accelstack_exporter_collect_seconds", "Time this scrape spent reading devices", ["node"])
        duration.add_metric([self.node], seconds)
        yield duration
        timeouts = CounterMetricFamily("accelstack_exporter_collect_timeouts", "Scrapes whose device reads did not "
                                       "finish within exporter.collectTimeout", labels=["node"])
        timeouts.add_metric([self.node], self.timeouts)
        yield timeouts
        errors = CounterMetricFamily("accelstack_exporter_errors", "Errors while reading a source",
                                     labels=["node", "source"])
        for source, count in sorted(self.errors.items()):
            errors.add_metric([self.node, source], count)
        yield errors

    def _ensure_gpus(self) -> None:
        if not self.values["exporter.gpu"] or self.gpu_backend is not None:
            return
        now = time.monotonic()
        if self.gpu_attempt is not None and now - self.gpu_attempt < float(self.values["exporter.nvmlRetry"]):
            return
        self.gpu_attempt = now
        from device_plugin.nvml_backend import NvmlBackend

        backend = NvmlBackend({"resourceName": "nvidia.com/gpu"}, sysfs_root=self.sysfs_root, nvml=self.nvml)
        try:
            backend.discover()
        except Exception as exc:
            self.gpu_error = str(exc.__cause__ or exc)
            log.error("no GPU metrics; NVML will be tried again", extra={"error": str(exc)[:300]})
            backend.close()
            return
        self.gpu_error = ""
        self.gpu_backend = backend
        self.event_thread = threading.Thread(target=self._watch_xids, name="xid-events", daemon=True)
        self.event_thread.start()

    def _devices(self) -> list[Metric]:
        self._ensure_gpus()
        out: list[Metric] = []
        if self.gpu_backend is not None:
            out.extend(self._gpus())
        if self.nr1_backend is not None:
            out.extend(self._nr1())
        return out

    def _gpus(self) -> list[Metric]:
        nvml = self.gpu_backend.nvml
        f: dict[str, Any] = {
            "info": _gauge("accelstack_gpu_info", "GPU identity (value 1)",
                           [*GPU_LABELS, "pci_bus_id", "model", "driver_version"]),
            "util": _gauge("accelstack_gpu_utilization_ratio", "Fraction of time a kernel ran (0-1)", GPU_LABELS),
            "mem_util": _gauge("accelstack_gpu_memory_utilization_ratio",
                               "Fraction of time device memory was read or written (0-1)", GPU_LABELS),
            "used": _gauge("accelstack_gpu_memory_used_bytes", "Device memory in use", GPU_LABELS),
            "total": _gauge("accelstack_gpu_memory_total_bytes", "Device memory size", GPU_LABELS),
            "temp": _gauge("accelstack_gpu_temperature_celsius", "GPU core temperature", GPU_LABELS),
            "slow": _gauge("accelstack_gpu_slowdown_temperature_celsius", "Temperature at which the GPU slows down",
                           GPU_LABELS),
            "power": _gauge("accelstack_gpu_power_watts", "Power draw", GPU_LABELS),
            "limit": _gauge("accelstack_gpu_power_limit_watts", "Enforced power limit", GPU_LABELS),
            "ecc": CounterMetricFamily("accelstack_gpu_ecc_errors", "ECC errors over the GPU's life (aggregate)",
                                       labels=[*GPU_LABELS, "type"]),
            "ecc_vol": _gauge("accelstack_gpu_ecc_volatile_errors", "ECC errors since the driver loaded",
                              [*GPU_LABELS, "type"]),
            "retired": _gauge("accelstack_gpu_retired_pages_pending", "1 when retired pages wait for a GPU reset",
                              GPU_LABELS),
            "remap_pending": _gauge("accelstack_gpu_row_remap_pending", "1 when remapped rows wait for a GPU reset",
                                    GPU_LABELS),
            "remap_failed": _gauge("accelstack_gpu_row_remap_failed", "1 when row remapping failed", GPU_LABELS),
            "xid": CounterMetricFamily("accelstack_gpu_xid_errors", "XID errors seen since the exporter started",
                                       labels=[*GPU_LABELS, "xid"]),
            "healthy": _gauge("accelstack_gpu_healthy", "1 healthy, 0 not (NVML answers, no uncorrected ECC, no "
                              "pending retirement or remap, no critical XID within gpu.xidHoldTime)", GPU_LABELS),
        }
        hold = float(self.values["gpu.xidHoldTime"])
        max_ecc = int(self.values["gpu.maxUncorrectedEcc"])
        now = time.monotonic()
        with self.lock:
            xids = dict(self.xids)
            last_critical = dict(self.last_critical)
        for device in self.gpu_backend.devices:
            labels = [self.node, str(device.index), device.id]
            f["info"].add_metric([*labels, device.attrs["bus_id"], device.model, self.gpu_backend.driver_version], 1)
            healthy = True
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(device.id)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:
                self.errors["nvml"] += 1
                f["healthy"].add_metric(labels, 0)
                continue
            f["used"].add_metric(labels, int(memory.used))
            f["total"].add_metric(labels, int(memory.total))

            def read(function: str, *args: Any) -> Any:
                try:
                    return getattr(nvml, function)(*args)
                except Exception as exc:
                    if getattr(exc, "value", None) not in (nvml.NVML_ERROR_NOT_SUPPORTED,
                                                           getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)):
                        self.errors["nvml"] += 1
                    return None

            rates = read("nvmlDeviceGetUtilizationRates", handle)
            if rates is not None:
                f["util"].add_metric(labels, rates.gpu / 100.0)
                f["mem_util"].add_metric(labels, rates.memory / 100.0)
            for key, value, scale in (
                ("temp", read("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU), 1.0),
                ("slow", read("nvmlDeviceGetTemperatureThreshold", handle,
                              nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN), 1.0),
                ("power", read("nvmlDeviceGetPowerUsage", handle), 0.001),
                ("limit", read("nvmlDeviceGetEnforcedPowerLimit", handle), 0.001),
            ):
                if value is not None:
                    f[key].add_metric(labels, float(value) * scale)
            for kind, error_type in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                     ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                lifetime = read("nvmlDeviceGetTotalEccErrors", handle, error_type, nvml.NVML_AGGREGATE_ECC)
                volatile = read("nvmlDeviceGetTotalEccErrors", handle, error_type, nvml.NVML_VOLATILE_ECC)
                if lifetime is not None:
                    f["ecc"].add_metric([*labels, kind], int(lifetime))
                if volatile is not None:
                    f["ecc_vol"].add_metric([*labels, kind], int(volatile))
                    if kind == "uncorrected" and int(volatile) > max_ecc:
                        healthy = False
            pending = read("nvmlDeviceGetRetiredPagesPendingStatus", handle)
            if pending is not None:
                retired = int(pending) == nvml.NVML_FEATURE_ENABLED
                f["retired"].add_metric(labels, int(retired))
                healthy = healthy and not retired
            rows = read("nvmlDeviceGetRemappedRows", handle)
            if rows is not None:
                f["remap_pending"].add_metric(labels, int(bool(rows[2])))
                f["remap_failed"].add_metric(labels, int(bool(rows[3])))
                healthy = healthy and not rows[2] and not rows[3]
            for (uuid, xid), count in sorted(xids.items()):
                if uuid == device.id:
                    f["xid"].add_metric([*labels, str(xid)], count)
            if device.id in last_critical and now - last_critical[device.id] < hold:
                healthy = False
            f["healthy"].add_metric(labels, int(healthy))
        return list(f.values())

    def _nr1(self) -> list[Metric]:
        from device_plugin import nr1_sysfs

        modules = self.nr1_backend.discover()
        info = _gauge("accelstack_nr1_info", "NR1 module identity (value 1)", [*NR1_LABELS, "device_id", "numa_node"])
        healthy = _gauge("accelstack_nr1_healthy", "1 healthy, 0 not (present, health attribute, probe)", NR1_LABELS)
        link = _gauge("accelstack_nr1_link_up", "1 when the module's interface is operationally up",
                      [*NR1_LABELS, "interface"])
        attributes = {
            "temperature": (_gauge("accelstack_nr1_temperature_celsius", "Module temperature", NR1_LABELS), 0.001),
            "power": (_gauge("accelstack_nr1_power_watts", "Module power draw", NR1_LABELS), 1e-6),
            "utilization": (_gauge("accelstack_nr1_utilization_ratio", "Module utilisation (0-1)", NR1_LABELS), 0.01),
            "memoryUsed": (_gauge("accelstack_nr1_memory_used_bytes", "Module memory in use", NR1_LABELS), 1.0),
            "memoryTotal": (_gauge("accelstack_nr1_memory_total_bytes", "Module memory size", NR1_LABELS), 1.0),
        }
        for module in modules:
            labels = [self.node, str(module.index), module.id]
            numa = "" if module.numa_node is None else str(module.numa_node)
            info.add_metric([*labels, module.attrs["device_id"], numa], 1)
            ok, _reason = self.nr1_backend.check(module)
            healthy.add_metric(labels, int(ok))
            for ifname in module.attrs["net_interfaces"]:
                state = nr1_sysfs.interface_operstate(self.sysfs_root, module.id, ifname)
                link.add_metric([*labels, ifname], int(state == "up"))
            for key, (family, scale) in attributes.items():
                pattern = self.values[f"nr1.{key}Attribute"]
                if not pattern:
                    continue
                value = _read_number(Path(self.sysfs_root) / nr1_sysfs.PCI_DEVICES / module.id, pattern)
                if value is not None:
                    family.add_metric(labels, value * scale)
        return [info, healthy, link, *(family for family, _ in attributes.values())]

    def _allocation(self) -> Iterator[Metric]:
        if self.allocation is None:
            return
        up = _gauge("accelstack_exporter_podresources_up", "1 when the kubelet pod-resources API answered", ["node"])
        try:
            allocatable, allocated = self.allocation.read()
        except Exception as exc:
            self.errors["podresources"] += 1
            log.warning("pod-resources API unavailable", extra={"error": str(exc)[:300]})
            up.add_metric([self.node], 0)
            yield up
            return
        up.add_metric([self.node], 1)
        yield up
        total = _gauge("accelstack_node_allocatable_devices", "Devices the kubelet can allocate", ["node", "resource"])
        used = _gauge("accelstack_node_allocated_devices", "Devices allocated to containers", ["node", "resource"])
        per = _gauge("accelstack_device_allocated", "1 for each device allocated to a container",
                     ["node", "resource", "device", "namespace", "pod", "container"])
        counts: Counter[str] = Counter()
        for resource, device, namespace, pod, container in allocated:
            counts[resource] += 1
            per.add_metric([self.node, resource, device, namespace, pod, container], 1)
        for resource in sorted(allocatable):
            total.add_metric([self.node, resource], allocatable[resource])
            used.add_metric([self.node, resource], counts[resource])
        yield from (total, used, per)


def _read_number(base: Path, pattern: str) -> float | None:
    paths = sorted(glob.glob(str(base / pattern)))
    if not paths:
        return None
    try:
        return float(Path(paths[0]).read_text().strip())
    except (OSError, ValueError):
        return None


def build(values: Mapping[str, Any], nvml: Any = None) -> tuple[CollectorRegistry, DeviceCollector]:
    """A registry with the device collector (started); ``nvml`` None means pynvml."""
    if nvml is None and values["exporter.gpu"]:
        import pynvml

        nvml = pynvml
    socket_path = values["exporter.podResourcesSocket"]
    allocation = Allocation(socket_path, list(values["exporter.resources"])) if socket_path else None
    collector = DeviceCollector(values, nvml=nvml, allocation=allocation)
    collector.start()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry, collector


def main(argv: list[str] | None = None) -> None:
    from types import SimpleNamespace
    from typing import cast

    from device_plugin.config import ConfigError
    from npd.config import load, print_config
    from service.observability import HttpEndpoint, PluginMetrics, setup_logging

    try:
        config, args = load(argv, prog="accelstack-device-exporter",
                            description="Prometheus exporter for this node's GPUs and NR1 modules and their "
                                        "allocation.")
    except ConfigError as exc:
        print(f"accelstack-device-exporter: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.print_config:
        print(print_config(config, "accelstack-device-exporter"), end="")
        return
    setup_logging(config["log.level"], config["log.format"])
    registry, collector = build(config.values)
    # the device plugin's endpoint only reads ``.registry`` from its metrics object
    endpoint = HttpEndpoint(config["exporter.address"], cast(PluginMetrics, SimpleNamespace(registry=registry)),
                            ready=lambda: True)
    log.info("exporter serving", extra={"port": endpoint.port, "node": config["node.name"]})
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    endpoint.close()
    collector.close()


if __name__ == "__main__":
    main(sys.argv[1:])
