"""The GPU check and the exporter on a real GPU through the real pynvml, when this machine has one (skips
otherwise): the pynvml signatures and constants the checks use must be the real ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from npd.exporter import build
from npd.gpu_check import CHECKS, check_gpus
from npd.plugin import UNKNOWN, Progress
from tests.device_plugin.test_real_nvml import real_nvml
from tests.npd.helpers import values
from tests.npd.test_plugin_process import npd_exec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not real_nvml(), reason="needs an NVIDIA GPU with a working driver (NVML)")]


def test_real_gpu_check_gives_a_verdict_not_an_error(tmp_path: Path) -> None:
    import pynvml

    (tmp_path / "kmsg").write_text("")
    result = check_gpus(pynvml, values(tmp_path, "--node-sysfs-root", "/sys"), CHECKS, {}, Progress())
    assert result.status != UNKNOWN, result.message  # every call the checks make exists and answers
    assert "GPUs" in result.message or "GPU" in result.message


def test_real_plugin_process_within_its_deadline(tmp_path: Path) -> None:
    (tmp_path / "kmsg").write_text("")
    run = npd_exec("npd.gpu_check", "--node-sysfs-root", "/sys", "--plugin-state-dir", str(tmp_path),
                   "--gpu-kmsg-path", str(tmp_path / "kmsg"), "--checks", ",".join(CHECKS), timeout=15)
    assert run.status in ("OK", "NonOK"), run.message


def test_real_exporter_metrics(tmp_path: Path) -> None:
    registry, collector = build(values(tmp_path, "--exporter-pod-resources-socket", ""))
    try:
        text = generate_latest(registry).decode()
    finally:
        collector.close()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("accelstack_gpu_info", "accelstack_gpu_temperature_celsius", "accelstack_gpu_power_watts",
                 "accelstack_gpu_memory_used_bytes", "accelstack_gpu_healthy", "accelstack_gpu_utilization_ratio"):
        assert name in names, name
