"""Shared fixtures for the node-health tests: configuration values, NVIDIA functions in a sysfs tree, kernel
log records."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from npd.config import load
from tests.fake_nvml import FakeNVML


def values(tmp: Path, *flags: str, environ: dict[str, str] | None = None) -> Mapping[str, Any]:
    config, _ = load(["--node-sysfs-root", str(tmp / "sys"), "--plugin-state-dir", str(tmp / "state"),
                      "--gpu-kmsg-path", str(tmp / "kmsg"), *flags], environ=environ or {})
    return config.values


def nvidia_functions(sysfs: Path, fake: FakeNVML) -> None:
    """The GPUs of ``fake`` as PCI functions (vendor 0x10de, 3D controller class), plus their audio siblings."""
    from device_plugin.nvml_backend import sysfs_pci_address

    for gpu in fake.gpus:
        base = sysfs / "bus/pci/devices" / sysfs_pci_address(gpu.bus_id)
        base.mkdir(parents=True, exist_ok=True)
        (base / "vendor").write_text("0x10de\n")
        (base / "device").write_text("0x2330\n")
        (base / "class").write_text("0x030200\n")
        (base / "numa_node").write_text("0\n")
        audio = base.parent / (base.name[:-1] + "1")
        audio.mkdir(exist_ok=True)
        (audio / "vendor").write_text("0x10de\n")
        (audio / "class").write_text("0x040300\n")


def kmsg_line(seq: int, text: str, prio: int = 4) -> str:
    return f"{prio},{seq},{seq * 1000},-;{text}\n"


def xid_line(seq: int, bus: str, xid: int, detail: str = "pid=1234, name=python, Ch 00000008") -> str:
    return kmsg_line(seq, f"NVRM: Xid (PCI:{bus}): {xid}, {detail}")
