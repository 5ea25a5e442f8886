"""The queue: by default priority first (higher first), then submission time, then arrival sequence.

The order is a key per GPR (:data:`Key`), computed once when it joins the queue; the scheduler may supply its
own key function (:mod:`.scheduler` orders by priority level, then predicted size with ageing). Held as one
sorted list per workspace so a pass can walk the global order and drop a whole workspace (for example one at
its quota) without stepping over its entries. A push appends; a list is sorted when it is next read in order, so
filling the queue with n GPRs costs one sort, not n insertions.

An entry may hold a *prototype* instead (``push(..., shared=True)``): a GPR object its driver keeps between
rebuilds and that nobody may change. The queue's ``fresh`` function makes the working copy the first time the
entry is handed out (walk, get, remove, ordered), so a rebuild of 10,000 queued GPRs copies only the few that a
pass looks at; ``names()`` reads the order without handing any out.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet

from .gpr import GPR

Key = tuple[int, float, int, str]


def queue_key(g: GPR, use_priority: bool = True) -> Key:
    """Priority (higher first; ignored for FIFO), then submission time, then arrival sequence."""
    return (-g.priority if use_priority else 0, g.submitted_at, g.seq, g.name)


class GPRQueue:
    def __init__(self, use_priority: bool = True, key: Callable[[GPR], Key] | None = None) -> None:
        self.use_priority = use_priority
        self.key_of: Callable[[GPR], Key] = key or (lambda g: queue_key(g, use_priority))
        self._by_ws: dict[str, list[Key]] = {}
        self._items: dict[str, tuple[str, Key, GPR]] = {}
        self._unsorted: set[str] = set()  # workspaces whose list was appended to out of order
        self._shared: set[str] = set()  # entries that still hold a prototype
        self.fresh: Callable[[GPR, Key], GPR] | None = None  # prototype, its key -> the working GPR

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def push(self, g: GPR, key: Key | None = None, shared: bool = False) -> None:
        """Queue ``g`` under ``key`` (default: the queue's key function of ``g``); ``shared``: ``g`` is a
        prototype, copied by ``fresh`` when first handed out."""
        if g.name in self._items:
            raise ValueError(f"{g.name} is already queued")
        if key is None:
            key = self.key_of(g)
        ws = g.workspace
        lst = self._by_ws.get(ws)
        if lst is None:
            lst = self._by_ws[ws] = []
        elif lst and key < lst[-1]:
            self._unsorted.add(ws)
        lst.append(key)
        self._items[g.name] = (ws, key, g)
        if shared:
            if self.fresh is None:
                raise ValueError("a shared entry needs the queue's fresh function")
            self._shared.add(g.name)

    def merge_shared(self, items: dict[str, tuple[str, Key, GPR]], by_ws: dict[str, list[Key]]) -> None:
        """Queue prototypes kept as this queue keeps its entries (``items``; ``by_ws``: each workspace's keys,
        sorted), as ``push(g, key, shared=True)`` of each would: a few copies in C instead of a push each."""
        if self.fresh is None:
            raise ValueError("a shared entry needs the queue's fresh function")
        if not self._items.keys().isdisjoint(items):
            raise ValueError("an entry is already queued")
        self._items.update(items)
        for ws, keys in by_ws.items():
            lst = self._by_ws.get(ws)
            if not lst:
                self._by_ws[ws] = keys.copy()
            elif keys:
                lst += keys
                self._unsorted.add(ws)
        self._shared.update(items)

    def _out(self, name: str) -> GPR:
        """The entry's GPR, copied from its prototype the first time."""
        ws, key, g = self._items[name]
        if name in self._shared:
            self._shared.discard(name)
            assert self.fresh is not None
            g = self.fresh(g, key)
            self._items[name] = (ws, key, g)
        return g

    def _sort(self) -> None:
        for ws in self._unsorted:
            self._by_ws[ws].sort()
        self._unsorted.clear()

    def remove(self, name: str) -> GPR | None:
        if name not in self._items:
            return None
        g = self._out(name)
        ws, key, _ = self._items.pop(name)
        if ws in self._unsorted:
            self._sort()
        lst = self._by_ws[ws]
        del lst[bisect.bisect_left(lst, key)]
        return g

    def key(self, name: str) -> Key | None:
        """The key ``name`` was queued with (None if not queued)."""
        item = self._items.get(name)
        return item[1] if item else None

    def get(self, name: str) -> GPR | None:
        return self._out(name) if name in self._items else None

    def walk(self) -> QueueWalk:
        """Iterate in global order; ``drop(workspace)`` skips the rest of a workspace. Do not mutate the
        queue while walking (collect removals and apply them afterwards)."""
        return QueueWalk(self)

    def _keys(self) -> list[Key]:
        """Every key in global order (the workspaces' sorted lists merged by one C-level sort of runs)."""
        self._sort()
        lists = [lst for lst in self._by_ws.values() if lst]
        return lists[0] if len(lists) == 1 else sorted(itertools.chain.from_iterable(lists))

    def ordered(self) -> list[GPR]:
        """All queued GPRs in global order."""
        keys = self._keys()
        if self._shared:
            return [self._out(k[3]) for k in keys]
        items = self._items
        return [items[k[3]][2] for k in keys]

    def peek(self) -> list[GPR]:
        """All queued GPRs in global order as stored, without handing any out: a shared entry is its prototype,
        which nobody may change (see :meth:`is_shared`)."""
        items = self._items
        return [items[k[3]][2] for k in self._keys()]

    def shared(self) -> AbstractSet[str]:
        """The entries that still hold their prototypes (never handed out); read only, valid until the queue
        next changes."""
        return self._shared

    def is_shared(self, name: str) -> bool:
        """Whether the entry still holds its prototype (never handed out)."""
        return name in self._shared

    def names(self) -> list[str]:
        """The queued GPRs' names in global order (no GPR handed out)."""
        return [k[3] for k in self._keys()]


class QueueWalk(Iterator[GPR]):
    def __init__(self, q: GPRQueue) -> None:
        self._q = q
        q._sort()
        self._dropped: set[str] = set()
        self._heap: list[tuple[Key, str, int]] = [(lst[0], ws, 0) for ws, lst in q._by_ws.items() if lst]
        heapq.heapify(self._heap)

    def drop(self, workspace: str) -> None:
        self._dropped.add(workspace)

    def __next__(self) -> GPR:
        while self._heap:
            key, ws, i = heapq.heappop(self._heap)
            if ws in self._dropped:
                continue
            lst = self._q._by_ws[ws]
            if i + 1 < len(lst):
                heapq.heappush(self._heap, (lst[i + 1], ws, i + 1))
            return self._q._out(key[3])
        raise StopIteration
