"""A kubelet peer for tests and the demo: the device-manager side of the v1beta1 device-plugin API.

It serves the real ``v1beta1.Registration`` service on ``<dir>/kubelet.sock`` and, for every registration,
dials the plugin's endpoint and drives it through the real ``v1beta1.DevicePlugin`` service the way the
kubelet's device manager does: ``GetDevicePluginOptions`` first, then a long-lived ``ListAndWatch`` stream
whose updates it records (with arrival times), and ``GetPreferredAllocation``/``Allocate`` on request.
``restart()`` behaves like a new kubelet: it deletes every socket in the directory and serves a new
``kubelet.sock``; ``stop()`` + ``wipe()`` then ``start()`` is a restart with the kubelet away in between.
``created_at`` (just before each ``kubelet.sock`` was bound: the earliest it can appear) and ``received``
(when each ``Register`` arrived) time re-registration. Nothing here is imported by product code.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

SUPPORTED_VERSIONS = ("v1beta1",)


@dataclass
class PluginEndpoint:
    resource: str
    endpoint: str
    options: Any
    channel: grpc.aio.Channel
    stub: api_pb2_grpc.DevicePluginStub
    devices: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # id -> (health, numa ids)
    updates: list[tuple[float, dict[str, tuple[str, list[int]]]]] = field(default_factory=list)
    stream_task: asyncio.Task[None] | None = None
    stream_ended: bool = False


class KubeletPeer(api_pb2_grpc.RegistrationServicer):
    def __init__(self, plugin_dir: str, refuse: Callable[[api_pb2.RegisterRequest], str | None] | None = None) -> None:
        self.plugin_dir = plugin_dir
        self.socket = os.path.join(plugin_dir, "kubelet.sock")
        self.refuse = refuse
        self.server: grpc.aio.Server | None = None
        self.plugins: dict[str, PluginEndpoint] = {}
        self.registrations: list[tuple[float, api_pb2.RegisterRequest]] = []
        self.created_at: list[float] = []  # monotonic time just before each kubelet.sock was bound
        self.received: list[tuple[float, str]] = []  # (monotonic time, resource) of each Register call
        self.failed_connects: list[tuple[str, str]] = []  # (resource, status) when its endpoint did not answer
        self._changed = asyncio.Condition()

    # -- Registration service ------------------------------------------------------------------------------
    async def Register(self, request: api_pb2.RegisterRequest, context: Any) -> api_pb2.Empty:
        self.received.append((time.monotonic(), request.resource_name))
        if request.version not in SUPPORTED_VERSIONS:
            await context.abort(grpc.StatusCode.UNKNOWN,
                                f"Unsupported version {request.version!r}: supported {SUPPORTED_VERSIONS}")
        reason = self.refuse(request) if self.refuse else None
        if reason:
            await context.abort(grpc.StatusCode.UNKNOWN, reason)
        # like the kubelet: connect to the plugin in the background, answer the registration right away
        asyncio.get_running_loop().create_task(self._connect(request))
        return api_pb2.Empty()

    async def _connect(self, request: api_pb2.RegisterRequest) -> None:
        old = self.plugins.pop(request.resource_name, None)
        if old is not None:
            await self._close(old)
        channel = grpc.aio.insecure_channel(f"unix://{os.path.join(self.plugin_dir, request.endpoint)}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        try:
            options = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
        except grpc.aio.AioRpcError as exc:  # like the kubelet: the registration is dropped
            self.failed_connects.append((request.resource_name, exc.code().name))
            await channel.close(None)
            return
        plugin = PluginEndpoint(request.resource_name, request.endpoint, options, channel, stub)
        self.plugins[request.resource_name] = plugin
        plugin.stream_task = asyncio.get_running_loop().create_task(self._watch(plugin))
        async with self._changed:
            self.registrations.append((time.monotonic(), request))
            self._changed.notify_all()

    async def _watch(self, plugin: PluginEndpoint) -> None:
        try:
            async for response in plugin.stub.ListAndWatch(api_pb2.Empty()):
                devices = {d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in response.devices}
                async with self._changed:
                    plugin.devices = devices
                    plugin.updates.append((time.monotonic(), devices))
                    self._changed.notify_all()
        except grpc.aio.AioRpcError:
            pass
        finally:
            plugin.stream_ended = True
            async with self._changed:
                self._changed.notify_all()

    async def _close(self, plugin: PluginEndpoint) -> None:
        if plugin.stream_task:
            plugin.stream_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await plugin.stream_task
        await plugin.channel.close(None)

    # -- life cycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        os.makedirs(self.plugin_dir, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.created_at.append(time.monotonic())
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()

    async def stop(self) -> None:
        for plugin in list(self.plugins.values()):
            await self._close(plugin)
        self.plugins.clear()
        if self.server is not None:
            await self.server.stop(grace=0)
            self.server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)

    def wipe(self) -> None:
        """What a starting kubelet does to the directory: delete every socket in it."""
        for name in os.listdir(self.plugin_dir):
            path = os.path.join(self.plugin_dir, name)
            if name.endswith(".sock") or not os.path.isfile(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    async def restart(self) -> None:
        """Like a kubelet restart: stop, delete every socket in the directory, serve a new kubelet.sock."""
        await self.stop()
        self.wipe()
        await self.start()

    # -- what tests ask ------------------------------------------------------------------------------------
    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    async def wait_registered(self, resource: str, count: int = 1, timeout: float = 10.0) -> PluginEndpoint:
        await self.wait_for(lambda: sum(r.resource_name == resource for _, r in self.registrations) >= count
                            and resource in self.plugins and bool(self.plugins[resource].updates), timeout)
        return self.plugins[resource]

    async def allocate(self, resource: str, *containers: list[str]) -> api_pb2.AllocateResponse:
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        return await self.plugins[resource].stub.Allocate(request, timeout=5)

    async def preferred(self, resource: str, available: list[str], must_include: list[str],
                        size: int) -> list[str]:
        request = api_pb2.PreferredAllocationRequest(container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                                        must_include_deviceIDs=must_include,
                                                        allocation_size=size)])
        response = await self.plugins[resource].stub.GetPreferredAllocation(request, timeout=5)
        return list(response.container_responses[0].deviceIDs)
