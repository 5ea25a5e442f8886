"""Device plugin benchmark over real gRPC on unix sockets, against the kubelet peer.

Measures, with a baseline from the same run for each:
- ``Allocate`` latency p50/p99 (client side, 4 NR1 modules and 8 GPUs behind NVML at the pynvml boundary),
  beside a no-op RPC (``PreStartContainer``) on the same channel: the ratio is what Allocate adds to gRPC;
- health change -> ``ListAndWatch`` update latency: NVML XID event path (event-driven) and NR1 sysfs path
  (polled, at the configured interval), beside that interval;
- RSS of the plugin process after registration, beside a bare Python interpreter;
- process start -> registered with the kubelet, beside a bare ``python -c pass`` start.

Targets (issue 2): Allocate p99 <= 1 ms, update <= 100 ms, RSS <= 50 MiB.
Usage: python bench/bench_device_plugin.py [--allocs 2000] [--health 30] [--starts 5]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from device_plugin.config import load
from device_plugin.main import DevicePluginProcess, build_backends
from protos.deviceplugin.v1beta1 import api_pb2
from tests.fake_nvml import dgx_like
from tests.kubelet_peer import KubeletPeer, PluginEndpoint
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

GPU, NR1 = "nvidia.com/gpu", "neureality.com/nr1"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def grown(endpoint: PluginEndpoint, seen: int) -> bool:
    return len(endpoint.updates) > seen


def registered(peer: KubeletPeer) -> bool:
    return bool(peer.registrations)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def in_process(args: argparse.Namespace, root: Path) -> dict[str, float]:
    nr1_node(root / "sys", 4)
    config, _ = load(["--device-plugin-path", str(root / "dp"), "--sysfs-root", str(root / "sys"),
                      "--metrics-address", "", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR,
                      "--nr1-health-attribute", "health", "--nr1-health-interval", "0.05",
                      "--nvidia-health-recovery-period", "0.05", "--nvidia-health-recheck-interval", "0.01",
                      "--labeller-enabled", "false"], environ={})
    nvml = dgx_like(8)
    peer = KubeletPeer(str(root / "dp"))
    await peer.start()
    process = DevicePluginProcess(config, build_backends(config, nvml=nvml), poll_interval=0.05)
    task = asyncio.create_task(process.run())
    gpu = await peer.wait_registered(GPU)
    nr1 = await peer.wait_registered(NR1)
    gpu_ids, nr1_ids = sorted(gpu.devices), sorted(nr1.devices)
    out: dict[str, float] = {}
    for resource, ids, stub in ((GPU, gpu_ids[:2], gpu.stub), (NR1, nr1_ids[:1], nr1.stub)):
        alloc = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)])
        noop = api_pb2.PreStartContainerRequest(devices_ids=ids)
        for _ in range(200):  # warm-up
            await stub.Allocate(alloc)
            await stub.PreStartContainer(noop)
        a_times, n_times = [], []
        for _ in range(args.allocs):  # interleaved so that noise hits both alike
            t0 = time.perf_counter()
            await stub.Allocate(alloc)
            t1 = time.perf_counter()
            await stub.PreStartContainer(noop)
            t2 = time.perf_counter()
            a_times.append(t1 - t0)
            n_times.append(t2 - t1)
        key = resource.split("/")[1]
        out[f"{key}_alloc_p50_ms"] = 1000 * statistics.median(a_times)
        out[f"{key}_alloc_p99_ms"] = 1000 * pct(a_times, 99)
        out[f"{key}_noop_p50_ms"] = 1000 * statistics.median(n_times)
        out[f"{key}_noop_p99_ms"] = 1000 * pct(n_times, 99)
    # NVML event -> ListAndWatch update (a critical XID, then recovery after the quiet period)
    lat = []
    for _ in range(args.health):
        before = len(gpu.updates)
        t0 = time.monotonic()
        nvml.inject_xid(0, 79)
        await peer.wait_for(functools.partial(grown, gpu, before))
        lat.append(gpu.updates[-1][0] - t0)
        await peer.wait_for(lambda: gpu.devices[gpu_ids[0]][0] == "Healthy")
    out["gpu_update_p50_ms"], out["gpu_update_p99_ms"] = 1000 * statistics.median(lat), 1000 * pct(lat, 99)
    # NR1 sysfs health attribute -> ListAndWatch update (polled every 50 ms)
    health = root / "sys/bus/pci/devices" / nr1_ids[0] / "health"
    lat = []
    for i in range(args.health):
        before = len(nr1.updates)
        t0 = time.monotonic()
        health.write_text("fault\n" if i % 2 == 0 else "ok\n")
        await peer.wait_for(functools.partial(grown, nr1, before))
        lat.append(nr1.updates[-1][0] - t0)
    out["nr1_update_p50_ms"], out["nr1_update_p99_ms"] = 1000 * statistics.median(lat), 1000 * pct(lat, 99)
    process.stop.set()
    await task
    await peer.stop()
    return out


async def subprocess_figures(args: argparse.Namespace, root: Path) -> dict[str, float]:
    nr1_node(root / "sys2", 4)
    starts, rss = [], []
    for i in range(args.starts):
        plugin_dir = root / f"dp{i}"
        peer = KubeletPeer(str(plugin_dir))
        await peer.start()
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "device_plugin.main", "--device-plugin-path", str(plugin_dir), "--sysfs-root",
            str(root / "sys2"), "--nvidia-enabled", "false", "--nr1-enabled", "true", "--nr1-vendor-ids",
            NR1_VENDOR, "--metrics-address", "127.0.0.1:0", "--log-level", "error",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await peer.wait_for(functools.partial(registered, peer), timeout=30)
        starts.append(peer.registrations[0][0] - t0)
        await asyncio.sleep(0.5)
        rss.append(rss_mib(proc.pid))
        proc.terminate()
        await proc.wait()
        await peer.stop()
    bare_starts, bare_rss = [], []
    for _ in range(args.starts):
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(0.3)")
        bare_starts.append(time.monotonic() - t0)
        await asyncio.sleep(0.1)
        bare_rss.append(rss_mib(proc.pid))
        await proc.wait()
    t0 = time.monotonic()
    for _ in range(args.starts):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare_start = (time.monotonic() - t0) / args.starts
    return {"start_to_registered_ms": 1000 * statistics.median(starts), "bare_python_start_ms": 1000 * bare_start,
            "rss_mib": statistics.median(rss), "bare_python_rss_mib": statistics.median(bare_rss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allocs", type=int, default=2000)
    parser.add_argument("--health", type=int, default=30)
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        figures = asyncio.run(in_process(args, Path(tmp)))
        figures.update(asyncio.run(subprocess_figures(args, Path(tmp))))
    f = figures
    rows = [
        ("Allocate p50 / p99, 2 GPUs (ms)", f"{f['gpu_alloc_p50_ms']:.3f} / {f['gpu_alloc_p99_ms']:.3f}",
         f"no-op RPC {f['gpu_noop_p50_ms']:.3f} / {f['gpu_noop_p99_ms']:.3f}",
         f"{f['gpu_alloc_p50_ms'] / f['gpu_noop_p50_ms']:.2f}x", "p99 <= 1 ms"),
        ("Allocate p50 / p99, 1 NR1 (ms)", f"{f['nr1_alloc_p50_ms']:.3f} / {f['nr1_alloc_p99_ms']:.3f}",
         f"no-op RPC {f['nr1_noop_p50_ms']:.3f} / {f['nr1_noop_p99_ms']:.3f}",
         f"{f['nr1_alloc_p50_ms'] / f['nr1_noop_p50_ms']:.2f}x", "p99 <= 1 ms"),
        ("XID event -> ListAndWatch p50 / p99 (ms)", f"{f['gpu_update_p50_ms']:.1f} / {f['gpu_update_p99_ms']:.1f}",
         "target 100 ms", f"{f['gpu_update_p99_ms'] / 100:.2f}x", "<= 100 ms"),
        ("NR1 sysfs -> ListAndWatch p50 / p99 (ms)", f"{f['nr1_update_p50_ms']:.1f} / {f['nr1_update_p99_ms']:.1f}",
         "poll interval 50 ms", f"{f['nr1_update_p99_ms'] / 50:.2f}x", "<= 100 ms"),
        ("RSS after registration (MiB)", f"{f['rss_mib']:.1f}", f"bare python {f['bare_python_rss_mib']:.1f}",
         f"{f['rss_mib'] / f['bare_python_rss_mib']:.2f}x", "<= 50 MiB"),
        ("start -> registered (ms)", f"{f['start_to_registered_ms']:.0f}",
         f"bare python start {f['bare_python_start_ms']:.0f}",
         f"{f['start_to_registered_ms'] / f['bare_python_start_ms']:.1f}x", "-"),
    ]
    print(f"{'measure':<42} {'value':<18} {'baseline (same run)':<30} {'ratio':<8} target")
    for row in rows:
        print(f"{row[0]:<42} {row[1]:<18} {row[2]:<30} {row[3]:<8} {row[4]}")


if __name__ == "__main__":
    main()
