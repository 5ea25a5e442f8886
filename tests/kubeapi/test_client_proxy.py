"""KubeClient decides the proxy once, from the environment as client-go does, and sends every call through it;
the session does not look up the environment or ~/.netrc per request."""

from __future__ import annotations

import asyncio

import pytest

from kubeapi.client import connected, proxy_for

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "ALL_PROXY",
              "all_proxy")


@pytest.fixture(autouse=True)
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)


def test_proxy_from_the_environment_by_scheme_and_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert proxy_for("https://api.example:6443") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert proxy_for("https://api.example:6443") == "http://proxy.example:3128"
    assert proxy_for("http://api.example:6443") is None  # HTTP_PROXY is not set
    monkeypatch.setenv("NO_PROXY", "api.example,10.0.0.0/8")
    assert proxy_for("https://api.example:6443") is None
    assert proxy_for("https://other.example") == "http://proxy.example:3128"


async def test_calls_go_through_the_proxy_decided_once(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head.split(b"\r\n", 1)[0].decode())
            body = b'{"kind": "NamespaceList", "items": []}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    async with connected("http://api.example:6443", field_manager="test") as kube:
        assert not kube.session.trust_env  # no per-request lookups
        monkeypatch.delenv("HTTP_PROXY")  # decided once, at construction
        answer = await kube.request("GET", "/api/v1/namespaces")
        assert answer["kind"] == "NamespaceList"
    server.close()
    # an absolute-form request line: the call went to the proxy, naming the API server
    assert seen == ["GET http://api.example:6443/api/v1/namespaces HTTP/1.1"]


async def test_no_proxy_means_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")

    async def api(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    server = await asyncio.start_server(api, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with connected(f"http://127.0.0.1:{port}", field_manager="test") as kube:
        assert kube.proxy is None
        assert await kube.request("GET", "/api/v1/namespaces") == {}
    server.close()
