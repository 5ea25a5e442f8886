"""Failure modes an independent kubelet found (issue 11): re-registration timing after a kubelet restart with the
default ``registerRetry``, unusable socket paths, a missing sysfs root, bounded INVALID_ARGUMENT messages, and
NVML absent with ``failOnInitError: false``."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pynvml
import pytest

from device_plugin import dirwatch
from device_plugin.config import ConfigError, load
from device_plugin.main import DevicePluginProcess, build_backends
from device_plugin.server import socket_name
from protos.deviceplugin.v1beta1 import api_pb2
from tests.device_plugin.test_plugin_kubelet import GPU, NR1, running
from tests.fake_nvml import FakeNVML
from tests.kubelet_peer import KubeletPeer
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

SUN_PATH_MAX = 107  # the kernel's limit on a unix socket path (sizeof(sun_path) - 1), which the message must name
REREGISTER_BOUND = 0.1  # seconds from kubelet.sock's return to Register (issue 11), median of the restarts
REREGISTER_WORST = 0.3  # any single restart, with room for a loaded 2-core machine (the old code: 2-5 s)


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``predicate()`` holds, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.005)


# 1. ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wake", ["inotify", "polling"])
async def test_kubelet_restart_reregisters_within_100ms_of_socket_return_with_default_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wake: str) -> None:
    if wake == "polling":  # a user out of inotify instances: the fallback polls
        monkeypatch.setattr(dirwatch, "_libc", lambda: None)
    plugin_dir, sysfs = tmp_path / "dp", tmp_path / "sys"
    nr1_node(sysfs)
    config, _ = load(["--device-plugin-path", str(plugin_dir), "--sysfs-root", str(sysfs), "--metrics-address", "",
                      "--nvidia-enabled", "false", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR,
                      "--labeller-enabled", "false"], environ={})
    assert config["flags.registerRetry"] == 5.0  # the default, which the plugin used to sleep through
    peer = KubeletPeer(str(plugin_dir))
    await peer.start()
    process = DevicePluginProcess(config, build_backends(config))  # default poll interval
    task = asyncio.create_task(process.run())
    own_socket = plugin_dir / socket_name(NR1)
    latencies = []
    try:
        await peer.wait_registered(NR1)
        assert process.runners[0].dirwatch.active == (wake == "inotify")
        for restart in range(3):
            # the kubelet goes away and a new one wipes the directory ...
            await peer.stop()
            peer.wipe()
            # ... the plugin notices, serves again and is now waiting for kubelet.sock ...
            await eventually(own_socket.exists)
            # ... which comes back
            await peer.start()
            await peer.wait_registered(NR1, count=restart + 2, timeout=3)
            latencies.append(peer.received[-1][0] - peer.created_at[-1])
    finally:
        process.stop.set()
        await asyncio.wait_for(task, 10)
        await peer.stop()
    assert statistics.median(latencies) < REREGISTER_BOUND, latencies
    assert max(latencies) < REREGISTER_WORST, latencies


async def test_plugin_directory_replaced_then_registers_again(tmp_path: Path) -> None:
    async with running(tmp_path) as (process, peer):
        await peer.wait_registered(NR1)
        await peer.stop()
        shutil.rmtree(peer.plugin_dir)  # the inotify watch goes with it
        os.makedirs(peer.plugin_dir, exist_ok=True)  # the plugin may have re-created it first
        await peer.start()
        await peer.wait_registered(NR1, count=2, timeout=5)
        await peer.restart()  # and the watch is back on the new directory
        await peer.wait_registered(NR1, count=3, timeout=5)
        assert process.runners[0].dirwatch.active


async def test_stale_kubelet_socket_then_new_kubelet_registers_without_waiting_the_retry(tmp_path: Path) -> None:
    # A dead kubelet leaves kubelet.sock behind: attempts fail (UNAVAILABLE). The new kubelet re-creates the file;
    # the plugin retries then, not after registerRetry (60 s here).
    plugin_dir, sysfs = tmp_path / "dp", tmp_path / "sys"
    nr1_node(sysfs)
    plugin_dir.mkdir()
    (plugin_dir / "kubelet.sock").touch()  # stale: nothing listens
    config, _ = load(["--device-plugin-path", str(plugin_dir), "--sysfs-root", str(sysfs), "--metrics-address", "",
                      "--nvidia-enabled", "false", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR,
                      "--labeller-enabled", "false", "--register-retry", "60s"], environ={})
    process = DevicePluginProcess(config, build_backends(config))
    task = asyncio.create_task(process.run())
    peer = KubeletPeer(str(plugin_dir))
    try:
        await eventually(lambda: (process.metrics.registry.get_sample_value(
            "accelstack_device_plugin_registrations_total", {"resource": NR1, "result": "unavailable"}) or 0) >= 1)
        await peer.start()  # replaces the stale file
        await peer.wait_registered(NR1, timeout=3)
        assert peer.received[-1][0] - peer.created_at[-1] < REREGISTER_WORST
    finally:
        process.stop.set()
        await asyncio.wait_for(task, 10)
        await peer.stop()


# 2. ---------------------------------------------------------------------------------------------------------
def plugin_argv(plugin_dir: Path, sysfs: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "device_plugin.main", "--device-plugin-path", str(plugin_dir), "--sysfs-root",
            str(sysfs), "--nvidia-enabled", "false", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR,
            "--metrics-address", "", "--labeller-enabled", "false", *extra]


def read_only_dir(tmp_path: Path) -> tuple[Path, list[str], str]:
    """A read-only directory: mode 0555 for a user; for root (who writes anyway) a read-only bind mount of it in
    a private mount namespace of the plugin's process."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return directory, [], "Permission denied"
    if shutil.which("unshare") is None:
        pytest.skip("root needs unshare(1) for a read-only bind mount")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace: {probe.stderr.decode().strip()}")
    wrap = ["unshare", "--mount", "sh", "-c", f'mount --bind -o ro "{directory}" "{directory}" && exec "$@"', "sh"]
    return directory, wrap, "Read-only file system"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path (pytest's can leave too few of a socket path's 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("case", ["read-only", "under-a-file", "too-long"])
def test_unusable_socket_path_exits_with_one_line_naming_path_and_reason(short_tmp: Path, case: str) -> None:
    tmp_path = short_tmp
    sysfs = tmp_path / "sys"
    nr1_node(sysfs)
    wrap: list[str] = []
    if case == "read-only":
        plugin_dir, wrap, reason = read_only_dir(tmp_path)
    elif case == "under-a-file":
        (tmp_path / "file").write_text("not a directory\n")
        plugin_dir, reason = tmp_path / "file" / "device-plugins", "Not a directory"
    else:
        plugin_dir = tmp_path / ("d" * max(1, SUN_PATH_MAX - len(str(tmp_path)) - 10))
        reason = f"over the {SUN_PATH_MAX}-byte limit"
    try:
        result = subprocess.run(wrap + plugin_argv(plugin_dir, sysfs), capture_output=True, text=True, timeout=30,
                                check=False)
    finally:
        if case == "read-only":
            plugin_dir.chmod(0o755)
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if '"level": "error"' in line]
    assert len(errors) == 1, result.stderr
    assert str(plugin_dir) in errors[0] and reason in errors[0], errors[0]


# 3. ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["missing", "not-sysfs"])
def test_missing_sysfs_root_is_a_configuration_error(tmp_path: Path, layout: str) -> None:
    sysfs = tmp_path / "nonexistent" / "sys"
    if layout == "not-sysfs":
        sysfs.mkdir(parents=True)  # a directory, but no bus/pci/devices: not the host's sysfs
    config, _ = load(["--sysfs-root", str(sysfs), "--nvidia-enabled", "false", "--nr1-enabled", "true",
                      "--nr1-vendor-ids", NR1_VENDOR], environ={})
    with pytest.raises(ConfigError, match=rf"^flags.sysfsRoot: {sysfs} (does not exist|has no bus/pci/devices)"):
        build_backends(config)


def test_missing_sysfs_root_exits_2_naming_the_key(tmp_path: Path) -> None:
    sysfs = tmp_path / "nonexistent" / "sys"
    result = subprocess.run(plugin_argv(tmp_path / "dp", sysfs), capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"accelstack-device-plugin: configuration error: flags.sysfsRoot: {sysfs} does not exist"]
    assert not (tmp_path / "dp").exists()  # nothing registered, no socket


def test_empty_pci_bus_is_a_node_without_modules(tmp_path: Path) -> None:
    (tmp_path / "sys/bus/pci/devices").mkdir(parents=True)
    config, _ = load(["--sysfs-root", str(tmp_path / "sys"), "--nvidia-enabled", "false", "--nr1-enabled", "true",
                      "--nr1-vendor-ids", NR1_VENDOR], environ={})
    [nr1] = build_backends(config)
    assert nr1.devices == []


# 4. ---------------------------------------------------------------------------------------------------------
MESSAGE_LIMIT = 1024  # bytes; far under the 8 KiB a gRPC C-core client accepts in a status header


async def test_unknown_ids_message_is_capped_and_names_empty_id(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, peer):
        plugin = await peer.wait_registered(NR1)
        known = sorted(plugin.devices)
        many = [f"0000:ff:{i:05d}.0" for i in range(10_000)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.allocate(NR1, [known[0], *many])
        details = err.value.details() or ""
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details[:200]
        assert len(details.encode()) <= MESSAGE_LIMIT
        assert details.startswith(f'unknown {NR1} device IDs 10000: "0000:ff:00000.0", "0000:ff:00001.0"')
        assert details.endswith('"0000:ff:00009.0" and 9990 more')
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.preferred(NR1, known + many, [], 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len((err.value.details() or "").encode()) <= MESSAGE_LIMIT
        # an empty ID is named, not an empty list
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.allocate(NR1, [known[0], ""])
        assert err.value.details() == f'unknown {NR1} device IDs 1: ""'
        # one absurdly long ID is cut too
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.allocate(NR1, ["x" * 100_000])
        assert len((err.value.details() or "").encode()) <= MESSAGE_LIMIT


async def test_must_include_not_available_message_is_capped(tmp_path: Path) -> None:
    # must_include IDs that are advertised but not offered as available: bounded like unknown ones
    async with running(tmp_path) as (_, peer):
        plugin = await peer.wait_registered(NR1)
        known = sorted(plugin.devices)
        request = api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=known[:1], must_include_deviceIDs=known[1:], allocation_size=4)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plugin.stub.GetPreferredAllocation(request, timeout=5)
        assert err.value.details() == (f'must_include devices not in available 3: "{known[1]}", "{known[2]}", '
                                       f'"{known[3]}"')


# 5. ---------------------------------------------------------------------------------------------------------
async def test_nvml_absent_with_fail_on_init_error_false_logs_no_error(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNVML([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    caplog.set_level(logging.INFO)
    async with running(tmp_path, "--fail-on-init-error", "false", nvml=nvml) as (process, peer):
        gpu = await peer.wait_registered(GPU)
        await peer.wait_registered(NR1)
        assert gpu.devices == {}
        await peer.wait_for(process.ready)
    # the process has stopped: its health threads have run to their end
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [(r.getMessage(), r.exc_text) for r in errors]
    [disabled] = [r for r in caplog.records if r.getMessage().startswith("nvidia backend disabled")]
    assert disabled.levelno == logging.WARNING and "NVML could not be initialised" in disabled.__dict__["reason"]
