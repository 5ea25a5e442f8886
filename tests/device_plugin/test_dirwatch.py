"""DirWatch: inotify wake-ups for a directory's entries, the watch re-added after the directory is replaced."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from device_plugin import dirwatch
from device_plugin.dirwatch import SAFETY_POLL, DirWatch


async def timed_wait(watch: DirWatch, timeout: float) -> float:
    started = time.monotonic()
    await watch.wait(timeout)
    return time.monotonic() - started


async def test_entry_created_or_deleted_wakes_the_waiter(tmp_path: Path) -> None:
    watch = DirWatch(str(tmp_path), poll_interval=0.05)
    watch.start()
    try:
        assert watch.active and watch.period == SAFETY_POLL
        await watch.wait(0)  # the start-up wake-up
        waiter = asyncio.create_task(timed_wait(watch, 30))
        await asyncio.sleep(0)  # the waiter is waiting
        (tmp_path / "kubelet.sock").touch()
        assert await asyncio.wait_for(waiter, 5) < SAFETY_POLL  # woken by the event, not the safety poll
        waiter = asyncio.create_task(timed_wait(watch, 30))
        await asyncio.sleep(0)
        (tmp_path / "kubelet.sock").unlink()
        assert await asyncio.wait_for(waiter, 5) < SAFETY_POLL
        waiter = asyncio.create_task(timed_wait(watch, 30))
        await asyncio.sleep(0)
        watch.poke()
        assert await asyncio.wait_for(waiter, 5) < SAFETY_POLL
    finally:
        watch.close()
    assert not watch.active


async def test_directory_replaced_is_watched_again(tmp_path: Path) -> None:
    directory = tmp_path / "dp"
    directory.mkdir()
    watch = DirWatch(str(directory), poll_interval=0.05)
    watch.start()
    try:
        await watch.wait(0)
        os.rmdir(directory)
        await asyncio.wait_for(watch.wait(30), 5)  # IN_DELETE_SELF
        assert not watch.active
        directory.mkdir()
        await watch.wait(0)  # the next wait re-adds the watch on the new directory
        assert watch.active
        waiter = asyncio.create_task(timed_wait(watch, 30))
        await asyncio.sleep(0)
        (directory / "x.sock").touch()
        assert await asyncio.wait_for(waiter, 5) < SAFETY_POLL
    finally:
        watch.close()


async def test_without_inotify_it_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dirwatch, "_libc", lambda: None)
    watch = DirWatch(str(tmp_path), poll_interval=0.05)
    watch.start()
    try:
        assert not watch.active and watch.period == 0.05
        assert await timed_wait(watch, 30) < SAFETY_POLL  # the poll interval bounds every wait
    finally:
        watch.close()
