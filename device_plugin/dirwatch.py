"""Wake-ups when a directory's entries change: inotify on the event loop, with a slow poll as the safety net.

The device-plugin runner must notice within milliseconds when ``kubelet.sock`` is created or replaced (a new
kubelet) or its own socket is deleted, and must not spend CPU polling for it the rest of the time. ``DirWatch``
registers an inotify watch for entries created, deleted or moved in the directory and sets an event when any
arrive; the runner then ``stat``s the paths it cares about. Every ``fallback`` seconds it wakes anyway: that
covers the directory itself being removed and re-created (the watch is then re-added) and a kernel without
inotify or a user out of inotify instances (``fs.inotify.max_user_instances``, often exhausted on busy nodes),
where the poll is all there is and uses the short interval the caller passes.

inotify is reached through libc with ctypes (Linux only); nothing else in the process depends on it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import struct

log = logging.getLogger("accelstack.device_plugin.dirwatch")

IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
WATCH_MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
EVENT_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)
SAFETY_POLL = 1.0  # seconds between wake-ups while inotify works


def _libc() -> ctypes.CDLL | None:
    """The C library the interpreter is linked with (no ``find_library``: it may run ``ldconfig``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1  # noqa: B018 - a libc without inotify raises AttributeError here
    except (OSError, AttributeError):
        return None
    return libc


class DirWatch:
    """``wait(timeout)`` returns early when an entry of ``directory`` is created, deleted or moved."""

    def __init__(self, directory: str, poll_interval: float) -> None:
        self.directory = directory
        self.poll_interval = poll_interval  # the wake-up period when inotify is not available
        self._changed = asyncio.Event()
        self._libc = _libc()
        self._fd = -1
        self._watching = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def active(self) -> bool:
        """Whether inotify watches the directory now (else the caller is polling)."""
        return self._watching

    @property
    def period(self) -> float:
        """Longest sleep between wake-ups."""
        return SAFETY_POLL if self._watching else self.poll_interval

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._libc is None:
            log.warning("no inotify: polling the plugin directory", extra={"interval": self.poll_interval})
            return
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            error = os.strerror(ctypes.get_errno())
            log.warning("inotify unavailable: polling the plugin directory",
                        extra={"error": error, "interval": self.poll_interval})
            return
        self._fd = fd
        self._loop.add_reader(fd, self._readable)
        self._add_watch()

    def _add_watch(self) -> None:
        if self._fd < 0 or self._watching or self._libc is None:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(self.directory), WATCH_MASK)
        if wd >= 0:
            self._watching = True
            self._changed.set()  # the directory may have changed while it was not watched

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError as exc:
            log.warning("inotify read failed: polling the plugin directory", extra={"error": exc.strerror})
            self.close()
            return
        offset = 0
        while offset + EVENT_HEADER.size <= len(data):
            _wd, mask, _cookie, length = EVENT_HEADER.unpack_from(data, offset)
            offset += EVENT_HEADER.size + length
            if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                self._watching = False  # the directory went away: re-added on the next wake-up if it is back
        self._changed.set()

    async def wait(self, timeout: float) -> None:
        """Until a change in the directory, ``poke()`` or ``timeout`` seconds (at most ``period``)."""
        if not self._watching:
            self._add_watch()
        if not self._changed.is_set():
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(timeout, self.period))
            except TimeoutError:
                pass
        self._changed.clear()

    def poke(self) -> None:
        """Wake the waiter now (on shutdown)."""
        self._changed.set()

    def close(self) -> None:
        if self._fd >= 0:
            if self._loop is not None:
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        self._watching = False
