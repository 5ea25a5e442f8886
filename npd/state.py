"""What a check remembers between runs: a small JSON file per check, replaced atomically.

A missing or corrupt file is a first run (with a warning), never a failure: the state only narrows what is
reported ("since the last run"), so losing it must not make the node look broken.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("accelstack.npd.state")


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("state unreadable; starting afresh", extra={"path": str(path), "error": str(exc)})
        return {}
    return data if isinstance(data, dict) else {}


def save(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle)
        os.replace(tmp, target)
    except OSError as exc:
        log.warning("state not saved", extra={"path": str(path), "error": str(exc)})


def boot_id(proc_root: str = "/proc") -> str:
    try:
        return Path(proc_root, "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
