"""HTTP heads the gateway has parsed before, kept by their bytes less the ``Content-Length`` line.

A client sends the same header block on request after request but for its length (an SDK's headers are fixed per
client), and a replica answers with the same head but for its length (and its ``Date``, once a second); parsing
such a head again was a tenth of the gateway's Python a request. Both the listener (request heads) and the
upstream client (answer heads) keep theirs here: the length's line, digits only, is found and checked by one
expression, and what is left is the key.
"""

from __future__ import annotations

import re
from typing import Generic, TypeVar

# a Content-Length line of a head (each header line after its CRLF), its value digits only
_LENGTH_LINE = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]{1,18})[ \t]*(?=\r\n|\Z)", re.IGNORECASE)

T = TypeVar("T")


def without_length(head: bytes) -> tuple[bytes, str | None]:
    """(``head`` less its first ``Content-Length`` line, that line's value), or (``head``, None) without one."""
    found = _LENGTH_LINE.search(head)
    if found is None:
        return head, None
    return head[:found.start()] + head[found.end():], found.group(1).decode("ascii")


class SeenHeads(Generic[T]):
    """Parsed heads by key, at most ``size`` of at most ``max_bytes`` each (all forgotten when full: the next
    request of each client parses its head again). Keys are any sender's bytes, so both bounds hold."""

    def __init__(self, size: int, max_bytes: int) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.kept: dict[bytes, T] = {}
        self.get = self.kept.get  # the hot path's lookup, without a method of this class in between

    def keep(self, key: bytes, parsed: T) -> None:
        if len(key) > self.max_bytes:
            return
        if len(self.kept) >= self.size:
            self.kept.clear()
        self.kept[key] = parsed
