"""Gateway benchmark: added latency and throughput against calling a replica directly, and least-request (power
of two choices) against round robin over replicas of unequal speed, all in one run.

Every party is its own process, so no one's work is counted in another's: OpenAI-compatible runtime peers
(``tests/inference/runtime_peer.py``), ``accelstack-gateway`` on an objects file (API keys on, as in a cluster),
and this process as the closed-loop load generator (aiohttp, N clients each sending its next request when the
previous one finished). Each figure is measured in rounds that alternate the baseline and the gateway; the table
shows the median over rounds.

1. Added latency, 1 client, a replica that answers at once: p50/p99 of the round trip through the gateway minus
   directly, JSON and streaming (time to first byte and to the last byte).
2. Throughput at 64 and 512 clients against one replica with a fixed service time (``--service-ms``): requests/s
   through the gateway over requests/s directly.
3. Balancing: four replicas that each generate ``--batch`` requests at once (the rest wait, as in a runtime's
   batch), one of them ``--slow`` times slower; the gateway (least outstanding requests) against round robin and
   against nginx ``least_conn`` (Debian ``nginx-light``, its own config and port) in front of the same replicas,
   with the CPU each proxy spends per request.

Targets: added p50 <= 1 ms; throughput >= 0.95x direct with one replica at 64 clients; over unequal replicas p99
<= 1.0x nginx least_conn's and throughput >= 1.0x its; CPU per request <= 0.25 ms.
Usage: python bench/bench_gateway.py [--seconds 2] [--rounds 3] [--poll S] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import yaml  # noqa: E402

from tests.inference.harness import KEY_A, endpoint, key_secret, slices  # noqa: E402

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
STREAM_BODY = {**BODY, "stream": True}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        self.by_url: dict[str, subprocess.Popen[Any]] = {}

    def peer(self, name: str, latency: float = 0.0, batch: int = 0, tokens: int = 8) -> str:
        proc = subprocess.Popen([sys.executable, "-m", "tests.inference.runtime_peer", "--name", name,
                                 "--latency", str(latency), "--batch", str(batch), "--tokens", str(tokens)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        return proc.stdout.readline().strip()

    def cpu_seconds(self, url: str) -> float:
        """User + system CPU time of the gateway process serving ``url``."""
        proc = self.by_url[url]
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def gateway(self, directory: Path, urls: list[str], policy: str, poll: float | None = 0.0) -> str:
        """``poll``: seconds between reads of the replicas' queue metric; None: the gateway's shipped default."""
        objects = directory / f"objects-{policy}-{len(self.procs)}.yaml"
        objects.write_text(yaml.safe_dump_all([endpoint("llm", max_inflight=4096, max_queue=4096),
                                               *slices("llm", urls), key_secret("bench", "team-a", KEY_A)]))
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "inference.gateway.main", "--objects", str(objects),
                                 "--listen", f"127.0.0.1:{port}", "--policy", policy, "--log-level", "error",
                                 *(("--load-poll-interval", str(poll)) if poll is not None else ()),
                                 "--drain-seconds", "0"],
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.procs.append(proc)
        self.by_url[f"http://127.0.0.1:{port}"] = proc
        return f"http://127.0.0.1:{port}"

    def nginx(self, directory: Path, urls: list[str]) -> str | None:
        """nginx ``least_conn`` in front of ``urls`` (Debian ``nginx-light``), its own config and port: the in-run
        baseline for balancing. None when no nginx binary is installed."""
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if binary is None:
            return None
        port = free_port()
        servers = "".join(f"server {url.removeprefix('http://')};" for url in urls)
        conf = directory / "nginx.conf"
        conf.write_text(
            # one process (no master), so its CPU time is the work: the same measure as for the gateway
            f"master_process off; worker_processes 1; daemon off; pid {directory}/nginx.pid; error_log {directory}/nginx.err error;\n"
            "events { worker_connections 4096; }\n"
            f"http {{ access_log off; client_body_temp_path {directory}; proxy_temp_path {directory};\n"
            f"  upstream llm {{ least_conn; {servers} keepalive 256; }}\n"
            f"  server {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://llm; proxy_http_version 1.1;\n"
            "    proxy_set_header Connection \"\"; proxy_buffering off; } } }\n")
        proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(directory)], cwd=ROOT)
        self.procs.append(proc)
        self.by_url[f"http://127.0.0.1:{port}"] = proc
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready")
            await asyncio.sleep(0.05)


async def load(url: str, clients: int, seconds: float, stream: bool = False) -> dict[str, Any]:
    """Closed loop: ``clients`` workers for ``seconds``; round trips, time to first byte, requests/s."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    body = json.dumps(STREAM_BODY if stream else BODY).encode()
    target = url + "/v1/chat/completions"
    latencies: list[float] = []
    firsts: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers={**headers, "Content-Type": "application/json"},
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def warm() -> None:
            async with session.post(target, data=body) as r:
                await r.read()

        await asyncio.gather(*(warm() for _ in range(min(clients, 64))))  # open connections, prime caches
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                start = time.perf_counter()
                try:
                    async with session.post(target, data=body) as r:
                        if stream:
                            await r.content.readany()
                            firsts.append(time.perf_counter() - start)
                        await r.read()
                        if r.status != 200:
                            errors += 1
                            continue
                except aiohttp.ClientError:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - start)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - began
    return {"rps": len(latencies) / elapsed, "p50": pct(latencies, 50), "p99": pct(latencies, 99),
            "ttfb50": pct(firsts, 50), "ttfb99": pct(firsts, 99), "n": len(latencies), "errors": errors}


def med(rounds: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    procs = Procs()
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            fast = procs.peer("fast")
            served = procs.peer("served", latency=args.service_ms / 1000)
            gw_fast = procs.gateway(directory, [fast], "least-request")
            gw_served = procs.gateway(directory, [served], "least-request")
            slow_urls = [procs.peer(f"r{i}", latency=(args.service_ms / 1000) * (args.slow if i == 0 else 1),
                                    batch=args.batch) for i in range(4)]
            # the runtimes' queue read as shipped (--load-poll-interval's default) unless --poll says otherwise: each
            # read costs about as much CPU as a proxied request (a wake-up from idle), so 0.1 s on four replicas
            # added ~70 us a request at this arm's ~120 requests/s
            gw_lr = procs.gateway(directory, slow_urls, "least-request", poll=args.poll)
            gw_rr = procs.gateway(directory, slow_urls, "round-robin")
            ngx = procs.nginx(directory, slow_urls)
            for url in (gw_fast, gw_served, gw_lr, gw_rr):
                await wait_ready(url)

            for stream in (False, True):
                direct, via = [], []
                for _ in range(args.rounds):
                    direct.append(await load(fast, 1, args.seconds, stream))
                    via.append(await load(gw_fast, 1, args.seconds, stream))
                key = "stream" if stream else "json"
                results[f"added_{key}"] = {
                    "direct_p50_ms": med(direct, "p50") * 1e3, "direct_p99_ms": med(direct, "p99") * 1e3,
                    "gateway_p50_ms": med(via, "p50") * 1e3, "gateway_p99_ms": med(via, "p99") * 1e3,
                    "added_p50_ms": statistics.median((v["p50"] - d["p50"]) * 1e3 for d, v in zip(direct, via, strict=True)),
                    "added_p99_ms": statistics.median((v["p99"] - d["p99"]) * 1e3 for d, v in zip(direct, via, strict=True)),
                }
                if stream:
                    results["added_stream"]["added_ttfb_p50_ms"] = statistics.median(
                        (v["ttfb50"] - d["ttfb50"]) * 1e3 for d, v in zip(direct, via, strict=True))

            for clients in (64, 512):
                direct, via = [], []
                cpu, served_requests = 0.0, 0
                for _ in range(args.rounds):
                    await load(served, clients, 0.5)  # open the clients' connections before measuring
                    direct.append(await load(served, clients, args.seconds))
                    await load(gw_served, clients, 0.5)
                    before = procs.cpu_seconds(gw_served)
                    via.append(await load(gw_served, clients, args.seconds))
                    cpu += procs.cpu_seconds(gw_served) - before
                    served_requests += via[-1]["n"] + via[-1]["errors"]
                results[f"throughput_{clients}"] = {
                    "direct_rps": med(direct, "rps"), "gateway_rps": med(via, "rps"),
                    "ratio": statistics.median(v["rps"] / d["rps"] for d, v in zip(direct, via, strict=True)),
                    "direct_p50_ms": med(direct, "p50") * 1e3, "gateway_p50_ms": med(via, "p50") * 1e3,
                    "direct_p99_ms": med(direct, "p99") * 1e3, "gateway_p99_ms": med(via, "p99") * 1e3,
                    "errors": sum(r["errors"] for r in direct + via),
                    "gateway_cpu_us_per_request": cpu / max(1, served_requests) * 1e6,
                }

            lr, rr, nx = [], [], []
            lr_cpu, nx_cpu, lr_n, nx_n = 0.0, 0.0, 0, 0
            for _ in range(args.rounds):  # the arms interleaved, round by round
                rr.append(await load(gw_rr, args.balance_clients, args.seconds))
                before = procs.cpu_seconds(gw_lr)
                lr.append(await load(gw_lr, args.balance_clients, args.seconds))
                lr_cpu += procs.cpu_seconds(gw_lr) - before
                lr_n += lr[-1]["n"] + lr[-1]["errors"]
                if ngx is not None:
                    before = procs.cpu_seconds(ngx)
                    nx.append(await load(ngx, args.balance_clients, args.seconds))
                    nx_cpu += procs.cpu_seconds(ngx) - before
                    nx_n += nx[-1]["n"] + nx[-1]["errors"]
            if nx:
                results["nginx_least_conn"] = {
                    "p50_ms": med(nx, "p50") * 1e3, "p99_ms": med(nx, "p99") * 1e3, "rps": med(nx, "rps"),
                    "cpu_us_per_request": nx_cpu / max(1, nx_n) * 1e6,
                    "gateway_p99_ratio": statistics.median(a["p99"] / b["p99"] for a, b in zip(lr, nx, strict=True)),
                    "gateway_rps_ratio": statistics.median(a["rps"] / b["rps"] for a, b in zip(lr, nx, strict=True)),
                    "gateway_cpu_us_per_request": lr_cpu / max(1, lr_n) * 1e6,
                }
            results["balancing"] = {
                "least_request_p99_ms": med(lr, "p99") * 1e3, "round_robin_p99_ms": med(rr, "p99") * 1e3,
                "least_request_p50_ms": med(lr, "p50") * 1e3, "round_robin_p50_ms": med(rr, "p50") * 1e3,
                "p99_ratio": statistics.median(a["p99"] / b["p99"] for a, b in zip(lr, rr, strict=True)),
                "least_request_rps": med(lr, "rps"), "round_robin_rps": med(rr, "rps"),
            }
    finally:
        procs.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0, help="length of one measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    p.add_argument("--service-ms", type=float, default=200.0,
                   help="a replica's service time for throughput (a short completion)")
    p.add_argument("--batch", type=int, default=4, help="requests a replica generates at once (balancing)")
    p.add_argument("--slow", type=float, default=4.0, help="how many times slower the slow replica is")
    p.add_argument("--balance-clients", type=int, default=24, help="clients in the balancing measurement")
    p.add_argument("--poll", type=float, default=None,
                   help="the balancing gateway's --load-poll-interval (default: the gateway's own default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    a, s = results["added_json"], results["added_stream"]
    print(f"added latency, 1 client, JSON:   direct p50/p99 {a['direct_p50_ms']:.3f}/{a['direct_p99_ms']:.3f} ms, "
          f"gateway {a['gateway_p50_ms']:.3f}/{a['gateway_p99_ms']:.3f} ms -> added p50 {a['added_p50_ms']:.3f} ms, "
          f"p99 {a['added_p99_ms']:.3f} ms (target p50 <= 1 ms)")
    print(f"added latency, 1 client, stream: direct p50/p99 {s['direct_p50_ms']:.3f}/{s['direct_p99_ms']:.3f} ms, "
          f"gateway {s['gateway_p50_ms']:.3f}/{s['gateway_p99_ms']:.3f} ms -> added p50 {s['added_p50_ms']:.3f} ms, "
          f"p99 {s['added_p99_ms']:.3f} ms, first byte p50 {s['added_ttfb_p50_ms']:.3f} ms")
    for clients in (64, 512):
        t = results[f"throughput_{clients}"]
        print(f"throughput, {clients} clients, {args.service_ms:g} ms service: direct {t['direct_rps']:.0f} req/s "
              f"(p50 {t['direct_p50_ms']:.1f}, p99 {t['direct_p99_ms']:.1f} ms), gateway {t['gateway_rps']:.0f} req/s "
              f"(p50 {t['gateway_p50_ms']:.1f}, p99 {t['gateway_p99_ms']:.1f} ms) -> {t['ratio']:.2f}x "
              f"(target >= 0.95x at 64); gateway CPU {t['gateway_cpu_us_per_request']:.0f} us/request; errors {t['errors']}")
    b = results["balancing"]
    poll = "shipped default" if args.poll is None else f"{args.poll:g} s"
    print(f"balancing, 4 replicas (one {args.slow:g}x slower, batch {args.batch}), {args.balance_clients} clients, "
          f"queue poll {poll}: "
          f"least-request p50/p99 {b['least_request_p50_ms']:.1f}/{b['least_request_p99_ms']:.1f} ms "
          f"({b['least_request_rps']:.0f} req/s), round robin {b['round_robin_p50_ms']:.1f}/"
          f"{b['round_robin_p99_ms']:.1f} ms ({b['round_robin_rps']:.0f} req/s) -> p99 ratio {b['p99_ratio']:.2f} "
          f"(target <= 0.5)")
    n = results.get("nginx_least_conn")
    if n is None:
        print("nginx least_conn: not run (no nginx; apt-get install -y nginx-light)")
    else:
        print(f"nginx least_conn, same replicas and clients: p50/p99 {n['p50_ms']:.1f}/{n['p99_ms']:.1f} ms "
              f"({n['rps']:.0f} req/s, CPU {n['cpu_us_per_request']:.0f} us/request) -> gateway/nginx p99 "
              f"{n['gateway_p99_ratio']:.2f}x (target <= 1.0), throughput {n['gateway_rps_ratio']:.2f}x "
              f"(target >= 1.0), gateway CPU {n['gateway_cpu_us_per_request']:.0f} us/request (target <= 250)")


if __name__ == "__main__":
    main()
