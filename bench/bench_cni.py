"""ADD and DEL latency of the accelstack NR1 CNI plugin beside the reference ``host-device`` plugin.

Both plugins run in the same run, interleaved call by call, on the same kind of interface (a dummy one where
the kernel has the dummy driver, else a veth end), moved between the same two namespaces, started the same
way (the runtime's way: fork/exec with CNI_* env and the config on stdin, entered into the "host" namespace
before exec). Each plugin gets its own interface so neither waits on the other's. Latency is the wall time
from spawn to exit, as a runtime sees it.

    sudo .venv/bin/python bench/bench_cni.py            # 200 rounds, no IPAM, then with static IPAM
    sudo .venv/bin/python bench/bench_cni.py -n 50 --json out.json --pod-resources

Variants: ``bare`` (no IPAM: the move itself), ``static`` (both delegate to Debian's ``static`` IPAM),
``pod-resources`` (ours only asks the kubelet API, a local gRPC peer, instead of being given ``deviceID``:
that path imports grpc). Needs root, iproute2 and containernetworking-plugins (/usr/lib/cni).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "cni" / "bin" / "accelstack-nr1-cni"
CNI_BIN = "/usr/lib/cni"
REFERENCE = f"{CNI_BIN}/host-device"
CLONE_NEWNET = 0x40000000


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def make_setns(path: str):  # type: ignore[no-untyped-def]
    """A preexec_fn entering the network namespace at ``path`` (the bench itself has no threads)."""
    fd = os.open(path, os.O_RDONLY)
    setns = getattr(os, "setns", None)  # Python 3.12+
    if setns is not None:

        def enter() -> None:
            setns(fd, CLONE_NEWNET)

        return enter
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def enter_ctypes() -> None:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")

    return enter_ctypes


def start_peer(sock: str, pci: str) -> subprocess.Popen[bytes]:
    """The test suite's pod-resources peer in its own process (gRPC threads and fork don't mix)."""
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from tests.podresources_peer import PodResourcesPeer; "
        "p = PodResourcesPeer(sys.argv[2]).start(); "
        "p.set_pod('bench', 'pod-0', {'neureality.com/nr1': [sys.argv[3]]}); time.sleep(3600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(REPO), sock, pci])
    deadline = time.monotonic() + 20
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("pod-resources peer did not start")
        time.sleep(0.05)
    return proc


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, int(-(-pct * len(ordered) // 100)))
    return ordered[rank - 1]


class Bench:
    def __init__(self, rounds: int, warmup: int):
        self.rounds, self.warmup = rounds, warmup
        self.id = secrets.token_hex(3)
        self.host, self.cont = f"acbh{self.id}", f"acbc{self.id}"
        self.tmp = Path(tempfile.mkdtemp(prefix="acn-bench-"))
        self.kind = "dummy"
        self.nics: list[str] = []
        sh("ip", "netns", "add", self.host)
        sh("ip", "netns", "add", self.cont)
        self.enter = make_setns(f"/run/netns/{self.host}")
        (self.tmp / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)

    def nic(self, pci: str) -> str:
        name = f"bn{self.id}{len(self.nics)}"
        if (
            self.kind == "dummy"
            and sh("ip", "-n", self.host, "link", "add", name, "type", "dummy", check=False).returncode
        ):
            self.kind = "veth"  # this kernel has no dummy driver
        if self.kind == "veth":
            sh(
                "ip",
                "-n",
                self.host,
                "link",
                "add",
                name,
                "type",
                "veth",
                "peer",
                "name",
                f"bp{self.id}{len(self.nics)}",
            )
        self.nics.append(name)
        if pci:
            (self.tmp / "sys" / "bus" / "pci" / "devices" / pci / "net" / name).mkdir(parents=True)
        return name

    def close(self) -> None:
        sh("ip", "netns", "del", self.cont, check=False)
        sh("ip", "netns", "del", self.host, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def call(
        self, exe: str, command: str, conf: bytes, ifname: str, extra: dict[str, str] | None = None
    ) -> float:
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": f"bench{ifname}",
            "CNI_NETNS": f"/run/netns/{self.cont}",
            "CNI_IFNAME": ifname,
            "CNI_PATH": CNI_BIN,
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            **(extra or {}),
        }
        start = time.perf_counter()
        proc = subprocess.run([exe], env=env, input=conf, capture_output=True, preexec_fn=self.enter)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{exe} {command} failed: {proc.stdout.decode()} {proc.stderr.decode()}")
        return elapsed * 1000.0

    def run_pair(
        self, plugins: list[tuple[str, str, bytes, str, dict[str, str]]]
    ) -> dict[str, dict[str, list[float]]]:
        """Interleave the plugins round by round: ADD then DEL each."""
        times: dict[str, dict[str, list[float]]] = {label: {"ADD": [], "DEL": []} for label, *_ in plugins}
        for i in range(self.warmup + self.rounds):
            for label, exe, conf, ifname, extra in plugins:
                add = self.call(exe, "ADD", conf, ifname, extra)
                dele = self.call(exe, "DEL", conf, ifname, extra)
                if i >= self.warmup:
                    times[label]["ADD"].append(add)
                    times[label]["DEL"].append(dele)
        return times


def move_cost(bench: Bench, rounds: int) -> float:
    """Median ms of one namespace move of an interface (the kernel's part of every ADD and DEL), timed
    in-process with the plugin's own netlink client, no process start-up involved."""
    sys.path.insert(0, str(REPO))
    from cni.netns import Namespaces

    name = bench.nic("")
    samples = []
    with Namespaces() as nss:
        host, cont = nss.open(f"/run/netns/{bench.host}"), nss.open(f"/run/netns/{bench.cont}")
        for _ in range(rounds):
            for src, dst in ((host, cont), (cont, host)):
                link = src.nl.get_link(name)
                assert link is not None
                start = time.perf_counter()
                src.nl.set_link(link.index, netns_fd=dst.fd)
                samples.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(samples)


def startup_floor(rounds: int) -> dict[str, float]:
    """What start-up alone costs: VERSION of each plugin, and a bare ``python -I -S``."""
    env = {"CNI_COMMAND": "VERSION", "PATH": "/usr/bin:/bin"}
    out: dict[str, float] = {}
    for label, argv in (
        ("host-device VERSION", [REFERENCE]),
        ("accelstack VERSION", [str(PLUGIN)]),
        ("python -I -S -c pass", [sys.executable, "-I", "-S", "-c", "pass"]),
    ):
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            subprocess.run(argv, env=env, input=b'{"cniVersion":"1.0.0"}', capture_output=True, check=True)
            samples.append((time.perf_counter() - start) * 1000.0)
        out[label] = statistics.median(samples)
    return out


def import_time() -> dict[str, float]:
    """Cumulative import time (ms) of what the ADD path imports, from ``python -X importtime``."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import cni.main, cni.plugin, cni.ipam; "
        "import device_plugin.nr1_sysfs"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-X", "importtime", "-c", code, str(REPO)],
        capture_output=True,
        text=True,
        check=True,
    )
    total = 0.0
    tops: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2].rstrip()
        if not name.startswith("  "):  # top-level imports: their cumulative times add up to the total
            cumulative = int(parts[1]) / 1000.0
            total += cumulative
            tops[name.strip()] = cumulative
    return {
        "total_ms": round(total, 2),
        **{k: round(v, 2) for k, v in sorted(tops.items(), key=lambda kv: -kv[1])[:8]},
    }


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    return {
        label: {
            cmd: {
                "median_ms": round(statistics.median(v), 2),
                "p99_ms": round(percentile(v, 99), 2),
                "mean_ms": round(statistics.fmean(v), 2),
                "n": len(v),
            }
            for cmd, v in per.items()
        }
        for label, per in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default="bare,static", help="comma list of bare, static")
    parser.add_argument(
        "--pod-resources", action="store_true", help="also time ours with the pod-resources lookup"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    if not os.access(REFERENCE, os.X_OK):
        print(f"{REFERENCE} missing: apt-get install containernetworking-plugins", file=sys.stderr)
        return 2

    report: dict[str, object] = {"rounds": args.rounds}
    bench = Bench(args.rounds, args.warmup)
    peer = None
    try:
        static = {
            "type": "static",
            "addresses": [{"address": "10.123.0.5/24", "gateway": "10.123.0.1"}],
            "routes": [{"dst": "10.124.0.0/16"}],
        }
        results: dict[str, object] = {}
        for variant in [v for v in args.variants.split(",") if v]:
            ipam = {"ipam": static} if variant == "static" else {}
            pci = f"0000:{0x10 + len(bench.nics):02x}:00.0"
            bench.nic(pci)
            ref_nic = bench.nic("")
            ours = dict(
                cniVersion="1.1.0",
                name="bench",
                type="accelstack-nr1-cni",
                sysfsRoot=str(bench.tmp / "sys"),
                dataDir=str(bench.tmp / "state"),
                runtimeConfig={"deviceID": pci},
                **ipam,
            )
            ref = dict(cniVersion="1.0.0", name="bench", type="host-device", device=ref_nic, **ipam)
            plugins = [
                ("host-device", REFERENCE, json.dumps(ref).encode(), "ref1", {}),
                (
                    "accelstack",
                    str(PLUGIN),
                    json.dumps(ours).encode(),
                    "acc1",
                    {"ACCELSTACK_CNI_PYTHON": sys.executable},
                ),
            ]
            if args.pod_resources and variant == "bare":
                sock = str(bench.tmp / "kubelet.sock")
                pr_pci = f"0000:{0x10 + len(bench.nics):02x}:00.0"
                bench.nic(pr_pci)
                peer = start_peer(sock, pr_pci)
                pr = dict(ours, podResourcesSocket=sock)
                pr.pop("runtimeConfig")
                plugins.append(
                    (
                        "accelstack (pod-resources)",
                        str(PLUGIN),
                        json.dumps(pr).encode(),
                        "acc2",
                        {
                            "ACCELSTACK_CNI_PYTHON": sys.executable,
                            "CNI_ARGS": "K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-0",
                        },
                    ),
                )
            summary = summarize(bench.run_pair(plugins))
            ratio = {
                cmd: round(
                    summary["accelstack"][cmd]["median_ms"] / summary["host-device"][cmd]["median_ms"], 2
                )
                for cmd in ("ADD", "DEL")
            }
            results[variant] = {"plugins": summary, "ratio_median": ratio}
            print(
                f"\n== {variant} ({'static IPAM' if ipam else 'no IPAM'}; interface kind: {bench.kind}; "
                f"{args.rounds} rounds)"
            )
            print(f"{'plugin':30} {'ADD med':>8} {'ADD p99':>8} {'DEL med':>8} {'DEL p99':>8}  (ms)")
            for label, per in summary.items():
                print(
                    f"{label:30} {per['ADD']['median_ms']:8.2f} {per['ADD']['p99_ms']:8.2f} "
                    f"{per['DEL']['median_ms']:8.2f} {per['DEL']['p99_ms']:8.2f}"
                )
            print(
                f"ratio accelstack/host-device (median): ADD {ratio['ADD']}x, DEL {ratio['DEL']}x  (goal <= 3x)"
            )
        report["variants"] = results
        report["interface_kind"] = bench.kind
        report["netns_move_median_ms"] = round(move_cost(bench, max(10, min(args.rounds, 50))), 2)
        print(
            f"\n== one namespace move of a {bench.kind} interface (kernel, in-process): "
            f"{report['netns_move_median_ms']} ms median; ADD moves it twice (via a temporary namespace), "
            "host-device 1.1.1 once; DEL once each"
        )
    finally:
        if peer is not None:
            peer.kill()
            peer.wait()
        bench.close()

    floor = startup_floor(max(20, min(args.rounds, 100)))
    report["startup_median_ms"] = {k: round(v, 2) for k, v in floor.items()}
    report["import_time_ms"] = import_time()
    print("\n== start-up (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in floor.items()))
    print(
        "== import time of the ADD path (python -X importtime, ms): " + json.dumps(report["import_time_ms"])
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
