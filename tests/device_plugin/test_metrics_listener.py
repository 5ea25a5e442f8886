"""The metrics listener every node agent serves (device plugin, exporter, remediation): a client that sends nothing
or drips its request is dropped, and no answer names the Python version."""

from __future__ import annotations

import socket
import time

from prometheus_client import CollectorRegistry

from service.observability import HttpEndpoint, PluginMetrics


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (one request per connection): the answer may come in several writes."""
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_silent_and_dripping_clients_are_dropped_and_no_banner_names_python() -> None:
    endpoint = HttpEndpoint("127.0.0.1:0", PluginMetrics(CollectorRegistry()), lambda: True, timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as plain:
            plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = read_all(plain)
        assert answer.startswith(b"HTTP/1.0 200") and b"ok\n" in answer
        head = answer.split(b"\r\n\r\n")[0].lower()
        assert b"server: accelstack" in head and b"python" not in head, head
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as silent:
            started = time.monotonic()
            assert silent.recv(1) == b""  # closed by the server, not by this client's 10 s timeout
            assert time.monotonic() - started < 9
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as drip:
            drip.sendall(b"GET /metr")
            assert drip.recv(1) == b""
        # and it still answers afterwards
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as again:
            again.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
            assert read_all(again).startswith(b"HTTP/1.0 200")
    finally:
        endpoint.close()
