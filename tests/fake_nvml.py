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
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

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
        return SimpleNamespace(total=gpu.memory_mib * 1024 * 1024, used=0, free=gpu.memory_mib * 1024 * 1024)

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
        return pynvml.NVML_FEATURE_ENABLED if self._gpu(handle).retired_pending else pynvml.NVML_FEATURE_DISABLED

    # events
    def nvmlEventSetCreate(self) -> str:
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
