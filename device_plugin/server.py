"""The kubelet-facing side of one resource: the v1beta1 ``DevicePlugin`` gRPC service on a unix socket, its
registration with the kubelet, and the restart logic.

Life cycle of a ``PluginRunner`` (one per resource):

1. serve the ``DevicePlugin`` service on ``<plugin dir>/<endpoint>`` and check it answers (serve before
   register, as the API requires);
2. call ``Registration.Register`` on ``<plugin dir>/kubelet.sock`` (version ``v1beta1``), retrying while the
   kubelet is away; any other refusal (unsupported version, resource name taken) is fatal, as the API asks;
3. watch: when ``kubelet.sock`` is re-created (a new kubelet) or our own socket disappears (a new kubelet
   wipes the directory), stop, then serve and register again with the same device IDs.

While the kubelet is away, registration does not sleep the whole ``registerRetry``: with no ``kubelet.sock`` it
waits for the file to appear, and after a failed attempt it retries as soon as ``kubelet.sock`` is re-created
(a new kubelet), else after ``registerRetry``. So a kubelet restart is followed by registration within
milliseconds of the new socket, whatever ``registerRetry`` says.

Both waits wake on inotify events of the plugin directory (``dirwatch.DirWatch``) and then ``stat`` the two
sockets; a safety poll every second re-adds the watch when the directory itself was replaced. Without inotify
(no instance left for the user) they poll every ``poll_interval`` seconds instead.

A socket path the plugin cannot serve on (directory not creatable or read-only, a path through a regular file,
a path longer than the 107 bytes of ``sun_path``) is a ``SocketPathError`` naming the path and the reason: the
process exits with one log line instead of a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from device_plugin.allocation import AllocationError
from device_plugin.devices import HEALTHY, Backend, DeviceTable, describe_ids
from device_plugin.dirwatch import DirWatch
from protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from service.observability import PluginMetrics

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
POLL_INTERVAL = 0.05  # seconds between the stat calls of the kubelet.sock watches when inotify is unavailable
SUN_PATH_MAX = 107  # bytes of a unix socket path, without the terminating NUL (sizeof(sun_path) - 1 on Linux)
log = logging.getLogger("accelstack.device_plugin.server")


class _Undecodable:
    """A request whose bytes are not the method's protobuf (what the tolerant deserializer hands on)."""

    def __init__(self, message_type: str, size: int, error: str) -> None:
        self.message_type, self.size, self.error = message_type, size, error


def _tolerant(deserializer: Callable[[bytes], Any] | None, message_type: str) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw) if deserializer is not None else raw
        except Exception as exc:  # google.protobuf's DecodeError: the request is refused in the method
            return _Undecodable(message_type, len(raw), type(exc).__name__)
    return decode


async def _refuse(method: str, request: _Undecodable, context: Any) -> None:
    log.warning("undecodable protobuf request refused", extra={
        "method": method, "message_type": request.message_type, "bytes": request.size, "error": request.error})
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {request.message_type} message")


def _quiet(method: str, handler: Any) -> Any:
    """``handler`` with requests that do not decode refused as INVALID_ARGUMENT and one WARNING line (grpc's
    own path logs an ERROR traceback per such request: ``Unexpected [DecodeError] raised by servicer method``)."""
    message_type = getattr(handler.request_deserializer, "__qualname__", "").split(".")[0] or "request"
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                return await _refuse(method, request, context)
            return await inner_uu(request, context)

        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer, message_type),
                                unary_unary=unary_unary)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _refuse(method, request, context)
                return
            async for item in inner_us(request, context):
                yield item

        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer, message_type),
                                unary_stream=unary_stream)
    return handler


class _Recorder:
    """Takes the generated code's method handlers instead of a server."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, _: Any) -> None:
        pass

    def add_registered_method_handlers(self, _: str, handlers: dict[str, Any]) -> None:
        self.handlers = dict(handlers)


def add_quiet_servicer(servicer: Any, server: Any) -> None:
    """``add_DevicePluginServicer_to_server`` with each method's undecodable requests refused quietly."""
    recorder = _Recorder()
    api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, recorder)
    handlers = {name: _quiet(name, h) for name, h in recorder.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", handlers),))
    server.add_registered_method_handlers("v1beta1.DevicePlugin", handlers)


class RegistrationError(RuntimeError):
    """The kubelet refused the registration for a reason retrying cannot fix."""


class SocketPathError(RuntimeError):
    """The plugin cannot serve on its socket path; the message names the path and the reason."""


def check_socket_path(path: str) -> None:
    """Raise SocketPathError when ``path`` is too long for a unix socket."""
    length = len(os.fsencode(path))
    if length > SUN_PATH_MAX:
        raise SocketPathError(f"socket path {path} is {length} bytes, over the {SUN_PATH_MAX}-byte limit of a "
                              "unix socket path (sun_path): use a shorter devicePluginPath")


def prepare_socket(path: str) -> None:
    """Make ``path`` ready to be served: its directory exists and a unix socket can be bound there (probed with a
    plain socket, so the reason is the kernel's), and no stale file is left on it. Raises SocketPathError."""
    check_socket_path(path)
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        raise SocketPathError(f"device-plugin directory {directory} exists and is not a directory") from None
    except OSError as exc:
        raise SocketPathError(f"device-plugin directory {directory} cannot be created: "
                              f"{exc.strerror or exc}") from None
    remove_socket(path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(path)
    except OSError as exc:
        raise SocketPathError(f"cannot create socket {path}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    remove_socket(path)


def remove_socket(path: str) -> None:
    """Remove a socket file if it is there; a path that cannot exist (a parent is a file) is fine too."""
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        log.warning("cannot remove socket", extra={"socket": path, "error": exc.strerror or str(exc)})


def socket_name(resource_name: str) -> str:
    """Endpoint file name for a resource: nvidia.com/gpu -> accelstack-nvidia.com-gpu.sock."""
    return "accelstack-" + resource_name.replace("/", "-") + ".sock"


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    """The five v1beta1 RPCs over a backend and its device table."""

    def __init__(self, backend: Backend, table: DeviceTable, metrics: PluginMetrics,
                 on_allocate: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.table = table
        self.metrics = metrics
        self.resource = backend.resource_name
        self.on_allocate = on_allocate  # handover.py re-reads the kubelet's view after an allocation

    async def GetDevicePluginOptions(self, request: api_pb2.Empty, context: Any) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def _listing(self) -> api_pb2.ListAndWatchResponse:
        response = api_pb2.ListAndWatchResponse()
        for aid, health, numa in self.table.listing():
            device = response.devices.add(ID=aid, health=health)
            if numa is not None:
                device.topology.nodes.add(ID=numa)
        return response

    async def ListAndWatch(self, request: api_pb2.Empty, context: Any) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        generation = self.table.generation
        yield self._listing()
        while True:
            generation = await self.table.wait_change(generation)
            yield self._listing()

    async def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest,
                                     context: Any) -> api_pb2.PreferredAllocationResponse:
        response = api_pb2.PreferredAllocationResponse()
        for creq in request.container_requests:
            available, must = list(creq.available_deviceIDs), list(creq.must_include_deviceIDs)
            unknown = self.table.unknown(available + must)
            if unknown:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"unknown {self.resource} device IDs {describe_ids(unknown)}")
            try:
                chosen = self.backend.preferred(available, must, int(creq.allocation_size))
            except AllocationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            response.container_responses.add(deviceIDs=chosen)
        return response

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Any) -> api_pb2.AllocateResponse:
        started = time.perf_counter()
        response = api_pb2.AllocateResponse()
        try:
            for creq in request.container_requests:
                ids = list(creq.devices_ids)
                if not ids:
                    raise ValueError("a container request names no device IDs")
                unknown = self.table.unknown(ids)
                if unknown:
                    raise ValueError(f"unknown {self.resource} device IDs {describe_ids(unknown)}")
                physical = [self.table.advertised[i] for i in ids]
                sick = sorted({p for p in physical if self.table.health[p] != HEALTHY})
                if sick:
                    log.warning("allocating unhealthy devices", extra={"devices": sick, "resource": self.resource})
                response.container_responses.append(self.backend.allocate(physical, ids))
        except ValueError as exc:
            self.metrics.allocations.labels(self.resource, "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.metrics.allocations.labels(self.resource, "ok").inc()
        self.metrics.allocate_seconds.labels(self.resource).observe(time.perf_counter() - started)
        if self.on_allocate:
            self.on_allocate()
        return response

    async def PreStartContainer(self, request: api_pb2.PreStartContainerRequest,
                                context: Any) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


FRESH_SOCKET_S = 2.0  # a kubelet socket younger than this may not be served yet
FRESH_RETRY_S = 0.2


def _inode(path: str) -> tuple[int, int, int] | None:
    """Identity of a file: device, inode and change time (inode numbers alone are reused)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class PluginRunner:
    """Serve, register and re-register one resource; see the module docstring."""

    def __init__(self, backend: Backend, table: DeviceTable, plugin_dir: str, metrics: PluginMetrics,
                 register_retry: float = 5.0, poll_interval: float = POLL_INTERVAL) -> None:
        self.backend = backend
        self.table = table
        self.plugin_dir = plugin_dir
        self.endpoint = socket_name(backend.resource_name)
        self.socket_path = os.path.join(plugin_dir, self.endpoint)
        self.kubelet_socket = os.path.join(plugin_dir, KUBELET_SOCKET)
        self.metrics = metrics
        self.register_retry = register_retry
        self.poll_interval = poll_interval
        self.registered = False
        self.registrations = 0
        self.on_registered: Callable[[], None] | None = None
        self.on_allocate: Callable[[], None] | None = None
        self._server: grpc.aio.Server | None = None
        self.dirwatch = DirWatch(plugin_dir, poll_interval)

    async def _serve(self) -> None:
        prepare_socket(self.socket_path)
        check_socket_path(self.kubelet_socket)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_quiet_servicer(DevicePluginService(self.backend, self.table, self.metrics, self._allocated), server)
        try:
            server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError as exc:  # grpc's "Failed to bind": the directory changed since the probe
            raise SocketPathError(f"cannot serve on socket {self.socket_path}: {exc}") from None
        await server.start()
        self._server = server
        # Serve before register: check our own socket answers before telling the kubelet about it.
        async with grpc.aio.insecure_channel(f"unix://{self.socket_path}") as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=5)
        log.info("serving", extra={"resource": self.backend.resource_name, "socket": self.socket_path})

    def _allocated(self) -> None:
        if self.on_allocate:
            self.on_allocate()

    async def _stop_server(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.2)
            self._server = None
        remove_socket(self.socket_path)

    async def _register_once(self) -> None:
        request = api_pb2.RegisterRequest(
            version=API_VERSION, endpoint=self.endpoint, resource_name=self.backend.resource_name,
            options=api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True))
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=5)

    async def _register(self, stop: asyncio.Event) -> bool:
        """Register, retrying while the kubelet is away. False when stopped first.

        No ``kubelet.sock``: wait for it to appear (watched). A failed attempt: wait ``register_retry``, or less
        when ``kubelet.sock`` is re-created meanwhile (a new kubelet)."""
        while not stop.is_set():
            tried = _inode(self.kubelet_socket)
            if tried is not None:
                try:
                    await self._register_once()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        self.metrics.registrations.labels(self.backend.resource_name, "refused").inc()
                        raise RegistrationError(
                            f"kubelet refused registration of {self.backend.resource_name}: "
                            f"{exc.code().name}: {exc.details()}") from None
                    self.metrics.registrations.labels(self.backend.resource_name, "unavailable").inc()
                    log.warning("kubelet unavailable, will retry",
                                extra={"resource": self.backend.resource_name, "error": exc.details()})
                else:
                    self.metrics.registrations.labels(self.backend.resource_name, "ok").inc()
                    return True
            await self._wait_kubelet_socket(stop, tried)
        return False

    async def _wait_kubelet_socket(self, stop: asyncio.Event, tried: tuple[int, int, int] | None) -> None:
        """Return on stop, when ``kubelet.sock`` is there and is not the one ``tried`` (None: none was), or,
        when one was tried, after ``register_retry`` at the latest."""
        loop = asyncio.get_running_loop()
        retry = self.register_retry
        if tried is not None and time.time() - tried[2] / 1e9 < FRESH_SOCKET_S:
            # a kubelet binds its socket a moment before it serves on it: an attempt that came in between must
            # not wait the whole retry period for a socket that will not be re-created again
            retry = min(retry, FRESH_RETRY_S)
        deadline = loop.time() + retry if tried is not None else None
        while not stop.is_set():
            current = _inode(self.kubelet_socket)
            if current is not None and current != tried:
                return
            if deadline is not None and loop.time() >= deadline:
                return
            await self.dirwatch.wait(math.inf if deadline is None else max(deadline - loop.time(), 0.0))

    async def run(self, stop: asyncio.Event) -> None:
        """Serve and stay registered until ``stop`` is set; then remove the socket."""
        stopping = asyncio.create_task(stop.wait())
        stopping.add_done_callback(lambda _: self.dirwatch.poke())
        try:
            while not stop.is_set():
                await self._serve()
                if not self.dirwatch.started:
                    self.dirwatch.start()  # the directory exists now
                if not await self._register(stop):
                    break
                kubelet_inode = _inode(self.kubelet_socket)
                self.registered = True
                self.registrations += 1
                self.metrics.registered.labels(self.backend.resource_name).set(1)
                log.info("registered", extra={"resource": self.backend.resource_name,
                                              "devices": len(self.table.advertised)})
                if self.on_registered:
                    self.on_registered()
                reason = await self._watch(stop, kubelet_inode)
                self.registered = False
                self.metrics.registered.labels(self.backend.resource_name).set(0)
                if reason:
                    log.warning("re-registering", extra={"resource": self.backend.resource_name, "reason": reason})
                await self._stop_server()
        finally:
            stopping.cancel()
            self.dirwatch.close()
            self.registered = False
            await self._stop_server()

    async def _watch(self, stop: asyncio.Event, kubelet_inode: tuple[int, int, int] | None) -> str:
        """Wait until stop (returns '') or a reason to re-register."""
        while not stop.is_set():
            await self.dirwatch.wait(math.inf)
            if stop.is_set():
                break
            current = _inode(self.kubelet_socket)
            if current is not None and current != kubelet_inode:
                return "kubelet.sock was re-created (kubelet restarted)"
            if _inode(self.socket_path) is None:
                return "plugin socket was removed (kubelet restarted)"
        return ""
