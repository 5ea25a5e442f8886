"""Demo: the device plugin against the kubelet test peer on an NR1 sysfs fixture (no cluster, no hardware).

Run from the repository root: ``python scripts/device_plugin_demo.py`` (scripts/demo.sh does it). It lays out
four NR1 modules in a temporary sysfs tree, starts the kubelet peer (real gRPC on unix sockets) and the
device plugin, then walks through registration, ListAndWatch, preferred allocation, Allocate, a module
failing and recovering, and a kubelet restart. Real NVML is used too when this machine has a GPU.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from device_plugin.config import load
from device_plugin.main import DevicePluginProcess, build_backends
from device_plugin.nvml_backend import BackendInitError
from tests.kubelet_peer import KubeletPeer
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

NR1 = "neureality.com/nr1"


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        nr1_node(root / "sys", 4)
        argv = ["--device-plugin-path", str(root / "dp"), "--sysfs-root", str(root / "sys"), "--metrics-address", "",
                "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR, "--nr1-health-attribute", "health",
                "--nr1-health-interval", "0.02", "--labeller-enabled", "false", "--log-level", "error"]
        config, _ = load(argv, environ={})
        try:
            backends = build_backends(config)
            print("NVML: found", len(backends[0].devices), "GPU(s)")
        except BackendInitError:
            config, _ = load([*argv, "--nvidia-enabled", "false"], environ={})
            backends = build_backends(config)
            print("NVML: not available on this machine (no NVIDIA driver); showing NR1 modules only")
        peer = KubeletPeer(str(root / "dp"))
        await peer.start()
        process = DevicePluginProcess(config, backends, poll_interval=0.02)
        started = time.monotonic()
        task = asyncio.create_task(process.run())
        plugin = await peer.wait_registered(NR1)
        print(f"registered {NR1} in {1000 * (time.monotonic() - started):.1f} ms; ListAndWatch says:")
        print(f"  {'device ID':<16} {'health':<10} NUMA")
        for device_id, (health, numa) in sorted(plugin.devices.items()):
            print(f"  {device_id:<16} {health:<10} {numa}")
        ids = sorted(plugin.devices)
        chosen = await peer.preferred(NR1, ids, [ids[3]], 2)
        print(f"preferred allocation of 2 including {ids[3]}: {chosen} (same NUMA node)")
        response = await peer.allocate(NR1, chosen)
        print("Allocate ->", dict(response.container_responses[0].envs))
        health_file = root / "sys/bus/pci/devices" / ids[1] / "health"
        health_file.write_text("fault\n")
        t0 = time.monotonic()
        await peer.wait_for(lambda: plugin.devices[ids[1]][0] == "Unhealthy")
        print(f"module {ids[1]} fails -> ListAndWatch update after {1000 * (time.monotonic() - t0):.0f} ms: Unhealthy")
        health_file.write_text("ok\n")
        await peer.wait_for(lambda: plugin.devices[ids[1]][0] == "Healthy")
        print(f"module {ids[1]} recovers -> Healthy again")
        t0 = time.monotonic()
        await peer.restart()
        again = await peer.wait_registered(NR1, count=2)
        print(f"kubelet restart (sockets wiped) -> re-registered in {1000 * (time.monotonic() - t0):.0f} ms, "
              f"same device IDs: {sorted(again.devices) == ids}")
        process.stop.set()
        await task
        await peer.stop()
        print("stopped cleanly")


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main())
