"""Where the gateway's CPU per request goes: its Python in process, and what each µs of it costs where it runs.

``bench/bench_gateway.py`` reports the gateway's CPU a request beside nginx's. This one splits that figure:

1. ``--part inprocess``: the gateway's listener, its ``Gateway.handle`` and its upstream pool in this process, the
   sockets replaced by transports in memory (a client writes the next request when an answer arrives; the
   replica answers a fixed JSON body on the next loop turn). CPU µs a proxied request for three handlers: the
   listener alone (a handler that answers at once), the listener with the pool (a handler that only forwards), and
   the gateway. Flat out (16 connections, the loop never idles), and with ``--gap`` seconds of idle between the
   requests of one connection: the way the gateway runs at ~120 requests/s.
2. ``--part arm``: ``bench_gateway.py``'s balancing arm (four replicas, one ``--slow`` times slower, each
   generating ``--batch`` requests at once; 64 closed-loop clients), three proxies in front of the same replicas,
   interleaved: a minimal Python proxy (uvloop protocols, a task a request, no parsing, no routing: each read taken
   as one whole request or answer, which holds for this load only), the gateway's listener and pool with a handler
   that forwards to the replica with the fewest outstanding requests, and the gateway itself (shipped settings,
   API keys on). CPU µs a request of each, user and system.

Usage: python bench/bench_gateway_cost.py [--part inprocess|arm|both] [--rounds 5] [--requests 20000] [--gap 0.005]
       [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # its sibling, as a script's neighbour (bench/ is no package)

from bench_gateway import Procs, free_port, load, wait_ready  # noqa: E402

from inference.gateway import listener as lst  # noqa: E402
from inference.gateway import upstream as up  # noqa: E402
from inference.gateway.server import Gateway, Settings  # noqa: E402
from inference.gateway.sources import apply_objects  # noqa: E402
from tests.inference.harness import KEY_A, endpoint, key_secret, slices  # noqa: E402

ANSWER_BODY = (b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":'
               b'"hello hello hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":8,'
               b'"total_tokens":13}}')
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
          b"Date: Fri, 04 Dec 2026 09:00:00 GMT\r\nServer: Python/3.11 aiohttp/3.9.5\r\n\r\n" % len(ANSWER_BODY)
          + ANSWER_BODY)
REQUEST_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}'
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: Python/3.11 aiohttp/3.9.5\r\n"
           b"Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nAuthorization: Bearer " + KEY_A.encode()
           + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(REQUEST_BODY) + REQUEST_BODY)
HANDLERS = ("listener", "forward", "gateway")


class MemoryTransport(asyncio.Transport):
    """A transport whose writes go to a callback: no socket, no system call."""

    def __init__(self, on_write: Callable[[bytes], None]) -> None:
        super().__init__()
        self.on_write, self.closing = on_write, False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.on_write(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.on_write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name in ("peername", "sockname") else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def inprocess(handler_name: str, requests: int, connections: int, gap: float, rounds: int) -> list[float]:
    """CPU µs a request (user + system of this process) for each round after a warm-up round."""
    loop = asyncio.get_running_loop()
    gateway = Gateway(Settings(request_timeout=30, idle_timeout=30, queue_timeout=30))
    urls = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
    apply_objects(gateway, [endpoint("llm", max_inflight=4096, max_queue=4096)], slices("llm", urls),
                  [key_secret("bench", "team-a", KEY_A)])
    await gateway.start()
    pool = gateway._pool
    assert pool is not None

    async def connect(key: tuple[str, int], left: float = 0.0) -> up._Connection:
        conn = up._Connection(pool, key)

        def answer(_request: bytes) -> None:
            loop.call_soon(conn.data_received, ANSWER)

        conn.connection_made(MemoryTransport(answer))
        return conn

    pool._connect = connect  # type: ignore[method-assign]  # the replicas, in memory
    head = up.request_head("POST", "/v1/chat/completions", "10.0.0.1:8000", [("Content-Type", "application/json")],
                           len(REQUEST_BODY))

    async def answer_at_once(request: lst.Request) -> lst.Response:
        return lst.Response(body=ANSWER_BODY, content_type="application/json")

    async def forward(request: lst.Request) -> lst.Response:
        body = request.content.read_nowait(request.content_length or 0)
        answer = await pool.request("10.0.0.1", 8000, head, body, 30)
        try:
            payload = await answer.read()
        finally:
            answer.close()
        return lst.Response(answer.status, payload, content_type="application/json")

    handlers: dict[str, Callable[[lst.Request], Awaitable[Any]]] = {
        "listener": answer_at_once, "forward": forward, "gateway": gateway.handle}
    listener = lst.Listener(handlers[handler_name])
    listener.loop = loop
    state = {"done": 0, "target": 0}
    finished: list[asyncio.Future[None]] = [loop.create_future()]

    def client() -> lst._Connection:
        proto = lst._Connection(listener)

        def on_write(data: bytes) -> None:
            if not data.startswith(b"HTTP/1.1 200 "):
                raise SystemExit(f"bench_gateway_cost: the {handler_name} handler answered {data[:40]!r}")
            state["done"] += 1
            if state["done"] < state["target"]:
                if gap > 0:
                    loop.call_later(gap, proto.data_received, REQUEST)
                else:
                    loop.call_soon(proto.data_received, REQUEST)
            elif state["done"] == state["target"] and not finished[0].done():
                finished[0].set_result(None)

        proto.connection_made(MemoryTransport(on_write))
        return proto

    protos = [client() for _ in range(connections)]
    out = []
    for index in range(rounds + 1):
        state["done"], state["target"] = 0, requests
        finished[0] = loop.create_future()
        before = resource.getrusage(resource.RUSAGE_SELF)
        for proto in protos:
            proto.data_received(REQUEST)
        await finished[0]
        after = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.sleep(0.05)  # the last answers' tasks end
        if index:  # the first round warms up
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            out.append(cpu / requests * 1e6)
    await gateway.stop()
    return out


# ---- the arm's two extra proxies (run as their own processes: --serve minimal|forward PORT URL...) -------------
class _MinimalUpstream(asyncio.Protocol):
    def __init__(self, index: int, idle: list[_MinimalUpstream], outstanding: list[int]) -> None:
        self.index, self.idle, self.outstanding = index, idle, outstanding
        self.client: _MinimalClient | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client, self.client = self.client, None
        self.outstanding[self.index] -= 1
        self.idle.append(self)
        if client is not None and client.transport is not None:
            client.transport.write(data)


class _MinimalClient(asyncio.Protocol):
    def __init__(self, targets: list[tuple[str, int]], pools: list[list[_MinimalUpstream]],
                 outstanding: list[int]) -> None:
        self.targets, self.pools, self.outstanding = targets, pools, outstanding
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if data.startswith(b"GET /readyz"):
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return
        asyncio.get_running_loop().create_task(self.forward(data))

    async def forward(self, data: bytes) -> None:
        index = min(range(len(self.outstanding)), key=self.outstanding.__getitem__)
        self.outstanding[index] += 1
        pool = self.pools[index]
        if pool:
            conn = pool.pop()
        else:
            host, port = self.targets[index]
            _, conn = await asyncio.get_running_loop().create_connection(
                lambda: _MinimalUpstream(index, pool, self.outstanding), host, port)
        conn.client = self
        assert conn.transport is not None
        conn.transport.write(data)


async def serve(kind: str, port: int, urls: list[str]) -> None:
    loop = asyncio.get_running_loop()
    if kind == "minimal":
        targets = [(urlsplit(u).hostname or "", urlsplit(u).port or 80) for u in urls]
        pools: list[list[_MinimalUpstream]] = [[] for _ in urls]
        outstanding = [0] * len(urls)
        await loop.create_server(lambda: _MinimalClient(targets, pools, outstanding), "127.0.0.1", port,
                                 backlog=1024)
    else:
        split = [up.split_url(u) for u in urls]
        busy = [0] * len(urls)
        pool = up.Pool()

        async def handle(request: lst.Request) -> lst.Response:
            if request.path == "/readyz":
                return lst.Response(body=b"ok")
            body = request.content.read_nowait(request.content_length or 0)
            index = min(range(len(busy)), key=busy.__getitem__)
            host, target_port, host_header = split[index]
            busy[index] += 1
            try:
                answer = await pool.request(host, target_port, up.request_head(
                    "POST", request.path, host_header, [("Content-Type", "application/json")], len(body)), body, 300)
                try:
                    payload = await answer.read()
                finally:
                    answer.close()
            finally:
                busy[index] -= 1
            return lst.Response(answer.status, payload, content_type="application/json")

        await lst.Listener(handle).start("127.0.0.1", port)
    await asyncio.Event().wait()


def _times(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def arm(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    procs = Procs()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            urls = [procs.peer(f"r{i}", latency=args.service_ms / 1000 * (args.slow if i == 0 else 1),
                               batch=args.batch) for i in range(4)]
            proxies: dict[str, str] = {}
            for kind in ("minimal", "forward"):
                port = free_port()
                proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", kind, str(port),
                                         *urls], cwd=ROOT)
                procs.procs.append(proc)
                proxies[kind] = f"http://127.0.0.1:{port}"
                procs.by_url[proxies[kind]] = proc
            proxies["gateway"] = procs.gateway(Path(tmp), urls, "least-request", poll=None)
            for url in proxies.values():
                await wait_ready(url)
            out: dict[str, list[tuple[float, float]]] = {k: [] for k in proxies}
            for index in range(args.rounds):
                for kind, url in proxies.items():
                    await load(url, args.clients, 1)
                    pid = procs.by_url[url].pid
                    user0, system0 = _times(pid)
                    result = await load(url, args.clients, args.seconds)
                    user1, system1 = _times(pid)
                    n = max(1, result["n"])
                    out[kind].append(((user1 - user0) / n * 1e6, (system1 - system0) / n * 1e6))
                    print(f"  round {index + 1} {kind}: {result['rps']:.0f} req/s, errors {result['errors']}, "
                          f"CPU {(user1 - user0 + system1 - system0) / n * 1e6:.0f} us/request", flush=True)
            return out
    finally:
        procs.stop()


def on_uvloop(coro: Any) -> Any:
    """``coro``'s result, run on uvloop as the gateway runs (asyncio's loop where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0 or (kind is int and value == 0):
            raise argparse.ArgumentTypeError(f"must be {'positive' if kind is int else 'zero or more'}: {text!r}")
        return value
    return parse


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":  # one of the arm's proxies, started by arm()
        on_uvloop(serve(sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("inprocess", "arm", "both"), default="both")
    p.add_argument("--rounds", type=positive(int), default=5, help="measured rounds (medians reported)")
    p.add_argument("--requests", type=positive(int), default=20000, help="requests a round in process (flat out)")
    p.add_argument("--gap", type=positive(float), default=0.005,
                   help="seconds of idle between one connection's requests in the idle rows (in process)")
    p.add_argument("--seconds", type=positive(float), default=8.0, help="seconds a round on the arm")
    p.add_argument("--clients", type=positive(int), default=64)
    p.add_argument("--service-ms", type=positive(float), default=100.0)
    p.add_argument("--slow", type=positive(float), default=3.0)
    p.add_argument("--batch", type=positive(int), default=4)
    args = p.parse_args()
    if args.part in ("inprocess", "both"):
        print("in process (transports in memory), CPU us a proxied request, median of rounds:")
        for name in HANDLERS:
            flat = on_uvloop(inprocess(name, args.requests, 16, 0.0, args.rounds))
            idle = on_uvloop(inprocess(name, max(200, args.requests // 40), 1, args.gap, args.rounds))
            print(f"  {name:9s} flat out {statistics.median(flat):6.1f}   with {args.gap * 1000:g} ms idle between "
                  f"requests {statistics.median(idle):6.1f}", flush=True)
    if args.part in ("arm", "both"):
        print(f"balancing arm ({args.clients} clients, 4 replicas, one {args.slow:g}x slower, batch {args.batch}), "
              "CPU us a request:", flush=True)
        out = asyncio.run(arm(args))
        for kind, rows in out.items():
            user = statistics.median(u for u, _ in rows)
            system = statistics.median(s for _, s in rows)
            total = statistics.median(u + s for u, s in rows)
            print(f"  {kind:8s} {total:6.0f} (user {user:.0f}, system {system:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
