"""A stand-in for the ``pynvml`` module at its function boundary, for unit tests without a GPU.

It implements the pynvml functions the NVML backend calls, with pynvml's own signatures, constants and
exception classes (``pynvml.NVMLError(code)``), over a small in-memory machine description. Tests push
events with ``inject_event`` and break devices with ``fail``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeGPU:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_mib: int = 81559
    bus_id: str = "00000000:00:00.0"
    minor: int = 0
    compute: tuple[int, int] = (9, 0)
    nvlinks: list[str] = field(default_factory=list)  # remote bus IDs, one entry per link
    broken: bool = False  # NVML calls on it fail (GPU fell off the bus)
    retired_pending: bool = False
    supported_events: int = 0x8 | 0x2 | 0x1
    # telemetry (node health checks and the exporter)
    temperature_c: int = 40
    slowdown_c: int = 90  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    power_mw: int = 300_000
    power_limit_mw: int = 700_000
    utilization_gpu: int = 0  # percent
    utilization_memory: int = 0
    memory_used_mib: int = 0
    ecc_corrected: int = 0  # volatile counts
    ecc_uncorrected: int = 0
    ecc_supported: bool = True
    remapped_rows: tuple[int, int, bool, bool] | None = (0, 0, False, False)  # None: not supported (pre-Ampere)
    retired_supported: bool = True


class FakeNVML:
    """Drop-in for the pynvml module: ``NvmlBackend(..., nvml=FakeNVML(gpus))``."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[FakeGPU], topology: dict[tuple[int, int], int] | None = None,
                 init_error: int | None = None, driver: str = "550.54.15", cuda: int = 12040) -> None:
        self.gpus = gpus
        self.topology = topology or {}  # (index a, index b) -> NVML_TOPOLOGY_* level; default SYSTEM
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: dict[str, int] = {}
        self.wait_error: int | None = None
        self.lock = threading.Lock()
        self.calls: list[str] = []
        self.hang: dict[str, threading.Event] = {}  # function name -> the call blocks until the event is set
        self.initialised = False  # like pynvml: event sets need a successful nvmlInit

    def _maybe_hang(self, name: str) -> None:
        event = self.hang.get(name)
        if event is not None:
            event.wait()

    def __getattr__(self, name: str) -> Any:  # constants: NVML_*, nvmlEventType*
        if name.startswith(("NVML_", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # handles are the FakeGPU objects themselves
    def _gpu(self, handle: FakeGPU) -> FakeGPU:
        if handle.broken:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def nvmlInit(self) -> None:
        self.calls.append("init")
        self._maybe_hang("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGPU:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return self._gpu(gpu)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: FakeGPU) -> str:
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGPU) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGPU) -> Any:
        gpu = self._gpu(handle)
        total, used = gpu.memory_mib * 1024 * 1024, gpu.memory_used_mib * 1024 * 1024
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetPciInfo(self, handle: FakeGPU) -> Any:
        return SimpleNamespace(busId=self._gpu(handle).bus_id.encode())

    def nvmlDeviceGetMinorNumber(self, handle: FakeGPU) -> int:
        return self._gpu(handle).minor

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGPU) -> tuple[int, int]:
        return self._gpu(handle).compute

    def nvmlDeviceGetTopologyCommonAncestor(self, a: FakeGPU, b: FakeGPU) -> int:
        ia, ib = self.gpus.index(a), self.gpus.index(b)
        return self.topology.get((min(ia, ib), max(ia, ib)), pynvml.NVML_TOPOLOGY_SYSTEM)

    def nvmlDeviceGetNvLinkState(self, handle: FakeGPU, link: int) -> int:
        if not handle.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(handle.nvlinks):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: FakeGPU, link: int) -> Any:
        return SimpleNamespace(busId=handle.nvlinks[link])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeGPU) -> int:
        gpu = self._gpu(handle)
        if not gpu.retired_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED if gpu.retired_pending else pynvml.NVML_FEATURE_DISABLED

    # telemetry
    def nvmlDeviceGetTemperature(self, handle: FakeGPU, sensor: int) -> int:
        self._maybe_hang("nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle).temperature_c

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeGPU, threshold: int) -> int:
        if threshold != pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(handle).slowdown_c

    def nvmlDeviceGetPowerUsage(self, handle: FakeGPU) -> int:
        return self._gpu(handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeGPU) -> int:
        return self._gpu(handle).power_limit_mw

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGPU) -> Any:
        gpu = self._gpu(handle)
        return SimpleNamespace(gpu=gpu.utilization_gpu, memory=gpu.utilization_memory)

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGPU, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        if not gpu.ecc_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if counter_type not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_uncorrected
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_corrected
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRemappedRows(self, handle: FakeGPU) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        if gpu.remapped_rows is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        corrected, uncorrected, pending, failed = gpu.remapped_rows
        return corrected, uncorrected, int(pending), int(failed)

    # events
    def nvmlEventSetCreate(self) -> str:
        if not self.initialised:  # pynvml without a loaded library or before nvmlInit
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return "event-set"

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self.calls.append("event-set-free")

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeGPU) -> int:
        return self._gpu(handle).supported_events

    def nvmlDeviceRegisterEvents(self, handle: FakeGPU, mask: int, event_set: Any) -> None:
        self.registered[self._gpu(handle).uuid] = mask

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        if self.wait_error is not None:
            code, self.wait_error = self.wait_error, None
            raise pynvml.NVMLError(code)
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None

    # test controls
    def inject_xid(self, index: int, xid: int) -> None:
        self.events.put(SimpleNamespace(device=self.gpus[index], eventType=pynvml.nvmlEventTypeXidCriticalError,
                                        eventData=xid))

    def inject_dbe(self, index: int) -> None:
        self.events.put(SimpleNamespace(device=self.gpus[index], eventType=pynvml.nvmlEventTypeDoubleBitEccError,
                                        eventData=0))


def dgx_like(count: int = 8) -> FakeNVML:
    """``count`` GPUs: pairs (0,1), (2,3), ... share a PCIe switch and have 2 NVLinks between them; the two
    halves sit on NUMA-style host bridges."""
    gpus = [FakeGPU(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", bus_id=f"00000000:{0x10 + i:02X}:00.0", minor=i)
            for i in range(count)]
    topology: dict[tuple[int, int], int] = {}
    for a in range(count):
        for b in range(a + 1, count):
            if a // 2 == b // 2:
                topology[(a, b)] = pynvml.NVML_TOPOLOGY_SINGLE
            elif (a < count // 2) == (b < count // 2):
                topology[(a, b)] = pynvml.NVML_TOPOLOGY_HOSTBRIDGE
            else:
                topology[(a, b)] = pynvml.NVML_TOPOLOGY_SYSTEM
    for a in range(0, count - 1, 2):
        gpus[a].nvlinks = [gpus[a + 1].bus_id] * 2
        gpus[a + 1].nvlinks = [gpus[a].bus_id] * 2
    return FakeNVML(gpus, topology)
