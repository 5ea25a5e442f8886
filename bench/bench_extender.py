"""Scheduler extender benchmark at 5,000 nodes over real HTTP, beside a no-op aiohttp handler in the same run.

Two server processes (so the client's work is not counted in theirs): the extender stack (API-server peer
with 5,000 nodes of 8 GPUs, informers, the extender) and a no-op aiohttp extender that parses the body and
returns every node. The client sends the request body a real kube-scheduler sends (the recorded one, with
500 node names — the scheduler's default sampling at 5,000 nodes — and with all 5,000).

Reported: filter and prioritize p50/p99 client round trip and requests/s (16 concurrent, like the scheduler's
parallelism), the same for the no-op, the ratio; filter p50/p99 *in the server* (the handler alone, timed in
the server process; target p99 <= 2 ms); bind p50/p99 including its API-server round trips (ledger patch,
Binding, pod annotation).

Usage: python bench/bench_extender.py [--requests 2000] [--binds 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.flags import run_loop  # noqa: E402

NODES = 5000


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_extender(conn: Any, binds: int) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)

    async def main() -> None:
        from kubernetes_asyncio import client

        from kubeapi import KubeClient
        from scheduler_extender.cmd.server import ExtenderServer
        from scheduler_extender.objects.kube import Kube
        from tests.apiserver_peer import APIServerPeer
        from tests.extender.harness import node, pod

        peer = APIServerPeer()
        await peer.start()
        for i in range(NODES):
            await peer.put_object("api/v1/nodes", node(f"node-{i:04d}", gpus=8))
        for i in range(binds):
            await peer.put_object("api/v1/pods", pod(f"bind-{i:04d}", 1, uid=f"uid-{i:04d}"))
        api = client.ApiClient(client.Configuration(host=peer.url))
        server = ExtenderServer(Kube(KubeClient(api, field_manager="accelstack-extender")), run_controller=False)
        await server.start()
        conn.send({"port": server.port})
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the HTTP runs are over
        # handler-only timing in this process, with the machine otherwise idle: the extender's own cost
        body = json.loads((ROOT / "tests/extender/wire/a-filter.request.json").read_text())
        body["NodeNames"] = [f"node-{i:04d}" for i in range(0, NODES, 10)]
        raw = json.dumps(body).encode()
        times = []
        for _ in range(3000):
            t0 = time.perf_counter()
            await server.extender.filter(raw)
            times.append(time.perf_counter() - t0)
        conn.send({"server_filter": times[500:]})
        await server.stop()
        await api.close()
        await peer.stop()

    run_loop(main())  # the loop the shipped extender serves on (uvloop)


def run_noop(conn: Any) -> None:
    async def main() -> None:
        import orjson
        from aiohttp import web

        async def verb(request: web.Request) -> web.Response:
            args = orjson.loads(await request.read())
            names = args.get("NodeNames") or []
            if request.path.endswith("prioritize"):
                return web.Response(body=orjson.dumps([{"Host": n, "Score": 0} for n in names]),
                                    content_type="application/json")
            return web.Response(body=orjson.dumps({"NodeNames": names, "FailedNodes": {},
                                                   "FailedAndUnresolvableNodes": {}, "Error": ""}),
                                content_type="application/json")

        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post("/scheduler/{verb}", verb)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send({"port": site._server.sockets[0].getsockname()[1]})  # type: ignore[union-attr]
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await runner.cleanup()

    run_loop(main())  # the loop the shipped extender serves on (uvloop)


async def load(port: int, verb: str, bodies: list[bytes], concurrency: int = 16) -> tuple[list[float], float]:
    import aiohttp

    latencies: list[float] = []
    queue = list(bodies)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def worker() -> None:
            while queue:
                body = queue.pop()
                t0 = time.perf_counter()
                async with http.post(f"http://127.0.0.1:{port}/scheduler/{verb}", data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200, await r.text()
                latencies.append(time.perf_counter() - t0)
        for _ in range(50):  # warm-up
            async with http.post(f"http://127.0.0.1:{port}/scheduler/{verb}", data=bodies[0]) as r:
                await r.read()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return latencies, len(bodies) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--binds", type=int, default=500)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ext_parent, ext_child = ctx.Pipe()
    noop_parent, noop_child = ctx.Pipe()
    ext = ctx.Process(target=run_extender, args=(ext_child, args.binds))
    noop = ctx.Process(target=run_noop, args=(noop_child,))
    ext.start()
    noop.start()
    ext_info, noop_info = ext_parent.recv(), noop_parent.recv()
    template = json.loads((ROOT / "tests/extender/wire/a-filter.request.json").read_text())
    rows = []
    for label, names in (("500 names", [f"node-{i:04d}" for i in range(0, NODES, 10)]),
                         ("5,000 names", [f"node-{i:04d}" for i in range(NODES)])):
        body = json.dumps(dict(template, NodeNames=names)).encode()
        for verb in ("filter", "prioritize"):
            n = args.requests if label == "500 names" else args.requests // 4
            ext_lat, ext_rps = asyncio.run(load(ext_info["port"], verb, [body] * n))
            noop_lat, noop_rps = asyncio.run(load(noop_info["port"], verb, [body] * n))
            rows.append((f"{verb}, {label}", ext_lat, ext_rps, noop_lat, noop_rps))
    binds = [json.dumps({"PodName": f"bind-{i:04d}", "PodNamespace": "default", "PodUID": f"uid-{i:04d}",
                         "Node": f"node-{i % NODES:04d}"}).encode() for i in range(args.binds)]
    bind_lat, bind_rps = asyncio.run(load(ext_info["port"], "bind", binds))
    noop_parent.send("stop")
    noop.join(30)
    ext_parent.send("measure")
    server = ext_parent.recv()["server_filter"]
    ext.join(60)
    print(f"{'verb (HTTP, 16 concurrent)':<28} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} | {'no-op p50':>9} "
          f"{'p99':>7} {'req/s':>7} | ratio p50")
    for name, lat, rps, nlat, nrps in rows:
        print(f"{name:<28} {1000 * statistics.median(lat):8.2f} {1000 * pct(lat, 99):8.2f} {rps:8.0f} | "
              f"{1000 * statistics.median(nlat):9.2f} {1000 * pct(nlat, 99):7.2f} {nrps:7.0f} | "
              f"{statistics.median(lat) / statistics.median(nlat):.2f}x")
    print(f"{'bind (with API round trips)':<28} {1000 * statistics.median(bind_lat):8.2f} "
          f"{1000 * pct(bind_lat, 99):8.2f} {bind_rps:8.0f}")
    print(f"filter in the server (handler only, 500 names): p50 {1000 * statistics.median(server):.3f} ms, "
          f"p99 {1000 * pct(server, 99):.3f} ms (target p99 <= 2 ms)")


if __name__ == "__main__":
    main()
