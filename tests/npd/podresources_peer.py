"""The shared pod-resources peer (``tests/podresources_peer.py``) with a fixed allocatable table.

The shared peer answers ``GetAllocatableResources`` with the devices its pods hold; the exporter's tests need
devices that are allocatable but not allocated, so ``allocatable`` (resource -> device IDs), when set, is the
answer instead. Everything else (List, Get, the pod table via ``set_pod``) is the shared peer's.
"""

from __future__ import annotations

from typing import Any

import grpc

from protos.podresources.v1 import api_pb2, api_pb2_grpc
from tests.podresources_peer import PodResourcesPeer as SharedPeer
from tests.podresources_peer import _Servicer


class _AllocatableServicer(_Servicer):
    def GetAllocatableResources(self, request: Any, context: Any) -> api_pb2.AllocatableResourcesResponse:
        peer = self.peer
        if not isinstance(peer, PodResourcesPeer) or peer.allocatable is None:
            return super().GetAllocatableResources(request, context)
        peer._record("GetAllocatableResources")
        return api_pb2.AllocatableResourcesResponse(devices=[
            api_pb2.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in sorted(peer.allocatable.items())])


class PodResourcesPeer(SharedPeer):
    def __init__(self, socket_path: str, **kwargs: Any) -> None:
        super().__init__(socket_path, **kwargs)
        self.allocatable: dict[str, list[str]] | None = None

    def start(self) -> PodResourcesPeer:
        from concurrent import futures

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_AllocatableServicer(self), self.server)
        self.server.add_insecure_port("unix:" + self.socket_path)
        self.server.start()
        return self
