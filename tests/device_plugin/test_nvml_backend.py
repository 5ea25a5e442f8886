"""The NVML backend with NVML replaced at the pynvml function boundary."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pynvml
import pytest

from device_plugin.config import load
from device_plugin.main import build_backends
from device_plugin.nvml_backend import BackendInitError, NvmlBackend, label_value, sysfs_pci_address
from tests.fake_nvml import FakeGPU, FakeNVML, dgx_like
from tests.sysfs_fixture import add_pci_function


def settings(*flags: str) -> dict:  # type: ignore[type-arg]
    config, _ = load(list(flags), environ={})
    return config.section("nvidia")


def backend(nvml: FakeNVML, *flags: str, sysfs: str = "/nonexistent", dev: str = "/dev") -> NvmlBackend:
    b = NvmlBackend(settings(*flags), sysfs, dev, nvml=nvml)  # type: ignore[arg-type]
    b.discover()
    return b


def test_discovery_by_uuid_with_numa_from_sysfs(tmp_path: Path) -> None:
    nvml = dgx_like(2)
    add_pci_function(tmp_path, "0000:10:00.0", vendor="0x10de", device="0x2330", numa_node=1)
    add_pci_function(tmp_path, "0000:11:00.0", vendor="0x10de", device="0x2330", numa_node=-1)
    b = backend(nvml, sysfs=str(tmp_path))
    assert [d.id for d in b.devices] == [g.uuid for g in nvml.gpus]
    assert [d.numa_node for d in b.devices] == [1, None]
    assert b.devices[0].model == "NVIDIA H100 80GB HBM3" and b.devices[0].memory_mib == 81559
    assert b.devices[1].attrs == {"bus_id": "0000:11:00.0", "minor": 1, "compute": "9.0"}


def test_nvml_missing_is_a_clear_error_or_zero_devices() -> None:
    nvml = FakeNVML([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(BackendInitError, match=r"NVML could not be initialised.*nvidia runtime"):
        NvmlBackend(settings(), nvml=nvml).discover()  # type: ignore[arg-type]
    config, _ = load(["--fail-on-init-error", "false"], environ={})
    [gpu] = build_backends(config, nvml=nvml)
    assert gpu.devices == []
    config, _ = load([], environ={})
    with pytest.raises(BackendInitError):
        build_backends(config, nvml=nvml)


def test_pair_scores_follow_nvlink_then_pcie() -> None:
    b = backend(dgx_like(8))
    ids = [d.id for d in b.devices]
    assert b.pair_score(ids[0], ids[1]) == 2 * 100 + 50  # two NVLinks + same switch
    assert b.pair_score(ids[0], ids[2]) == 30  # same host bridge
    assert b.pair_score(ids[0], ids[7]) == 10  # across CPUs


def test_preferred_allocation_picks_connected_sets() -> None:
    b = backend(dgx_like(8))
    ids = [d.id for d in b.devices]
    assert b.preferred(ids, [], 2) == [ids[0], ids[1]]
    assert b.preferred(ids[1:], [], 2) == [ids[2], ids[3]]  # GPU 1 alone has no linked partner left
    assert b.preferred(ids, [ids[5]], 2) == [ids[4], ids[5]]
    assert b.preferred(ids, [], 4) == ids[:4]  # two linked pairs under one host bridge
    assert b.preferred([ids[0], ids[2], ids[3], ids[6]], [ids[0]], 3) == [ids[0], ids[2], ids[3]]


def test_allocate_strategies(tmp_path: Path) -> None:
    nvml = dgx_like(2)
    ids = [g.uuid for g in nvml.gpus]
    b = backend(nvml)
    response = b.allocate(ids, ids)
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}
    assert not response.cdi_devices and not response.devices
    b = backend(nvml, "--nvidia-device-list-strategy", "cdi-cri", "--nvidia-device-id-strategy", "index")
    response = b.allocate([ids[1]], [ids[1]])
    assert not response.envs
    assert [c.name for c in response.cdi_devices] == [f"nvidia.com/gpu={ids[1]}"]
    for name in ("nvidiactl", "nvidia-uvm", "nvidia1"):
        (tmp_path / name).touch()
    b = backend(nvml, "--nvidia-device-list-strategy", "envvar,cdi-cri", "--nvidia-device-id-strategy", "index",
                "--nvidia-pass-device-specs", "true", dev=str(tmp_path))
    response = b.allocate([ids[1]], [ids[1]])
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == "1"
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        ("/dev/nvidiactl", f"{tmp_path}/nvidiactl", "rw"), ("/dev/nvidia-uvm", f"{tmp_path}/nvidia-uvm", "rw"),
        ("/dev/nvidia1", f"{tmp_path}/nvidia1", "rw")]


def test_time_slicing_replicas() -> None:
    nvml = dgx_like(2)
    b = backend(nvml, "--nvidia-sharing-replicas", "3")
    ids = [g.uuid for g in nvml.gpus]
    replicas = [f"{u}::{k}" for u in ids for k in range(3)]
    response = b.allocate([ids[0], ids[0]], replicas[:2])
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == ids[0]  # each physical GPU once
    # distributed spreads over GPUs; packed fills the busiest GPU first
    assert b.preferred(replicas, [], 2) == sorted([f"{ids[0]}::0", f"{ids[1]}::0"])
    packed = backend(nvml, "--nvidia-sharing-replicas", "3", "--nvidia-sharing-allocation-policy", "packed")
    available = [r for r in replicas if r != f"{ids[1]}::0"]  # GPU 1 already has one replica in use
    assert packed.preferred(available, [], 2) == [f"{ids[1]}::1", f"{ids[1]}::2"]
    strict = backend(nvml, "--nvidia-sharing-replicas", "3", "--nvidia-sharing-fail-requests-greater-than-one", "true")
    with pytest.raises(ValueError, match="2 shared GPU replicas requested"):
        strict.allocate([ids[0], ids[0]], replicas[:2])


def run_health(b: NvmlBackend, duration: float) -> list[tuple[str, bool, str]]:
    reports: list[tuple[str, bool, str]] = []
    stop = threading.Event()
    thread = threading.Thread(target=b.run_health, args=(lambda *r: reports.append(r), stop.is_set))
    thread.start()
    time.sleep(duration)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    return reports


def test_xids_ignored_critical_and_dbe() -> None:
    nvml = dgx_like(3)
    b = backend(nvml, "--nvidia-health-ignored-xids", "13,31,94", "--nvidia-health-recovery-period", "0")
    ids = [g.uuid for g in nvml.gpus]
    nvml.inject_xid(0, 94)  # configured as ignored
    nvml.inject_xid(1, 48)  # double-bit ECC XID: critical
    nvml.inject_dbe(2)
    reports = run_health(b, 0.5)
    assert reports == [(ids[1], False, "XID 48"), (ids[2], False, "double-bit ECC error")]
    assert nvml.registered == {u: 0x8 | 0x2 for u in ids}
    assert "event-set-free" in nvml.calls


def test_recovery_after_quiet_period_and_passing_recheck() -> None:
    nvml = dgx_like(2)
    b = backend(nvml, "--nvidia-health-recovery-period", "0.2", "--nvidia-health-recheck-interval", "0.05")
    ids = [g.uuid for g in nvml.gpus]
    nvml.gpus[1].retired_pending = True  # the re-check fails for GPU 1 until the pages are retired
    nvml.inject_xid(0, 79)
    nvml.inject_xid(1, 79)
    reports = run_health(b, 0.8)
    assert (ids[0], False, "XID 79") in reports and (ids[1], False, "XID 79") in reports
    assert reports[-1][0] == ids[0] and reports[-1][1] is True
    assert not any(r[0] == ids[1] and r[1] for r in reports)


def test_no_recovery_when_period_is_zero() -> None:
    nvml = dgx_like(1)
    b = backend(nvml, "--nvidia-health-recovery-period", "0", "--nvidia-health-recheck-interval", "0.01")
    nvml.inject_xid(0, 79)
    reports = run_health(b, 0.4)
    assert [r[1] for r in reports] == [False]


def test_event_wait_failure_marks_all_unhealthy_then_recovers() -> None:
    nvml = dgx_like(2)
    nvml.wait_error = pynvml.NVML_ERROR_UNKNOWN
    b = backend(nvml, "--nvidia-health-recovery-period", "0.1", "--nvidia-health-recheck-interval", "0.05")
    reports = run_health(b, 0.8)
    assert [(r[0], r[1]) for r in reports[:2]] == [(g.uuid, False) for g in nvml.gpus]
    assert {r[0] for r in reports[2:] if r[1]} == {g.uuid for g in nvml.gpus}


def test_registration_failure_marks_device_unhealthy() -> None:
    nvml = FakeNVML([FakeGPU("GPU-a", bus_id="00000000:01:00.0"), FakeGPU("GPU-b", bus_id="00000000:02:00.0")])
    b = backend(nvml, "--nvidia-health-recovery-period", "0")
    nvml.gpus[1].broken = True
    reports = run_health(b, 0.3)
    assert reports[0][0] == "GPU-b" and reports[0][1] is False and "cannot register" in reports[0][2]


def test_labels_use_gfd_names() -> None:
    b = backend(dgx_like(4), "--nvidia-sharing-replicas", "2")
    assert b.labels() == {
        "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.replicas": "2", "nvidia.com/gpu.sharing-strategy": "time-slicing",
        "nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/cuda.driver-version.full": "550.54.15", "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54", "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.runtime-version.full": "12.4", "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
    }


def test_helpers() -> None:
    assert sysfs_pci_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert label_value(" Tesla T4 (PCIe) ") == "Tesla-T4--PCIe"
    assert len(label_value("x" * 100)) == 63
