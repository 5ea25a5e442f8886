"""Who may call the scheduler verbs (issue 36.2): on their own listener only a client certificate the scheduler's
CA signed, with the scheduler's common name, gets a TLS session and an answer; the main listener (webhooks, REST
API) no longer serves them; and bind refuses a pod that is not accelstack's to decide, whoever asks."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from kubeapi import KubeClient
from scheduler_extender.cmd.server import ExtenderServer
from scheduler_extender.objects.kube import Kube
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import node, pod, stack, wait_until
from tests.realcluster.controlplane import PKI

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")


def plain_pod(name: str, uid: str, gpr: str = "") -> dict[str, Any]:
    """A pod that requests no managed resource (CPU only)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": "default", "uid": uid, "labels": {"accelstack.io/gpr": gpr} if gpr else {}},
        "spec": {"containers": [{"name": "c", "image": "pause", "resources": {"requests": {"cpu": "1"}}}]},
        "status": {"phase": "Pending"}}


def bind_body(name: str, uid: str, node_name: str = "gpu-node-1") -> bytes:
    return json.dumps({"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node_name}).encode()


async def test_bind_refuses_a_pod_that_requests_no_managed_resource_and_has_no_gpr() -> None:
    """The hole the security test found: an anonymous bind of a plain pod was bound with the extender's right.
    A pod of a GPR that asks for no device, and a managed pod, still bind."""
    async with stack() as (peer, server):
        for obj in (node("gpu-node-1", gpus=2), plain_pod("plain", "uid-plain"), plain_pod("side", "uid-side", "g"),
                    pod("gpu", 1, uid="uid-gpu")):
            await peer.put_object("api/v1/nodes" if obj["kind"] == "Node" else "api/v1/pods", obj)
        await wait_until(lambda: "uid-gpu" in server.view.pods and "gpu-node-1" in server.view.nodes)
        async with aiohttp.ClientSession() as http:
            async def bind(name: str, uid: str) -> dict[str, Any]:
                async with http.post(f"http://127.0.0.1:{server.port}/scheduler/bind",
                                     data=bind_body(name, uid)) as r:
                    assert r.status == 200
                    return dict(await r.json())

            refused = await bind("plain", "uid-plain")
            assert "requests no resource accelstack manages" in refused["Error"]
            assert "belongs to no GPR" in refused["Error"]
            assert peer.bindings == []
            assert await bind("side", "uid-side") == {"Error": ""}
            assert await bind("gpu", "uid-gpu") == {"Error": ""}
        assert sorted(peer.bindings) == [("default", "gpu", "gpu-node-1"), ("default", "side", "gpu-node-1")]


async def test_bind_refuses_names_longer_than_kubernetes_allows_without_logging_them(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    huge = "n" * (3 * 1024 * 1024)
    async with stack() as (_, server), aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{server.port}/scheduler/bind", data=bind_body("p", "uid-p", huge)) as r:
        assert r.status == 400
        answer = await r.json()
    assert "Node is 3145728 characters, over the 253" in answer["Error"] and len(answer["Error"]) < 300
    assert all(len(rec.getMessage()) + sum(len(str(v)) for v in rec.__dict__.values()) < 20_000
               for rec in caplog.records)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def tls_stack(main_ctx: ssl.SSLContext, verbs_ctx: ssl.SSLContext
                    ) -> AsyncIterator[tuple[APIServerPeer, ExtenderServer]]:
    """The extender as the shipped Deployment runs it: the verbs on a listener of their own that requires a client
    certificate of the scheduler's CA and common name."""
    peer = APIServerPeer()
    await peer.start()
    api = client.ApiClient(client.Configuration(host=peer.url))
    server = ExtenderServer(Kube(KubeClient(api, field_manager="accelstack-extender")), run_controller=False,
                            verbs_apart=True, verbs_clients=("accelstack-scheduler",))
    await server.start(ssl_context=main_ctx, verbs_ssl=verbs_ctx)
    try:
        yield peer, server
    finally:
        await server.stop()
        await api.close()
        await peer.stop()


def client_context(pki: PKI, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


async def test_verbs_apart_take_only_the_schedulers_client_certificate(pki: PKI) -> None:
    serving = pki.issue("serving", "/CN=accelstack-extender", sans="IP:127.0.0.1")
    scheduler = pki.issue("scheduler", "/CN=accelstack-scheduler", client=True)
    stranger = pki.issue("stranger", "/CN=someone-else", client=True)
    main_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    main_ctx.load_cert_chain(str(serving[0]), str(serving[1]))
    verbs_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_crt))
    verbs_ctx.verify_mode = ssl.CERT_REQUIRED
    verbs_ctx.load_cert_chain(str(serving[0]), str(serving[1]))
    async with tls_stack(main_ctx, verbs_ctx) as (peer, server):
        await peer.put_object("api/v1/nodes", node("gpu-node-1", gpus=2))
        await peer.put_object("api/v1/pods", pod("gpu", 1, uid="uid-gpu"))
        await wait_until(lambda: "uid-gpu" in server.view.pods and "gpu-node-1" in server.view.nodes)
        verbs = f"https://127.0.0.1:{server.verbs_port}/scheduler/bind"
        async with aiohttp.ClientSession() as http:
            # the main listener: the verbs are not there
            async with http.post(f"https://127.0.0.1:{server.port}/scheduler/bind", data=bind_body("gpu", "uid-gpu"),
                                 ssl=client_context(pki, None)) as r:
                assert r.status == 404
            # no certificate: no TLS session, no answer
            with pytest.raises(aiohttp.ClientError):
                async with http.post(verbs, data=bind_body("gpu", "uid-gpu"), ssl=client_context(pki, None)) as r:
                    await r.read()
            # the CA's certificate, another name: 403
            async with http.post(verbs, data=bind_body("gpu", "uid-gpu"), ssl=client_context(pki, stranger)) as r:
                assert r.status == 403 and "not allowed" in (await r.json())["Error"]
            assert peer.bindings == []
            async with http.post(verbs, data=bind_body("gpu", "uid-gpu"), ssl=client_context(pki, scheduler)) as r:
                assert (r.status, await r.json()) == (200, {"Error": ""})
        assert peer.bindings == [("default", "gpu", "gpu-node-1")]
