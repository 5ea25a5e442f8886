"""NR1 discovery against a sysfs tree laid out in a temp dir, and the NR1 backend's health and Allocate."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from device_plugin import nr1_sysfs
from device_plugin.config import load
from device_plugin.nr1_backend import NR1Backend
from tests.sysfs_fixture import NR1_VENDOR, add_pci_function, nr1_node


def backend(sysfs: Path, *flags: str) -> NR1Backend:
    config, _ = load(["--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR, *flags], environ={})
    b = NR1Backend(config.section("nr1"), str(sysfs))
    b.discover()
    return b


def test_discovery_filters_by_vendor_and_device(tmp_path: Path) -> None:
    addresses = nr1_node(tmp_path, 3)
    add_pci_function(tmp_path, "0000:99:00.0", device="0x0002")
    modules = nr1_sysfs.discover(tmp_path, ["1E2D"], ["0x0001"])
    assert [m.pci_address for m in modules] == addresses
    assert [m.index for m in modules] == [0, 1, 2]
    assert [m.numa_node for m in modules] == [0, 1, 1]
    assert modules[0].net_interfaces == ("nr1p0",)
    assert len(nr1_sysfs.discover(tmp_path, ["0x1e2d"])) == 4  # any device ID
    assert nr1_sysfs.discover(tmp_path / "missing", ["0x1e2d"]) == []
    with pytest.raises(ValueError):
        nr1_sysfs.normalize_hex_id("0x12345")


def test_dev_nodes_from_pattern(tmp_path: Path) -> None:
    nr1_node(tmp_path / "sys", 2)
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nr1_0", "nr1_0_ctl", "nr1_1"):
        (dev / name).touch()
    b = backend(tmp_path / "sys", "--nr1-dev-pattern", f"{dev}/nr1_{{index}}*")
    assert b.devices[0].attrs["dev_nodes"] == [f"{dev}/nr1_0", f"{dev}/nr1_0_ctl"]
    response = b.allocate([b.devices[0].id], [b.devices[0].id])
    assert response.envs["NR1_VISIBLE_DEVICES"] == "0000:3b:00.0"
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        (f"{dev}/nr1_0", f"{dev}/nr1_0", "rw"), (f"{dev}/nr1_0_ctl", f"{dev}/nr1_0_ctl", "rw")]
    assert nr1_sysfs.expand_dev_pattern("/dev/nr1-{pci}", "0000:3b:00.0", 0) == ()


def test_health_attribute_probe_and_disappearance(tmp_path: Path) -> None:
    nr1_node(tmp_path, 2)
    b = backend(tmp_path, "--nr1-health-attribute", "health")
    first, second = b.devices
    assert b.check(first) == (True, "")
    (tmp_path / "bus/pci/devices" / first.id / "health").write_text("degraded\n")
    assert b.check(first) == (False, "health attribute health='degraded'")
    (tmp_path / "bus/pci/devices" / second.id / "health").unlink()
    assert b.check(second)[0] is False and "unreadable" in b.check(second)[1]
    probe = tmp_path / "probe.py"
    probe.write_text("import sys; print('link down on', sys.argv[1]); sys.exit(0 if sys.argv[1].endswith('3b:00.0') else 3)")
    b = backend(tmp_path, "--nr1-probe-command", f"{sys.executable} {probe} {{pci}}")
    assert b.check(b.devices[0]) == (True, "")
    assert b.check(b.devices[1]) == (False, "probe exit 3: link down on 0000:3c:00.0")
    (tmp_path / "hang.py").write_text("import time; time.sleep(5)")
    slow = backend(tmp_path, "--nr1-probe-command", f"{sys.executable} {tmp_path / 'hang.py'}",
                   "--nr1-probe-timeout", "0.2")
    assert slow.check(slow.devices[0]) == (False, "probe timed out")
    shutil.rmtree(tmp_path / "bus/pci/devices" / first.id)
    assert b.check(first) == (False, "PCI function disappeared")


def test_labels(tmp_path: Path) -> None:
    nr1_node(tmp_path, 2)
    assert backend(tmp_path).labels() == {"accelstack.io/nr1.count": "2", "accelstack.io/nr1.product": "NR1-0x0001"}
