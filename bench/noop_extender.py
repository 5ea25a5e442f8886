"""The do-nothing extender the control-plane benchmark measures accelstack against, inside the real kube-scheduler.

Same HTTP stack as the product's extender (aiohttp on uvloop, HTTPS with a certificate the scheduler's profile
trusts): ``filter`` passes every node it is sent, ``prioritize`` scores all equal, and with ``--bind`` it is a
binder that creates the pod's Binding itself (one API call, with the credentials of ``--kubeconfig``), as
accelstack's extender does. No state, no checks: the floor an extender sets on the real scheduler's pace.

Usage: python bench/noop_extender.py --port P --tls-cert-file C --tls-key-file K [--bind --kubeconfig F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from kubeapi.client import from_config
    from kubeapi.resources import PODS

    kube = await from_config(args.kubeconfig, field_manager="noop-extender") if args.bind else None

    async def filter_(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"NodeNames": body.get("NodeNames"), "FailedNodes": {}, "Error": ""})

    async def prioritize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response([{"Host": n, "Score": 0} for n in body.get("NodeNames") or []])

    async def bind(request: web.Request) -> web.Response:
        b: dict[str, Any] = await request.json()
        binding = {"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": b["PodName"], "namespace": b["PodNamespace"], "uid": b["PodUID"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": b["Node"]}}
        assert kube is not None
        try:
            await kube.create(PODS, binding, b["PodNamespace"], name=b["PodName"], subresource="binding")
        except Exception as exc:  # the scheduler retries the pod; the answer says why
            return web.json_response({"Error": str(exc)[:300]})
        return web.json_response({"Error": ""})

    app = web.Application(client_max_size=8 << 20)
    app.add_routes([web.post("/scheduler/filter", filter_), web.post("/scheduler/prioritize", prioritize),
                    web.post("/scheduler/bind", bind)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.tls_cert_file, args.tls_key_file)
    await web.TCPSite(runner, "127.0.0.1", args.port, ssl_context=ctx).start()
    print(json.dumps({"msg": "noop extender serving", "port": args.port, "bind": args.bind}), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    from service.flags import run_loop

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tls-cert-file", required=True)
    p.add_argument("--tls-key-file", required=True)
    p.add_argument("--bind", action="store_true", help="be a binder: create the Binding")
    p.add_argument("--kubeconfig", default="", help="credentials for the Binding (with --bind)")
    run_loop(serve(p.parse_args()))


if __name__ == "__main__":
    main()
