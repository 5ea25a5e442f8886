"""A real Prometheus server (Debian's prometheus) scrapes the exporter (8 FakeNVML GPUs, pod-resources peer) and
loads the shipped alert rules; queried through its HTTP API, the alerts through its own /api/v1/alerts. The
accelerator-node alerts (the controller's gauge) are tested with promtool only: no controller is scraped here.
Bounded: 60 s at most."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import yaml

from npd.exporter import build
from service.observability import HttpEndpoint, PluginMetrics
from tests.fake_nvml import dgx_like
from tests.npd.helpers import values
from tests.npd.podresources_peer import PodResourcesPeer
from tests.npd.promtools import need, write_rules


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def alerts(port: int) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/alerts", timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return cast(list[dict[str, Any]], body["data"]["alerts"])


def test_prometheus_scrapes_the_exporter_and_loads_the_rules(tmp_path: Path) -> None:
    prometheus = need("prometheus")
    fake = dgx_like(8)
    fake.gpus[2].temperature_c = 88
    fake.gpus[3].utilization_gpu = 90  # busy, allocated to no container
    fake.gpus[4].utilization_gpu = 50  # exactly the threshold: not over it
    # GPU 0 (allocated to ml/train-0 below) and the free GPUs stay at 0 %: only GPU 0 is idle while allocated
    peer = PodResourcesPeer(str(tmp_path / "kubelet.sock"))
    peer.allocatable = {"nvidia.com/gpu": [g.uuid for g in fake.gpus]}
    peer.set_pod("ml", "train-0", {"nvidia.com/gpu": [fake.gpus[0].uuid]})
    peer.start()
    registry, collector = build(values(tmp_path, "--node-name", "gpu-1", "--exporter-pod-resources-socket",
                                       str(tmp_path / "kubelet.sock")), nvml=fake)
    endpoint = HttpEndpoint("127.0.0.1:0", cast(PluginMetrics, SimpleNamespace(registry=registry)), lambda: True)
    write_rules(tmp_path / "rules.yml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(tmp_path / "rules.yml")],
        "scrape_configs": [{"job_name": "accelstack-device-exporter",
                            "static_configs": [{"targets": [f"127.0.0.1:{endpoint.port}"]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 45
        temperatures: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                temperatures = query(port, "accelstack_gpu_temperature_celsius")
            except OSError:
                temperatures = []
            if len(temperatures) == 8:
                break
            time.sleep(0.3)
        assert len(temperatures) == 8, "Prometheus did not scrape the 8 GPUs in time"
        by_gpu = {r["metric"]["gpu"]: float(r["value"][1]) for r in temperatures}
        assert by_gpu["2"] == 88 and by_gpu["0"] == 40
        assert query(port, 'up{job="accelstack-device-exporter"}')[0]["value"][1] == "1"
        allocated = query(port, 'accelstack_node_allocated_devices{resource="nvidia.com/gpu"}')
        assert allocated[0]["value"][1] == "1"
        # the rules pending on the exporter's real data (their `for` is minutes): GPU 2 over 85 °C, GPU 0 idle
        # while allocated, GPU 3 busy while not; as Prometheus itself reports its alerts
        expected = {("AccelstackGPUTemperatureHigh", "2", "pending"),
                    ("AccelstackGPUIdleWhileAllocated", "0", "pending"),
                    ("AccelstackGPUBusyWhileUnallocated", "3", "pending")}
        seen: set[tuple[str, str, str]] = set()
        found: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            found = alerts(port)
            seen = {(a["labels"]["alertname"], a["labels"].get("gpu", ""), a["state"]) for a in found}
            if expected <= seen:
                break
            time.sleep(0.3)
        # nothing else: the free idle GPUs, GPU 4 at exactly 50 %, the allocated GPU 0 not "busy while unallocated"
        assert seen == expected, seen
        (idle,) = [a for a in found if a["labels"]["alertname"] == "AccelstackGPUIdleWhileAllocated"]
        assert idle["labels"]["namespace"] == "ml" and idle["labels"]["pod"] == "train-0"
        assert idle["labels"]["uuid"] == fake.gpus[0].uuid and idle["labels"]["severity"] == "warning"
        assert idle["annotations"]["summary"] == "GPU 0 on gpu-1 is allocated to ml/train-0 but idle"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as response:
            groups = json.loads(response.read())["data"]["groups"]
        assert sum(len(g["rules"]) for g in groups) == 20
        assert all(r["health"] == "ok" for g in groups for r in g["rules"])
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        endpoint.close()
        collector.close()
        peer.stop()
