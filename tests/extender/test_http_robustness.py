"""The extender process's three HTTP surfaces (scheduler extender verbs, admission webhooks, REST API) under
hostile input, over real HTTP against the API-server peer: a seeded fuzz (deep nesting, wrong types, huge
numbers, invalid UTF-8, truncated bodies) never gets a 5xx and always gets the surface's documented error shape;
a body shorter than its Content-Length is answered 408 within the body-read timeout instead of holding a
handler; a refused body is one log line without a traceback; the REST API authenticates before it reads the
body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from kubeapi import KubeClient
from scheduler_extender.admission.webhook import KubeLookup, Webhook, add_webhook_routes
from scheduler_extender.api.app import RateLimiter
from scheduler_extender.cmd.server import ExtenderServer
from scheduler_extender.objects.kube import Kube
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import filter_body, node, pod, stack, wait_until

SEED = int(os.environ.get("ACCELSTACK_FUZZ_SEED", "20261130"))
FUZZ_PER_TARGET = int(os.environ.get("ACCELSTACK_FUZZ_BODIES", "120"))  # bodies per endpoint; raise it to soak


@pytest.fixture(autouse=True)
def production_recursion_limit() -> Any:
    """The interpreter's default recursion limit, as ``accelstack-extender`` runs with it (cel-python, imported
    by other tests, raises it to 2,500 for the whole test process)."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(before)
ADMIN = {"Authorization": "Bearer admin-token"}


def grant_admin(peer: APIServerPeer) -> None:
    peer.tokens["admin-token"] = {"username": "alice", "groups": ["team-a"]}
    for verb in ("list", "get", "create", "delete"):
        peer.grants.add(("alice", verb, "accelstack.io", "gpuprovisioningrequests", ""))
    peer.grants.add(("alice", "list", "", "nodes", ""))


@contextlib.asynccontextmanager
async def process(**kwargs: Any) -> AsyncIterator[tuple[APIServerPeer, ExtenderServer]]:
    """The extender process as ``accelstack-extender`` assembles it: verbs, REST API (with authentication) and
    the webhook (KubeLookup on the peer) on one server."""
    peer = APIServerPeer()
    await peer.start()
    grant_admin(peer)
    lookup_client = client.ApiClient(client.Configuration(host=peer.url))
    webhook_kw = {k: kwargs[k] for k in ("body_timeout",) if k in kwargs}

    def routes(app: Any) -> None:
        lookup = KubeLookup(Kube(KubeClient(lookup_client, field_manager="accelstack-extender")))
        add_webhook_routes(app, Webhook(lookup, **webhook_kw))

    try:
        async with stack(peer, extra_routes=routes, **kwargs) as (_, server):
            await peer.put_object("api/v1/nodes", node("n1"))
            await wait_until(lambda: "n1" in server.view.nodes)
            server.rest.limiter = RateLimiter(rate=1e6, burst=10**6)  # fuzz the wait-time body, not its rate limit
            yield peer, server
    finally:
        await lookup_client.close()
        await peer.stop()


# ---- what the three surfaces answer when they refuse -----------------------------------------------------------
def admission_review(obj: dict[str, Any], resource: str = "pods") -> dict[str, Any]:
    group, version = ("", "v1") if resource == "pods" else ("accelstack.io", "v1alpha1")
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                        "resource": {"group": group, "version": version, "resource": resource},
                        "namespace": "team-a", "operation": "CREATE", "object": obj, "oldObject": None,
                        "dryRun": False}}


def gpr_object(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": "g", "namespace": "team-a"}, "spec": spec}


def check_extender(status: int, body: Any, sent: bytes = b"") -> str:
    if status == 200:
        return ""
    assert status in (400, 408, 413), status
    assert isinstance(body, dict) and isinstance(body.get("Error"), str) and body["Error"], body
    return body["Error"]


def sent_uid(sent: bytes) -> Any:
    try:
        return json.loads(sent)["request"]["uid"]
    except (ValueError, KeyError, TypeError):
        return None


def check_webhook(status: int, body: Any, sent: bytes = b"") -> str:
    if status == 200:  # an answer: an AdmissionReview for the request's uid
        assert body["kind"] == "AdmissionReview" and body["apiVersion"] == "admission.k8s.io/v1", body
        assert body["response"]["uid"] == (sent_uid(sent) if sent else "705ab4f5-6393-11e8-b7cc-42010a800002")
        if not body["response"]["allowed"]:
            assert body["response"]["status"]["code"] < 500, body  # no refusal dressed as an internal error
        return ""
    assert status in (400, 408, 413), status
    assert isinstance(body, dict) and body.get("kind") == "Status" and body.get("code") == status, body
    assert body["status"] == "Failure" and isinstance(body["message"], str) and body["message"]
    return body["message"]


def check_rest(status: int, body: Any, sent: bytes = b"") -> str:
    if status in (200, 201):
        return ""
    assert status in (400, 404, 408, 409, 413, 422, 429), status
    assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], body
    return body["error"]


# ---- the fuzz ----------------------------------------------------------------------------------------------------
def deep(levels: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * levels + b"]" * levels
    return b'{"a":' * levels + b"1" + b"}" * levels


JUNK: list[Any] = [None, True, 0, -1, 2**63, 2**64 + 1, 10**40, -(10**40), 1.5, 1e308, -1e308, "", "x", "1e999999999",
                   "Infinity", "-Infinity", "NaN", "sNaN", "1.5", "-3", "9" * 400, "999999999h", [], [1, [2]], {},
                   {"a": {"b": []}}, "\u0000", "\ud7ff\U0001f600"]
RAW_NUMBERS = [b"1e400", b"-1e400", b"123456789012345678901234567890123456789", b"1" * 5000, b"0.1e-400"]


def leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += leaves(v, (*path, i))
    return out


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy_ = json.loads(json.dumps(value))
    holder = copy_
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = new
    return copy_


def mutations(valid: Any, rng: random.Random, count: int) -> list[bytes]:
    """Bodies near a valid one: every kind of malformed input the issue names, with the seed's choices."""
    text = json.dumps(valid).encode()
    paths = leaves(valid)
    out = [deep(n, k) for n in (1_000, 1_100, 5_000, 100_000) for k in ("list", "object")]
    for _ in range(count):
        path = rng.choice(paths)
        how = rng.randrange(7)
        if how == 0:  # a deep value where a field is
            marker = "\u2603MARK\u2603"
            body = json.dumps(replaced(valid, path, marker)).encode()
            out.append(body.replace(json.dumps(marker).encode(), deep(rng.choice((990, 1_000, 3_000)),
                                                                           rng.choice(("list", "object")))))
        elif how == 1:  # a wrong type or an extreme value
            out.append(json.dumps(replaced(valid, path, rng.choice(JUNK))).encode())
        elif how == 2:  # a number no 64-bit type holds
            marker = "\u2603NUM\u2603"
            body = json.dumps(replaced(valid, path, marker)).encode()
            out.append(body.replace(json.dumps(marker).encode(), rng.choice(RAW_NUMBERS)))
        elif how == 3:  # invalid UTF-8 inside the text
            i = rng.randrange(len(text))
            out.append(text[:i] + rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80")) + text[i:])
        elif how == 4:  # truncated
            out.append(text[:rng.randrange(len(text))])
        elif how == 5:  # a key of an object renamed to an unknown one holding something deep
            body = json.loads(text)
            holder = body
            for key in path[:-1]:
                holder = holder[key]
            if isinstance(holder, dict):
                holder["zz-unknown"] = "\u2603DEEP\u2603"
            out.append(json.dumps(body).encode().replace(b'"\\u2603DEEP\\u2603"', deep(2_000, "list")))
        else:  # random bytes
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
    return out


async def post(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, Any]:
    async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")


def fuzz_targets(valid_pod: dict[str, Any]) -> list[tuple[str, Any, Callable[..., str]]]:
    return [
        ("/scheduler/filter", json.loads(filter_body(valid_pod, ["n1"])), check_extender),
        ("/scheduler/prioritize", json.loads(filter_body(valid_pod, ["n1"])), check_extender),
        ("/scheduler/preempt", {"Pod": valid_pod, "NodeNameToVictims": None,
                                "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 0}}},
         check_extender),
        ("/scheduler/bind", {"PodName": "p", "PodNamespace": "default", "PodUID": "u", "Node": "n1"},
         check_extender),
        ("/mutate-pods", admission_review(valid_pod), check_webhook),
        ("/validate-gprs", admission_review(gpr_object({"devicesPerNode": 2, "exitDuration": "1h",
                                                        "models": ["H100"]}), "gpuprovisioningrequests"),
         check_webhook),
        ("/api/v1/gprs", {"namespace": "team-a", "name": "g", "spec": {"devicesPerNode": 2, "priority": 120,
                                                                       "idleTimeout": "30m"}}, check_rest),
        ("/api/v1/waittime", {"namespace": "team-a", "spec": {"devicesPerNode": 1, "models": ["H100"]}}, check_rest),
    ]


async def test_fuzzed_bodies_never_get_a_5xx_and_always_the_documented_error_shape(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(SEED)
    valid_pod = pod("p", 1, gpr="g")
    async with process() as (_, server):
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession(headers=ADMIN) as http:
            for path, valid, check in fuzz_targets(valid_pod):
                with caplog.at_level(logging.INFO):
                    caplog.clear()
                    for body in mutations(valid, rng, FUZZ_PER_TARGET):
                        status, answer = await post(http, base + path, body)
                        try:
                            check(status, answer, body)
                        except AssertionError as exc:
                            raise AssertionError(f"{path} {body[:120]!r}... -> {status} {str(answer)[:300]}") from exc
                    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
                    assert tracebacks == [], (path, tracebacks)
                # and the surface still answers a valid request
                status, answer = await post(http, base + path, json.dumps(valid).encode())
                assert status in (200, 201, 409), (path, status, answer)


@pytest.mark.parametrize(("path", "body", "check", "fragment"), [
    ("/scheduler/filter", b'{"Pod": {"spec": {"affinity": ' + deep(1_000, "list") + b'}}, "NodeNames": []}',
     check_extender, "nested"),
    ("/scheduler/bind", b'{"x": ' + deep(1_000, "object") + b"}", check_extender, "nested"),
    ("/mutate-pods", deep(1_000, "list"), check_webhook, "nested"),
    ("/validate-gprs", b'{"apiVersion": ' + deep(1_000, "object") + b"}", check_webhook, "nested"),
    ("/api/v1/gprs", deep(1_000, "list"), check_rest, "nested"),
])
async def test_json_nested_a_thousand_levels_is_a_400_saying_so(path: str, body: bytes,
                                                                 check: Callable[..., str],
                                                                 fragment: str) -> None:
    async with process() as (_, server), aiohttp.ClientSession(headers=ADMIN) as http:
        status, answer = await post(http, f"http://127.0.0.1:{server.port}{path}", body)
        assert status == 400, answer
        assert fragment in check(status, answer)


async def test_webhook_refuses_json_nested_deeper_than_an_object_can_be() -> None:
    """Below the parser's own limit too: a pod nested 200 levels deep (no API object is) is a 400, not a
    refusal dressed as an internal error."""
    async with process() as (_, server), aiohttp.ClientSession() as http:
        p = pod("p", 1)
        p["metadata"]["annotations"] = json.loads(deep(200, "object"))
        status, answer = await post(http, f"http://127.0.0.1:{server.port}/mutate-pods",
                                    json.dumps(admission_review(p)).encode())
        assert status == 400 and "nested" in check_webhook(status, answer)


# ---- a body shorter than its Content-Length --------------------------------------------------------------------
async def raw_exchange(port: int, head: bytes, body: bytes, deadline: float) -> tuple[bytes, bool, float]:
    """Send the head and part of the body, keep the connection open; -> (what came back, closed by the server,
    seconds until the answer)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = loop.time()
    writer.write(head + body)
    await writer.drain()
    got = b""
    closed = False
    answered_at = None
    try:
        async with asyncio.timeout(deadline):
            while True:
                chunk = await reader.read(4096)
                if not chunk:
                    closed = True
                    break
                got += chunk
                answered_at = answered_at or loop.time() - started
    except TimeoutError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return got, closed, answered_at if answered_at is not None else deadline


@pytest.mark.parametrize(("path", "shape"), [("/scheduler/filter", "Error"), ("/scheduler/bind", "Error"),
                                             ("/mutate-pods", "message"), ("/validate-gprs", "message"),
                                             ("/api/v1/gprs", "error"), ("/api/v1/waittime", "error")])
async def test_body_shorter_than_its_content_length_is_408_and_closed(path: str, shape: str) -> None:
    async with process(body_timeout=0.3) as (_, server):
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer admin-token\r\nContent-Length: 1000\r\n\r\n").encode()
        got, closed, after = await raw_exchange(server.port, head, b'{"Pod": {', deadline=5.0)
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert closed, "the connection must be closed after a 408"
        assert 0.25 <= after < 3.0
        body = json.loads(got.split(b"\r\n\r\n", 1)[1])
        assert "not received within 0.3s" in body[shape]
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/healthz") as r:
            assert r.status == 200  # the server still answers


# ---- refusals are one log line, counted ------------------------------------------------------------------------
async def test_refused_body_is_one_log_line_without_traceback_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    async with process(max_body=2048, body_timeout=0.3) as (_, server):
        base = f"http://127.0.0.1:{server.port}"
        with caplog.at_level(logging.INFO, logger="accelstack"):
            async with aiohttp.ClientSession() as http:
                status, answer = await post(http, base + "/scheduler/filter",
                                            filter_body(pod("p"), [f"node-{i}" for i in range(500)]))
                assert status == 413 and "size limit" in answer["Error"]
            # a client that goes away half way through its body
            head = b"POST /scheduler/bind HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(head + b'{"PodName"')
            await writer.drain()
            writer.close()
            await wait_until(lambda: any(getattr(r, "verb", "") == "bind" for r in caplog.records))
            # and one that is too slow
            head = b"POST /scheduler/prioritize HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
            got, _, _ = await raw_exchange(server.port, head, b"{", deadline=5.0)
            assert got.startswith(b"HTTP/1.1 408 ")
        records = [r for r in caplog.records if r.name.startswith("accelstack")]
        assert [r for r in records if r.exc_info] == []
        refused = {(getattr(r, "verb", None), getattr(r, "status", None)) for r in records
                   if r.getMessage() == "request refused"}
        assert refused == {("filter", 413), ("bind", 400), ("prioritize", 408)}, [r.__dict__ for r in records]
        async with aiohttp.ClientSession() as http, http.get(base + "/metrics") as r:
            text = await r.text()
        for verb in ("filter", "bind", "prioritize"):
            assert f'accelstack_extender_bad_requests_total{{verb="{verb}"}} 1.0' in text


# ---- the REST API: who before what -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/api/v1/gprs", "/api/v1/waittime"])
async def test_rest_api_authenticates_before_it_reads_the_body(path: str) -> None:
    async with process() as (peer, server):
        peer.tokens["bob-token"] = {"username": "bob", "groups": []}
        url = f"http://127.0.0.1:{server.port}{path}"
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer forged"}):
                for body in (b"{not json", b"[1]", b'{"namespace": 5}', deep(2_000, "list")):
                    async with http.post(url, data=body, headers=headers) as r:
                        assert r.status == 401, (headers, body[:20], await r.text())
                        assert "token" in (await r.json())["error"]
            bob = {"Authorization": "Bearer bob-token"}
            async with http.post(url, data=b"{not json", headers=bob) as r:  # who is known: the body is next
                assert r.status == 400 and "not JSON" in (await r.json())["error"]
            async with http.post(url, headers=bob, json={"namespace": "team-b", "name": "x",
                                                          "spec": {"devicesPerNode": 1}}) as r:
                assert r.status == 403 and "bob may not" in (await r.json())["error"]



async def test_rest_api_refuses_a_fraction_before_the_api_server_sees_it() -> None:
    async with process() as (peer, server), aiohttp.ClientSession(headers=ADMIN) as http:
        async with http.post(f"http://127.0.0.1:{server.port}/api/v1/gprs",
                             json={"namespace": "team-a", "name": "slice", "spec": {"milliPerDevice": 250}}) as r:
            assert r.status == 400
            assert (await r.json())["error"].startswith("spec.milliPerDevice: fractions of a device are not supported")
        assert peer.get("apis/accelstack.io/v1alpha1/gpuprovisioningrequests", "team-a", "slice") is None
