"""The exporter and the remediation controller as processes: their console-script entry points started the
way the DaemonSet/Deployment start them, driven over their real interfaces, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.apiserver_peer import APIServerPeer
from tests.npd.test_remediation import NODES, iso, node, taints_of, wait_for
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "NODE_NAME": "node-a"}


def test_exporter_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    nr1_node(tmp_path / "sys", 2)
    port = free_port()
    (tmp_path / "exporter.yaml").write_text(
        f"version: v1\nnode:\n  sysfsRoot: {tmp_path / 'sys'}\nexporter:\n  address: 127.0.0.1:{port}\n"
        "  gpu: true\n  nr1: true\n  podResourcesSocket: ''\nnr1:\n"
        f"  vendorIDs: ['{NR1_VENDOR}']\n  healthAttribute: health\nlog:\n  level: warning\n")
    proc = subprocess.Popen([sys.executable, "-m", "npd.exporter", f"--config-file={tmp_path / 'exporter.yaml'}"],
                            env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        text = ""
        while time.monotonic() < deadline and not text:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.1)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        healthy = [v for (name, _), v in samples.items() if name == "accelstack_nr1_healthy"]
        assert healthy == [1.0, 1.0]
        up = [(dict(labels), v) for (name, labels), v in samples.items() if name == "accelstack_exporter_gpu_up"]
        assert len(up) == 1 and up[0][1] == 0 and up[0][0]["node"] == "node-a"  # no NVML on this machine
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read() == b"ok\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(10)
    assert code == 0


async def test_remediation_process_taints_through_its_kubeconfig_flag(tmp_path: Path) -> None:
    peer = APIServerPeer()
    url = await peer.start()
    (tmp_path / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: peer\n"
        f"clusters: [{{name: peer, cluster: {{server: '{url}'}}}}]\n"
        "contexts: [{name: peer, context: {cluster: peer, user: nobody}}]\nusers: [{name: nobody, user: {}}]\n")
    await peer.put_object(NODES, node("gpu-9", {"GPUUnhealthy": ("False", 0)}))
    # --kubeconfig, as every other process takes it: no KUBECONFIG, no in-cluster account, no ~/.kube/config
    process_env = {k: v for k, v in env().items() if not k.startswith("KUBERNETES_SERVICE") and k != "KUBECONFIG"}
    process_env["HOME"] = str(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "npd.remediation", "--kubeconfig", str(tmp_path / "kubeconfig"),
        "--remediation-hold-time", "1s", "--remediation-metrics-address", "", "--log-level", "warning",
        env=process_env, cwd=REPO)
    try:
        obj = peer.get(NODES, "", "gpu-9")
        assert obj is not None
        obj["status"]["conditions"][1].update(status="True", lastTransitionTime=iso(time.time()))
        await peer.put_object(NODES, obj, "MODIFIED")
        await wait_for(lambda: bool(taints_of(peer, "gpu-9")), 10)
        obj = peer.get(NODES, "", "gpu-9")
        assert obj is not None
        assert {e["manager"] for e in obj["metadata"]["managedFields"]} == {"accelstack-remediation"}
        obj["status"]["conditions"][1].update(status="False", lastTransitionTime=iso(time.time()))
        await peer.put_object(NODES, obj, "MODIFIED")
        await wait_for(lambda: not taints_of(peer, "gpu-9"), 6)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 10)
        await peer.stop()
    assert code == 0
