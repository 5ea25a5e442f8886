"""Informers resume watches from the last resourceVersion and relist after 410 Gone."""

from __future__ import annotations

import asyncio
from typing import Any

from kubeapi.client import connected
from kubeapi.informer import Informer
from kubeapi.resources import NODES
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import node, wait_until


async def test_resume_then_relist_after_410() -> None:
    peer = APIServerPeer()
    await peer.start()
    await peer.put_object("api/v1/nodes", node("a"))
    kube_cm = connected(peer.url, field_manager="test")
    kube = await kube_cm.__aenter__()
    state: dict[str, dict[str, Any]] = {}
    events: list[str] = []

    def on_event(kind: str, obj: dict[str, Any]) -> None:
        events.append(kind)
        if kind == "DELETED":
            state.pop(obj["metadata"]["name"], None)
        else:
            state[obj["metadata"]["name"]] = obj

    def on_sync(items: list[dict[str, Any]]) -> None:
        state.clear()
        state.update({o["metadata"]["name"]: o for o in items})

    informer = Informer(kube, NODES, on_event, on_sync, watch_timeout=(1, 1), backoff=(0.05, 0.1))
    stop = asyncio.Event()
    task = asyncio.create_task(informer.run(stop))
    try:
        await informer.synced.wait()
        assert set(state) == {"a"} and informer.relists == 1
        await peer.put_object("api/v1/nodes", node("b"))
        await wait_until(lambda: "b" in state)
        await asyncio.sleep(1.3)  # the server ends the watch; the informer resumes from its resourceVersion
        watches = [q for m, q in peer.requests if "watch=true" in q]
        assert len(watches) >= 2 and f"resourceVersion={informer.resource_version}" in watches[-1]
        assert informer.relists == 1
        # history compacted: the open watch ends with 410, the resume from the old version gets 410 too, and
        # the informer relists; changes made meanwhile are not lost
        peer.compact()
        await peer.delete_object("api/v1/nodes", "", "a")
        await peer.put_object("api/v1/nodes", node("c"))
        await wait_until(lambda: informer.relists == 2, timeout=5)
        await peer.put_object("api/v1/nodes", node("d"))
        await wait_until(lambda: set(state) == {"b", "c", "d"}, timeout=5)
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube_cm.__aexit__(None, None, None)
        await peer.stop()
