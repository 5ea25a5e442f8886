"""What runs on an NR1 node, for the real-cluster tests and the node life-cycle benchmark: the kubelet's part
(the kubelet gRPC peer and the pod-resources peer, and the Node status the kubelet writes from what a device plugin
sends in ListAndWatch), the REAL ``accelstack-device-plugin`` process as the shipped NR1 DaemonSet runs it, and the
REAL node-problem-detector with accelstack's NR1 plugin (``test_node_health.NPD``).

The device plugin runs with in-cluster credentials as in its pod: ``KUBERNETES_SERVICE_HOST``/``PORT`` and a real
token of the shipped ``accelstack-device-plugin`` ServiceAccount, bound to the node (as the kubelet's projected
token is, which the shipped label policy requires), with the CA at the ServiceAccount path inside a private mount
namespace (``test_node_health.in_cluster_argv``). What differs from the DaemonSet, and only this: the host paths
(the sysfs fixture, the kubelet's device-plugin and pod-resources sockets in short temp paths), the site's
``nr1.vendorIDs`` (the fixture's vendor, as ``ACCELSTACK_DP_NR1_VENDOR_IDS``), the metrics address (a free loopback
port), JSON logs, and ``podResources.interval`` shortened to 1 s (shipped 30 s) so that a pod ending is read back
within the test's time. Nothing here is imported by product code.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.kubelet_peer import KubeletPeer
from tests.podresources_peer import PodResourcesPeer
from tests.realcluster.controlplane import ControlPlane, Process, free_port
from tests.realcluster.objects import wait_for
from tests.realcluster.shipped import ROOT, pick
from tests.realcluster.test_node_health import NPD, in_cluster_argv
from tests.sysfs_fixture import NR1_VENDOR

NR1 = "neureality.com/nr1"
NODE_NS, PLUGIN_SA = "accelstack-node", "accelstack-device-plugin"
SA_DIR = "/run/secrets/kubernetes.io/serviceaccount"


class Kubelet:
    """The kubelet's part for one fake node: it serves ``kubelet.sock`` (the device-plugin registration peer) and the
    pod-resources API, and writes the Node's ``capacity``/``allocatable`` of ``neureality.com/nr1`` from the
    plugin's ListAndWatch (capacity: every device listed; allocatable: the Healthy ones), as the kubelet's device
    manager does. The peers' asyncio loop runs in a thread of its own, so the tests stay synchronous."""

    def __init__(self, cp: ControlPlane, node: str) -> None:
        self.cp, self.node = cp, node
        self.dir = Path(tempfile.mkdtemp(prefix="kl-"))  # unix socket paths must stay under 107 bytes
        self.plugin_dir = str(self.dir / "dp")
        self.pods = PodResourcesPeer(str(self.dir / "pr.sock"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"kubelet-{node}", daemon=True)
        self.peer: KubeletPeer | None = None
        self.registered_at: float | None = None  # monotonic time of the plugin's first ListAndWatch answer
        self.written: list[tuple[int, int]] = []  # (capacity, allocatable) each time the Node status was written
        self._task: asyncio.Task[None] | None = None

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> Kubelet:
        self.pods.start()
        self.thread.start()
        self.peer = self._run(self._start())
        return self

    async def _start(self) -> KubeletPeer:
        peer = KubeletPeer(self.plugin_dir)
        await peer.start()
        self._task = asyncio.get_running_loop().create_task(self._sync(peer))
        return peer

    async def _sync(self, peer: KubeletPeer) -> None:
        last: tuple[int, int] | None = None
        loop = asyncio.get_running_loop()
        while True:
            plugin = peer.plugins.get(NR1)
            if plugin is not None and plugin.updates:
                if self.registered_at is None:
                    self.registered_at = plugin.updates[0][0]
                devices = dict(plugin.devices)
                now = (len(devices), sum(1 for h, _ in devices.values() if h == "Healthy"))
                if now != last:
                    await loop.run_in_executor(None, self._write_status, *now)
                    last = now
            await asyncio.sleep(0.05)

    def _write_status(self, capacity: int, allocatable: int) -> None:
        self.cp.patch(f"api/v1/nodes/{self.node}/status", {"status": {
            "capacity": {NR1: str(capacity)}, "allocatable": {NR1: str(allocatable)}}})
        self.written.append((capacity, allocatable))

    def health(self) -> dict[str, str]:
        """Device ID -> health in the plugin's last ListAndWatch answer ({} before it registered)."""
        plugin = self.peer.plugins.get(NR1) if self.peer is not None else None
        return {i: h for i, (h, _) in plugin.devices.items()} if plugin is not None else {}

    def stop(self) -> None:
        if self.peer is not None:
            peer, task = self.peer, self._task

            async def close() -> None:
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                await peer.stop()
            self._run(close())
            self.peer = None
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.pods.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class DevicePlugin:
    """The real ``accelstack-device-plugin`` as the shipped DaemonSet ``accelstack-device-plugin-nr1`` runs it, on a
    sysfs fixture, against :class:`Kubelet`'s sockets, in-cluster as its ServiceAccount."""

    def __init__(self, cp: ControlPlane, shipped: list[dict[str, Any]], node: str, sysfs: Path, kubelet: Kubelet,
                 workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        ds = pick(shipped, "DaemonSet", "accelstack-device-plugin-nr1")
        pod = ds["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == PLUGIN_SA
        container = next(c for c in pod["containers"] if c["name"] == "device-plugin")
        assert container["command"] == ["accelstack-device-plugin"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "config")["mountPath"]
        cm = pick(shipped, "ConfigMap", "accelstack-device-plugin")
        for name, text in cm["data"].items():
            (workdir / name).write_text(text)
        args: list[str] = []
        for arg in container["args"]:
            flag, _, value = arg.partition("=")
            if flag == "--config-file":
                arg = f"{flag}={value.replace(mount, str(workdir))}"
            elif flag == "--sysfs-root":
                arg = f"{flag}={sysfs}"
            args.append(arg)
        self.metrics = f"http://127.0.0.1:{free_port()}"
        args += ["--device-plugin-path", kubelet.plugin_dir, "--pod-resources-socket", kubelet.pods.socket_path,
                 "--pod-resources-interval", "1s", "--metrics-address", self.metrics.removeprefix("http://"),
                 "--log-format", "json"]
        sa_dir = workdir / "serviceaccount"
        sa_dir.mkdir()
        (sa_dir / "token").write_text(cp.token(NODE_NS, PLUGIN_SA, bound={"kind": "Node", "name": node}))
        shutil.copy(cp.pki.ca_crt, sa_dir / "ca.crt")
        (sa_dir / "namespace").write_text(NODE_NS)
        host, port = cp.url.removeprefix("https://").rsplit(":", 1)
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}  # in-cluster, never a kubeconfig
        self.env = {**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "NODE_NAME": node,
                    "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
                    "ACCELSTACK_DP_NR1_VENDOR_IDS": NR1_VENDOR, "ACCELSTACK_TEST_SA_DIR": str(sa_dir)}
        self.argv = in_cluster_argv([sys.executable, "-m", "device_plugin.main", *args])
        self.log = cp.dir / f"device-plugin-{node}.log"
        self.proc: Process | None = None

    def start(self) -> DevicePlugin:
        self.proc = Process(f"device-plugin-{self.workdir.name}", self.argv, self.log, env=self.env)
        return self

    def ready(self) -> bool:
        """``/readyz``: every resource registered with the kubelet."""
        if self.proc is not None and not self.proc.alive():
            raise self.proc.fail("exited")
        try:
            with urllib.request.urlopen(f"{self.metrics}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def nr1_npd(cp: ControlPlane, shipped: list[dict[str, Any]], node: str, sysfs: Path, workdir: Path) -> NPD:
    """The real node-problem-detector as the shipped ``accelstack-npd-nr1`` DaemonSet runs it (not started)."""
    return NPD(cp, shipped, "accelstack-npd-nr1", node, workdir, {
        "ACCELSTACK_NPD_NODE_SYSFS_ROOT": str(sysfs), "ACCELSTACK_NPD_PLUGIN_STATE_DIR": str(workdir / "state"),
        "ACCELSTACK_NPD_NR1_VENDOR_IDS": NR1_VENDOR, "ACCELSTACK_NPD_NR1_HEALTH_ATTRIBUTE": "health"})


def landing_label_seen(cp: ControlPlane, node: str, timeout: float = 60.0) -> float:
    """Wait for the controller's landing label ``accelstack.io/nr1-node=true`` (where the DaemonSets would land);
    the monotonic time it was seen."""
    wait_for(f"the landing label on {node}", lambda: ((cp.get(f"api/v1/nodes/{node}") or {}).get("metadata") or {})
             .get("labels", {}).get("accelstack.io/nr1-node") == "true", timeout=timeout, every=0.05)
    return time.monotonic()


def nr1_pod(name: str, modules: int, node: str) -> dict[str, Any]:
    """A pod of another scheduler holding ``modules`` NR1 modules on ``node`` (bound by nodeName)."""
    res = {"requests": {"cpu": "100m", NR1: str(modules)}, "limits": {NR1: str(modules)}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"schedulerName": "default-scheduler", "nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": res}]}}
