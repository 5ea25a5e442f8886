"""kubeapi.collector: pauses of the cyclic collector nest and overlap (tasks, a worker thread), end with the last
of them, restore what was there before, and freeze what is alive only when a block asked for it."""

from __future__ import annotations

import asyncio
import gc
import threading

from kubeapi.collector import collector_paused


def test_pauses_nest_and_the_last_one_restores_the_collector() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still holds it
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_an_error_in_the_block_still_ends_the_pause() -> None:
    try:
        with collector_paused():
            raise ValueError("boom")
    except ValueError:
        pass
    assert gc.isenabled()


async def test_overlapping_pauses_in_tasks_and_a_thread_end_with_the_last() -> None:
    entered, leave = threading.Event(), threading.Event()

    def worker() -> None:  # a controller pass in its worker thread
        with collector_paused():
            entered.set()
            leave.wait(5)

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(5)
    release = asyncio.Event()

    async def relist() -> None:
        with collector_paused():
            await release.wait()

    task = asyncio.create_task(relist())
    await asyncio.sleep(0)
    leave.set()
    thread.join(5)
    assert not gc.isenabled()  # the thread's pause ended; the task's holds
    release.set()
    await task
    assert gc.isenabled()


def test_freeze_is_done_once_when_the_last_pause_ends_and_only_if_asked() -> None:
    gc.unfreeze()
    kept = [[i] for i in range(1000)]  # container objects the collector tracks
    try:
        with collector_paused():
            pass
        assert gc.get_freeze_count() == 0  # not asked
        with collector_paused():
            with collector_paused() as pause:
                pause.freeze()
            assert gc.get_freeze_count() == 0  # asked, but another block still pauses
        assert gc.get_freeze_count() >= len(kept)  # frozen at the end of the last pause
        frozen = gc.get_freeze_count()
        with collector_paused():
            pass
        assert gc.get_freeze_count() == frozen  # the request does not outlive the pause it was made in
        gc.unfreeze()
        try:  # a block that fails before it asks (a relist that failed half way) freezes nothing
            with collector_paused() as pause:
                raise ValueError("the list failed")
        except ValueError:
            pass
        assert gc.get_freeze_count() == 0 and gc.isenabled()
    finally:
        gc.unfreeze()
        del kept
