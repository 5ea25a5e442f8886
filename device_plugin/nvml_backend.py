"""NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py).

Discovery by UUID with model, memory, minor number, PCI bus ID and NUMA node (sysfs ``numa_node`` of the PCI
function); interconnect scores for the preferred allocation (NVLink links, then PCIe topology); health from
NVML events (critical XIDs, double-bit ECC) with a configurable ignored-XID list; and, unlike the upstream
plugin, **recovery**: an unhealthy GPU is re-checked once its quiet period has passed and returns to Healthy
when the check passes.

The NVML module is injected (``nvml=pynvml`` in production) so tests replace it at the pynvml function
boundary; there is no other code path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from device_plugin import nr1_sysfs
from device_plugin.allocation import best_connected, pick_replicas
from device_plugin.devices import HealthReport, PhysicalDevice, physical_of
from protos.deviceplugin.v1beta1 import api_pb2

log = logging.getLogger("accelstack.device_plugin.nvml")

# NVML topology levels (nvmlGpuTopologyLevel_t) -> pair score, NVIDIA's best-effort ordering.
_PCIE_SCORE = {0: 60, 10: 50, 20: 40, 30: 30, 40: 20, 50: 10}
NVLINK_SCORE = 100
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


class BackendInitError(RuntimeError):
    """The backend cannot start (no driver, NVML missing); the message says why and what to check."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def sysfs_pci_address(nvml_bus_id: str) -> str:
    """NVML's '00000000:3B:00.0' -> sysfs's '0000:3b:00.0'."""
    bus_id = nvml_bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest else bus_id


def pci_gpu_functions(sysfs_root: str, vendor: str = "0x10de") -> list[str]:
    """PCI addresses of display-class functions (class 0x03xxxx) of ``vendor`` in sysfs: the GPUs the bus
    shows, whatever NVML sees (used to notice a GPU that NVML lost)."""
    root = Path(sysfs_root) / nr1_sysfs.PCI_DEVICES
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            if (entry / "vendor").read_text().strip().lower() != vendor:
                continue
            if not (entry / "class").read_text().strip().lower().startswith("0x03"):
                continue
        except OSError:
            continue
        found.append(entry.name)
    return found


class NvmlBackend:
    """The GPUs of this node; see the module docstring."""

    def __init__(self, settings: dict[str, Any], sysfs_root: str = "/sys", dev_root: str = "/dev",
                 nvml: ModuleType | None = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml: Any = nvml
        self.resource_name: str = settings["resourceName"]
        self.replicas: int = settings.get("sharing.replicas", 1)
        self.settings = settings
        self.sysfs_root = sysfs_root
        self.dev_root = dev_root
        self.devices: list[PhysicalDevice] = []
        self.by_uuid: dict[str, PhysicalDevice] = {}
        self._pair: dict[tuple[str, str], int] = {}
        self.driver_version = ""
        self.cuda_version = ""
        self._initialised = False

    # -- discovery -----------------------------------------------------------------------------------------
    def discover(self) -> list[PhysicalDevice]:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise BackendInitError(
                f"NVML could not be initialised ({exc}): is the NVIDIA driver installed and the container run with "
                "the nvidia runtime (or CDI) so that libnvidia-ml.so is visible?"
            ) from exc
        self._initialised = True
        self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
            self.cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        except Exception:
            self.cuda_version = ""
        devices: list[PhysicalDevice] = []
        handles: dict[str, Any] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            bus_id = sysfs_pci_address(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
            try:
                minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
            except Exception:
                minor = index
            try:
                major, minor_cc = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                compute = f"{major}.{minor_cc}"
            except Exception:
                compute = ""
            device = PhysicalDevice(
                id=uuid,
                index=index,
                numa_node=nr1_sysfs.read_numa_node(self.sysfs_root, bus_id),
                model=_text(nvml.nvmlDeviceGetName(handle)),
                memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024),
                attrs={"bus_id": bus_id, "minor": minor, "compute": compute},
            )
            devices.append(device)
            handles[uuid] = handle
        self.devices = devices
        self.by_uuid = {d.id: d for d in devices}
        self._pair = self._topology(handles)
        log.info("nvml discovery", extra={"devices": len(devices), "driver": self.driver_version,
                                          "cuda": self.cuda_version})
        return devices

    def _topology(self, handles: dict[str, Any]) -> dict[tuple[str, str], int]:
        nvml = self.nvml
        bus_to_uuid = {d.attrs["bus_id"]: d.id for d in self.devices}
        nvlinks: dict[tuple[str, str], int] = {}
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
        for uuid, handle in handles.items():
            for link in range(max_links):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                        continue
                    remote = sysfs_pci_address(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
                except Exception:
                    break  # NotSupported / InvalidArgument: no (more) links on this GPU
                peer = bus_to_uuid.get(remote)
                if peer and peer != uuid:
                    key = (min(uuid, peer), max(uuid, peer))
                    nvlinks[key] = nvlinks.get(key, 0) + 1
        scores: dict[tuple[str, str], int] = {}
        uuids = list(handles)
        for i, a in enumerate(uuids):
            for b in uuids[i + 1:]:
                try:
                    level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
                    pcie = _PCIE_SCORE.get(level, 10)
                except Exception:
                    pcie = 20 if self.by_uuid[a].numa_node == self.by_uuid[b].numa_node else 10
                key = (min(a, b), max(a, b))
                # NVLink links are counted from both ends: halve to get links between the pair
                scores[key] = pcie + NVLINK_SCORE * (nvlinks.get(key, 0) // 2 or nvlinks.get(key, 0))
        return scores

    def pair_score(self, a: str, b: str) -> int:
        return self._pair.get((min(a, b), max(a, b)), 0)

    # -- allocation ----------------------------------------------------------------------------------------
    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        if self.replicas > 1:
            return pick_replicas(available, must_include, size, self.settings["sharing.allocationPolicy"])
        return best_connected(available, must_include, size, self.pair_score)

    def allocate(self, physical_ids: list[str], advertised_ids: list[str]) -> api_pb2.ContainerAllocateResponse:
        if (self.replicas > 1 and self.settings.get("sharing.failRequestsGreaterThanOne")
                and len(advertised_ids) > 1):
            raise ValueError(
                f"{len(advertised_ids)} shared GPU replicas requested, but sharing.failRequestsGreaterThanOne "
                "allows one per container"
            )
        unique = list(dict.fromkeys(physical_ids))
        devices = [self.by_uuid[u] for u in unique]
        response = api_pb2.ContainerAllocateResponse()
        strategies: Sequence[str] = self.settings["deviceListStrategy"]
        if "envvar" in strategies:
            ids = [d.id if self.settings["deviceIDStrategy"] == "uuid" else str(d.index) for d in devices]
            response.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
        if "cdi-cri" in strategies:
            for d in devices:
                response.cdi_devices.add(name=f"{self.settings['cdiKind']}={d.id}")
        if self.settings.get("passDeviceSpecs"):
            for name in CONTROL_DEVICES:
                path = Path(self.dev_root) / name
                if path.exists():
                    response.devices.add(container_path=f"/dev/{name}", host_path=str(path), permissions="rw")
            for d in devices:
                name = f"nvidia{d.attrs['minor']}"
                response.devices.add(container_path=f"/dev/{name}", host_path=str(Path(self.dev_root) / name),
                                     permissions="rw")
        return response

    # -- health --------------------------------------------------------------------------------------------
    def recheck(self, uuid: str) -> tuple[bool, str]:
        """A passing re-check: the GPU answers NVML and has no page retirement pending."""
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception as exc:
            return False, f"NVML does not answer for the GPU: {exc}"
        try:
            if int(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                return False, "retired pages pending (reset the GPU)"
        except Exception:
            pass  # not supported on this GPU (e.g. row remapping instead): no verdict from it
        return True, ""

    def run_health(self, report: HealthReport, stopped: Callable[[], bool]) -> None:
        """Event loop of the health thread: NVML events in, health reports out, recovery by re-check."""
        if not self.settings.get("health.enabled", True):
            return
        if not self._initialised or not self.devices:
            # NVML absent (failOnInitError=false) or no GPU: zero GPUs is a state, with nothing to watch; NVML
            # calls would only fail (nvmlEventSetCreate raises Uninitialized without nvmlInit).
            log.info("nvml health watch idle: no GPUs", extra={"initialised": self._initialised})
            return
        nvml = self.nvml
        ignored = set(self.settings.get("health.ignoredXids", ()))
        recovery = float(self.settings.get("health.recoveryPeriod", 300.0))
        recheck_every = float(self.settings.get("health.recheckInterval", 30.0))
        xid_type = int(getattr(nvml, "nvmlEventTypeXidCriticalError", 0x8))
        dbe_type = int(getattr(nvml, "nvmlEventTypeDoubleBitEccError", 0x2))
        event_set = nvml.nvmlEventSetCreate()
        unhealthy_since: dict[str, float] = {}  # uuid -> monotonic time of the last critical event

        def mark(uuid: str, reason: str) -> None:
            unhealthy_since[uuid] = time.monotonic()
            report(uuid, False, reason)

        for device in self.devices:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(device.id)
                supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                nvml.nvmlDeviceRegisterEvents(handle, (xid_type | dbe_type) & supported, event_set)
            except Exception as exc:
                mark(device.id, f"cannot register for NVML health events: {exc}")
        last_recheck = time.monotonic()
        try:
            while not stopped():
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, 200)
                except Exception as exc:
                    if getattr(exc, "value", None) != getattr(nvml, "NVML_ERROR_TIMEOUT", 10):
                        for device in self.devices:
                            mark(device.id, f"NVML event wait failed: {exc}")
                        time.sleep(0.2)
                    data = None
                if data is not None:
                    self._handle_event(data, ignored, xid_type, dbe_type, mark)
                now = time.monotonic()
                if recovery > 0 and unhealthy_since and now - last_recheck >= min(recheck_every, recovery):
                    last_recheck = now
                    for uuid, since in list(unhealthy_since.items()):
                        if now - since < recovery:
                            continue
                        ok, reason = self.recheck(uuid)
                        if ok:
                            del unhealthy_since[uuid]
                            report(uuid, True, "recovered: quiet period passed and re-check passed")
                        else:
                            log.info("gpu still unhealthy", extra={"uuid": uuid, "reason": reason})
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception:
                pass

    def _handle_event(self, data: Any, ignored: set[int], xid_type: int, dbe_type: int,
                      mark: Callable[[str, str], None]) -> None:
        try:
            uuid = _text(self.nvml.nvmlDeviceGetUUID(data.device))
        except Exception:
            uuid = ""
        event_type = int(data.eventType)
        if event_type == xid_type:
            xid = int(data.eventData)
            if xid in ignored:
                log.info("ignored xid", extra={"uuid": uuid, "xid": xid})
                return
            reason = f"XID {xid}"
        elif event_type == dbe_type:
            reason = "double-bit ECC error"
        else:
            return
        targets = [uuid] if uuid in self.by_uuid else [d.id for d in self.devices]
        for target in targets:
            log.warning("gpu unhealthy", extra={"uuid": target, "reason": reason})
            mark(target, reason)

    # -- labels and shutdown -------------------------------------------------------------------------------
    def labels(self) -> dict[str, str]:
        """GPU feature discovery labels (the names GFD uses, so existing node selectors keep working)."""
        if not self.devices:
            return {"nvidia.com/gpu.present": "false"}
        first = self.devices[0]
        try:  # live: a GPU that fell off the bus no longer counts
            count = int(self.nvml.nvmlDeviceGetCount())
        except Exception:
            count = len(self.devices)
        labels = {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(count),
            "nvidia.com/gpu.product": label_value(first.model),
            "nvidia.com/gpu.memory": str(first.memory_mib),
            "nvidia.com/gpu.replicas": str(self.replicas),
            "nvidia.com/gpu.sharing-strategy": "time-slicing" if self.replicas > 1 else "none",
        }
        if first.attrs.get("compute"):
            major, _, minor = first.attrs["compute"].partition(".")
            labels["nvidia.com/gpu.compute.major"] = major
            labels["nvidia.com/gpu.compute.minor"] = minor
        if self.driver_version:
            parts = self.driver_version.split(".")
            labels["nvidia.com/cuda.driver-version.full"] = self.driver_version
            for name, part in zip(("major", "minor", "revision"), parts, strict=False):
                labels[f"nvidia.com/cuda.driver-version.{name}"] = part
        if self.cuda_version:
            major, _, minor = self.cuda_version.partition(".")
            labels["nvidia.com/cuda.runtime-version.full"] = self.cuda_version
            labels["nvidia.com/cuda.runtime-version.major"] = major
            labels["nvidia.com/cuda.runtime-version.minor"] = minor
        return labels

    def close(self) -> None:
        if self._initialised:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self._initialised = False


def label_value(text: str) -> str:
    """Make a string a valid label value: [A-Za-z0-9._-], at most 63, alphanumeric at both ends."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in text.strip())
    return cleaned[:63].strip("._-")


__all__ = ["BackendInitError", "NvmlBackend", "label_value", "pci_gpu_functions", "physical_of", "sysfs_pci_address"]
