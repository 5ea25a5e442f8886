"""Feature discovery labels patched onto the Node through the project's client layer (``kubeapi``) and the REST
protocol, under the device plugin's field manager."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from device_plugin.config import load
from device_plugin.labeller import FIELD_MANAGER, NodeLabeller, label_patch
from device_plugin.main import DevicePluginProcess, build_backends
from kubeapi.client import connected
from tests.apiserver_peer import APIServerPeer
from tests.fake_nvml import dgx_like
from tests.kubelet_peer import KubeletPeer
from tests.sysfs_fixture import NR1_VENDOR, add_pci_function, nr1_node


def test_label_patch_sets_changes_and_removes_only_owned_keys() -> None:
    current = {"kubernetes.io/hostname": "n1", "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "1",
               "accelstack.io/nr1.count": "2", "nvidia.com/gpu.deploy.driver": "true"}
    desired = {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81559"}
    assert label_patch(current, desired) == {"nvidia.com/gpu.memory": "81559", "accelstack.io/nr1.count": None,
                                             "nvidia.com/gpu.deploy.driver": None}


async def test_labels_reach_the_node_and_follow_device_changes(tmp_path: Path) -> None:
    api = APIServerPeer()
    await api.start()
    await api.put_object("api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "gpu-node-1", "labels": {"kubernetes.io/hostname": "gpu-node-1", "accelstack.io/nr1.product": "old"}}})
    sysfs = tmp_path / "sys"
    nr1_node(sysfs, 2)
    config, _ = load(["--device-plugin-path", str(tmp_path / "dp"), "--sysfs-root", str(sysfs), "--metrics-address",
                      "", "--nr1-enabled", "true", "--nr1-vendor-ids", NR1_VENDOR, "--labeller-interval", "0.1"],
                     environ={"NODE_NAME": "gpu-node-1"})
    kubelet = KubeletPeer(str(tmp_path / "dp"))
    await kubelet.start()
    stack = contextlib.AsyncExitStack()
    kube = await stack.enter_async_context(connected(api.url, field_manager=FIELD_MANAGER, timeout=2.0))
    process = DevicePluginProcess(config, build_backends(config, nvml=dgx_like(2)), poll_interval=0.02, kube=kube)
    task = asyncio.create_task(process.run())

    def labels() -> dict[str, str]:
        node = api.get("api/v1/nodes", "", "gpu-node-1")
        return dict(node["metadata"]["labels"]) if node else {}

    try:
        for _ in range(100):
            if labels().get("accelstack.io/nr1.count") == "2":
                break
            await asyncio.sleep(0.05)
        got = labels()
        assert got["kubernetes.io/hostname"] == "gpu-node-1"  # not ours: untouched
        assert got["nvidia.com/gpu.count"] == "2" and got["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert got["accelstack.io/nr1.product"] == "NR1-0x0001"
        assert ("PATCH", f"/api/v1/nodes/gpu-node-1?fieldManager={FIELD_MANAGER}") in api.requests
        stored = api.get("api/v1/nodes", "", "gpu-node-1") or {}
        managers = {e["manager"] for e in stored["metadata"]["managedFields"]}
        assert FIELD_MANAGER == "accelstack-device-plugin" and FIELD_MANAGER in managers
        add_pci_function(sysfs, "0000:50:00.0", interfaces=("nr1p9",))  # a module hot-added
        for _ in range(100):
            if labels().get("accelstack.io/nr1.count") == "3":
                break
            await asyncio.sleep(0.05)
        assert labels()["accelstack.io/nr1.count"] == "3"
        patches = sum(1 for m, _ in api.requests if m == "PATCH")
        await asyncio.sleep(0.3)
        assert sum(1 for m, _ in api.requests if m == "PATCH") == patches  # nothing changed: no writes
    finally:
        process.stop.set()
        await asyncio.wait_for(task, 10)
        await stack.aclose()
        await kubelet.stop()
        await api.stop()


async def test_a_hung_or_failing_api_server_delays_the_labels_but_does_not_stall_them() -> None:
    """Client-side timeout on the read, then a 500 and a 503: each retried with backoff within one round."""
    api = APIServerPeer()
    await api.start()
    await api.put_object("api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    api.inject("GET", "nodes", name="n1", hang=True, times=1)
    api.inject("GET", "nodes", name="n1", status=500, times=1)
    api.inject("PATCH", "nodes", name="n1", status=503, times=1)
    try:
        async with connected(api.url, field_manager=FIELD_MANAGER, timeout=0.5, backoff_base=0.05,
                             backoff_cap=0.1) as kube:
            labeller = NodeLabeller(kube, "n1", lambda: {"nvidia.com/gpu.count": "2"})
            assert await asyncio.wait_for(labeller.reconcile(), 5) == {"nvidia.com/gpu.count": "2"}
        stored = api.get("api/v1/nodes", "", "n1") or {}
        assert stored["metadata"]["labels"] == {"nvidia.com/gpu.count": "2"}
        assert [r.status for r in api.calls("GET", "nodes", name="n1")] == [499, 500, 200]
        assert [r.status for r in api.calls("PATCH", "nodes", name="n1")] == [503, 200]
    finally:
        await api.stop()
