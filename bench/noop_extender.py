"""The do-nothing extender the control-plane benchmark measures accelstack against, inside the real kube-scheduler.

Same HTTP stack as the product's extender (aiohttp on uvloop, HTTPS with a certificate the scheduler's profile
trusts): ``filter`` passes every node it is sent, ``prioritize`` scores all equal, and with ``--bind`` it is a
binder that creates the pod's Binding itself (one API call, with the credentials of ``--kubeconfig``), as
accelstack's extender does. No state, no checks: the floor an extender sets on the real scheduler's pace.

``--floor gprs|auto`` adds the least work a design that narrows pods to reserved nodes must do,
with no decision behind it, to measure what rate such a design could reach at best: ``gprs``: a mutating webhook
(``/mutate-pods``, as the shipped webhook configuration calls it) that narrows a pod labelled
``accelstack.io/gpr: team-K`` to 25 fixed nodes (two teams a set, as best-fit packs 20 GPRs of 25 nodes x 4 GPUs),
as accelstack's webhook narrows the pods of an admitted GPR; ``auto``: a webhook that puts the pod behind the
scheduling gate ``accelstack.io/gpr`` and a loop that watches pods and, for each gated one, lifts the gate and
narrows it to a node in one PATCH (8 pods a node, in order), as accelstack's controller does once a GPR is
admitted, with no GPR object, status write or queue. The floors offer the verbs over HTTP/2, as the product did
when they were measured (2026-12-04; its verbs are HTTP/1.1 by default since 2026-12-05, as the baseline's are);
without ``--bind`` kube-scheduler binds.
``--pod-watch`` adds what an informer of every pod costs (a watch, each event decoded and kept by UID), as
accelstack's extender keeps one; ``--watch-only --kubeconfig F`` is a process that does only that (as accelstack's
controller keeps another).

Usage: python bench/noop_extender.py --port P --tls-cert-file C --tls-key-file K [--bind --kubeconfig F]
                                     [--floor gprs|auto --ungate-kubeconfig F] [--pod-watch]
       python bench/noop_extender.py --watch-only --kubeconfig F
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import ssl
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GATE = "accelstack.io/gpr"
GPU = "nvidia.com/gpu"
TEAM_NODES = 25  # nodes a pair of teams shares (the bench's 20 GPRs x 25 nodes x 4 GPUs)
PODS_A_NODE = 8


def node_name(i: int) -> str:
    return f"node-{i:04d}"  # bench/real_e2e.py's make_nodes


def team_nodes(label: str) -> list[str]:
    k = int(label.rsplit("-", 1)[-1]) if label.rsplit("-", 1)[-1].isdigit() else 0
    return [node_name((k // 2) * TEAM_NODES + j) for j in range(TEAM_NODES)]


async def serve(args: argparse.Namespace) -> None:
    import orjson
    from aiohttp import web

    from kubeapi.client import from_config
    from kubeapi.resources import PODS
    from scheduler_extender.objects.narrowing import narrow_affinity
    from service.h2_server import Request, Routes
    from service.http_listener import serve_app

    kube = await from_config(args.kubeconfig, field_manager="noop-extender") if args.bind else None

    # the baseline arms as they were measured (the standard library's JSON); the floors as the product (orjson)
    loads: Callable[[bytes], Any] = orjson.loads if args.floor else json.loads
    dumps: Callable[[Any], bytes] = orjson.dumps if args.floor else (lambda obj: json.dumps(obj).encode())

    def answer(obj: Any) -> web.Response:
        return web.Response(body=dumps(obj), content_type="application/json")

    async def filter_(raw: bytes) -> web.Response:
        body = loads(raw)
        return answer({"NodeNames": body.get("NodeNames"), "FailedNodes": {}, "Error": ""})

    async def prioritize(raw: bytes) -> web.Response:
        body = loads(raw)
        return answer([{"Host": n, "Score": 0} for n in body.get("NodeNames") or []])

    async def bind(raw: bytes) -> web.Response:
        b: dict[str, Any] = loads(raw)
        binding = {"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": b["PodName"], "namespace": b["PodNamespace"], "uid": b["PodUID"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": b["Node"]}}
        assert kube is not None
        try:
            await kube.create(PODS, binding, b["PodNamespace"], name=b["PodName"], subresource="binding")
        except Exception as exc:  # the scheduler retries the pod; the answer says why
            return answer({"Error": str(exc)[:300]})
        return answer({"Error": ""})

    placed: dict[str, int] = {}  # --one-node: pods narrowed so far, by label

    async def mutate(raw: bytes) -> web.Response:
        req = orjson.loads(raw)["request"]
        pod = req["object"]
        if args.floor == "gprs":
            label = ((pod.get("metadata") or {}).get("labels") or {}).get(GATE, "")
            nodes = team_nodes(label) if label else []
            if nodes and args.one_node:  # the next of its nodes in turn: 4 pods of each of the 2 teams a node
                k = placed[label] = placed.get(label, -1) + 1
                nodes = [nodes[k % TEAM_NODES]]
            ops = narrow_affinity((pod.get("spec") or {}).get("affinity"), nodes) if nodes else []
        else:
            ops = [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GATE}]}]
        response: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        if ops:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(orjson.dumps(ops)).decode()
        return answer({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})

    verbs: dict[str, Callable[[bytes], Awaitable[web.Response]]] = {
        "/scheduler/filter": filter_, "/scheduler/prioritize": prioritize, "/scheduler/bind": bind}
    if args.floor:
        verbs["/mutate-pods"] = mutate

    def http1(handler: Callable[[bytes], Awaitable[web.Response]]) -> Any:
        async def route(request: web.Request) -> web.Response:
            return await handler(await request.read())
        return route

    def http2(handler: Callable[[bytes], Awaitable[web.Response]]) -> Any:
        async def route(request: Request) -> web.Response:
            return await handler(request.body)
        return route

    app = web.Application(client_max_size=8 << 20)
    app.add_routes([web.post(path, http1(h)) for path, h in verbs.items()])
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.tls_cert_file, args.tls_key_file)
    h2 = Routes({("POST", path): http2(h) for path, h in verbs.items()}, max_body=8 << 20, body_timeout=10.0) \
        if args.floor else None
    if args.floor:
        await serve_app(app, "127.0.0.1", args.port, ssl_context=ctx, h2=h2)
    else:  # the baseline arms as they were measured
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port, ssl_context=ctx).start()
    # held here for as long as the process serves (the loop keeps only weak references to tasks)
    background = [asyncio.create_task(work) for work in (
        ungate_loop(args.ungate_kubeconfig) if args.floor == "auto" else None,
        pod_informer(args.kubeconfig) if args.pod_watch else None) if work is not None]
    print(json.dumps({"msg": "noop extender serving", "port": args.port, "bind": args.bind,
                      "floor": args.floor, "background": len(background)}), flush=True)
    await asyncio.Event().wait()


async def pod_informer(kubeconfig: str) -> None:
    """Every pod, listed then watched, each event decoded and kept by UID (deleted ones dropped)."""
    import orjson

    from kubeapi.client import from_config
    from kubeapi.resources import PODS

    kube = await from_config(kubeconfig, field_manager="noop-informer")
    store: dict[str, dict[str, Any]] = {}
    rv = ""
    print(json.dumps({"msg": "pod informer watching"}), flush=True)
    while True:
        try:
            if not rv:
                items, rv = await kube.list_raw(PODS)
                store = {}
                for item in items:
                    obj = orjson.loads(memoryview(item))  # type: ignore[arg-type]
                    store[str(obj["metadata"].get("uid"))] = obj
            async for kind, obj in kube.watch(PODS, resource_version=rv):
                meta = obj.get("metadata") or {}
                rv = str(meta.get("resourceVersion") or rv)
                if kind == "DELETED":
                    store.pop(str(meta.get("uid")), None)
                elif kind in ("ADDED", "MODIFIED"):
                    store[str(meta.get("uid"))] = obj
        except Exception as exc:  # an expired watch: list again
            print(json.dumps({"msg": "watch ended", "error": str(exc)[:200]}), flush=True)
            rv = ""
            await asyncio.sleep(0.5)


async def ungate_loop(kubeconfig: str) -> None:
    """Watch every pod; lift the gate of each gated one, narrowed to the next node (8 pods a node)."""
    from kubeapi.client import from_config
    from kubeapi.resources import PODS
    from scheduler_extender.objects.cluster import pod_view
    from scheduler_extender.objects.narrowing import ungate_patch

    kube = await from_config(kubeconfig, field_manager="noop-ungater")
    done: set[str] = set()
    running: set[asyncio.Task[None]] = set()
    slots = asyncio.Semaphore(32)
    count = 0

    async def lift(obj: dict[str, Any], node: str) -> None:
        async with slots:
            view = pod_view(obj, (GPU,))
            patch = ungate_patch(view, [node], GATE) if view is not None else None
            if patch is None:
                return
            meta = obj["metadata"]
            try:
                await kube.patch(PODS, meta["name"], patch, meta["namespace"], patch_type="json")
            except Exception as exc:  # a pod deleted meanwhile: nothing to lift
                print(json.dumps({"msg": "ungate failed", "pod": meta["name"], "error": str(exc)[:200]}), flush=True)

    rv = ""
    while True:
        try:
            if not rv:
                _, rv = await kube.list_raw(PODS)
            async for kind, obj in kube.watch(PODS, resource_version=rv):
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind not in ("ADDED", "MODIFIED"):
                    continue
                uid = str(obj["metadata"].get("uid"))
                gates = [g.get("name") for g in (obj.get("spec") or {}).get("schedulingGates") or []]
                if GATE in gates and uid not in done:
                    done.add(uid)
                    task = asyncio.create_task(lift(obj, node_name(count // PODS_A_NODE)))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    count += 1
        except Exception as exc:  # an expired watch: list again
            print(json.dumps({"msg": "watch ended", "error": str(exc)[:200]}), flush=True)
            rv = ""
            await asyncio.sleep(0.5)


def main() -> None:
    from service.flags import run_loop

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tls-cert-file", default="")
    p.add_argument("--tls-key-file", default="")
    p.add_argument("--bind", action="store_true", help="be a binder: create the Binding")
    p.add_argument("--kubeconfig", default="", help="credentials for the Binding (with --bind)")
    p.add_argument("--floor", choices=["", "gprs", "auto"], default="",
                   help="serve /mutate-pods too: narrow labelled pods (gprs) or gate them and lift the gate (auto)")
    p.add_argument("--one-node", action="store_true",
                   help="with --floor gprs: narrow each pod to one of its team's nodes (in turn), not all 25")
    p.add_argument("--ungate-kubeconfig", default="", help="credentials that may patch pods (with --floor auto)")
    p.add_argument("--pod-watch", action="store_true", help="keep an informer of every pod (with --kubeconfig)")
    p.add_argument("--watch-only", action="store_true", help="only keep an informer of every pod (with --kubeconfig)")
    args = p.parse_args()
    if args.watch_only:
        if not args.kubeconfig:
            p.error("--watch-only needs --kubeconfig")
        run_loop(pod_informer(args.kubeconfig))
        return
    if not (args.port and args.tls_cert_file and args.tls_key_file):
        p.error("--port, --tls-cert-file and --tls-key-file are required (unless --watch-only)")
    if args.pod_watch and not args.kubeconfig:
        p.error("--pod-watch needs --kubeconfig")
    if args.floor == "auto" and not args.ungate_kubeconfig:
        p.error("--floor auto needs --ungate-kubeconfig")
    run_loop(serve(args))


if __name__ == "__main__":
    main()
