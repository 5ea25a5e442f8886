"""Lay out a sysfs-like tree in a temp dir: PCI functions with vendor/device/numa_node and net/ children."""

from __future__ import annotations

from pathlib import Path

NR1_VENDOR = "0x1e2d"  # test value; real deployments configure nr1.vendorIDs from `lspci -nn`
NR1_DEVICE = "0x0001"


def add_pci_function(root: Path, address: str, vendor: str = NR1_VENDOR, device: str = NR1_DEVICE,
                     numa_node: int = 0, interfaces: tuple[str, ...] = (), attrs: dict[str, str] | None = None) -> Path:
    base = root / "bus/pci/devices" / address
    base.mkdir(parents=True, exist_ok=True)
    (base / "vendor").write_text(vendor + "\n")
    (base / "device").write_text(device + "\n")
    (base / "numa_node").write_text(f"{numa_node}\n")
    for name in interfaces:
        (base / "net" / name).mkdir(parents=True, exist_ok=True)
        (base / "net" / name / "operstate").write_text("up\n")
    for name, value in (attrs or {}).items():
        (base / name).write_text(value + "\n")
    return base


def nr1_node(root: Path, count: int = 4) -> list[str]:
    """``count`` NR1 modules split over NUMA nodes 0 and 1, each with one interface, plus a non-NR1 device."""
    addresses = []
    for i in range(count):
        address = f"0000:{0x3b + i:02x}:00.0"
        add_pci_function(root, address, numa_node=0 if i < count // 2 else 1, interfaces=(f"nr1p{i}",),
                         attrs={"health": "ok"})
        addresses.append(address)
    add_pci_function(root, "0000:00:1f.0", vendor="0x8086", device="0xa1c8")  # some unrelated Intel function
    return addresses
