"""The per-node allocation ledger: which pods hold how many managed devices on a node.

The ledger lives in the Node's annotation ``accelstack.io/ledger`` and is changed only with optimistic
concurrency (the patch carries the Node's ``resourceVersion``; the API server refuses a stale one with 409).
That makes the API server the single point of serialisation for binds, so two extender replicas — or a
replica restarted in the middle of a burst — can never hand out the same devices twice. This module is the
pure part: parse and render; ``cluster.NodeView`` aggregates it and ``binder`` does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

LEDGER_ANNOTATION = "accelstack.io/ledger"
LEDGER_VERSION = 1  # {"v": 1, "pods": {uid: entry}}; version 0 is the bare {uid: entry} map of earlier releases


class LedgerVersionError(ValueError):
    """The annotation was written by a newer accelstack: read nothing from it and write nothing to it."""


@dataclass(frozen=True)
class Entry:
    uid: str
    pod: str  # namespace/name
    requests: dict[str, int]  # managed resource -> devices
    gpr: str = ""  # namespace/name of the pod's GPR, "" when it has none
    since: float = 0.0  # epoch seconds when the bind recorded it (stale unbound entries expire)


def parse(text: str | None) -> dict[str, Entry]:
    """Entries by pod UID. An absent annotation is an empty ledger; a malformed one raises ValueError (and a
    newer format :class:`LedgerVersionError`): the caller must neither trust nor overwrite it."""
    if not text:
        return {}
    raw = orjson.loads(text)  # {"v": 1, "pods": {uid: {"p": "ns/name", "r": {resource: n}, "g": "ns/gpr", "t": t}}}
    if not isinstance(raw, dict):
        raise ValueError("ledger annotation is not a JSON object")
    if "v" in raw:
        if raw["v"] != LEDGER_VERSION:
            raise LedgerVersionError(f"ledger format version {raw['v']!r} is newer than {LEDGER_VERSION}")
        raw = raw.get("pods")
        if not isinstance(raw, dict):
            raise ValueError("ledger annotation has no pods map")
    out = {}
    for uid, item in raw.items():
        requests = {str(k): int(v) for k, v in dict(item["r"]).items()}
        out[uid] = Entry(uid=uid, pod=str(item["p"]), requests=requests, gpr=str(item.get("g", "")),
                         since=float(item.get("t", 0.0)))
    return out


def render(entries: Mapping[str, Entry]) -> str:
    pods = {uid: {"p": e.pod, "r": e.requests, "t": round(e.since, 3), **({"g": e.gpr} if e.gpr else {})}
            for uid, e in sorted(entries.items())}
    return orjson.dumps({"v": LEDGER_VERSION, "pods": pods}).decode()
