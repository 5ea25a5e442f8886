"""XIDs from the kernel log (``/dev/kmsg``), read from where the previous run stopped.

The NVIDIA driver logs ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.`` for every
XID. A short-lived NPD plugin cannot hold an NVML event set open between runs, so it reads the kernel's record
stream instead: each ``/dev/kmsg`` record is ``<prio>,<seq>,<usec>,<flags>;<text>`` with continuation lines
starting with a space, and the sequence number lets the next run skip what this one saw. The same reader takes
a plain file in that format (a saved log, a test fixture).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass

# "PCI:" is missing in older drivers' lines: "NVRM: Xid (0000:01:00): 13, ..."
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]+)\): (\d+)(?:,\s*(.*))?")


@dataclass(frozen=True)
class XidEvent:
    seq: int
    pci: str  # as the driver writes it: "0000:3b:00" (domain:bus:device) or with the function
    xid: int
    text: str


def _records(path: str) -> list[str]:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        char_device = stat.S_ISCHR(os.fstat(fd).st_mode)
        chunks: list[bytes] = []
        while True:
            try:
                chunk = os.read(fd, 16384)
            except BlockingIOError:
                break  # /dev/kmsg: no more records
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records were overwritten while we read: carry on with the next
                raise
            if not chunk:
                break
            chunks.append(chunk if chunk.endswith(b"\n") or not char_device else chunk + b"\n")
    finally:
        os.close(fd)
    text = b"".join(chunks).decode(errors="replace")
    return [line for line in text.split("\n") if line and not line.startswith(" ")]


def read_xids(path: str, after_seq: int) -> tuple[list[XidEvent], int]:
    """XID records with a sequence number above ``after_seq``, and the highest sequence number seen."""
    last = after_seq
    events: list[XidEvent] = []
    for record in _records(path):
        header, sep, message = record.partition(";")
        if not sep:
            continue
        fields = header.split(",")
        try:
            seq = int(fields[1])
        except (IndexError, ValueError):
            continue
        if seq <= after_seq:
            continue
        last = max(last, seq)
        match = _XID.search(message)
        if match:
            events.append(XidEvent(seq, match.group(1).lower(), int(match.group(2)), (match.group(3) or "").strip()))
    return events, last


def same_device(driver_pci: str, sysfs_address: str) -> bool:
    """'0000:3b:00' (the driver's short form) names the sysfs function '0000:3b:00.0'."""
    driver_pci, sysfs_address = driver_pci.lower(), sysfs_address.lower()
    return sysfs_address == driver_pci or sysfs_address.startswith(driver_pci + ".")
