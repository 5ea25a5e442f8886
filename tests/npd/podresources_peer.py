"""A minimal kubelet pod-resources API v1 peer (List, GetAllocatableResources, Get) on a unix socket, for the
exporter's allocation metrics. (tests/podresources_peer.py did not exist when this was written; when it does,
the exporter tests can move to it.)"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc

from protos.podresources.v1 import api_pb2, api_pb2_grpc


class PodResourcesPeer(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.allocatable: dict[str, list[str]] = {}  # resource -> device IDs
        self.pods: list[tuple[str, str, str, str, list[str]]] = []  # (namespace, pod, container, resource, ids)
        self.calls: list[str] = []
        self.server: Any = None

    def List(self, request: Any, context: Any) -> api_pb2.ListPodResourcesResponse:
        self.calls.append("List")
        response = api_pb2.ListPodResourcesResponse()
        for namespace, pod, container, resource, ids in self.pods:
            entry = response.pod_resources.add(name=pod, namespace=namespace)
            entry.containers.add(name=container).devices.add(resource_name=resource, device_ids=ids)
        return response

    def GetAllocatableResources(self, request: Any, context: Any) -> api_pb2.AllocatableResourcesResponse:
        self.calls.append("GetAllocatableResources")
        response = api_pb2.AllocatableResourcesResponse()
        for resource, ids in self.allocatable.items():
            response.devices.add(resource_name=resource, device_ids=ids)
        return response

    def Get(self, request: Any, context: Any) -> api_pb2.GetPodResourcesResponse:
        self.calls.append("Get")
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Get is not served by this peer")
        raise AssertionError("unreachable")

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix:" + self.socket_path)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0)
