"""NeuReality NR1 modules: PCI functions found in sysfs (see ``nr1_sysfs``), advertised by PCI address.

Health is polled: the PCI function must still exist; a configured sysfs attribute must read one of the
healthy values; a configured probe command must exit 0 within its timeout. A module that passes again
becomes Healthy again. ``Allocate`` returns device specs for the module's device nodes and
``NR1_VISIBLE_DEVICES`` with the PCI addresses; the module's network interfaces are recorded so that the CNI
plugin can hand them to the pod.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_plugin import nr1_sysfs
from device_plugin.allocation import best_connected
from device_plugin.devices import HealthReport, PhysicalDevice
from protos.deviceplugin.v1beta1 import api_pb2

log = logging.getLogger("accelstack.device_plugin.nr1")


PROBE_OUTPUT_LIMIT = 160  # characters of a failed probe's output in the reason (a node condition, a log line)
_SECRET = re.compile(r"(?i)\b(password|passwd|secret|token|api[_-]?key|authorization)(\s*[:=]\s*)(bearer\s+)?\S+")
_BEARER = re.compile(r"(?i)\bbearer\s+\S+")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # terminal colour and cursor sequences


def probe_output(stderr: bytes, stdout: bytes, limit: int = PROBE_OUTPUT_LIMIT) -> str:
    """What a failed probe said, for its reason: stderr (where a failing command says why), else stdout, else
    '(no output)'; one line (lines joined with ' | ', colour codes and control characters dropped), values of password/token/
    key/authorization-like fields and bearer tokens replaced by '<redacted>', and its last ``limit``
    characters (the end says why it failed)."""
    for raw in (stderr, stdout):
        lines = [" ".join("".join(c if c.isprintable() else " " for c in line).split())
                 for line in _ANSI.sub("", raw.decode(errors="replace")).splitlines()]
        text = " | ".join(line for line in lines if line)
        if text:
            text = _BEARER.sub("Bearer <redacted>", _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}<redacted>", text))
            return text if len(text) <= limit else "…" + text[-(limit - 1):]
    return "(no output)"


class NR1Backend:
    replicas = 1

    def __init__(self, settings: dict[str, Any], sysfs_root: str = "/sys") -> None:
        self.resource_name: str = settings["resourceName"]
        self.settings = settings
        self.sysfs_root = sysfs_root
        self.devices: list[PhysicalDevice] = []
        self.by_id: dict[str, PhysicalDevice] = {}

    def discover(self) -> list[PhysicalDevice]:
        modules = nr1_sysfs.discover(self.sysfs_root, self.settings["vendorIDs"], self.settings["deviceIDs"],
                                     self.settings["devPattern"])
        self.devices = [
            PhysicalDevice(
                id=m.pci_address,
                index=m.index,
                numa_node=m.numa_node,
                model=f"NR1-{m.device_id}",
                attrs={"net_interfaces": list(m.net_interfaces), "dev_nodes": list(m.dev_nodes),
                       "vendor_id": m.vendor_id, "device_id": m.device_id},
            )
            for m in modules
        ]
        self.by_id = {d.id: d for d in self.devices}
        log.info("nr1 discovery", extra={"devices": len(self.devices), "sysfs": self.sysfs_root})
        return self.devices

    def pair_score(self, a: str, b: str) -> int:
        na, nb = self.by_id[a].numa_node, self.by_id[b].numa_node
        return 20 if na is not None and na == nb else 10

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        return best_connected(available, must_include, size, self.pair_score)

    def allocate(self, physical_ids: list[str], advertised_ids: list[str]) -> api_pb2.ContainerAllocateResponse:
        response = api_pb2.ContainerAllocateResponse()
        modules = [self.by_id[i] for i in dict.fromkeys(physical_ids)]
        response.envs["NR1_VISIBLE_DEVICES"] = ",".join(m.id for m in modules)
        for module in modules:
            for node in module.attrs["dev_nodes"]:
                response.devices.add(container_path=node, host_path=node, permissions="rw")
        return response

    def check(self, device: PhysicalDevice) -> tuple[bool, str]:
        """One health verdict for a module: (healthy, reason when not)."""
        if not nr1_sysfs.find_module(self.sysfs_root, device.id):
            return False, "PCI function disappeared"
        attribute = self.settings.get("healthAttribute", "")
        if attribute:
            path = Path(self.sysfs_root) / nr1_sysfs.PCI_DEVICES / device.id / attribute
            try:
                value = path.read_text().strip()
            except OSError as exc:
                return False, f"health attribute {attribute} unreadable: {exc.strerror}"
            healthy_values = {v.lower() for v in self.settings.get("healthyValues", ())}
            if value.lower() not in healthy_values:
                return False, f"health attribute {attribute}={value!r}"
        probe = self.settings.get("probeCommand") or []
        if probe:
            argv = [arg.replace("{pci}", device.id) for arg in probe]
            try:
                result = subprocess.run(argv, capture_output=True, timeout=self.settings.get("probeTimeout", 5.0),
                                        check=False)
            except subprocess.TimeoutExpired:
                return False, "probe timed out"
            except OSError as exc:
                return False, f"probe could not run: {exc.strerror}"
            if result.returncode != 0:
                return False, f"probe exit {result.returncode}: {probe_output(result.stderr, result.stdout)}"
        return True, ""

    def run_health(self, report: HealthReport, stopped: Callable[[], bool]) -> None:
        interval = float(self.settings.get("healthInterval", 10.0))
        known: dict[str, bool] = {}
        while not stopped():
            for device in self.devices:
                healthy, reason = self.check(device)
                if known.get(device.id, True) != healthy:
                    log.warning("nr1 health change", extra={"pci": device.id, "healthy": healthy, "reason": reason})
                known[device.id] = healthy
                report(device.id, healthy, reason)
            deadline = time.monotonic() + interval
            while not stopped() and time.monotonic() < deadline:
                time.sleep(min(0.05, interval))

    def labels(self) -> dict[str, str]:
        present = nr1_sysfs.discover(self.sysfs_root, self.settings["vendorIDs"], self.settings["deviceIDs"])
        labels = {"accelstack.io/nr1.count": str(len(present))}
        if self.devices:
            labels["accelstack.io/nr1.product"] = self.devices[0].model
        return labels

    def close(self) -> None:
        return None
