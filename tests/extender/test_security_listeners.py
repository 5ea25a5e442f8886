"""The extender's and the controller's listeners under raw hostile bytes on loopback (issue 36.3, 36.5, 36.8):

- a request aiohttp cannot parse (bare-LF line endings, a header value ending in ``\\x7f``) gets the fixed 400
  body, never its own bytes back (an ``Authorization`` value included), and one log line without header values
  and without a traceback;
- no answer names Python's or aiohttp's version (``Server: accelstack``);
- a connection that sends nothing, or drips its request head a byte at a time, is closed once the header timeout
  passes (aiohttp alone keeps both for its hour-long keep-alive timeout);
- a fuzz of malformed request heads and bodies (seeded, bounded in count) never gets a 5xx or a traceback and
  leaves both listeners answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from kubeapi import KubeClient
from scheduler_extender.cmd.controller import ControllerProcess, parse
from scheduler_extender.objects.kube import Kube
from service.http_listener import BAD_REQUEST_BODY, Limits
from tests.extender.harness import stack

SECRET = "s3cr3t-t0ken-do-not-echo"
HEADER_TIMEOUT = 0.5
LIMITS = Limits(header_timeout=HEADER_TIMEOUT, idle_timeout=1.0)
# generous: the bound under test is HEADER_TIMEOUT; without one aiohttp keeps a connection for 3,630 s
CLOSED_WITHIN = 30.0
SEED = int(os.environ.get("ACCELSTACK_FUZZ_SEED", "20261203"))
FUZZ_CASES = int(os.environ.get("ACCELSTACK_FUZZ_LISTENER_CASES", "60"))  # per listener; raise it to soak


@contextlib.asynccontextmanager
async def listeners() -> AsyncIterator[dict[str, int]]:
    """The extender (verbs, REST API, health on one listener) and the controller's health/metrics listener, both
    with the short header timeout, on loopback: {name: port}."""
    async with stack(limits=LIMITS) as (peer, server):
        api = client.ApiClient(client.Configuration(host=peer.url))
        opts = parse(["--listen", "127.0.0.1:0", "--header-timeout", str(HEADER_TIMEOUT), "--idle-timeout", "1",
                      "--lease-namespace", "accelstack-system"], environ={})
        process = ControllerProcess(Kube(KubeClient(api, field_manager="accelstack-gpr-controller")), opts)
        await process.start("127.0.0.1", 0)
        try:
            yield {"extender": server.port, "controller": process.port}
        finally:
            await process.stop()
            await api.close()


async def exchange(port: int, data: bytes, wait: float = CLOSED_WITHIN) -> bytes:
    """What the listener answers to ``data`` until it closes the connection (at most ``wait`` seconds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(wait):
            while chunk := await reader.read(65536):
                out += chunk
        return out
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


MALFORMED = {
    "bare-LF": f"GET /healthz HTTP/1.1\nHost: x\nAuthorization: Bearer {SECRET}\n\n".encode(),
    "DEL at header end": f"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\x7f\r\n\r\n".encode(),
    "DEL in header name": f"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\nX\x7f: 1\r\n\r\n"
                          .encode(),
}


def no_secret_in_logs(records: list[logging.LogRecord]) -> None:
    for rec in records:
        text = rec.getMessage() + " ".join(str(v) for v in rec.__dict__.values())
        assert SECRET not in text, f"secret logged by {rec.name}: {rec.getMessage()}"
        assert not (rec.name.startswith("aiohttp") and rec.exc_info), f"traceback from {rec.name}"


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_request_gets_a_fixed_400_and_one_quiet_log_line(case: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with listeners() as ports:
        for name, port in ports.items():
            caplog.clear()
            answer = await exchange(port, MALFORMED[case])
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.split(b" ", 2)[1] == b"400", (name, answer[:200])
            assert body == BAD_REQUEST_BODY.encode(), (name, body[:200])
            assert SECRET.encode() not in answer
            assert b"aiohttp" not in answer.lower() and b"python" not in answer.lower()
            no_secret_in_logs(caplog.records)
            refused = [r for r in caplog.records if r.getMessage() == "malformed HTTP request refused"]
            assert len(refused) == 1 and refused[0].levelno == logging.WARNING, name
            assert not any(r.exc_info for r in caplog.records), name


async def test_answers_name_no_python_or_aiohttp_version() -> None:
    async with listeners() as ports:
        for name, port in ports.items():
            answer = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = answer.partition(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"http/1.1 200"), (name, answer[:200])
            assert b"\r\nserver: accelstack" in head and b"aiohttp" not in head and b"python" not in head, name


async def test_a_silent_connection_is_closed_after_the_header_timeout() -> None:
    async with listeners() as ports:
        for name, port in ports.items():
            assert await exchange(port, b"") == b"", name  # closed without an answer (TimeoutError if not)


async def test_a_dripping_request_head_is_closed_after_the_header_timeout() -> None:
    async with listeners() as ports:
        for name, port in ports.items():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 10_000
            sent = 0
            try:
                async with asyncio.timeout(CLOSED_WITHIN):
                    closed = asyncio.ensure_future(reader.read())
                    while not closed.done() and sent < len(head):
                        writer.write(head[sent:sent + 1])
                        sent += 1
                        await asyncio.sleep(HEADER_TIMEOUT / 10)
                    assert await closed == b"", name
            finally:
                writer.close()
            # it was the head's bound that closed it, not the end of the head: the head was never finished
            assert sent < len(head), name


async def test_a_prompt_request_on_a_kept_alive_connection_is_answered() -> None:
    """The head's clock starts at the next request's first byte, not at the end of the last answer."""
    async with listeners() as ports:
        for name, port in ports.items():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                for _ in range(2):
                    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    await writer.drain()
                    status = await asyncio.wait_for(reader.readline(), CLOSED_WITHIN)
                    assert status.startswith(b"HTTP/1.1 200"), name
                    while await reader.readline() not in (b"\r\n", b""):
                        pass
                    await reader.readexactly(3)  # "ok\n"
                    await asyncio.sleep(HEADER_TIMEOUT * 1.5)  # idle, within the idle timeout
            finally:
                writer.close()


def fuzz_case(rng: random.Random) -> bytes:
    """A request head (and maybe body) with one or more of the faults hostile clients send."""
    method = rng.choice([b"GET", b"POST", b"PUT", b"G\x00T", b"\x16\x03\x01", b"GET GET", b"PRI"])
    path = rng.choice([b"/healthz", b"/scheduler/bind", b"/scheduler/filter", b"/api/v1/waittime", b"/metrics",
                       b"/" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))), b"*", b"/%zz"])
    version = rng.choice([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b"HTTP/1.1 x", b""])
    eol = rng.choice([b"\r\n", b"\n", b"\r", b"\r\r\n"])
    headers = [b"Host: x", f"Authorization: Bearer {SECRET}".encode()]
    for _ in range(rng.randrange(0, 4)):
        headers.append(rng.choice([
            b"Content-Length: " + rng.choice([b"-1", b"99999999999999999999", b"abc", b"5, 6", b"10"]),
            b"Transfer-Encoding: " + rng.choice([b"chunked", b"gzip, chunked", b"xchunked", b"chunked\x7f"]),
            b"X-Long: " + b"y" * rng.choice([100, 9000, 70000]),
            b"Bad Header: 1", b": empty-name", b"X-Ctl: a\x01b", b"X-Del: v\x7f",
            b"Content-Type: application/json"]))
    body = rng.choice([b"", b"{", b"0\r\n\r\n", b"zz\r\nabc\r\n0\r\n\r\n", b'{"Pod": 1}', bytes(range(256))])
    return method + b" " + path + b" " + version + eol + eol.join(headers) + eol + eol + body


async def test_fuzzed_request_heads_never_get_a_5xx_or_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    rng = random.Random(SEED)
    async with listeners() as ports:
        for name, port in ports.items():
            for i in range(FUZZ_CASES):
                data = fuzz_case(rng)
                answer = await exchange(port, data)
                assert SECRET.encode() not in answer, (name, i, data[:120])
                if answer:
                    status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b""
                    assert status[:1] in (b"2", b"3", b"4"), (name, i, data[:120], answer[:200])
                    assert b"aiohttp" not in answer.lower(), (name, i)
            # still serving
            ok = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert ok.startswith(b"HTTP/1.1 200"), name
    no_secret_in_logs(caplog.records)
    tracebacks = [r for r in caplog.records if r.exc_info and r.levelno >= logging.ERROR]
    assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks[:3]]


async def test_tls_listeners_issue_no_session_tickets_and_the_verbs_require_a_client_certificate(
        tmp_path: Path) -> None:
    """``server_tls``: no TLS 1.3 session tickets (their clients never resume; each ticket cost CPU on every
    handshake), and with a client CA no session without a certificate from it."""
    import socket
    import ssl
    import subprocess

    from aiohttp import web

    from service.http_listener import serve_app, server_tls

    folder = tmp_path

    def pair(name: str, cn: str) -> tuple[str, str]:
        key, crt = folder / f"{name}.key", folder / f"{name}.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "1", "-subj", f"/CN={cn}",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        return str(crt), str(key)

    server_crt, server_key = pair("server", "server")
    client_crt, client_key = pair("client", "accelstack-scheduler")
    app = web.Application()

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/", hello)
    runner, port = await serve_app(app, "127.0.0.1", 0, ssl_context=server_tls(server_crt, server_key,
                                                                               client_ca=client_crt))

    def call(with_cert: bool) -> bool:
        ctx = ssl.create_default_context(cafile=server_crt)
        if with_cert:
            ctx.load_cert_chain(client_crt, client_key)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := tls.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
            assert tls.version() == "TLSv1.3"
            return bool(tls.session is not None and tls.session.has_ticket)

    try:
        assert await asyncio.to_thread(call, True) is False  # no ticket to resume with
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError, AssertionError)):
            await asyncio.to_thread(call, False)  # no client certificate: no session
    finally:
        await runner.cleanup()
