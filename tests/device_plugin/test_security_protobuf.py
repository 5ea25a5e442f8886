"""Issue 36.8: a request whose bytes are not the method's protobuf is refused as INVALID_ARGUMENT with one
WARNING line and no traceback (grpc's own path logged ``Unexpected [DecodeError] raised by servicer method`` at
ERROR with a traceback, once per request: 3,200 malformed calls, 3,200 tracebacks). Valid requests still work."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from device_plugin.server import add_quiet_servicer
from protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc


class Servicer(api_pb2_grpc.DevicePluginServicer):
    async def Allocate(self, request: Any, context: Any) -> Any:
        return api_pb2.AllocateResponse(container_responses=[api_pb2.ContainerAllocateResponse()
                                                             for _ in request.container_requests])

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID="d0", health="Healthy")])


async def test_undecodable_requests_are_one_warning_each_and_valid_ones_still_answered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    server = grpc.aio.server()
    add_quiet_servicer(Servicer(), server)
    address = f"unix://{tmp_path}/plugin.sock"
    server.add_insecure_port(address)
    await server.start()
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    bad = [b"\xff\xff\xff\xff", b"\x0a\x05abc", b"\x08" * 7]
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for payload in bad:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await channel.unary_unary("/v1beta1.DevicePlugin/Allocate", **raw)(payload)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid AllocateRequest" in (refused.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in channel.unary_stream("/v1beta1.DevicePlugin/ListAndWatch", **raw)(payload):
                        pass
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stub = api_pb2_grpc.DevicePluginStub(channel)
            answer = await stub.Allocate(api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["d0"])]))
            assert len(answer.container_responses) == 1
            assert [d.ID async for r in stub.ListAndWatch(api_pb2.Empty()) for d in r.devices] == ["d0"]
    finally:
        await server.stop(0)
    warnings = [r for r in caplog.records if r.getMessage() == "undecodable protobuf request refused"]
    assert len(warnings) == 2 * len(bad) and all(r.levelno == logging.WARNING and not r.exc_info for r in warnings)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
