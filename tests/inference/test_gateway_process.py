"""``accelstack-gateway`` as a process: configuration errors, the objects file, SIGTERM draining."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from inference.gateway.main import UsageError, parse
from inference.gateway.sources import SourceError, load_objects
from tests.inference.harness import DEFAULT_KEYS, KEY_A, endpoint, slices


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_flags_and_env() -> None:
    opts = parse(["--listen", ":9000", "--retries", "2"], {"ACCELSTACK_GW_QUEUE_TIMEOUT": "7.5"})
    assert opts["port"] == 9000 and opts["settings"].retries == 2 and opts["settings"].queue_timeout == 7.5
    assert parse(["--queue-timeout", "3"], {"ACCELSTACK_GW_QUEUE_TIMEOUT": "7.5"})["settings"].queue_timeout == 3
    keys = parse(["--key-namespaces", " keys, team-a ,keys"], {})
    assert keys["key_namespaces"] == ("keys", "team-a") and keys["namespaces"] == ()


@pytest.mark.parametrize(("argv", "env", "message"), [
    ([], {"ACCELSTACK_GW_IDLE_TIMEOUT": "soon"}, "--idle-timeout (env ACCELSTACK_GW_IDLE_TIMEOUT): not a number"),
    (["--retries", "9"], {}, "--retries (env ACCELSTACK_GW_RETRIES): must be between 0 and 5"),
    (["--listen", "nowhere"], {}, "--listen (env ACCELSTACK_GW_LISTEN): must be host:port"),
    (["--policy", "random"], {}, "--policy (env ACCELSTACK_GW_POLICY): one of least-request, round-robin"),
    ([], {"ACCELSTACK_GW_AUTH": "maybe"}, "--auth (env ACCELSTACK_GW_AUTH): not a boolean"),
    (["--objects", "/no/such/file"], {}, "--objects (env ACCELSTACK_GW_OBJECTS): no such file"),
    (["--eject-max-fraction", "2"], {}, "--eject-max-fraction (env ACCELSTACK_GW_EJECT_MAX_FRACTION)"),
    (["--key-namespaces", "ok,Not_A_Namespace"], {}, "--key-namespaces (env ACCELSTACK_GW_KEY_NAMESPACES): not a "
                                                      "namespace name: 'Not_A_Namespace'"),
])
def test_bad_values_name_the_flag_and_variable(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError) as err:
        parse(argv, env)
    assert message in str(err.value)


def test_process_exits_2_on_bad_config() -> None:
    out = subprocess.run([sys.executable, "-m", "inference.gateway.main", "--retries", "x"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2
    assert "accelstack-gateway: --retries (env ACCELSTACK_GW_RETRIES): not a number: 'x'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("text", "message"), [
    ("kind: Pod\nmetadata: {name: x}\n", "document 1: kind 'Pod' is not one of"),
    ("[1, 2]\n", "document 1: not a Kubernetes object"),
    ("kind: Secret\nmetadata: {namespace: a}\n", "document 1: metadata.name is required"),
    ("a: [\n", "not YAML"),
    ("kind: List\nitems:\n- kind: Node\n  metadata: {name: n}\n", "document 1 item 1: kind 'Node'"),
])
def test_malformed_objects_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "objects.yaml"
    path.write_text(text)
    with pytest.raises(SourceError) as err:
        load_objects(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_bad_objects_file_stops_the_process_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "objects.yaml"
    path.write_text("kind: Pod\nmetadata: {name: x}\n")
    out = subprocess.run([sys.executable, "-m", "inference.gateway.main", "--objects", str(path),
                          "--listen", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "kind 'Pod' is not one of" in out.stderr and "Traceback" not in out.stderr


async def _wait_http(session: aiohttp.ClientSession, url: str, status: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(url) as r:
                if r.status == status:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} never answered {status}")
        await asyncio.sleep(0.05)


def _gateway_process(peer: Any, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """accelstack-gateway on an objects file with one endpoint in front of ``peer``; (process, base URL)."""
    objects = tmp_path / "objects.yaml"
    objects.write_text(yaml.safe_dump_all([endpoint("llm"), *slices("llm", [peer.url]), *DEFAULT_KEYS]))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "inference.gateway.main", "--objects", str(objects),
                             "--listen", f"127.0.0.1:{port}", *flags, "--log-format", "text"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


async def _request_in_flight(s: aiohttp.ClientSession, base: str, peer: Any) -> asyncio.Task[aiohttp.ClientResponse]:
    """Once the gateway is ready, a request sent through it and seen by ``peer`` (still being served there)."""
    await _wait_http(s, base + "/readyz", 200)
    request = asyncio.create_task(s.post(base + "/v1/embeddings", json={"model": "m", "input": "x"},
                                         headers={"Authorization": f"Bearer {KEY_A}"}))
    deadline = time.monotonic() + 10
    while peer.inflight == 0:
        assert time.monotonic() < deadline, "request never reached the replica"
        await asyncio.sleep(0.01)
    return request


async def test_sigterm_drains_and_lets_requests_finish(make_peers: Any, tmp_path: Path) -> None:
    (peer,) = await make_peers(1, latency=1.5)
    proc, base = _gateway_process(peer, tmp_path, "--drain-seconds", "0.5")
    try:
        async with aiohttp.ClientSession() as s:
            request = await _request_in_flight(s, base, peer)
            proc.send_signal(signal.SIGTERM)
            await _wait_http(s, base + "/readyz", 503)  # draining: taken out of the Service first
            response = await request
            assert response.status == 200 and (await response.json())["object"] == "list"
            rc = await asyncio.to_thread(proc.wait, 20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0
    assert proc.stderr is not None
    log = proc.stderr.read()
    assert "draining" in log and KEY_A not in log


async def test_shutdown_takes_drain_plus_one_shutdown_timeout(make_peers: Any, tmp_path: Path) -> None:
    """Issue 37.4: a request that outlives --shutdown-timeout is cancelled at it, not after twice it (aiohttp waited
    the timeout for the handler, then the same again for the handler it had only asked to stop). The shipped
    manifest's drain and shutdown flags and grace period, scaled down by one factor: the process exits after drain +
    timeout and before the grace period ends (the old code took drain + 2 x timeout, past it)."""
    from tests.inference.test_inference_manifests import docs

    (deployment,) = [d for d in docs("gateway.yaml") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    args = dict(a.removeprefix("--").split("=", 1) for a in pod["containers"][0]["args"])
    drain, timeout, grace = float(args["drain-seconds"]), float(args["shutdown-timeout"]), pod["terminationGracePeriodSeconds"]
    assert drain + timeout < grace
    scale = (drain + timeout) / 3.5  # 0.5 s drain, 3 s timeout and a 4.5 s grace with the shipped 5, 30 and 45 s
    drain, timeout, grace = drain / scale, timeout / scale, grace / scale
    (peer,) = await make_peers(1, latency=600)
    proc, base = _gateway_process(peer, tmp_path, "--drain-seconds", str(drain), "--shutdown-timeout", str(timeout))
    try:
        async with aiohttp.ClientSession() as s:
            request = await _request_in_flight(s, base, peer)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(proc.wait, 60)
            took = time.monotonic() - started
            with contextlib.suppress(aiohttp.ClientError):
                await request
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0
    assert drain + timeout * 0.9 <= took < grace, (took, drain, timeout, grace)  # exits before the kubelet kills


async def test_objects_file_is_reloaded(make_peers: Any, tmp_path: Path) -> None:
    peers = await make_peers(2)
    objects = tmp_path / "objects.yaml"
    objects.write_text(yaml.safe_dump_all([endpoint("llm", models=["one"]), *slices("llm", [peers[0].url]),
                                           *DEFAULT_KEYS]))
    from inference.gateway.server import Gateway, Settings
    from inference.gateway.sources import FileSource

    gateway = Gateway(Settings())
    source = FileSource(objects, gateway, interval=0.02)
    source.load()
    task = asyncio.create_task(source.run())
    try:
        assert set(gateway.routes) == {"one"}
        objects.write_text(yaml.safe_dump_all([endpoint("llm", models=["two"]), *slices("llm", [peers[1].url]),
                                               *DEFAULT_KEYS]))
        os.utime(objects, (time.time() + 1, time.time() + 1))  # a distinct mtime even with coarse timestamps
        deadline = time.monotonic() + 5
        while set(gateway.routes) != {"two"}:
            assert time.monotonic() < deadline, "file change not picked up"
            await asyncio.sleep(0.02)
        objects.write_text("kind: Pod\nmetadata: {name: x}\n")  # a broken edit keeps the routes in force
        os.utime(objects, (time.time() + 2, time.time() + 2))
        broken = os.stat(objects).st_mtime
        while source.seen != broken:
            assert time.monotonic() < deadline + 5, "broken file never read"
            await asyncio.sleep(0.02)
        assert set(gateway.routes) == {"two"}
    finally:
        task.cancel()
