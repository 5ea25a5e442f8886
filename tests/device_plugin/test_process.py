"""The device plugin as a real process: registration, metrics and health endpoints, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from device_plugin.server import socket_name
from tests.kubelet_peer import KubeletPeer
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

NR1 = "neureality.com/nr1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_process_registers_serves_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    plugin_dir, sysfs = tmp_path / "dp", tmp_path / "sys"
    nr1_node(sysfs)
    peer = KubeletPeer(str(plugin_dir))
    await peer.start()
    port = free_port()
    env = {**os.environ, "ACCELSTACK_DP_NR1_VENDOR_IDS": NR1_VENDOR, "ACCELSTACK_DP_NR1_ENABLED": "true"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "device_plugin.main", "--device-plugin-path", str(plugin_dir), "--sysfs-root",
        str(sysfs), "--nvidia-enabled", "false", "--metrics-address", f"127.0.0.1:{port}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        plugin = await peer.wait_registered(NR1, timeout=20)
        assert len(plugin.devices) == 4
        async with aiohttp.ClientSession() as http:
            for _ in range(50):
                async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert r.status == 200
            async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
            await peer.allocate(NR1, ["0000:3b:00.0"])
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("accelstack_device_plugin_devices", (("health", "Healthy"), ("resource", NR1)))] == 4
        assert samples[("accelstack_device_plugin_allocations_total", (("resource", NR1), ("result", "ok")))] == 1
        assert samples[("accelstack_device_plugin_registered", (("resource", NR1),))] == 1
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 10)
        stderr = (await proc.stderr.read()).decode() if proc.stderr else ""
        assert rc == 0, stderr
        assert not (plugin_dir / socket_name(NR1)).exists()
        assert '"msg": "registered"' in stderr and '"msg": "stopped"' in stderr  # structured JSON logs
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await peer.stop()


def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


async def test_process_without_nvml_exits_1_with_reason(tmp_path: Path) -> None:
    if nvml_available():
        pytest.skip("this machine has a working NVIDIA driver")
    # No NVIDIA driver: NVML cannot load, and failOnInitError (default true) stops the process.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "device_plugin.main", "--device-plugin-path", str(tmp_path), "--metrics-address", "",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 1
    assert "NVML could not be initialised" in stderr.decode() and "Traceback" not in stderr.decode()


async def test_process_without_nvml_and_fail_on_init_error_false_runs_without_error_logs(tmp_path: Path) -> None:
    if nvml_available():
        pytest.skip("this machine has a working NVIDIA driver")
    # Zero GPUs is the documented state with failOnInitError=false: no error-level line, no health-loop crash.
    plugin_dir, sysfs = tmp_path / "dp", tmp_path / "sys"
    nr1_node(sysfs)
    peer = KubeletPeer(str(plugin_dir))
    await peer.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "device_plugin.main", "--device-plugin-path", str(plugin_dir), "--sysfs-root",
        str(sysfs), "--fail-on-init-error", "false", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR,
        "--metrics-address", "", "--labeller-enabled", "false",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        gpu = await peer.wait_registered("nvidia.com/gpu", timeout=20)
        await peer.wait_registered(NR1, timeout=20)
        assert gpu.devices == {}
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 10)
        stderr = (await proc.stderr.read()).decode() if proc.stderr else ""
        assert rc == 0, stderr
        assert '"level": "error"' not in stderr and "Traceback" not in stderr, stderr
        assert "advertising zero GPUs" in stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await peer.stop()


async def test_labeller_without_credentials_outside_a_cluster_says_what_is_missing(tmp_path: Path) -> None:
    """No kubeconfig, not in a cluster: the plugin still serves its devices and says in one line why it does
    not label the node, naming what it looked for (issue 35.7: the reason was cut at 200 characters, before
    the kubeconfig path it had looked for)."""
    plugin_dir, sysfs = tmp_path / "dp", tmp_path / "sys"
    nr1_node(sysfs)
    peer = KubeletPeer(str(plugin_dir))
    await peer.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "KUBECONFIG"))}
    env.update(HOME=str(tmp_path), NODE_NAME="node-a")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "device_plugin.main", "--device-plugin-path", str(plugin_dir), "--sysfs-root",
        str(sysfs), "--nvidia-enabled", "false", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR,
        "--metrics-address", "", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        await peer.wait_registered(NR1, timeout=20)
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        text = (out + err).decode()
        assert proc.returncode == 0 and "Traceback" not in text, text
        lines = [ln for ln in text.splitlines() if "\"msg\": \"labeller" in ln]
        assert len(lines) == 1 and "no Kubernetes credentials" in lines[0], lines
        assert "not in a cluster" in lines[0] and f"{tmp_path}/.kube/config" in lines[0], lines[0]
        assert "KUBECONFIG" in lines[0] and lines[0].count("no Kubernetes credentials") == 1, lines[0]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await peer.stop()
