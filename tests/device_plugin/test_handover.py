"""Handing a node over from another device plugin: the kubelet's pod-resources view published on the Node as the
annotation ``accelstack.io/pod-resources``, and free devices reported Unhealthy while pods hold device IDs this
plugin does not serve (``device_plugin/handover.py``).

Every test runs the real process against the kubelet peer (the device-plugin gRPC API), the pod-resources peer
(the kubelet's v1 pod-resources API) and the API-server peer, over real unix sockets and HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from device_plugin.config import ConfigError, load
from device_plugin.devices import DeviceTable, PhysicalDevice
from device_plugin.handover import ANNOTATION, Report, unchanged
from device_plugin.labeller import FIELD_MANAGER
from device_plugin.main import DevicePluginProcess, build_backends
from kubeapi.client import connected
from tests.apiserver_peer import APIServerPeer
from tests.fake_nvml import dgx_like
from tests.kubelet_peer import KubeletPeer, PluginEndpoint
from tests.podresources_peer import PodResourcesPeer
from tests.sysfs_fixture import nr1_node

GPU = "nvidia.com/gpu"
NODE = "gpu-node-1"
IDS = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(4)]


@dataclass
class Stack:
    process: DevicePluginProcess
    kubelet: KubeletPeer
    pods: PodResourcesPeer
    api: APIServerPeer

    def annotation(self) -> dict[str, Any] | None:
        node = self.api.get("api/v1/nodes", "", NODE) or {}
        value = (node.get("metadata", {}).get("annotations") or {}).get(ANNOTATION)
        return json.loads(value) if value else None

    def node_patches(self) -> int:
        return sum(1 for m, path in self.api.requests if m == "PATCH" and path.startswith(f"/api/v1/nodes/{NODE}"))

    def metric(self, name: str, **labels: str) -> float | None:
        return self.process.metrics.registry.get_sample_value(name, labels)

    async def health(self, predicate: Callable[[dict[str, str]], bool]) -> dict[str, str]:
        """Wait until the kubelet's last ListAndWatch update satisfies ``predicate``; id -> health."""
        plugin: PluginEndpoint = await self.kubelet.wait_registered(GPU)

        def now() -> dict[str, str]:
            return {i: h for i, (h, _) in plugin.devices.items()}

        await self.kubelet.wait_for(lambda: predicate(now()), timeout=20)
        return now()


async def until(what: str, predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``predicate`` until truthy; the bound is generous (a loaded machine), the order is what is tested."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def stack(tmp_path: Path, *flags: str, serve_pods: bool = True,
                pods: dict[tuple[str, str], dict[str, list[str]]] | None = None) -> AsyncIterator[Stack]:
    api = APIServerPeer()
    await api.start()
    await api.put_object("api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": NODE, "annotations": {"accelstack.io/ledger": "{}"}}})
    sysfs = tmp_path / "sys"
    nr1_node(sysfs, 0)
    socket_path = str(tmp_path / "pr.sock")
    config, _ = load(["--device-plugin-path", str(tmp_path / "dp"), "--sysfs-root", str(sysfs),
                      "--metrics-address", "", "--register-retry", "0.05", "--labeller-interval", "0.1",
                      "--pod-resources-socket", socket_path, "--pod-resources-interval", "0.2", *flags],
                     environ={"NODE_NAME": NODE})
    peer = PodResourcesPeer(socket_path)
    for (ns, name), resources in (pods or {}).items():
        peer.set_pod(ns, name, resources)
    if serve_pods:
        peer.start()
    kubelet = KubeletPeer(str(tmp_path / "dp"))
    await kubelet.start()
    exits = contextlib.AsyncExitStack()
    kube = await exits.enter_async_context(connected(api.url, field_manager=FIELD_MANAGER, timeout=2.0))
    process = DevicePluginProcess(config, build_backends(config, nvml=dgx_like(4)), poll_interval=0.02, kube=kube)
    task = asyncio.create_task(process.run())
    try:
        yield Stack(process, kubelet, peer, api)
    finally:
        process.stop.set()
        await asyncio.wait_for(task, 10)
        await exits.aclose()
        await kubelet.stop()
        peer.stop()
        await api.stop()


def counts(annotation: dict[str, Any] | None) -> dict[str, Any] | None:
    return {k: v for k, v in annotation.items() if k != "observedAt"} if annotation else None


async def test_same_ids_as_the_old_plugin_are_counted_in_use_and_every_device_stays_healthy(tmp_path: Path) -> None:
    held = {("ml", "train-0"): {GPU: [IDS[0], IDS[1]]}, ("ml", "train-1"): {GPU: [IDS[2]]},
            ("web", "cpu-only"): {}}
    async with stack(tmp_path, pods=held) as s:
        got = await until("the annotation", lambda: counts(s.annotation()))
        assert got == {"resource": GPU, "devices": 4, "inUse": 3, "unknownIDs": 0}
        assert s.annotation()["observedAt"].endswith("Z")  # type: ignore[index]
        assert await s.health(lambda h: len(h) == 4) == dict.fromkeys(IDS, "Healthy")
        assert s.process.tables[GPU].fenced == frozenset()
        assert s.metric("accelstack_device_plugin_pod_resources_unknown_ids", resource=GPU) == 0
        stored = s.api.get("api/v1/nodes", "", NODE) or {}
        assert stored["metadata"]["annotations"]["accelstack.io/ledger"] == "{}"  # others' annotations stay
        assert FIELD_MANAGER in {e["manager"] for e in stored["metadata"]["managedFields"]}


async def test_nothing_changed_no_rewrite_even_through_pod_churn_and_a_new_observed_at(tmp_path: Path) -> None:
    async with stack(tmp_path, pods={("ml", "a"): {GPU: [IDS[0]]}}) as s:
        first = await until("the annotation", s.annotation)
        assert first["inUse"] == 1
        patches = s.node_patches()
        # one pod ends and another takes a different GPU: the counts stay, so the Node is not written
        with s.pods.lock:
            del s.pods.pods[("ml", "a")]
            s.pods.pods[("ml", "b")] = {"main": {GPU: [IDS[3]]}}
        reads = s.process.watch.reads  # type: ignore[union-attr]
        watch = s.process.watch
        assert watch is not None
        # wait until the plugin's own report carries a later second than the Node's, with many labeller rounds
        await until("a later observation", lambda: watch.reports[GPU].observed_at != first["observedAt"]
                    and watch.reads > reads + 3)
        assert s.node_patches() == patches and s.annotation() == first
        # a real change is written at once (the labeller is poked, not left to its interval)
        s.pods.set_pod("ml", "c", {GPU: [IDS[1]]})
        await until("inUse 2", lambda: (s.annotation() or {}).get("inUse") == 2)
        assert s.node_patches() == patches + 1


async def test_ids_the_plugin_does_not_serve_fence_the_free_devices_until_those_pods_end(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # NVIDIA's plugin with time-slicing named its replicas <uuid>::<k>; one pod already runs on our naming
    held = {("ml", "old-0"): {GPU: [f"{IDS[0]}::0", f"{IDS[0]}::1"]}, ("ml", "new-0"): {GPU: [IDS[1]]}}
    caplog.set_level(logging.INFO, logger="accelstack.device_plugin.handover")
    async with stack(tmp_path, pods=held) as s:
        got = await until("the annotation", lambda: counts(s.annotation()))
        assert got == {"resource": GPU, "devices": 4, "inUse": 3, "unknownIDs": 2}
        health = await s.health(lambda h: len(h) == 4 and h[IDS[0]] == "Unhealthy")
        # only the device a pod holds under this plugin's ID stays schedulable... and it is in use: none is free
        assert health == {IDS[0]: "Unhealthy", IDS[1]: "Healthy", IDS[2]: "Unhealthy", IDS[3]: "Unhealthy"}
        assert s.metric("accelstack_device_plugin_pod_resources_unknown_ids", resource=GPU) == 2
        assert s.metric("accelstack_device_plugin_devices", resource=GPU, health="Unhealthy") == 3
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "does not serve" in r.getMessage()]
        assert len(warnings) == 1  # one clear warning, not one per read
        assert warnings[0].pods == ["ml/old-0"] and warnings[0].fenced == 3  # type: ignore[attr-defined]
        reads = s.process.watch.reads  # type: ignore[union-attr]
        await until("more reads", lambda: s.process.watch.reads > reads + 2)  # type: ignore[union-attr]
        assert len([r for r in caplog.records if "does not serve" in r.getMessage()]) == 1
        # the pods under the old naming end: everything comes back, the annotation says so
        with s.pods.lock:
            del s.pods.pods[("ml", "old-0")]
        assert await s.health(lambda h: set(h.values()) == {"Healthy"}) == dict.fromkeys(IDS, "Healthy")
        await until("unknownIDs 0", lambda: counts(s.annotation()) == {"resource": GPU, "devices": 4, "inUse": 1,
                                                                        "unknownIDs": 0})
        assert any("own health again" in r.getMessage() for r in caplog.records)


async def test_an_unreadable_pod_resources_api_is_an_error_on_the_node_not_a_zero(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="accelstack.device_plugin.handover")
    async with stack(tmp_path, serve_pods=False, pods={("ml", "a"): {GPU: [IDS[0]]}}) as s:
        got = await until("the annotation", s.annotation)
        assert set(got) == {"resource", "devices", "error", "observedAt"}
        assert got["resource"] == GPU and got["devices"] == 4
        assert "pr.sock does not exist" in got["error"] and "\n" not in got["error"]
        errors = await until("errors counted", lambda: (s.metric(
            "accelstack_device_plugin_pod_resources_errors_total") or 0) >= 3 and s.metric(
            "accelstack_device_plugin_pod_resources_errors_total"))
        assert errors >= 3
        assert len([r for r in caplog.records if "cannot read" in r.getMessage()]) == 1  # once per distinct error
        assert await s.health(lambda h: len(h) == 4) == dict.fromkeys(IDS, "Healthy")
        # the kubelet's socket appears: the error gives way to the counts
        s.pods.start()
        await until("counts", lambda: counts(s.annotation()) == {"resource": GPU, "devices": 4, "inUse": 1,
                                                                 "unknownIDs": 0})


async def test_an_allocation_is_read_back_without_waiting_for_the_period(tmp_path: Path) -> None:
    async with stack(tmp_path, "--pod-resources-interval", "1h") as s:
        got = await until("the annotation", lambda: counts(s.annotation()))
        assert got == {"resource": GPU, "devices": 4, "inUse": 0, "unknownIDs": 0}
        reads = s.process.watch.reads  # type: ignore[union-attr]
        await s.kubelet.wait_registered(GPU)
        s.pods.set_pod("ml", "a", {GPU: [IDS[2]]})  # what the kubelet records once Allocate answered
        await s.kubelet.allocate(GPU, [IDS[2]])
        await until("inUse 1", lambda: (s.annotation() or {}).get("inUse") == 1)
        assert s.process.watch.reads == reads + 1  # type: ignore[union-attr]


async def test_no_socket_configured_means_no_annotation_and_no_guard(tmp_path: Path) -> None:
    async with stack(tmp_path, "--pod-resources-socket", "", pods={("ml", "a"): {GPU: ["MIG-x"]}}) as s:
        assert await s.health(lambda h: len(h) == 4) == dict.fromkeys(IDS, "Healthy")
        patches = await until("the labeller's labels", s.node_patches)
        assert s.process.watch is None and s.annotation() is None and patches == 1
        assert s.pods.calls == []


def test_fencing_keeps_a_device_s_own_health() -> None:
    async def run() -> None:
        table = DeviceTable([PhysicalDevice(id=i, index=n) for n, i in enumerate(IDS)])
        table.set_health(IDS[3], False, "XID 79")
        assert table.set_fenced({IDS[0], IDS[3], "not-ours"}) and not table.set_fenced([IDS[3], IDS[0]])
        assert [h for _, h, _ in table.listing()] == ["Unhealthy", "Healthy", "Healthy", "Unhealthy"]
        assert table.set_fenced([])
        assert [h for _, h, _ in table.listing()] == ["Healthy", "Healthy", "Healthy", "Unhealthy"]
        assert table.reasons == {IDS[3]: "XID 79"}

    asyncio.run(run())


def test_the_annotation_format_and_its_comparison() -> None:
    ok = Report(GPU, 8, 6, 0, observed_at="2026-12-03T22:00:00Z").to_json()
    assert json.loads(ok) == {"resource": GPU, "devices": 8, "inUse": 6, "unknownIDs": 0,
                              "observedAt": "2026-12-03T22:00:00Z"}
    later = Report(GPU, 8, 6, 0, observed_at="2026-12-03T22:05:00Z").to_json()
    assert unchanged(ok, later) and not unchanged(ok, Report(GPU, 8, 5, 0, observed_at="x").to_json())
    assert not unchanged(None, ok) and not unchanged("not json", ok)
    bad = json.loads(Report(GPU, 8, error="boom", observed_at="t").to_json())
    assert bad == {"resource": GPU, "devices": 8, "error": "boom", "observedAt": "t"}


def test_a_zero_interval_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match=r"^podResources.interval: must be more than 0s, got 0.0s$"):
        load(["--pod-resources-interval", "0"], environ={})
