"""The exporter scraped over HTTP and parsed with prometheus_client's parser: GPUs from FakeNVML at the pynvml
boundary, NR1 modules from a sysfs fixture, allocation from a pod-resources peer."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from npd.exporter import build
from service.observability import HttpEndpoint, PluginMetrics
from tests.fake_nvml import dgx_like
from tests.npd.helpers import values
from tests.npd.podresources_peer import PodResourcesPeer
from tests.sysfs_fixture import NR1_VENDOR, nr1_node


def serve(registry: Any) -> HttpEndpoint:
    return HttpEndpoint("127.0.0.1:0", cast(PluginMetrics, SimpleNamespace(registry=registry)), lambda: True)


def scrape(endpoint: HttpEndpoint, timeout: float = 10) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> {sorted labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=timeout) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def one(samples: dict, name: str, **labels: str) -> float:
    matches = [v for k, v in samples[name].items() if all((key, val) in k for key, val in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


@pytest.fixture
def gpu_node(tmp_path: Path):
    fake = dgx_like(8)
    peer = PodResourcesPeer(str(tmp_path / "kubelet.sock"))
    peer.allocatable = {"nvidia.com/gpu": [g.uuid for g in fake.gpus], "cpu-ignored/x": ["a"]}
    peer.set_pod("ml", "train-0", {"nvidia.com/gpu": [fake.gpus[0].uuid, fake.gpus[1].uuid]})
    peer.set_pod("ml", "infer-0", {"nvidia.com/gpu": [fake.gpus[5].uuid]}, container="srv")
    peer.start()
    vals = values(tmp_path, "--node-name", "gpu-1", "--exporter-pod-resources-socket", str(tmp_path / "kubelet.sock"))
    registry, collector = build(vals, nvml=fake)
    endpoint = serve(registry)
    yield fake, endpoint, collector, peer
    endpoint.close()
    collector.close()
    peer.stop()


def test_gpu_metrics_per_device(gpu_node) -> None:
    fake, endpoint, _, _ = gpu_node
    fake.gpus[3].temperature_c, fake.gpus[3].power_mw, fake.gpus[3].utilization_gpu = 77, 512_345, 93
    fake.gpus[3].memory_used_mib, fake.gpus[3].ecc_corrected = 1024, 12
    samples = scrape(endpoint)
    uuid = fake.gpus[3].uuid
    assert len(samples["accelstack_gpu_info"]) == 8
    assert one(samples, "accelstack_gpu_info", gpu="3", uuid=uuid, pci_bus_id="0000:13:00.0",
               model="NVIDIA H100 80GB HBM3", driver_version="550.54.15", node="gpu-1") == 1
    assert one(samples, "accelstack_gpu_temperature_celsius", uuid=uuid) == 77
    assert one(samples, "accelstack_gpu_slowdown_temperature_celsius", uuid=uuid) == 90
    assert one(samples, "accelstack_gpu_power_watts", uuid=uuid) == pytest.approx(512.345)
    assert one(samples, "accelstack_gpu_power_limit_watts", uuid=uuid) == 700
    assert one(samples, "accelstack_gpu_utilization_ratio", uuid=uuid) == pytest.approx(0.93)
    assert one(samples, "accelstack_gpu_memory_used_bytes", uuid=uuid) == 1024 * 2**20
    assert one(samples, "accelstack_gpu_memory_total_bytes", uuid=uuid) == 81559 * 2**20
    assert one(samples, "accelstack_gpu_ecc_errors_total", uuid=uuid, type="corrected") == 12
    assert one(samples, "accelstack_gpu_ecc_errors_total", uuid=uuid, type="uncorrected") == 0
    assert all(v == 1 for v in samples["accelstack_gpu_healthy"].values())
    assert one(samples, "accelstack_exporter_gpu_up", node="gpu-1") == 1


def test_health_and_xid_counts(gpu_node) -> None:
    fake, endpoint, _, _ = gpu_node
    fake.gpus[2].ecc_uncorrected = 1
    fake.gpus[4].remapped_rows = (0, 1, True, False)
    fake.inject_xid(6, 79)
    fake.inject_xid(6, 79)
    fake.inject_xid(1, 13)  # application error: counted, GPU stays healthy
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        samples = scrape(endpoint)
        if sum(samples.get("accelstack_gpu_xid_errors_total", {}).values()) == 3:
            break
        time.sleep(0.05)
    assert one(samples, "accelstack_gpu_xid_errors_total", uuid=fake.gpus[6].uuid, xid="79") == 2
    assert one(samples, "accelstack_gpu_xid_errors_total", uuid=fake.gpus[1].uuid, xid="13") == 1
    healthy = {dict(k)["gpu"]: v for k, v in samples["accelstack_gpu_healthy"].items()}
    assert healthy == {"0": 1, "1": 1, "2": 0, "3": 1, "4": 0, "5": 1, "6": 0, "7": 1}
    assert one(samples, "accelstack_gpu_row_remap_pending", gpu="4") == 1


def test_allocation_from_pod_resources(gpu_node) -> None:
    fake, endpoint, _, peer = gpu_node
    samples = scrape(endpoint)
    assert one(samples, "accelstack_node_allocatable_devices", resource="nvidia.com/gpu") == 8
    assert one(samples, "accelstack_node_allocated_devices", resource="nvidia.com/gpu") == 3
    assert one(samples, "accelstack_node_allocatable_devices", resource="neureality.com/nr1") == 0
    assert one(samples, "accelstack_device_allocated", device=fake.gpus[5].uuid, namespace="ml", pod="infer-0",
               container="srv") == 1
    assert one(samples, "accelstack_exporter_podresources_up") == 1
    peer.stop()
    samples = scrape(endpoint)
    assert one(samples, "accelstack_exporter_podresources_up") == 0
    assert "accelstack_node_allocated_devices" not in samples
    assert one(samples, "accelstack_exporter_errors_total", source="podresources") >= 1


class Gate(threading.Event):
    """An event that FakeNVML's hung call waits on, counting the calls that entered and left the wait: a test can
    tell that a call is blocked right now (entered, not left) without timing it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = self.left = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.entered += 1
        try:
            return super().wait(timeout)
        finally:
            self.left += 1


def test_hung_nvml_call_costs_the_scrape_its_device_metrics_only(gpu_node) -> None:
    """Judged by ordering, not by wall-clock bounds a loaded machine breaks: each scrape by what the hung call was
    doing when it answered; the only times are scaled to a healthy scrape measured here."""
    fake, endpoint, collector, _ = gpu_node
    assert len(scrape(endpoint)["accelstack_gpu_temperature_celsius"]) == 8  # the GPUs discovered
    started = time.perf_counter()
    assert len(scrape(endpoint)["accelstack_gpu_temperature_celsius"]) == 8
    healthy = time.perf_counter() - started  # a whole scrape, every read included, on this machine now
    patience = max(10.0, 100 * healthy)  # how long the client waits for an answer: a safety net, never reached
    # the collect timeout fits a healthy scrape many times over, so the scrape below times out in the hung call,
    # not on the way to it
    collector.timeout = max(0.3, 20 * healthy)
    release = Gate()
    fake.hang["nvmlDeviceGetTemperature"] = release
    try:
        samples = scrape(endpoint, timeout=collector.timeout + patience)
        # it answered while its read was blocked in the hung call, which nothing has released
        assert (release.entered, release.left) == (1, 0)
        assert "accelstack_gpu_temperature_celsius" not in samples
        assert one(samples, "accelstack_exporter_collect_timeouts_total") == 1
        assert one(samples, "accelstack_node_allocated_devices", resource="nvidia.com/gpu") == 3
        # the stuck read is still stuck: the next scrape neither queues a second read behind it nor waits for it.
        # Its timeout is one no scrape could sit out: a scrape that waited would leave the client without an answer
        collector.timeout = 3600.0
        samples = scrape(endpoint, timeout=patience)
        assert (release.entered, release.left) == (1, 0)
        assert "accelstack_gpu_temperature_celsius" not in samples
        assert one(samples, "accelstack_exporter_collect_timeouts_total") == 2
        assert one(samples, "accelstack_node_allocated_devices", resource="nvidia.com/gpu") == 3
        assert threading.active_count() < 40
    finally:
        release.set()
        del fake.hang["nvmlDeviceGetTemperature"]
    # once the call returns and the reader has finished that read, a scrape reads the GPUs again (until then
    # scrapes answer at once without them)
    collector.timeout = patience
    deadline = time.monotonic() + patience
    while "accelstack_gpu_temperature_celsius" not in (samples := scrape(endpoint, timeout=2 * patience)):
        assert time.monotonic() < deadline, "the GPUs were not read again after the hung call returned"
        time.sleep(0.01)
    assert len(samples["accelstack_gpu_temperature_celsius"]) == 8
    assert (release.entered, release.left) == (1, 1)


def test_no_nvml_is_reported_not_fatal_and_retried(tmp_path: Path) -> None:
    import pynvml

    fake = dgx_like(2)
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED  # the driver is not loaded yet at boot
    registry, collector = build(values(tmp_path, "--exporter-pod-resources-socket", "",
                                       "--exporter-nvml-retry", "0.2s"), nvml=fake)
    endpoint = serve(registry)
    try:
        samples = scrape(endpoint)
        assert one(samples, "accelstack_exporter_gpu_up") == 0
        assert "Driver Not Loaded" in dict(next(iter(samples["accelstack_exporter_gpu_up"])))["error"]
        assert "accelstack_gpu_info" not in samples
        fake.init_error = None  # the driver loads: the exporter picks the GPUs up without a restart
        time.sleep(0.25)
        samples = scrape(endpoint)
        assert one(samples, "accelstack_exporter_gpu_up", error="") == 1
        assert len(samples["accelstack_gpu_info"]) == 2
    finally:
        endpoint.close()
        collector.close()


def test_nr1_metrics(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    addresses = nr1_node(sysfs, 2)
    base = sysfs / "bus/pci/devices"
    hwmon = base / addresses[0] / "hwmon/hwmon3"
    hwmon.mkdir(parents=True)
    (hwmon / "temp1_input").write_text("61500\n")
    (hwmon / "power1_average").write_text("35250000\n")
    (base / addresses[0] / "util").write_text("42\n")
    (base / addresses[1] / "net/nr1p1/operstate").write_text("down\n")
    (base / addresses[1] / "health").write_text("fault\n")
    vals = values(tmp_path, "--exporter-gpu", "false", "--exporter-nr1", "true", "--nr1-vendor-ids", NR1_VENDOR,
                  "--nr1-health-attribute", "health", "--nr1-utilization-attribute", "util",
                  "--exporter-pod-resources-socket", "")
    registry, collector = build(vals)
    endpoint = serve(registry)
    try:
        samples = scrape(endpoint)
    finally:
        endpoint.close()
        collector.close()
    assert one(samples, "accelstack_nr1_info", pci_bus_id=addresses[0], device_id="0x0001", numa_node="0") == 1
    assert one(samples, "accelstack_nr1_temperature_celsius", nr1="0") == pytest.approx(61.5)
    assert one(samples, "accelstack_nr1_power_watts", nr1="0") == pytest.approx(35.25)
    assert one(samples, "accelstack_nr1_utilization_ratio", nr1="0") == pytest.approx(0.42)
    assert "accelstack_nr1_temperature_celsius" in samples and len(samples["accelstack_nr1_temperature_celsius"]) == 1
    assert one(samples, "accelstack_nr1_link_up", nr1="1", interface="nr1p1") == 0
    assert one(samples, "accelstack_nr1_link_up", nr1="0", interface="nr1p0") == 1
    assert {dict(k)["nr1"]: v for k, v in samples["accelstack_nr1_healthy"].items()} == {"0": 1, "1": 0}
    assert "accelstack_gpu_info" not in samples
