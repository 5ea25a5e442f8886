"""An API server that does not answer is an outage the processes ride out: a pass or background task that fails
on it is logged as one warning line with the error, never with a traceback; any other failure keeps its
traceback (issue 35.7: a plain connection refused was logged as an error with a 40-line traceback)."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from kubeapi import TransportError
from kubeapi.tasks import supervise

REFUSED = "GET /api/v1/nodes: ClientConnectorError: Cannot connect to host 127.0.0.1:6443 [Connect call failed]"


async def _crash_once(exc: BaseException, caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    stop = asyncio.Event()
    calls = 0

    async def task(_: asyncio.Event) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc
        stop.set()

    with caplog.at_level(logging.WARNING, logger="accelstack.tasks"):
        await asyncio.wait_for(supervise("t", task, stop, backoff=(0.001, 0.001), rng=random.Random(1)), 30)
    [record] = [r for r in caplog.records if r.name == "accelstack.tasks"]
    return record


async def test_a_refused_connection_is_one_warning_line_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    record = await _crash_once(TransportError(REFUSED), caplog)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "Connect call failed" in record.error  # type: ignore[attr-defined]
    assert "\n" not in record.getMessage()


async def test_a_bug_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    record = await _crash_once(KeyError("spec"), caplog)
    assert record.levelno == logging.ERROR and record.exc_info is not None
