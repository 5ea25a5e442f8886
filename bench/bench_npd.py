"""Node-health benchmark: NPD plugin run time per invocation and exporter scrape time with 8 GPUs.

Each figure sits beside a baseline measured in the same run:
- plugin invocations as NPD makes them (a fresh subprocess, exit code and stdout read): the GPU check (on a
  machine without NVML: its real Unknown path; with ``--checks xid`` on a 5000-record kernel log) and the NR1
  check (4 modules in a sysfs fixture), from the development venv and through the wrappers of the relocated
  runtime ``accelstack-npd-install`` writes (what NPD's container runs), beside a bare ``python -c pass``;
- the GPU check's logic in-process over 8 GPUs at the pynvml boundary (FakeNVML ``dgx_like(8)``, all six
  checks), beside the same call with no checks selected (NVML discovery only);
- exporter scrapes over HTTP with 8 GPUs (FakeNVML, in-process) with and without the pod-resources peer,
  beside a scrape of an empty registry on the same stdlib WSGI endpoint.

Usage: python bench/bench_npd.py [--runs 30] [--scrapes 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

from npd.config import load  # noqa: E402
from npd.exporter import build  # noqa: E402
from npd.gpu_check import CHECKS, check_gpus  # noqa: E402
from npd.plugin import Progress  # noqa: E402
from service.observability import HttpEndpoint, PluginMetrics  # noqa: E402
from tests.fake_nvml import dgx_like  # noqa: E402
from tests.npd.helpers import kmsg_line, nvidia_functions, xid_line  # noqa: E402
from tests.npd.podresources_peer import PodResourcesPeer  # noqa: E402
from tests.sysfs_fixture import NR1_VENDOR, nr1_node  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(name: str, samples: list[float], unit: str = "ms") -> str:
    scale = 1000.0 if unit == "ms" else 1e6
    return (f"{name:<58} median {statistics.median(samples) * scale:8.2f} {unit}"
            f"   p99 {pct(samples, 99) * scale:8.2f} {unit}   (n={len(samples)})")


def timed_runs(argv: list[str], runs: int, expect: set[int]) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, env=env, cwd=ROOT, timeout=30, check=False)
        out.append(time.perf_counter() - started)
        if proc.returncode not in expect:
            raise SystemExit(f"{argv}: exit {proc.returncode}: {proc.stdout!r} {proc.stderr[-500:]!r}")
    return out


def timed_calls(fn: Callable[[], Any], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def scrape_times(port: int, scrapes: int) -> list[float]:
    url = f"http://127.0.0.1:{port}/metrics"
    for _ in range(5):
        urllib.request.urlopen(url, timeout=5).read()
    out = []
    for _ in range(scrapes):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=5) as response:
            response.read()
        out.append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="plugin invocations per case")
    parser.add_argument("--scrapes", type=int, default=300, help="scrapes per case")
    args = parser.parse_args()
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        fake = dgx_like(8)
        nvidia_functions(tmp / "sys", fake)
        nr1_node(tmp / "sys", 4)
        with (tmp / "kmsg").open("w") as log:
            for seq in range(1, 5001):
                log.write(xid_line(seq, "0000:13:00", 31) if seq % 1000 == 0 else kmsg_line(seq, f"line {seq}"))
        common = ["--node-sysfs-root", str(tmp / "sys"), "--plugin-state-dir", str(tmp / "state"),
                  "--log-level", "warning"]
        nr1 = [*common, "--nr1-vendor-ids", NR1_VENDOR, "--nr1-health-attribute", "health"]
        common += ["--gpu-kmsg-path", str(tmp / "kmsg")]  # the GPU plugin's flag: the NR1 plugin has none
        py = sys.executable

        print(f"== plugin invocations as NPD runs them ({args.runs} each)", flush=True)
        cases = [
            ("baseline: python -c pass", [py, "-c", "pass"], {0}),
            ("accelstack-npd-gpu (default checks; NVML absent -> Unknown)", [py, "-m", "npd.gpu_check", *common], {2}),
            ("accelstack-npd-gpu --checks xid (5000-record kernel log)",
             [py, "-m", "npd.gpu_check", *common, "--checks", "xid", "--plugin-state-dir", str(tmp / "fresh")],
             {0, 1}),
            ("accelstack-npd-nr1 (4 modules)",
             [py, "-m", "npd.nr1_check", *nr1],
             {0}),
        ]
        # the production path: the relocated runtime NPD's container runs (accelstack-npd-install)
        subprocess.run([py, "-m", "npd.install", str(tmp / "opt"), f"--mount-path={tmp / 'opt'}"], cwd=ROOT,
                       check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        cases.append(("installed wrapper accelstack-npd-gpu (default checks)",
                      [str(tmp / "opt/bin/accelstack-npd-gpu"), *common], {2}))
        cases.append(("installed wrapper accelstack-npd-nr1 (4 modules)",
                      [str(tmp / "opt/bin/accelstack-npd-nr1"), *nr1], {0}))
        for name, argv, expect in cases:
            if "fresh" in " ".join(argv):  # read the whole log every time: no cursor kept between runs
                samples = []
                for _ in range(args.runs):
                    for stale in (tmp / "fresh").glob("*.json"):
                        stale.unlink()
                    samples.extend(timed_runs(argv, 1, expect))
            else:
                samples = timed_runs(argv, args.runs, expect)
            lines.append(summary(name, samples))
            print(lines[-1], flush=True)

        print("== GPU check logic in-process, 8 GPUs at the pynvml boundary", flush=True)
        values = load(common, environ={})[0].values
        runs = max(200, args.runs * 10)
        base = timed_calls(lambda: check_gpus(fake, values, (), {}, Progress()), runs)
        full = timed_calls(lambda: check_gpus(fake, values, CHECKS, {}, Progress()), runs)
        lines.append(summary("baseline: NVML discovery only (no checks)", base, "us"))
        print(lines[-1])
        lines.append(summary("all six checks, incl. parsing the 5000-record kernel log", full, "us"))
        print(lines[-1], flush=True)

        print(f"== exporter scrape over HTTP ({args.scrapes} each)", flush=True)
        empty = HttpEndpoint("127.0.0.1:0", cast(PluginMetrics, SimpleNamespace(registry=CollectorRegistry())),
                             lambda: True)
        lines.append(summary("baseline: empty registry, same endpoint", scrape_times(empty.port, args.scrapes)))
        print(lines[-1], flush=True)
        empty.close()
        for with_alloc in (False, True):
            peer = None
            socket_path = ""
            if with_alloc:
                socket_path = str(tmp / "kubelet.sock")
                peer = PodResourcesPeer(socket_path)
                peer.allocatable = {"nvidia.com/gpu": [g.uuid for g in fake.gpus]}
                for i, gpu in enumerate(fake.gpus):
                    peer.set_pod("ml", f"p{i}", {"nvidia.com/gpu": [gpu.uuid]})
                peer.start()
            vals = load([*common, "--node-name", "bench", "--exporter-pod-resources-socket", socket_path],
                        environ={})[0].values
            registry, collector = build(vals, nvml=fake)
            endpoint = HttpEndpoint("127.0.0.1:0", cast(PluginMetrics, SimpleNamespace(registry=registry)),
                                    lambda: True)
            size = len(urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics").read())
            name = f"exporter, 8 GPUs{' + pod-resources (8 pods)' if with_alloc else ''} [{size} B]"
            lines.append(summary(name, scrape_times(endpoint.port, args.scrapes)))
            print(lines[-1], flush=True)
            endpoint.close()
            collector.close()
            if peer is not None:
                peer.stop()
    print("\n".join(["", "== summary", *lines]))


if __name__ == "__main__":
    main()
