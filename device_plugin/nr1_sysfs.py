"""NR1 module discovery from sysfs: the one place that knows how an NR1 module looks on the host.

NeuReality NR1 modules are PCI functions. A module is found under ``<sysfs>/bus/pci/devices/<address>``
by its ``vendor`` and ``device`` attributes; its NUMA node is ``numa_node``; its network interfaces are the
children of its ``net/`` directory; its device nodes come from a configurable ``/dev`` pattern.

This module imports only ``os`` at load time (``glob`` lazily, for device-node patterns) because the CNI plugin,
which is exec'd for every pod and whose start-up time matters, imports it too: no dataclasses, pathlib or re.
The device plugin, the NPD check and the CNI plugin all call these functions, so the mapping
module -> interfaces -> device nodes is written once.
"""

from __future__ import annotations

import os

PCI_DEVICES = "bus/pci/devices"


class NR1Module:
    """One NR1 module as the host shows it (immutable by convention; compared by value)."""

    __slots__ = ("dev_nodes", "device_id", "index", "net_interfaces", "numa_node", "pci_address", "vendor_id")

    def __init__(self, pci_address: str, index: int, vendor_id: str, device_id: str, numa_node: int | None,
                 net_interfaces: tuple[str, ...] = (), dev_nodes: tuple[str, ...] = ()) -> None:
        self.pci_address = pci_address  # e.g. "0000:3b:00.0"; also the device ID advertised to the kubelet
        self.index = index  # ordinal among the modules found, sorted by PCI address
        self.vendor_id = vendor_id  # "0x...." as sysfs writes it
        self.device_id = device_id
        self.numa_node = numa_node  # None when sysfs says -1 (no NUMA affinity) or has no attribute
        self.net_interfaces = net_interfaces
        self.dev_nodes = dev_nodes

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NR1Module) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "NR1Module(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


def _pci(sysfs_root: str | os.PathLike[str], address: str, *parts: str) -> str:
    return os.path.join(os.fspath(sysfs_root), PCI_DEVICES, address, *parts)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def normalize_hex_id(value: str) -> str:
    """'1F2E', '0x1f2e' and '0X1F2E' all become '0x1f2e'; anything else raises ValueError."""
    text = value.strip().lower()
    if text.startswith("0x"):
        text = text[2:]
    if not text or len(text) > 4 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"not a 16-bit hex PCI ID: {value!r}")
    return "0x" + text.rjust(4, "0")


def read_numa_node(sysfs_root: str | os.PathLike[str], pci_address: str) -> int | None:
    """NUMA node of a PCI function, or None when the platform reports none (-1) or sysfs lacks it."""
    raw = _read(_pci(sysfs_root, pci_address, "numa_node"))
    if raw is None:
        return None
    try:
        node = int(raw)
    except ValueError:
        return None
    return node if node >= 0 else None


def net_interfaces(sysfs_root: str | os.PathLike[str], pci_address: str) -> tuple[str, ...]:
    """Names of the network interfaces that belong to a PCI function (children of its ``net/``)."""
    try:
        return tuple(sorted(os.listdir(_pci(sysfs_root, pci_address, "net"))))
    except OSError:
        return ()


def interface_operstate(sysfs_root: str | os.PathLike[str], pci_address: str, ifname: str) -> str | None:
    """The kernel's ``operstate`` of one of the module's interfaces ("up", "down", ...), None if absent."""
    return _read(_pci(sysfs_root, pci_address, "net", ifname, "operstate"))


def expand_dev_pattern(pattern: str, pci_address: str, index: int) -> tuple[str, ...]:
    """Device nodes of a module: ``{index}`` and ``{pci}`` are substituted, then the result is globbed.

    A pattern that names no existing file yields nothing, so a module whose driver made no node is visible.
    """
    import glob  # only the device plugin expands patterns; keep it off the CNI plugin's start-up

    path = pattern.replace("{index}", str(index)).replace("{pci}", pci_address)
    if glob.has_magic(path):
        return tuple(sorted(glob.glob(path)))
    return (path,) if os.path.exists(path) else ()


def discover(
    sysfs_root: str | os.PathLike[str],
    vendor_ids: list[str] | tuple[str, ...],
    device_ids: list[str] | tuple[str, ...] = (),
    dev_pattern: str = "",
) -> list[NR1Module]:
    """All NR1 modules under ``sysfs_root``: PCI functions whose vendor is in ``vendor_ids`` and, when
    ``device_ids`` is not empty, whose device ID is in it. Sorted by PCI address; indexes follow that order."""
    vendors = {normalize_hex_id(v) for v in vendor_ids}
    devices = {normalize_hex_id(d) for d in device_ids}
    root = os.path.join(os.fspath(sysfs_root), PCI_DEVICES)
    try:
        addresses = sorted(os.listdir(root))
    except OSError:
        return []
    found: list[NR1Module] = []
    for address in addresses:
        vendor, device = _read(_pci(sysfs_root, address, "vendor")), _read(_pci(sysfs_root, address, "device"))
        if vendor is None or device is None:
            continue
        try:
            vendor, device = normalize_hex_id(vendor), normalize_hex_id(device)
        except ValueError:
            continue
        if vendor not in vendors or (devices and device not in devices):
            continue
        index = len(found)
        found.append(
            NR1Module(
                pci_address=address,
                index=index,
                vendor_id=vendor,
                device_id=device,
                numa_node=read_numa_node(sysfs_root, address),
                net_interfaces=net_interfaces(sysfs_root, address),
                dev_nodes=expand_dev_pattern(dev_pattern, address, index) if dev_pattern else (),
            )
        )
    return found


def check_sysfs_root(sysfs_root: str | os.PathLike[str], need_pci: bool = True) -> str:
    """Why ``sysfs_root`` cannot be the host's sysfs ('' when it can): it must be a directory and, when PCI
    functions are looked up (``need_pci``), hold ``bus/pci/devices``. An empty ``bus/pci/devices`` is fine (a
    node without modules); a missing one means a wrong path or a missing hostPath mount."""
    root = os.fspath(sysfs_root)
    if not os.path.isdir(root):
        return f"{root} is not a directory" if os.path.exists(root) else f"{root} does not exist"
    if need_pci and not os.path.isdir(os.path.join(root, PCI_DEVICES)):
        return f"{root} has no {PCI_DEVICES} (is it the host's sysfs, mounted into the container?)"
    return ""


def find_module(sysfs_root: str | os.PathLike[str], pci_address: str) -> bool:
    """Whether the PCI function still exists (a module that vanished is unhealthy)."""
    return os.path.isdir(_pci(sysfs_root, pci_address))
