"""Which NR1 modules the kubelet gave a pod: the pod-resources API v1 over its unix socket.

``Get`` (one pod) is asked first; a kubelet without it (older, or the ``KubeletPodResourcesGet`` gate off)
answers with an error and the pod is then looked up in ``List``. grpc is imported here, and only when the
runtime did not name the device itself (``runtimeConfig.deviceID``), because importing it costs ~50 ms.
"""

from __future__ import annotations

import sys

from cni.errors import NO_DEVICE, POD_RESOURCES, TRY_AGAIN, CNIError


def _import_grpc():  # type: ignore[no-untyped-def]
    try:
        import grpc
    except ImportError:
        if not sys.flags.no_site:
            raise
        # the launcher starts Python with -S (no site scan: ~10 ms faster); site-packages are needed now
        import site

        site.main()
        import grpc
    return grpc


def allocated_devices(
    socket_path: str, pod_name: str, pod_namespace: str, resource_name: str, timeout: float
) -> list[str]:
    """Device IDs of ``resource_name`` allocated to the pod's containers (sorted, without duplicates)."""
    grpc = _import_grpc()
    from protos.podresources.v1 import api_pb2, api_pb2_grpc

    channel = grpc.insecure_channel("unix:" + socket_path)
    stub = api_pb2_grpc.PodResourcesListerStub(channel)
    transient = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    try:
        try:
            reply = stub.Get(
                api_pb2.GetPodResourcesRequest(pod_name=pod_name, pod_namespace=pod_namespace),
                timeout=timeout,
            )
            pods = [reply.pod_resources]
        except grpc.RpcError as err:
            if err.code() in transient:
                raise
            # Get is missing or refused (disabled gate, pod unknown to it): List has every pod
            listing = stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout)
            pods = [p for p in listing.pod_resources if p.name == pod_name and p.namespace == pod_namespace]
    except grpc.RpcError as err:
        code = err.code()
        if code in transient:
            raise CNIError(
                TRY_AGAIN, f"kubelet pod-resources API at {socket_path} unavailable", str(err.details())
            ) from None
        raise CNIError(
            POD_RESOURCES, f"kubelet pod-resources API error {code.name}", str(err.details())
        ) from None
    finally:
        channel.close()
    if not pods:
        raise CNIError(
            NO_DEVICE, f"pod {pod_namespace}/{pod_name} is unknown to the kubelet's pod-resources API"
        )
    found = set()
    for pod in pods:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name == resource_name:
                    found.update(devices.device_ids)
    return sorted(found)
