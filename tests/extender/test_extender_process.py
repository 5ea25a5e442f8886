"""``accelstack-extender`` as a real process: kubeconfig to the API-server peer, HTTPS with a self-signed
certificate, the recorded filter request, SIGTERM; and its command-line errors."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import node, recorded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def self_signed(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


async def test_process_serves_https_and_stops_on_sigterm(tmp_path: Path) -> None:
    peer = APIServerPeer()
    await peer.start()
    for name in ("gpu-node-1", "gpu-node-2"):
        await peer.put_object("api/v1/nodes", node(name))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: peer, cluster: {{server: "{peer.url}"}}}}]
users: [{{name: test, user: {{}}}}]
contexts: [{{name: peer, context: {{cluster: peer, user: test}}}}]
current-context: peer
""")
    cert, key = self_signed(tmp_path)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_extender.cmd.extender", "--kubeconfig", str(kubeconfig), "--listen",
        f"127.0.0.1:{port}", "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--lease-seconds", "2",
        "--insecure-verbs=true",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "ACCELSTACK_EXT_LEASE_NAMESPACE": "accelstack-system"})
    context = ssl.create_default_context(cafile=str(cert))
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(f"https://127.0.0.1:{port}/readyz", ssl=context) as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            async with http.post(f"https://127.0.0.1:{port}/scheduler/filter", data=recorded("a-filter.request.json"),
                                 ssl=context) as r:
                body = await r.json()
        assert body["NodeNames"] == ["gpu-node-1", "gpu-node-2"]
        assert body["FailedAndUnresolvableNodes"] == {"reject-node-3": "node unknown to the accelstack extender"}
        # the admission webhook is served by the same process: a pod asking for a GPU without a GPR is refused
        gpu_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
                   "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
        admission = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "default",
            "operation": "CREATE", "userInfo": {"username": "alice"}, "object": gpu_pod, "dryRun": False}}
        async with aiohttp.ClientSession() as http, http.post(
                f"https://127.0.0.1:{port}/mutate-pods", json=admission, ssl=context) as r:
            answer = await r.json()
        assert answer["response"]["uid"] == "u-1" and answer["response"]["allowed"] is False
        assert "GPR" in answer["response"]["status"]["message"]
        async with aiohttp.ClientSession() as http, http.get(f"https://127.0.0.1:{port}/metrics", ssl=context) as r:
            metrics = await r.text()
        assert 'accelstack_webhook_request_seconds_count{endpoint="mutate-pods",outcome="denied"} 1.0' in metrics
        assert "accelstack_kube_request_seconds_bucket" in metrics  # every API call is timed
        for _ in range(50):  # the controller took the Lease
            if peer.get("apis/coordination.k8s.io/v1/leases", "accelstack-system", "accelstack-gpr-controller"):
                break
            await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        lease = peer.get("apis/coordination.k8s.io/v1/leases", "accelstack-system", "accelstack-gpr-controller")
        assert lease is not None and lease["spec"]["holderIdentity"] == ""  # given up on shutdown
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await peer.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["--listen", "nowhere"], "--listen: must be host:port"),
    (["--tls-cert-file", "/etc/hostname"], "give both or neither"),
    (["--tls-cert-file", "/nope.crt", "--tls-key-file", "/nope.key"], "no such file"),
    (["--resources", "gpu"], "--resources: extended resource names"),
    (["--policy", "magic"], "--policy: one of bestfit, fgd, random"),
    (["--require-gpr", "perhaps"], "--require-gpr: not a boolean"),
    (["--resync", "-1"], "--resync: must be >= 0.05"),
    (["--max-body-bytes", "many"], "--max-body-bytes: not a number"),
    (["--body-timeout", "0"], "--body-timeout: must be >= 0.01"),
    (["--url-prefix", "scheduler"], "--url-prefix: must start with '/'"),
    ([], "--scheduler-listen: the extender verbs need a listener of their own"),  # secure by default
    (["--insecure-verbs=true", "--scheduler-listen", ":8444"], "--scheduler-listen: needs --tls-cert-file"),
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "scheduler_extender.cmd.extender", *args], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_env_sets_flags_and_help_reads_well() -> None:
    result = subprocess.run([sys.executable, "-m", "scheduler_extender.cmd.extender", "--help"], capture_output=True,
                            text=True, check=True)
    assert "ACCELSTACK_EXT_LISTEN" in result.stdout and "--tls-cert-file" in result.stdout
    result = subprocess.run([sys.executable, "-m", "scheduler_extender.cmd.extender"], capture_output=True, text=True,
                            check=False, env={**os.environ, "ACCELSTACK_EXT_POLICY": "nope"})
    assert result.returncode == 2 and "--policy" in result.stderr
