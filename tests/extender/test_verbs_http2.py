"""HTTP/2 on the verbs' listener (service/h2_server.py), offered with ``--scheduler-http2`` (for a profile that names
bindVerb): kube-scheduler's client offers ``h2`` and then sends every verb on one connection, where over HTTP/1.1 it
opened a new TLS connection for nearly every bind (878 for 2,000 pods in the benchmark). The same answers, the
same client-certificate check, the same bounds as HTTP/1.1; a replica that is not the binder ends the connection
after its 503, so the client's next request is routed anew. Without the flag (the shipped profile: the filter
alone, one pod at a time) only HTTP/1.1 is offered, and connections are counted all the same."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.events
import pytest
from kubernetes_asyncio import client

from kubeapi import KubeClient
from scheduler_extender.cmd.server import ExtenderServer
from scheduler_extender.objects.kube import Kube
from service.h2_server import CONNECTIONS
from service.http_listener import Limits
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import node, pod, wait_until
from tests.realcluster.controlplane import PKI

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")
Run = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a test's body on the process's loop (uvloop: its TLS transport is no asyncio.Transport) and on
    asyncio's own."""
    import uvloop

    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def run(body: Coroutine[Any, Any, None]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(body)
    return run


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def certs(pki: PKI) -> dict[str, tuple[Path, Path]]:
    return {"serving": pki.issue("serving", "/CN=accelstack-extender", sans="IP:127.0.0.1"),
            "scheduler": pki.issue("scheduler", "/CN=accelstack-scheduler", client=True),
            "stranger": pki.issue("stranger", "/CN=someone-else", client=True)}


@contextlib.asynccontextmanager
async def verbs_stack(pki: PKI, certs: dict[str, tuple[Path, Path]], *, max_body: int = 4 * 1024 * 1024,
                      body_timeout: float = 10.0, limits: Limits | None = None, http2: bool | None = True
                      ) -> AsyncIterator[tuple[APIServerPeer, ExtenderServer]]:
    """The extender with its verbs on a listener of their own (the scheduler's CA and name), HTTP/2 offered
    (``http2``; None: the server's default)."""
    peer = APIServerPeer()
    await peer.start()
    api = client.ApiClient(client.Configuration(host=peer.url))
    kube = Kube(KubeClient(api, field_manager="accelstack-extender"))
    shared: dict[str, Any] = {"max_body": max_body, "run_controller": False, "verbs_apart": True,
                              "verbs_clients": ("accelstack-scheduler",), "body_timeout": body_timeout,
                              "limits": limits}
    server = ExtenderServer(kube, **shared) if http2 is None else ExtenderServer(kube, **shared, verbs_http2=http2)
    serving = certs["serving"]
    verbs_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_crt))
    verbs_ctx.verify_mode = ssl.CERT_REQUIRED
    verbs_ctx.load_cert_chain(str(serving[0]), str(serving[1]))
    await server.start(verbs_ssl=verbs_ctx)
    try:
        await peer.put_object("api/v1/nodes", node("gpu-node-1", gpus=2))
        await peer.put_object("api/v1/pods", pod("gpu", 1, uid="uid-gpu"))
        await wait_until(lambda: "uid-gpu" in server.view.pods and "gpu-node-1" in server.view.nodes)
        yield peer, server
    finally:
        await server.stop()
        await api.close()
        await peer.stop()


class H2Client:
    """One HTTP/2 connection as Go's client makes it (TLS, ALPN ``h2``, a client certificate)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.answers: dict[int, dict[str, Any]] = {}
        self.goaway = False
        self.pending = b""  # bytes of a frame not whole yet

    @classmethod
    async def connect(cls, port: int, pki: PKI, cert: tuple[Path, Path]) -> H2Client:
        ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        self = cls(reader, writer)
        self.conn.initiate_connection()
        await self.flush()
        return self

    async def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def send(self, path: str, body: bytes, *, method: str = "POST", end: bool = True,
                   length: int | None = None) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", method), (":path", path), (":scheme", "https"),
                                     (":authority", "127.0.0.1"), ("content-type", "application/json"),
                                     ("content-length", str(len(body) if length is None else length))],
                               end_stream=end and not body)
        if body:
            self.conn.send_data(sid, body, end_stream=end)
        await self.flush()
        return sid

    async def read(self, streams: set[int], timeout: float = 10.0) -> None:
        """Until every stream of ``streams`` is answered whole (or reset), or the connection ends."""
        async with asyncio.timeout(timeout):
            while not all(s in self.answers and self.answers[s].get("done") for s in streams):
                data = await self.reader.read(65536)
                if not data:
                    return
                for event in self.conn.receive_data(self._without_goaway(data)):
                    sid = getattr(event, "stream_id", 0)
                    if isinstance(event, h2.events.ResponseReceived):
                        headers = {_str(k): _str(v) for k, v in event.headers or ()}
                        self.answers[sid] = {"status": int(headers[":status"]), "body": b"", "headers": headers}
                    elif isinstance(event, h2.events.DataReceived):
                        self.answers[sid]["body"] += event.data
                        self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
                    elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                        self.answers.setdefault(sid, {"status": 0, "body": b""})["done"] = True
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        self.goaway = True
                await self.flush()

    def json(self, sid: int) -> tuple[int, Any]:
        answer = self.answers[sid]
        return answer["status"], json.loads(answer["body"])

    def _without_goaway(self, data: bytes) -> bytes:
        """``data`` without GOAWAY frames, which are noted: as Go's client does, the streams the GOAWAY lets finish
        are still read (the ``h2`` library would close its state machine at once)."""
        buf, out = self.pending + data, b""
        while len(buf) >= 9:
            size = int.from_bytes(buf[:3], "big") + 9
            if len(buf) < size:
                break
            if buf[3] == 0x7:
                self.goaway = True
            else:
                out += buf[:size]
            buf = buf[size:]
        self.pending = buf
        return out

    async def bind(self) -> tuple[int, Any]:
        """A bind of the test pod on a stream of its own: (status, answer)."""
        sid = await self.send("/scheduler/bind", bind_body())
        await self.read({sid})
        return self.json(sid)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def filter_body(names: list[str]) -> bytes:
    return json.dumps({"Pod": pod("gpu", 1, uid="uid-gpu"), "NodeNames": names}).encode()


def bind_body(name: str = "gpu", uid: str = "uid-gpu", node_name: str = "gpu-node-1") -> bytes:
    return json.dumps({"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node_name}).encode()


def h2_connections(protocol: str = "h2") -> float:
    return CONNECTIONS.labels(protocol)._value.get()


def test_by_default_only_http1_is_offered_and_one_connection_carries_every_verb(
        pki: PKI, certs: dict[str, tuple[Path, Path]], run: Run) -> None:
    """The shipped default: a client that offers ``h2`` first (as kube-scheduler's does) settles on HTTP/1.1, and
    verbs sent one at a time (the scheduling cycle's filter) all go over the one kept-alive connection, counted
    as ``http/1.1``; a replica that is no longer the binder answers 503 and closes it."""
    async def body() -> None:
        async with verbs_stack(pki, certs, http2=None) as (_, server):
            before = {p: h2_connections(p) for p in ("h2", "http/1.1")}
            ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
            ctx.load_cert_chain(*(str(p) for p in certs["scheduler"]))
            ctx.set_alpn_protocols(["h2", "http/1.1"])
            reader, writer = await asyncio.open_connection("127.0.0.1", server.verbs_port, ssl=ctx)
            try:
                assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
                request = filter_body(["gpu-node-1", "cpu-only"])
                for _ in range(5):  # one after another on the same connection
                    writer.write(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(request)).encode() + b"\r\n\r\n" + request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                                      if ln.lower().startswith(b"content-length:")))
                    answer = json.loads(await reader.readexactly(length))
                    assert answer["NodeNames"] == ["gpu-node-1"], answer
                # another replica takes the binder Lease: this one answers 503 and ends the connection, so the
                # client's next connection is routed anew (to the binder)
                server.binding = False
                writer.write(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(request)).encode() + b"\r\n\r\n" + request)
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower(), head
                length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                                  if ln.lower().startswith(b"content-length:")))
                assert "not the active binder" in json.loads(await reader.readexactly(length))["Error"]
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
            finally:
                writer.close()
            assert h2_connections("http/1.1") - before["http/1.1"] == 1
            assert h2_connections("h2") == before["h2"]

    run(body())


def test_every_verb_on_one_connection_answers_as_over_http1(
        pki: PKI, certs: dict[str, tuple[Path, Path]], run: Run) -> None:
    async def body() -> None:
        async with verbs_stack(pki, certs) as (peer, server):
            before = h2_connections()
            c = await H2Client.connect(server.verbs_port, pki, certs["scheduler"])
            try:
                # filters for several pods at once, and the health endpoints, multiplexed on the one connection
                sids = [await c.send("/scheduler/filter", filter_body(["gpu-node-1", "cpu-only"])) for _ in range(8)]
                health = await c.send("/readyz", b"", method="GET")
                await c.read({*sids, health})
                over_h2 = [c.json(s) for s in sids]
                assert over_h2[0][0] == 200 and over_h2[0][1]["NodeNames"] == ["gpu-node-1"]
                assert all(a == over_h2[0] for a in over_h2)
                assert (c.answers[health]["status"], c.answers[health]["body"]) == (200, b"ok\n")
                # the same answer over HTTP/1.1 (aiohttp's client offers no h2)
                ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
                ctx.load_cert_chain(*(str(p) for p in certs["scheduler"]))
                async with aiohttp.ClientSession() as http, http.post(
                        f"https://127.0.0.1:{server.verbs_port}/scheduler/filter",
                        data=filter_body(["gpu-node-1", "cpu-only"]), ssl=ctx) as r:
                    assert (r.status, await r.json()) == over_h2[0]
                sid = await c.send("/scheduler/bind", bind_body())
                await c.read({sid})
                assert c.json(sid) == (200, {"Error": ""})
                assert peer.bindings == [("default", "gpu", "gpu-node-1")]
                # malformed JSON: the verb's Error, as over HTTP/1.1; an unknown path 404; the connection lives on
                bad, unknown = await c.send("/scheduler/bind", b"{"), await c.send("/nope", b"", method="GET")
                await c.read({bad, unknown})
                status, answer = c.json(bad)
                assert status == 400 and "malformed request" in answer["Error"]
                assert c.answers[unknown]["status"] == 404 and not c.goaway
            finally:
                await c.close()
            assert h2_connections() - before == 1

    run(body())


def test_the_client_certificate_check_holds_over_http2(
        pki: PKI, certs: dict[str, tuple[Path, Path]], run: Run) -> None:
    async def body() -> None:
        async with verbs_stack(pki, certs) as (peer, server):
            c = await H2Client.connect(server.verbs_port, pki, certs["stranger"])
            try:
                status, answer = await c.bind()
                assert status == 403 and "not allowed" in answer["Error"]
            finally:
                await c.close()
            assert peer.bindings == []

    run(body())


def test_a_replica_that_is_not_the_binder_answers_503_and_ends_the_connection(
        pki: PKI, certs: dict[str, tuple[Path, Path]], run: Run) -> None:
    async def body() -> None:
        async with verbs_stack(pki, certs) as (peer, server):
            server.binding = False  # another replica holds the binder Lease
            c = await H2Client.connect(server.verbs_port, pki, certs["scheduler"])
            try:
                status, answer = await c.bind()
                assert status == 503 and "not the active binder" in answer["Error"]
                await c.read({3}, timeout=5)  # nothing more comes: the GOAWAY, then the connection closes
                assert c.goaway
            finally:
                await c.close()
            assert peer.bindings == []

    run(body())


def test_http2_keeps_the_listener_bounds(pki: PKI, certs: dict[str, tuple[Path, Path]],
                                               caplog: pytest.LogCaptureFixture, run: Run) -> None:
    """A body over the limit (413), one that never ends (408), a silent connection (closed), a connection that
    breaks the protocol (closed, one line that quotes nothing it sent)."""
    async def body() -> None:
        caplog.set_level(logging.INFO)
        limits = Limits(header_timeout=0.5, idle_timeout=60)
        async with verbs_stack(pki, certs, max_body=1024, body_timeout=0.5, limits=limits) as (peer, server):
            c = await H2Client.connect(server.verbs_port, pki, certs["scheduler"])
            try:
                big = await c.send("/scheduler/filter", b"x" * 10, length=5000, end=False)
                slow = await c.send("/scheduler/filter", b'{"Pod":', end=False)
                await c.read({big, slow})
                assert c.answers[big]["status"] == 413 and b"size limit" in c.answers[big]["body"]
                assert c.answers[slow]["status"] == 408
                ok = await c.send("/scheduler/filter", filter_body(["gpu-node-1"]))  # the connection still serves
                await c.read({ok})
                assert c.json(ok)[0] == 200
            finally:
                await c.close()
            silent = await H2Client.connect(server.verbs_port, pki, certs["scheduler"])  # sends its preface, no request
            try:
                await silent.read({1}, timeout=5)
                assert silent.goaway and silent.reader.at_eof()
            finally:
                await silent.close()
            rude = await H2Client.connect(server.verbs_port, pki, certs["scheduler"])
            try:
                # a HEADERS frame on stream 1 whose header block is not HPACK: a compression error, the connection ends
                rude.writer.write(b"\x00\x00\x12\x01\x04\x00\x00\x00\x01SECRET-TOKEN-VALUE")
                await rude.read({1}, timeout=5)
                assert rude.reader.at_eof()
            finally:
                await rude.close()
            assert peer.bindings == []
        assert any("malformed HTTP/2 connection closed" in r.getMessage() for r in caplog.records)
        assert not any("SECRET-TOKEN-VALUE" in (r.getMessage() + str(r.__dict__)) for r in caplog.records)


    run(body())


def test_stopping_sends_goaway_and_answers_the_request_in_progress(
        pki: PKI, certs: dict[str, tuple[Path, Path]], run: Run) -> None:
    """SIGTERM (the server stopping, a rollout): the scheduler's connection gets a GOAWAY at once, so its next
    requests go to a replica that still serves, and the request it is sending is answered before the close."""
    async def body() -> None:
        async with verbs_stack(pki, certs) as (_, server):
            c = await H2Client.connect(server.verbs_port, pki, certs["scheduler"])
            try:
                whole = filter_body(["gpu-node-1"])
                sid = await c.send("/scheduler/filter", whole[:20], end=False, length=len(whole))
                stopping = asyncio.create_task(server.stop())
                await asyncio.sleep(0.3)
                assert not stopping.done()  # waiting for the request in progress
                c.conn.send_data(sid, whole[20:], end_stream=True)
                await c.flush()
                await c.read({sid})
                assert c.goaway and c.json(sid)[0] == 200
                await c.read({sid + 2}, timeout=5)
                assert c.reader.at_eof()
                await asyncio.wait_for(stopping, 10)
            finally:
                await c.close()

    run(body())
