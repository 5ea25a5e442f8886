from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.inference.harness import CLIENTS, RunningGateway
from tests.inference.runtime_peer import RuntimePeer


@pytest.fixture
async def make_peers() -> AsyncIterator[Callable[..., Any]]:
    started: list[RuntimePeer] = []

    async def make(count: int = 1, **kw: Any) -> list[RuntimePeer]:
        peers = [RuntimePeer(name=f"r{len(started) + i}", **kw) for i in range(count)]
        for peer in peers:
            await peer.start()
        started.extend(peers)
        return peers

    yield make
    for peer in started:
        await peer.stop()


@pytest.fixture
async def make_gateway() -> AsyncIterator[Callable[..., Any]]:
    started: list[RunningGateway] = []

    async def make(settings: Any = None, **listener: Any) -> RunningGateway:
        gw = RunningGateway(settings, **listener)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        await gw.stop()



@pytest.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    yield
    while CLIENTS:
        await CLIENTS.pop().close()


@pytest.fixture(autouse=True)
def every_log_record(caplog: pytest.LogCaptureFixture) -> None:
    """Every log call is formatted, at every level: an ``extra`` key that clashes with a LogRecord attribute
    (``name``, ``msg``…) raises, and must do so here rather than in production at level info."""
    caplog.set_level(logging.DEBUG)
