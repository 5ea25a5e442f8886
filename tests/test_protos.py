"""The checked-in generated modules match the .proto files, and the protos match upstream's wire names."""

from __future__ import annotations

import subprocess
import sys

from protos.deviceplugin.v1beta1 import api_pb2 as dp
from protos.podresources.v1 import api_pb2 as pr


def test_generated_code_is_current() -> None:
    result = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr


def _fields(message) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_device_plugin_wire_names() -> None:
    assert dp.DESCRIPTOR.package == "v1beta1"
    services = {s.name: [m.name for m in s.methods] for s in dp.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "Registration": ["Register"],
        "DevicePlugin": ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
                         "PreStartContainer"],
    }
    assert dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming
    assert _fields(dp.RegisterRequest) == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert _fields(dp.DevicePluginOptions) == {"pre_start_required": 1, "get_preferred_allocation_available": 2}
    assert _fields(dp.Device) == {"ID": 1, "health": 2, "topology": 3}
    assert _fields(dp.NUMANode) == {"ID": 1}
    assert _fields(dp.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    assert _fields(dp.ContainerPreferredAllocationResponse) == {"deviceIDs": 1}
    assert _fields(dp.ContainerAllocateRequest) == {"devices_ids": 1}
    assert _fields(dp.PreStartContainerRequest) == {"devices_ids": 1}
    assert _fields(dp.ContainerAllocateResponse) == {
        "envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    assert _fields(dp.Mount) == {"container_path": 1, "host_path": 2, "read_only": 3}
    assert _fields(dp.DeviceSpec) == {"container_path": 1, "host_path": 2, "permissions": 3}
    assert _fields(dp.CDIDevice) == {"name": 1}


def test_device_plugin_bytes_are_stable() -> None:
    # Field numbers and types decide the bytes: a Register request encodes exactly as upstream's does.
    request = dp.RegisterRequest(version="v1beta1", endpoint="a.sock", resource_name="x.io/y",
                                 options=dp.DevicePluginOptions(get_preferred_allocation_available=True))
    assert request.SerializeToString() == (b"\n\x07v1beta1\x12\x06a.sock\x1a\x06x.io/y\"\x02\x10\x01")


def test_pod_resources_wire_names() -> None:
    assert pr.DESCRIPTOR.package == "v1"
    service = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]
    assert _fields(pr.PodResources) == {"name": 1, "namespace": 2, "containers": 3, "cpu_ids": 4, "memory": 5}
    assert _fields(pr.ContainerResources) == {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4,
                                              "dynamic_resources": 5}
    assert _fields(pr.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert _fields(pr.GetPodResourcesRequest) == {"pod_name": 1, "pod_namespace": 2}
    assert _fields(pr.GetPodResourcesResponse) == {"pod_resources": 1}
    assert _fields(pr.AllocatableResourcesResponse) == {"devices": 1, "cpu_ids": 2, "memory": 3}
    assert _fields(pr.ContainerMemory) == {"memory_type": 1, "size": 2, "topology": 3}
    assert _fields(pr.DynamicResource) == {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4}
    assert _fields(pr.ClaimResource) == {"cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4,
                                         "share_id": 5}
    assert _fields(pr.CDIDevice) == {"name": 1}


def test_pod_resources_pod_level_fields_and_share_id() -> None:
    # pod-level resources (KEP-5526): the pod's CPUs and memory beside its containers'
    pod = {f.name: f for f in pr.PodResources.DESCRIPTOR.fields}
    assert pod["cpu_ids"].type == pod["cpu_ids"].TYPE_INT64 and pod["cpu_ids"].is_repeated
    assert pod["memory"].message_type is pr.ContainerMemory.DESCRIPTOR and pod["memory"].is_repeated
    # a DRA device shared by claims (consumable capacity): share_id is optional, so unset differs from ""
    share_id = pr.ClaimResource.DESCRIPTOR.fields_by_name["share_id"]
    assert share_id.type == share_id.TYPE_STRING and share_id.has_presence
    assert not pr.ClaimResource().HasField("share_id") and pr.ClaimResource(share_id="").HasField("share_id")


def test_pod_resources_bytes_are_stable() -> None:
    pod = pr.PodResources(name="p", namespace="n", cpu_ids=[2, 3],
                          memory=[pr.ContainerMemory(memory_type="memory", size=1024)])
    assert pod.SerializeToString() == b"\n\x01p\x12\x01n\"\x02\x02\x03*\x0b\n\x06memory\x10\x80\x08"
    claim = pr.ClaimResource(device_name="gpu-0", share_id="")
    assert claim.SerializeToString() == b"\"\x05gpu-0*\x00"
