"""Admin portal benchmark at 5,000 nodes and 10,000 GPRs: the REST calls each portal page makes, their payload
sizes and times (in the server and over HTTP), beside the bare per-node ``GET /api/v1/inventory`` in the same
run, and — when Debian's chromium and chromium-driver are installed — the time a real browser takes from
navigation to the page's first useful render (the heat map's totals, the queue's first page).

The server process holds the API-server peer (5,000 nodes of 8 GPUs in 12 node groups of 3 models; 10,000 GPRs:
4,800 running with reservations, 5,200 queued with the positions and estimates the controller writes; 60
namespaces in 12 workspaces) and the extender's REST API with authorisation on (TokenReview +
SubjectAccessReview, cached). The client (this process) and the browser are separate processes.

The REST process keeps the queue order, the inventory summary and health until an informer event changes its
view (half a second at most). The calls are measured both ways: with the view unchanged (what the kept answers
cost) and with nothing kept (a bench-only middleware drops the kept answers before every request: everything is
computed, the cost a busy cluster pays at most twice a second). The browser runs see the first kind.

Usage: python bench/bench_portal.py [--samples 30] [--browser-samples 10] [--no-browser]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NODES, GPRS, RUNNING = 5000, 10_000, 4800
GROUPS = [f"type-{i:02d}" for i in range(12)]
MODELS = ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB", "NVIDIA-L40S"]
NAMESPACES = [f"team-{i:02d}" for i in range(60)]
TOKEN = "bench-token"


def run_server(conn: Any) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)

    async def main() -> None:
        from aiohttp import web
        from kubernetes_asyncio import client

        from kubeapi import KubeClient
        from scheduler_extender.cmd.server import ExtenderServer
        from scheduler_extender.objects import gpr_codec as gr
        from scheduler_extender.objects.kube import Kube
        from tests.apiserver_peer import APIServerPeer
        from tests.extender.harness import gpr, node
        from tests.portal.cluster import grant_admin

        peer = APIServerPeer()
        await peer.start()
        peer.tokens[TOKEN] = {"username": "admin", "groups": []}
        grant_admin(peer, "admin")
        for i in range(NODES):
            labels = {"node.kubernetes.io/instance-type": GROUPS[i % len(GROUPS)],
                      "nvidia.com/gpu.product": MODELS[i % len(GROUPS) % len(MODELS)]}
            conditions = [{"type": "GPUUnhealthy", "status": "True", "message": "Xid 79",
                           "lastTransitionTime": "2026-11-30T08:00:00Z"}] if i % 250 == 7 else None
            await peer.put_object("api/v1/nodes", node(f"node-{i:04d}", gpus=8, labels=labels, conditions=conditions))
        for i, ns in enumerate(NAMESPACES):
            await peer.put_object("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
                "name": ns, "labels": {"accelstack.io/workspace": f"ws-{i % 12:02d}"}}})
        now = time.time()
        for i in range(GPRS):
            ns = NAMESPACES[i % len(NAMESPACES)]
            if i < RUNNING:
                obj = gpr(f"run-{i:05d}", phase="Running", namespace=ns, reservation={f"node-{i % NODES:04d}": 8},
                          devices=8, exitDuration="4h")
            else:
                position = i - RUNNING + 1
                obj = gpr(f"wait-{i:05d}", phase="Queued", namespace=ns, priority=100 + i % 50, devices=8)
                obj["status"].update({"queuePosition": position, "reason": "InsufficientCapacity",
                                      "message": f"queued at position {position}",
                                      "estimatedStart": gr.rfc3339(now + 60 * position)})
            await peer.put_object("apis/accelstack.io/v1alpha1/gpuprovisioningrequests", obj)

        times: dict[str, list[float]] = {}

        server: Any = None

        @web.middleware
        async def timed(request: web.Request, handler: Any) -> Any:
            fresh = request.headers.get("X-Bench-Fresh") == "1"
            if fresh:  # as if the view had changed long enough ago: nothing kept is reused
                server.view.version += 1
                server.rest.views.forget()
            start = time.perf_counter()
            try:
                return await handler(request)
            finally:
                key = request.path + ("?" + "&".join(sorted(request.query)) if request.query else "")
                key = ("fresh " if fresh else "") + key
                times.setdefault(key, []).append((time.perf_counter() - start) * 1000)

        api = client.ApiClient(client.Configuration(host=peer.url))
        server = ExtenderServer(Kube(KubeClient(api, field_manager="accelstack-extender")), run_controller=False)
        server.app.middlewares.append(timed)
        await server.start(sync_timeout=300)
        conn.send(server.port)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # until the client is done
        conn.send(times)
        await server.stop()
        await api.close()
        await peer.stop()

    asyncio.run(main())


CALLS = {  # what each page asks for, in order
    "baseline: GET /api/v1/inventory (per-node rows)": ["/api/v1/inventory"],
    "inventory page": ["/ui/", "/ui/app.js", "/ui/app.css", "/api/v1/whoami", "/api/v1/inventory?summary=1"],
    "queue page (first 50)": ["/api/v1/whoami", "/api/v1/queue?limit=50"],
    "queue page, one workspace": ["/api/v1/whoami", "/api/v1/queue?limit=50&workspace=ws-03"],
    "node group drill-down (417 nodes)": ["/api/v1/inventory/groups/type-03"],
    "node page": ["/api/v1/inventory/nodes/node-0003"],
    "health page": ["/api/v1/whoami", "/api/v1/health"],
}


async def measure_http(port: int, samples: int, fresh: bool) -> dict[str, tuple[float, int]]:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    out: dict[str, tuple[float, int]] = {}
    headers = {"Authorization": f"Bearer {TOKEN}", **({"X-Bench-Fresh": "1"} if fresh else {})}
    async with aiohttp.ClientSession(headers=headers) as http:
        paths = sorted({p for ps in CALLS.values() for p in ps})
        for path in paths:  # warm the caches (whoami, the namespace index, SubjectAccessReviews)
            async with http.get(base + path) as r:
                assert r.status == 200, (path, r.status, await r.text())
        for path in paths:
            durations, size = [], 0
            for _ in range(samples):
                start = time.perf_counter()
                async with http.get(base + path) as r:
                    body = await r.read()
                durations.append((time.perf_counter() - start) * 1000)
                size = len(body)
            out[path] = (statistics.median(durations), size)
    return out


def rendered(css: str) -> Any:
    return lambda driver: driver.execute_script("return document.querySelector(arguments[0]) !== null", css)


def measure_browser(port: int, samples: int) -> dict[str, float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1360,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver") or ""))
    base = f"http://127.0.0.1:{port}/ui/"
    results: dict[str, float] = {}
    try:
        driver.get(base)
        driver.execute_script("sessionStorage.setItem('accelstack.token', arguments[0]);", TOKEN)
        durations = []
        for _ in range(samples):  # the browser's own floor: navigate to one small static file
            driver.get("about:blank")
            start = time.perf_counter()
            driver.get(base + "app.css")
            durations.append((time.perf_counter() - start) * 1000)
        results["baseline: a static file"] = statistics.median(durations)
        for label, route, ready in (("inventory", "inventory", "#totals"), ("queue", "queue", "table.queue"),
                                    ("health", "health", "#health-summary")):
            durations = []
            for _ in range(samples):
                driver.get("about:blank")
                start = time.perf_counter()
                driver.get(base + "#/" + route)  # a full load: HTML, script, style, whoami, the page's data
                WebDriverWait(driver, 10, poll_frequency=0.005).until(rendered(ready))
                durations.append((time.perf_counter() - start) * 1000)
            results[label] = statistics.median(durations)
    finally:
        driver.quit()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--browser-samples", type=int, default=10)
    p.add_argument("--no-browser", action="store_true")
    args = p.parse_args()
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=run_server, args=(child,))
    began = time.perf_counter()
    proc.start()
    port = parent.recv()
    print(f"server ready with {NODES} nodes and {GPRS} GPRs in {time.perf_counter() - began:.1f}s")
    kept = asyncio.run(measure_http(port, args.samples, fresh=False))
    fresh = asyncio.run(measure_http(port, args.samples, fresh=True))
    browser: dict[str, float] = {}
    browser_note = ""
    if args.no_browser:
        browser_note = "--no-browser"
    elif not (shutil.which("chromium") and shutil.which("chromedriver")):
        browser_note = "chromium/chromium-driver not installed"
    else:
        browser = measure_browser(port, args.browser_samples)
    parent.send("done")
    server_times: dict[str, list[float]] = parent.recv()
    proc.join(30)

    def server_ms(path: str, fresh: bool) -> float:
        key = path.split("?")[0] + ("?" + "&".join(sorted(k.split("=")[0] for k in path.split("?")[1].split("&")))
                                    if "?" in path else "")
        values = server_times.get(("fresh " if fresh else "") + key, [])
        return statistics.median(values) if values else float("nan")

    for label, http, is_fresh in (("view unchanged since the last request (kept answers reused)", kept, False),
                                  ("nothing kept: every answer computed (the view changed)", fresh, True)):
        base_ms = http["/api/v1/inventory"][0]
        print(f"\n== {label}")
        print(f"{'call':<48} {'bytes':>10} {'server ms':>10} {'HTTP ms':>9} {'vs baseline':>12}")
        for path in sorted(http):
            ms, size = http[path]
            print(f"{path:<48} {size:>10,} {server_ms(path, is_fresh):>10.2f} {ms:>9.2f} {ms / base_ms:>11.2f}x")
        print(f"{'page (sequential calls, medians summed)':<48} {'bytes':>10} {'HTTP ms':>9} {'vs baseline':>12}")
        for page, paths in CALLS.items():
            total = sum(http[p][0] for p in paths)
            size = sum(http[p][1] for p in paths)
            print(f"{page:<48} {size:>10,} {total:>9.2f} {total / base_ms:>11.2f}x")
    if browser:
        print("\nheadless chromium, navigation -> first useful render, median of "
              f"{args.browser_samples}:")
        floor = browser["baseline: a static file"]
        for label, ms in browser.items():
            print(f"  {label:<24} {ms:8.1f} ms  {ms / floor:6.2f}x the static-file navigation")
    else:
        print(f"\nbrowser timing skipped: {browser_note}")


if __name__ == "__main__":
    main()
