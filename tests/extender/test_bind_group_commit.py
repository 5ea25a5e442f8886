"""Binds to one node that arrive while its ledger patch is in flight are decided together and written in the
next patch (group commit): each sees the ones before it, so the node is never over-allocated, and none waits for
the others' round trips one by one."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from scheduler_extender.objects import ledger
from scheduler_extender.objects.ledger import LEDGER_ANNOTATION
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import node, pod, stack

PODS, GPUS = 12, 8


async def test_binds_waiting_on_a_patch_share_the_next_one_and_never_over_allocate() -> None:
    peer = APIServerPeer()
    await peer.start()
    await peer.put_object("api/v1/nodes", node("n0", gpus=GPUS))
    for i in range(PODS):
        await peer.put_object("api/v1/pods", pod(f"p{i:02d}", 1, uid=f"uid-{i:02d}"))
    async with stack(peer) as (_, ext):
        binder = ext.binder
        held = asyncio.Event()

        async def hold_first_patch(_request: web.Request) -> None:
            # the first ledger patch answers only once every other bind waits behind it (ordering, not time)
            held.set()
            while len(binder._waiting.get("n0", [])) < PODS - 1:
                await asyncio.sleep(0.01)

        first = peer.inject("PATCH", "nodes", name="n0", respond=hold_first_patch, times=1)
        patches = peer.inject("PATCH", "nodes", name="n0", respond=lambda _r: None)

        async def bind(http: aiohttp.ClientSession, i: int) -> str:
            body = json.dumps({"PodName": f"p{i:02d}", "PodNamespace": "default", "PodUID": f"uid-{i:02d}",
                               "Node": "n0"})
            async with http.post(f"http://127.0.0.1:{ext.port}/scheduler/bind", data=body) as r:
                return str((await r.json())["Error"])

        async with aiohttp.ClientSession() as http:
            one = asyncio.create_task(bind(http, 0))
            await held.wait()
            rest = asyncio.gather(*(bind(http, i) for i in range(1, PODS)))
            answers = [await one, *await rest]
    assert first.hits == 1
    assert patches.hits == 1, "the eleven binds that waited were written in one patch"
    assert binder.patches == 2 and binder.recorded == GPUS
    bound = [i for i, error in enumerate(answers) if not error]
    refused = [error for error in answers if error]
    assert len(bound) == GPUS and len(refused) == PODS - GPUS
    assert all("0 nvidia.com/gpu free, pod asks 1" in error for error in refused), refused
    node_obj = peer.get("api/v1/nodes", "", "n0")
    assert node_obj is not None
    entries = ledger.parse(node_obj["metadata"]["annotations"][LEDGER_ANNOTATION])
    assert sorted(entries) == sorted(f"uid-{i:02d}" for i in bound)
    assert sorted(peer.bindings) == sorted(("default", f"p{i:02d}", "n0") for i in bound)
    await peer.stop()
