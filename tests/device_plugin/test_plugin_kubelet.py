"""The device plugin against the kubelet peer over real gRPC on real unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from device_plugin.config import load
from device_plugin.main import DevicePluginProcess, build_backends
from device_plugin.server import socket_name
from tests.fake_nvml import dgx_like
from tests.kubelet_peer import KubeletPeer
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

GPU = "nvidia.com/gpu"
NR1 = "neureality.com/nr1"


@contextlib.asynccontextmanager
async def running(tmp_path: Path, *flags: str, nvml=None, kubelet: bool = True) -> AsyncIterator[tuple[DevicePluginProcess, KubeletPeer]]:
    plugin_dir = tmp_path / "dp"
    sysfs = tmp_path / "sys"
    nr1_node(sysfs)
    argv = ["--device-plugin-path", str(plugin_dir), "--sysfs-root", str(sysfs), "--metrics-address", "",
            "--register-retry", "0.05", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR,
            "--nr1-health-attribute", "health", "--nr1-health-interval", "0.02", *flags]
    if nvml is None:
        argv += ["--nvidia-enabled", "false"]
    config, _ = load(argv, environ={})
    peer = KubeletPeer(str(plugin_dir))
    if kubelet:
        await peer.start()
    process = DevicePluginProcess(config, build_backends(config, nvml=nvml), poll_interval=0.02)
    task = asyncio.create_task(process.run())
    try:
        yield process, peer
    finally:
        process.stop.set()
        await asyncio.wait_for(task, 10)
        await peer.stop()


async def test_registers_and_lists_devices_with_numa(tmp_path: Path) -> None:
    async with running(tmp_path, nvml=dgx_like(4)) as (_, peer):
        nr1 = await peer.wait_registered(NR1)
        gpu = await peer.wait_registered(GPU)
        requests = {r.resource_name: r for _, r in peer.registrations}
        assert requests[NR1].version == "v1beta1"
        assert requests[NR1].endpoint == socket_name(NR1)
        assert requests[GPU].options.get_preferred_allocation_available is True
        assert nr1.options.get_preferred_allocation_available and not nr1.options.pre_start_required
        assert nr1.devices == {
            "0000:3b:00.0": ("Healthy", [0]), "0000:3c:00.0": ("Healthy", [0]),
            "0000:3d:00.0": ("Healthy", [1]), "0000:3e:00.0": ("Healthy", [1]),
        }
        assert sorted(gpu.devices) == [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(4)]


async def test_allocate_and_unknown_ids(tmp_path: Path) -> None:
    async with running(tmp_path, nvml=dgx_like(2)) as (_, peer):
        await peer.wait_registered(NR1)
        await peer.wait_registered(GPU)
        response = await peer.allocate(NR1, ["0000:3b:00.0", "0000:3d:00.0"], ["0000:3c:00.0"])
        assert response.container_responses[0].envs["NR1_VISIBLE_DEVICES"] == "0000:3b:00.0,0000:3d:00.0"
        assert response.container_responses[1].envs["NR1_VISIBLE_DEVICES"] == "0000:3c:00.0"
        gpu_ids = sorted(peer.plugins[GPU].devices)
        response = await peer.allocate(GPU, gpu_ids)
        assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(gpu_ids)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.allocate(GPU, [gpu_ids[0], "GPU-nope", "GPU-nope2"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-nope" in (err.value.details() or "") and "GPU-nope2" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.allocate(GPU, [])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_preferred_allocation_over_grpc(tmp_path: Path) -> None:
    async with running(tmp_path, nvml=dgx_like(8)) as (_, peer):
        gpu = await peer.wait_registered(GPU)
        ids = sorted(gpu.devices)
        # GPUs 2 and 3 share a switch and two NVLinks: the best pair containing 2 is (2, 3)
        assert await peer.preferred(GPU, ids, [ids[2]], 2) == [ids[2], ids[3]]
        # NR1: prefer the same NUMA node as the module that must be included
        await peer.wait_registered(NR1)
        nr1 = sorted(peer.plugins[NR1].devices)
        assert await peer.preferred(NR1, nr1, [nr1[3]], 2) == [nr1[2], nr1[3]]
        for available, must, size in ((ids, ["GPU-x"], 1), (ids, ids[:3], 2), (ids[:2], [], 3)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await peer.preferred(GPU, available, must, size)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_kubelet_restart_reregisters_with_same_ids(tmp_path: Path) -> None:
    async with running(tmp_path) as (process, peer):
        first = await peer.wait_registered(NR1)
        ids = dict(first.devices)
        await peer.restart()  # wipes every socket, new kubelet.sock
        second = await peer.wait_registered(NR1, count=2)
        assert second.devices == ids
        assert os.path.exists(os.path.join(peer.plugin_dir, socket_name(NR1)))
        assert process.runners[0].registrations == 2
        # the plugin's own socket removed alone also triggers a re-registration
        os.unlink(os.path.join(peer.plugin_dir, socket_name(NR1)))
        third = await peer.wait_registered(NR1, count=3)
        assert third.devices == ids


async def test_waits_for_kubelet_then_registers(tmp_path: Path) -> None:
    async with running(tmp_path, kubelet=False) as (process, peer):
        await asyncio.sleep(0.2)
        assert not process.ready()
        await peer.start()
        await peer.wait_registered(NR1)
        await peer.wait_for(process.ready)


async def test_refused_registration_is_fatal(tmp_path: Path) -> None:
    plugin_dir, sysfs = tmp_path / "dp", tmp_path / "sys"
    nr1_node(sysfs)
    config, _ = load(["--device-plugin-path", str(plugin_dir), "--sysfs-root", str(sysfs), "--metrics-address", "",
                      "--nvidia-enabled", "false", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR],
                     environ={})
    peer = KubeletPeer(str(plugin_dir), refuse=lambda r: f"resource {r.resource_name} already registered")
    await peer.start()
    try:
        from device_plugin.server import RegistrationError

        with pytest.raises(RegistrationError, match="already registered"):
            await asyncio.wait_for(DevicePluginProcess(config, build_backends(config)).run(), 10)
        assert not os.path.exists(plugin_dir / socket_name(NR1))
    finally:
        await peer.stop()


async def test_nr1_failure_and_recovery_reach_list_and_watch(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, peer):
        plugin = await peer.wait_registered(NR1)
        health = tmp_path / "sys/bus/pci/devices/0000:3c:00.0/health"
        health.write_text("fault\n")
        await peer.wait_for(lambda: plugin.devices["0000:3c:00.0"][0] == "Unhealthy", timeout=5)
        assert plugin.devices["0000:3b:00.0"][0] == "Healthy"
        health.write_text("ok\n")
        await peer.wait_for(lambda: plugin.devices["0000:3c:00.0"][0] == "Healthy", timeout=5)


async def test_gpu_xid_marks_unhealthy_fast_and_recovers(tmp_path: Path) -> None:
    nvml = dgx_like(2)
    async with running(tmp_path, "--nvidia-health-recovery-period", "0.3", "--nvidia-health-recheck-interval",
                       "0.05", nvml=nvml) as (_, peer):
        plugin = await peer.wait_registered(GPU)
        ids = sorted(plugin.devices)
        nvml.inject_xid(0, 31)  # ignored (application error): stays healthy
        nvml.inject_xid(1, 79)  # GPU fell off the bus: critical
        sent = time.monotonic()
        await peer.wait_for(lambda: plugin.devices[ids[1]][0] == "Unhealthy", timeout=5)
        update_latency = plugin.updates[-1][0] - sent
        assert update_latency < 0.5  # the bench measures it properly; this only guards against polling
        assert plugin.devices[ids[0]][0] == "Healthy"
        await peer.wait_for(lambda: plugin.devices[ids[1]][0] == "Healthy", timeout=5)
        assert time.monotonic() - sent >= 0.3  # not before the quiet period
