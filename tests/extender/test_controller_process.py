"""``accelstack-controller`` as a real process against the API-server peer: it is not ready while GPRs cannot be
listed (the CRD missing: 404) and retries without a storm, becomes ready when they can, admits a GPR and lifts its
pod's gate, writes as its own field manager, and exits 0 on SIGTERM giving the Lease up; bad flags exit 2."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, node, pod, wait_until
from tests.extender.test_extender_process import free_port

GPRS = "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"
LEASES = "apis/coordination.k8s.io/v1/leases"


def kubeconfig(tmp: Path, url: str) -> Path:
    path = tmp / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: peer, cluster: {{server: "{url}"}}}}]
users: [{{name: test, user: {{}}}}]
contexts: [{{name: peer, context: {{cluster: peer, user: test}}}}]
current-context: peer
""")
    return path


async def readyz(http: aiohttp.ClientSession, port: int) -> int:
    try:
        async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
            return r.status
    except aiohttp.ClientError:
        return 0


async def test_controller_process_admits_and_stops_on_sigterm(tmp_path: Path) -> None:
    peer = APIServerPeer()
    await peer.start()
    await peer.put_object("api/v1/nodes", node("n0", gpus=4))
    await peer.put_object(GPRS, gpr("train", phase=None, devices=2))
    await peer.put_object("api/v1/pods", pod("train-0", 2, gpr="train", gated=True))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_extender.cmd.controller", "--kubeconfig",
        str(kubeconfig(tmp_path, peer.url)), "--listen", f"127.0.0.1:{port}", "--lease-seconds", "3",
        "--log-format", "text", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "ACCELSTACK_CTL_LEASE_NAMESPACE": "accelstack-system"})
    try:
        await wait_until(lambda: ((peer.get(GPRS, "default", "train") or {}).get("status") or {}).get("phase")
                         == "Admitted", timeout=20)
        await wait_until(lambda: not peer.get("api/v1/pods", "default", "train-0")["spec"].get("schedulingGates"),  # type: ignore[index]
                         timeout=10)
        obj = peer.get(GPRS, "default", "train")
        assert obj is not None
        managers = {m.get("manager") for m in obj["metadata"].get("managedFields") or []}
        assert "accelstack-gpr-controller" in managers  # not OpenAPI-Generator
        async with aiohttp.ClientSession() as http:
            assert await readyz(http, port) == 200
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert "accelstack_controller_pass_seconds_bucket" in text and "accelstack_kube_request_seconds" in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        lease = peer.get(LEASES, "accelstack-system", "accelstack-gpr-controller")
        assert lease is not None and lease["spec"]["holderIdentity"] == ""
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await peer.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["--listen", "nowhere"], "--listen: must be host:port"),
    (["--kubeconfig", "/nope"], "--kubeconfig: no such file"),
    (["--policy", "magic"], "--policy: one of bestfit, fgd, random"),
    (["--lease-seconds", "1"], "--lease-seconds: must be >= 2"),
    (["--concurrency", "0"], "--concurrency: must be >= 1"),
    (["--estimate-every", "x"], "--estimate-every: not a number"),
])
def test_controller_bad_flags_exit_2_naming_the_flag(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "scheduler_extender.cmd.controller", *args], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
