"""The NVML backend on a real GPU through the real pynvml, when this machine has one (skips otherwise)."""

from __future__ import annotations

import threading
import time

import pytest

from device_plugin.config import load
from device_plugin.nvml_backend import NvmlBackend


def real_nvml() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return bool(count)
    except Exception:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not real_nvml(), reason="needs an NVIDIA GPU with a working driver (NVML)")]


def test_real_discovery_topology_health_and_labels() -> None:
    config, _ = load([], environ={})
    backend = NvmlBackend(config.section("nvidia"))
    devices = backend.discover()
    try:
        assert devices and all(d.id.startswith(("GPU-", "MIG-")) for d in devices)
        assert all(d.memory_mib > 0 and d.model for d in devices)
        ids = [d.id for d in devices]
        assert backend.preferred(ids, [], 1) == [ids[0]] or len(ids) > 1
        assert backend.allocate(ids[:1], ids[:1]).envs["NVIDIA_VISIBLE_DEVICES"] == ids[0]
        labels = backend.labels()
        assert labels["nvidia.com/gpu.count"] == str(len(devices)) and labels["nvidia.com/cuda.driver-version.full"]
        assert backend.recheck(ids[0]) == (True, "")
        reports: list[tuple[str, bool, str]] = []
        stop = threading.Event()
        thread = threading.Thread(target=backend.run_health, args=(lambda *r: reports.append(r), stop.is_set))
        thread.start()
        time.sleep(1.0)
        stop.set()
        thread.join(5)
        assert not thread.is_alive()
        assert not [r for r in reports if not r[1]], reports  # a healthy GPU raises no critical event
    finally:
        backend.close()
