"""Network namespaces without leaving the plugin's own: open a netlink socket *inside* another namespace.

A netlink socket stays bound to the namespace it was created in, so the plugin enters a namespace just long
enough to create a socket there and returns at once. The temporary namespace of the host-device pattern is
made with ``unshare(CLONE_NEWNET)`` and lives as long as its file descriptor is open: no bind mount, nothing
left behind if the plugin dies (the kernel then hands physical devices in it back to the initial namespace).
"""

from __future__ import annotations

import os

from cni.netlink import Netlink

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs start-up time; only the type checker needs it
    from typing import Any

CLONE_NEWNET = 0x40000000
_libc: Any = None


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = _load_libc()
    if libc.setns(fd, CLONE_NEWNET) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _unshare() -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(CLONE_NEWNET)
        return
    libc = _load_libc()
    if libc.unshare(CLONE_NEWNET) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


class Namespace:
    """An open network namespace: its file descriptor and a netlink socket inside it."""

    def __init__(self, fd: int, nl: Netlink, path: str):
        self.fd, self.nl, self.path = fd, nl, path

    def close(self) -> None:
        self.nl.close()
        os.close(self.fd)


class Namespaces:
    """The plugin's own (host) namespace plus any it opens; closes them all on ``close``."""

    def __init__(self) -> None:
        self.host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.host = Namespace(self.host_fd, Netlink(), "host")
        self._opened: list[Namespace] = []

    def _socket_in(self, fd: int) -> Netlink:
        _setns(fd)
        try:
            return Netlink()
        finally:
            _setns(self.host_fd)

    def open(self, path: str) -> Namespace:
        """The namespace at ``path`` (e.g. CNI_NETNS); OSError when it does not exist or is no netns."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            ns = Namespace(fd, self._socket_in(fd), path)
        except BaseException:
            os.close(fd)
            raise
        self._opened.append(ns)
        return ns

    def temporary(self) -> Namespace:
        """A new, empty namespace that disappears when closed."""
        _unshare()
        try:
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                nl = Netlink()
            except BaseException:
                os.close(fd)
                raise
        finally:
            _setns(self.host_fd)
        ns = Namespace(fd, nl, "temporary")
        self._opened.append(ns)
        return ns

    def close(self) -> None:
        for ns in reversed(self._opened):
            ns.close()
        self._opened.clear()
        self.host.close()

    def __enter__(self) -> Namespaces:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
