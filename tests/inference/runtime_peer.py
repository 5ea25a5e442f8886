"""An OpenAI-compatible model runtime for the gateway's tests and benchmark (a peer, not product code).

It answers ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` in the OpenAI shapes (JSON, or
server-sent events with ``data: [DONE]``), exports vLLM's ``vllm:num_requests_waiting`` on ``/metrics``, and
misbehaves on demand the way real runtimes do: slow first token, a token rate, HTTP errors, a stream that stalls
or breaks after some chunks, an answer that never comes. Every knob is an attribute the test may change between
requests. It counts what it saw, including requests whose client went away (cancelled).

``python -m tests.inference.runtime_peer --port P --latency 0.02`` runs one as a process (the benchmark does).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
from aiohttp import web


class RuntimePeer:
    def __init__(self, name: str = "peer", latency: float = 0.0, tokens: int = 8, token_rate: float = 0.0,
                 batch: int = 0) -> None:
        self.name = name
        # requests generated at once (a runtime's batch); the rest wait and show in vllm:num_requests_waiting
        self._batch = asyncio.Semaphore(batch) if batch > 0 else None
        self.waiting = 0
        self.latency = latency  # seconds before the answer (or the stream's first chunk)
        self.tokens = tokens  # completion tokens per answer
        self.token_rate = token_rate  # tokens per second in a stream; 0: all at once
        self.fail_status: int | None = None  # answer every request with this status
        self.fail_next = 0  # answer this many next requests with fail_status or 500
        self.hang = False  # accept the request and never answer
        self.stall_after: int | None = None  # stream: send this many chunks, then go silent
        self.break_after: int | None = None  # stream: send this many chunks, then drop the connection
        self.hold_after_done = False  # stream: keep the connection open after [DONE] (the client closes first)
        self.reported_queue = 0.0  # vllm:num_requests_waiting
        self.metrics_hang = False  # /metrics: accept and never answer
        self.received = 0
        self.completed = 0
        self.cancelled = 0
        self.inflight = 0
        self.max_inflight = 0
        self.paths: list[str] = []
        self.last_headers: dict[str, str] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            app.router.add_post(path, self.handle)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def metrics(self, _request: web.Request) -> web.Response:
        if self.metrics_hang:
            await asyncio.Event().wait()
        text = ("# HELP vllm:num_requests_waiting Requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="m"}} {self.reported_queue + self.waiting}\n')
        return web.Response(text=text, content_type="text/plain")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received += 1
        self.paths.append(request.path)
        self.last_headers = dict(request.headers)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self._batch is None:
                return await self._answer(request)
            self.waiting += 1
            try:
                await self._batch.acquire()
            finally:
                self.waiting -= 1
            try:
                return await self._answer(request)
            finally:
                self._batch.release()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.inflight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        model = body.get("model", "")
        if self.hang:
            await asyncio.Event().wait()
        if self.fail_next > 0 or self.fail_status is not None:
            self.fail_next = max(0, self.fail_next - 1)
            status = self.fail_status or 500
            return web.json_response({"error": {"message": f"{self.name} failed", "type": "server_error",
                                                "param": None, "code": None}}, status=status)
        if self.latency:
            await asyncio.sleep(self.latency)
        if request.path == "/v1/embeddings":
            inputs = body.get("input")
            items = inputs if isinstance(inputs, list) else [inputs]
            data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(len(items))]
            self.completed += 1
            return web.json_response({"object": "list", "data": data, "model": model,
                                      "usage": {"prompt_tokens": 4 * len(items), "total_tokens": 4 * len(items)}})
        chat = request.path == "/v1/chat/completions"
        usage = {"prompt_tokens": 5, "completion_tokens": self.tokens, "total_tokens": 5 + self.tokens}
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{self.received}"
        created = int(time.time())
        if not body.get("stream"):
            text = " ".join(["tok"] * self.tokens)
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "stop", "logprobs": None} if chat else
                                      {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None})
            self.completed += 1
            return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": model, "system_fingerprint": self.name,
                                      "choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
            doc = {"id": ident, "object": kind, "created": created, "model": model, "system_fingerprint": self.name,
                   "choices": choices, **(extra or {})}
            return b"data: " + orjson.dumps(doc) + b"\n\n"

        for i in range(self.tokens):
            if self.stall_after is not None and i >= self.stall_after:
                await asyncio.Event().wait()
            if self.break_after is not None and i >= self.break_after:
                assert request.transport is not None
                request.transport.close()
                return response
            if i and self.token_rate:
                await asyncio.sleep(1 / self.token_rate)
            last = i == self.tokens - 1
            choice = ({"index": 0, "delta": {"content": "tok "}, "finish_reason": "stop" if last else None}
                      if chat else {"index": 0, "text": "tok ", "finish_reason": "stop" if last else None})
            await response.write(event([choice]))
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(event([], {"usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        if self.hold_after_done:
            await asyncio.Event().wait()
        await response.write_eof()
        self.completed += 1
        return response


async def _serve(args: argparse.Namespace) -> None:
    peer = RuntimePeer(args.name, args.latency, args.tokens, args.token_rate, args.batch)
    await peer.start(args.host, args.port)
    print(peer.url, flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="peer")
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--token-rate", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=0, help="requests generated at once; 0: unlimited")
    args = p.parse_args()
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
