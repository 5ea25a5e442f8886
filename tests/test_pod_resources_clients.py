"""The CNI's and the exporter's pod-resources clients against a kubelet that fills the API's newest fields:
pod-level ``cpu_ids`` and ``memory`` (pod-level resource managers, Kubernetes 1.37) and DRA claims with a
``share_id``.

Both clients need the device-plugin devices a pod's containers hold (``ContainerResources.devices``); the new
fields carry CPUs, memory and DRA devices, which they read past. The peer is the real gRPC service generated
from ``protos/podresources/v1/api.proto`` on a unix socket."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cni.podresources import allocated_devices
from npd.exporter import Allocation
from protos.podresources.v1 import api_pb2, api_pb2_grpc
from tests.podresources_peer import PodResourcesPeer

NR1, GPU = "neureality.com/nr1", "nvidia.com/gpu"
PCI_A, PCI_B = "0000:3b:00.0", "0000:5e:00.0"
GIB = 1 << 30


@pytest.fixture
def socket_path() -> Iterator[str]:
    short = Path(tempfile.mkdtemp(prefix="prnew-"))  # unix socket paths must stay under 108 bytes
    try:
        yield str(short / "kubelet.sock")
    finally:
        shutil.rmtree(short, ignore_errors=True)


def kubelet_newest(socket_path: str, get_mode: str = "ok") -> PodResourcesPeer:
    peer = PodResourcesPeer(socket_path, get_mode=get_mode)
    peer.set_pod("team-a", "infer-0", {NR1: [PCI_B], GPU: ["GPU-1"]})
    peer.set_pod("team-a", "infer-0", {}, container="sidecar")
    peer.set_pod_level("team-a", "infer-0", [2, 3, 4, 5], {"memory": 4 * GIB, "hugepages-1Gi": 2 * GIB})
    shared = api_pb2.ClaimResource(cdi_devices=[api_pb2.CDIDevice(name="nvidia.com/gpu=gpu-0")],
                                   driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-0",
                                   share_id="6f1c2a10-0000-4000-8000-000000000001")
    peer.set_claims("team-a", "infer-0", "sidecar", [
        api_pb2.DynamicResource(claim_name="shared-gpu", claim_namespace="team-a", claim_resources=[shared])])
    peer.set_pod("team-b", "other-0", {NR1: [PCI_A]})
    return peer


def test_peer_serves_the_newest_fields(socket_path: str) -> None:
    with kubelet_newest(socket_path), grpc.insecure_channel("unix:" + socket_path) as channel:
        pod = api_pb2_grpc.PodResourcesListerStub(channel).Get(
            api_pb2.GetPodResourcesRequest(pod_name="infer-0", pod_namespace="team-a"), timeout=5).pod_resources
    assert list(pod.cpu_ids) == [2, 3, 4, 5]
    assert {(m.memory_type, m.size) for m in pod.memory} == {("memory", 4 * GIB), ("hugepages-1Gi", 2 * GIB)}
    [sidecar] = [c for c in pod.containers if c.name == "sidecar"]
    [claim] = sidecar.dynamic_resources[0].claim_resources
    assert claim.HasField("share_id") and claim.device_name == "gpu-0"


@pytest.mark.parametrize("get_mode", ["ok", "unimplemented"])
def test_cni_client_finds_the_module_beside_pod_level_resources_and_claims(socket_path: str, get_mode: str) -> None:
    with kubelet_newest(socket_path, get_mode) as peer:
        assert allocated_devices(socket_path, "infer-0", "team-a", NR1, timeout=5) == [PCI_B]
        assert peer.calls == (["Get"] if get_mode == "ok" else ["Get", "List"])


def test_exporter_client_attributes_devices_beside_pod_level_resources_and_claims(socket_path: str) -> None:
    allocation = Allocation(socket_path, [GPU, NR1], timeout=5)
    try:
        with kubelet_newest(socket_path):
            allocatable, allocated = allocation.read()
    finally:
        allocation.close()
    assert allocatable == {GPU: 1, NR1: 2}  # the shared peer's allocatable: what its pods hold
    assert sorted(allocated) == [(NR1, PCI_A, "team-b", "other-0", "main"),
                                 (NR1, PCI_B, "team-a", "infer-0", "main"),
                                 (GPU, "GPU-1", "team-a", "infer-0", "main")]
