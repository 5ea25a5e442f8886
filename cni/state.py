"""What ADD leaves for DEL, CHECK and GC (one JSON file per attachment), and the per-module lock.

Layout under ``dataDir`` (default ``/var/lib/cni/accelstack-nr1``)::

    attachments/<network name>/<container ID>_<ifname>.json   written before ADD moves the NIC, completed at its end
    locks/<PCI address>.lock                                 flock(2)'d while a module is being moved
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from cni import fastjson as json
from cni.errors import TRY_AGAIN, CNIError


def attachment_dir(data_dir: str, network: str) -> str:
    return os.path.join(data_dir, "attachments", network)


def attachment_path(data_dir: str, network: str, container_id: str, ifname: str) -> str:
    return os.path.join(attachment_dir(data_dir, network), f"{container_id}_{ifname}.json")


def save(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(record))
    # no fsync: after a crash of the node every pod namespace is gone and the NICs are back anyway; the
    # rename alone keeps a reader from ever seeing half a record
    os.replace(tmp, path)


def load(path: str) -> dict | None:
    """The record, or None when there is none or it is unreadable (DEL then works from what it finds)."""
    try:
        with open(path) as fh:
            record = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def records(data_dir: str, network: str) -> list[tuple[str, dict]]:
    """All attachment records of one network: (path, record)."""
    directory = attachment_dir(data_dir, network)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        if name.endswith(".json"):
            path = os.path.join(directory, name)
            record = load(path)
            if record is not None:
                out.append((path, record))
    return out


class DeviceLock:
    """An exclusive flock on one module, so two ADDs (or an ADD and a DEL) never move its NIC at once."""

    def __init__(self, data_dir: str, pci_address: str, timeout: float):
        self.path = os.path.join(data_dir, "locks", f"{pci_address}.lock")
        self.timeout = timeout
        self.fd = -1

    def __enter__(self) -> DeviceLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self.fd)
                    raise
            if time.monotonic() >= deadline:
                os.close(self.fd)
                self.fd = -1
                raise CNIError(TRY_AGAIN, f"module {os.path.basename(self.path)[:-5]} is busy (lock held)")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1
