"""Many small pods of one GPR, bound inside the real kube-scheduler (issue 35 point 3): a GPR of N nodes x 1 GPU
on nodes of 8 GPUs, then its N pods created at once (as a Job makes them). kube-scheduler filters the next pod
while the last one binds and sees 8 free GPUs on every reserved node; the extender must offer each pod a node
whose share no pod in flight holds, or binds fail ("reservation here is used up") and the pods retry.

Measured in the same run, arms interleaved round by round, on the real kube-apiserver and kube-scheduler
(``KUBEBUILDER_ASSETS``), shipped profile, webhooks and RBAC:

- ``accelstack``: the GPR admitted first; then the N pods; the time from the first pod's gate lifting to the last
  pod bound, failed binds (kube-scheduler's FailedScheduling Events quoting a bind error), pods per reserved node;
- ``noop``: the same N pods without a GPR through a do-nothing extender (filter only): create -> last bound.

Target (issue 35.3): zero failed binds, all 20 bound within 2 s of the gate lifting.

Usage: KUBEBUILDER_ASSETS=.cache/k8s-bin python bench/bench_gpr_binds.py [--rounds 3] [--shapes 20,8]
[--nodes 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from real_e2e import GPU, Admin, Arm, Bench, make_nodes  # noqa: E402  (bench/ is on sys.path: this script's folder)

from tests.realcluster.controlplane import ControlPlane  # noqa: E402
from tests.realcluster.shipped import install, render  # noqa: E402

GPRS = "apis/accelstack.io/v1alpha1/namespaces/{ns}/gpuprovisioningrequests"
ARMS = {"accelstack": Arm("accelstack", "accelstack, one GPR of N x 1 GPU", "accelstack"),
        "noop": Arm("noop", "do-nothing extender, the same pods without a GPR", "noop")}


class Round:
    def __init__(self) -> None:
        self.created: dict[str, float] = {}
        self.ungated: dict[str, float] = {}
        self.bound: dict[str, str] = {}
        self.bound_at: dict[str, float] = {}
        self.failed_binds = 0
        self.reserved: set[str] = set()

    def seconds(self) -> float:
        """First gate lifted (or first create, for pods that have no gate) -> last pod bound."""
        start = min(self.ungated.values(), default=min(self.created.values(), default=0.0))
        return max(self.bound_at.values(), default=float("nan")) - start


async def watch(api: Admin, ns: str, r: Round, stop: asyncio.Event) -> None:
    """When each pod is first seen without a scheduling gate, and bound (one watch, resumed)."""
    rv = ""
    while not stop.is_set():
        q = "watch=1&timeoutSeconds=30" + (f"&resourceVersion={rv}" if rv else "")
        try:
            async with api.http.get(f"{api.url}/api/v1/namespaces/{ns}/pods?{q}") as resp:
                async for line in resp.content:
                    ev = json.loads(line)
                    obj = ev.get("object") or {}
                    if ev.get("type") == "ERROR":
                        rv = ""
                        break
                    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
                    rv = meta.get("resourceVersion", rv)
                    name, now = str(meta.get("name") or ""), time.monotonic()
                    if not spec.get("schedulingGates") and name not in r.ungated:
                        r.ungated[name] = now
                    if spec.get("nodeName") and name not in r.bound:
                        r.bound[name], r.bound_at[name] = spec["nodeName"], now
                    if stop.is_set():
                        return
        except (TimeoutError, OSError, ValueError):
            await asyncio.sleep(0.2)


def pod(ns: str, i: int, gpr: str) -> dict[str, Any]:
    labels = {"app": "binds", **({"accelstack.io/gpr": gpr} if gpr else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"w-{i:03d}", "namespace": ns, "labels": labels},
            "spec": {"schedulerName": "accelstack-scheduler", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {
                         "requests": {"cpu": "10m", GPU: "1"}, "limits": {GPU: "1"}}}]}}


async def one(bench: Bench, arm: Arm, n: int, rnd: int, timeout: float) -> Round:
    r = Round()
    ns = f"binds-{arm.key}-{n}-{rnd}"
    api = bench.api
    await api.call("POST", "api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    await api.call("POST", f"api/v1/namespaces/{ns}/serviceaccounts",
                   {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    bench._start(arm)
    try:
        gpr = ""
        if arm.extender == "accelstack":
            bench._webhooks(True)
            gpr = "spread"
            status, body = await api.call("POST", GPRS.format(ns=ns), {
                "apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest", "metadata": {"name": gpr},
                "spec": {"resource": GPU, "devicesPerNode": 1, "nodeCount": n, "priority": 100}})
            if status != 201:
                raise SystemExit(f"bench binds: GPR refused: {status} {body.get('message')}")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                _, obj = await api.call("GET", f"{GPRS.format(ns=ns)}/{gpr}")
                st = obj.get("status") or {}
                if st.get("phase") in ("Admitted", "Running"):
                    r.reserved = {x["node"] for x in st.get("reservation") or []}
                    break
                await asyncio.sleep(0.2)
            else:
                raise SystemExit(f"bench binds: GPR {ns}/{gpr} not admitted within {timeout:.0f} s")
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(api, ns, r, stop))
        await asyncio.sleep(0.5)  # the watch is open before the first create

        async def create(i: int) -> None:
            t = time.monotonic()
            status, body = await api.call("POST", f"api/v1/namespaces/{ns}/pods", pod(ns, i, gpr))
            if status != 201:
                raise SystemExit(f"bench binds: pod refused: {status} {str(body.get('message'))[:200]}")
            r.created[body["metadata"]["name"]] = t

        await asyncio.gather(*(create(i) for i in range(n)))
        deadline = time.monotonic() + timeout
        while len(r.bound) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        watcher.cancel()
        _, events = await api.call("GET", f"api/v1/namespaces/{ns}/events")
        r.failed_binds = sum(1 for e in events.get("items") or [] if e.get("reason") == "FailedScheduling"
                             and ("cannot bind" in e.get("message", "") or "binding" in e.get("message", "").lower()))
    finally:
        bench._stop()
        await bench._clean(ns)
    return r


def summary(rounds: list[Round], n: int) -> tuple[str, str, str, str]:
    secs = [r.seconds() for r in rounds]
    med = statistics.median(secs)
    failed = [r.failed_binds for r in rounds]
    unbound = [n - len(r.bound) for r in rounds]
    per_node = [max((list(r.bound.values()).count(v) for v in set(r.bound.values())), default=0) for r in rounds]
    outside = [sum(1 for v in r.bound.values() if r.reserved and v not in r.reserved) for r in rounds]
    return (f"{med:.2f} s ({', '.join(f'{s:.2f}' for s in secs)})", f"{max(failed)} ({', '.join(map(str, failed))})",
            f"{max(unbound)}", f"{max(per_node)} / {max(outside)}")


async def main_async(args: argparse.Namespace) -> list[str]:
    from tests.realcluster.controlplane import assets_dir, missing_assets

    folder = assets_dir()
    if folder is None or missing_assets(folder, ("kube-apiserver", "kube-scheduler", "etcd", "kubectl")):
        raise SystemExit("bench binds: KUBEBUILDER_ASSETS must name a folder with kube-apiserver, kube-scheduler, "
                         "etcd and kubectl (scripts/test.sh unpacks ../shared/k8s into .cache/k8s-bin)")
    cp = ControlPlane(folder)
    results: dict[tuple[str, int], list[Round]] = {}
    try:
        cp.start()
        bench = Bench(cp, args.nodes, 0, 1, lambda m: print(m, file=sys.stderr, flush=True))
        bench.objects = install(cp, render())
        bench.api = Admin(cp)
        bench.nodes = await make_nodes(bench.api, args.nodes)
        bench.noop_cert = cp.pki.issue("noop", "/CN=noop-extender", sans="IP:127.0.0.1")
        for rnd in range(args.rounds):
            for n in args.shapes:
                for key in ("noop", "accelstack"):
                    r = await one(bench, ARMS[key], n, rnd, args.timeout)
                    results.setdefault((key, n), []).append(r)
                    print(f"round {rnd + 1}/{args.rounds} {key} {n} pods: {r.seconds():.2f} s, failed binds "
                          f"{r.failed_binds}, bound {len(r.bound)}/{n}", file=sys.stderr, flush=True)
        await bench.api.close()
    finally:
        if os.environ.get("ACCELSTACK_KEEP_CONTROL_PLANE"):
            cp.stop()
        else:
            cp.cleanup()
    out = [f"many small pods of one GPR inside the real kube-scheduler v1.36.2, {args.nodes} nodes x 8 GPUs, "
           f"median of {args.rounds} interleaved round(s) (each round's value in brackets):", "",
           "| pods | arm | gate lifted (or created) -> all bound | failed binds | never bound | "
           "most pods on one node / pods outside the reservation | ratio to the do-nothing extender |",
           "|---|---|---|---|---|---|---|"]
    for n in args.shapes:
        base = statistics.median(r.seconds() for r in results[("noop", n)])
        for key in ("accelstack", "noop"):
            s = summary(results[(key, n)], n)
            ratio = statistics.median(r.seconds() for r in results[(key, n)]) / base if key == "accelstack" else 1
            out.append(f"| {n} | {ARMS[key].label} | {s[0]} | {s[1]} | {s[2]} | {s[3]} | {ratio:.2f}x |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_gpr_binds.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--shapes", default="20,8", help="pods (= reserved nodes of one GPU) per GPR, comma-separated")
    p.add_argument("--nodes", type=int, default=60, help="fake nodes of 8 GPUs")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for an admission or the binds")
    args = p.parse_args(argv)
    try:
        args.shapes = [int(x) for x in args.shapes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--shapes: expected comma-separated integers, got {args.shapes!r}")
    if not args.shapes or min(args.shapes) < 1 or max(args.shapes) > args.nodes:
        p.error(f"--shapes: each between 1 and --nodes ({args.nodes})")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    for line in asyncio.run(main_async(args)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
