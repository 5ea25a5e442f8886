"""A kubelet pod-resources API v1 peer for tests: the real gRPC service (generated from the kubelet's proto)
served on a unix socket, answering from a table of pods the test sets up.

    with PodResourcesPeer(socket_path) as peer:
        peer.set_pod("default", "web-0", {"neureality.com/nr1": ["0000:3b:00.0"]})
        ...   # the code under test dials unix:<socket_path>
        assert peer.calls == ["Get"]

``set_pod_level`` adds what a kubelet with pod-level resource managers reports beside the containers (the pod's
``cpu_ids`` and ``memory``), and ``set_claims`` a container's DRA claims (``dynamic_resources``, with
``share_id`` for a shared device): the newest fields of the API, which the clients must read past.

``get_mode`` shapes ``Get``: "ok" (answers), "unimplemented" (an older kubelet: UNIMPLEMENTED) or "disabled"
(the ``KubeletPodResourcesGet`` gate off: the kubelet answers with an UNKNOWN error). ``delay`` makes every
call wait first (for deadline tests).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from protos.podresources.v1 import api_pb2, api_pb2_grpc


class _Servicer(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, peer: PodResourcesPeer):
        self.peer = peer

    def _pod(
        self, namespace: str, name: str, containers: dict[str, dict[str, list[str]]]
    ) -> api_pb2.PodResources:
        cpu_ids, memory = self.peer.pod_level.get((namespace, name), ([], {}))
        return api_pb2.PodResources(
            name=name,
            namespace=namespace,
            containers=[
                api_pb2.ContainerResources(
                    name=cname,
                    devices=[
                        api_pb2.ContainerDevices(resource_name=res, device_ids=ids)
                        for res, ids in resources.items()
                    ],
                    dynamic_resources=self.peer.claims.get((namespace, name, cname), []),
                )
                for cname, resources in containers.items()
            ],
            cpu_ids=cpu_ids,
            memory=[api_pb2.ContainerMemory(memory_type=t, size=size) for t, size in sorted(memory.items())],
        )

    def List(self, request, context):  # type: ignore[no-untyped-def]
        self.peer._record("List")
        with self.peer.lock:
            pods = [self._pod(ns, name, c) for (ns, name), c in sorted(self.peer.pods.items())]
        return api_pb2.ListPodResourcesResponse(pod_resources=pods)

    def Get(self, request, context):  # type: ignore[no-untyped-def]
        self.peer._record("Get")
        if self.peer.get_mode == "unimplemented":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "method Get not implemented")
        if self.peer.get_mode == "disabled":
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        with self.peer.lock:
            containers = self.peer.pods.get((request.pod_namespace, request.pod_name))
        if containers is None:
            context.abort(  # raises
                grpc.StatusCode.UNKNOWN,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        return api_pb2.GetPodResourcesResponse(
            pod_resources=self._pod(request.pod_namespace, request.pod_name, containers or {})
        )

    def GetAllocatableResources(self, request, context):  # type: ignore[no-untyped-def]
        self.peer._record("GetAllocatableResources")
        with self.peer.lock:
            ids: dict[str, set[str]] = {}
            for containers in self.peer.pods.values():
                for resources in containers.values():
                    for res, devs in resources.items():
                        ids.setdefault(res, set()).update(devs)
        return api_pb2.AllocatableResourcesResponse(
            devices=[
                api_pb2.ContainerDevices(resource_name=r, device_ids=sorted(d))
                for r, d in sorted(ids.items())
            ]
        )


class PodResourcesPeer:
    """The pod-resources service on ``socket_path`` until ``stop``."""

    def __init__(self, socket_path: str, get_mode: str = "ok", delay: float = 0.0):
        self.socket_path = socket_path
        self.get_mode = get_mode
        self.delay = delay
        self.pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        self.pod_level: dict[tuple[str, str], tuple[list[int], dict[str, int]]] = {}
        self.claims: dict[tuple[str, str, str], list[api_pb2.DynamicResource]] = {}
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.server: grpc.Server | None = None

    def _record(self, method: str) -> None:
        with self.lock:
            self.calls.append(method)
        if self.delay:
            time.sleep(self.delay)

    def set_pod(
        self, namespace: str, name: str, resources: dict[str, list[str]], container: str = "main"
    ) -> None:
        with self.lock:
            self.pods.setdefault((namespace, name), {})[container] = resources

    def set_pod_level(self, namespace: str, name: str, cpu_ids: list[int], memory: dict[str, int]) -> None:
        """The pod's own CPUs and memory (memory type -> bytes), as pod-level resource managers report them."""
        with self.lock:
            self.pod_level[(namespace, name)] = (list(cpu_ids), dict(memory))

    def set_claims(self, namespace: str, name: str, container: str, claims: list[api_pb2.DynamicResource]) -> None:
        """A container's DRA claims (``dynamic_resources``)."""
        with self.lock:
            self.claims[(namespace, name, container)] = list(claims)

    def start(self) -> PodResourcesPeer:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), self.server)
        self.server.add_insecure_port("unix:" + self.socket_path)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None

    def __enter__(self) -> PodResourcesPeer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
