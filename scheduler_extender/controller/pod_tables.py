"""The pods as a pass sees them: by GPR (bound, gated, loose), each GPR's tally (counted, running, ended, failed),
which nodes' pods changed since the last pass, and why an Admitted GPR's pods cannot run on its nodes."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection, Sequence
from typing import NamedTuple

from scheduler_extender.core.gpr import GPR
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import TERMINAL_POD_PHASES, NodeView, PodView
from scheduler_extender.objects.podfit import (
    why_not,
)


class PodsByGPR:
    """The pods of a snapshot by GPR, as a pass reads them; a function of the pods alone (kept between passes
    while every pod is the one seen last time, and made from the last one when a few pods changed: see
    :meth:`after`). The tables' key order is not part of what they say."""

    def __init__(self, seen: list[PodView]) -> None:
        self.seen = seen
        self.of: dict[str, list[PodView]] = {}  # every pod of each GPR
        self.placed: dict[str, list[PodView]] = {}  # bound or past the gate: the only ones an eviction may take
        self.loose: list[PodView] = []  # ungated and unbound: waiting for kube-scheduler (few)
        # live pods of a GPR held at its gate: where they can run is where the GPR may go. Their node affinity is
        # all their own (accelstack narrows a pod only in the patch that lifts the gate, or, in the webhook,
        # instead of it)
        self.gated: dict[str, list[PodView]] = {}
        # GPR -> node -> CPU and memory its live pods bound there request (only GPRs whose pods request some)
        self.hosted: dict[str, dict[str, tuple[int, int]]] = {}
        # made by after(): the tables it was made from, and the GPRs whose tables were made again (the others
        # keep their very lists)
        self.origin: PodsByGPR | None = None
        self.affected: frozenset[str] = frozenset()
        self.moved: frozenset[str] = frozenset()  # the nodes the changed pods were or are on
        gate = gr.SCHEDULING_GATE
        for p in seen:
            if p.gpr and self._file(p, gate):
                self.loose.append(p)

    def _file(self, p: PodView, gate: str) -> bool:
        """Put pod ``p`` (of a GPR) in its GPR's tables; True when it is loose (ungated and unbound)."""
        self.of.setdefault(p.gpr, []).append(p)
        if p.node:
            self.placed.setdefault(p.gpr, []).append(p)
            if (p.host[0] or p.host[1]) and p.phase not in TERMINAL_POD_PHASES:
                on = self.hosted.setdefault(p.gpr, {})
                have = on.get(p.node, (0, 0))
                on[p.node] = (have[0] + p.host[0], have[1] + p.host[1])
        elif gate not in p.gates:
            self.placed.setdefault(p.gpr, []).append(p)
            return True
        elif not p.terminating and p.phase not in TERMINAL_POD_PHASES:
            self.gated.setdefault(p.gpr, []).append(p)
        return False

    @classmethod
    def after(cls, prev: PodsByGPR, seen: list[PodView]) -> PodsByGPR:
        """``PodsByGPR(seen)``, made from ``prev`` (the last pass's) when at most :data:`MOVED_LIMIT` pods changed
        (by identity: the informer replaces a pod's view when its object changes, in place in its order, and
        appends a new pod): the tables of the GPRs those pods belong or belonged to are made again, in
        ``seen``'s order; every other GPR keeps its lists, the very objects (a later step that keeps what it
        worked out for a GPR's list sees it unchanged)."""
        old = prev.seen
        diff = _list_changes(old, seen, MOVED_LIMIT)
        if diff is None:
            return cls(seen)
        pairs, deleted, added = diff
        swapped = {id(a): b for a, b in pairs}  # old view -> its new version, in the same place
        moved = _moved_nodes(pairs, deleted, added)
        affected = {a.gpr for a, _ in pairs if a.gpr}
        affected.update(b.gpr for _, b in pairs if b.gpr)
        affected.update(p.gpr for p in added if p.gpr)
        affected.update(p.gpr for p in deleted if p.gpr)
        out = cls([])
        out.seen, out.origin, out.affected, out.moved = seen, prev, frozenset(affected), moved
        prev.origin = None  # one step back only: no chain of every pass's tables
        out.of, out.placed, out.gated, out.hosted = dict(prev.of), dict(prev.placed), dict(prev.gated), dict(prev.hosted)
        if not affected:
            out.loose = prev.loose
            return out
        regrouped = any(a.gpr != b.gpr for a, b in pairs)
        if regrouped:  # a pod moved to another GPR: its place in that GPR's list is its place in ``seen``
            members = [p for p in seen if p.gpr in affected]
        else:
            gone = {id(p) for p in deleted}
            members = [swapped.get(id(p), p) for key in affected for p in prev.of.get(key, ()) if id(p) not in gone]
            members += [p for p in added if p.gpr]
        for key in affected:
            for table in (out.of, out.placed, out.gated, out.hosted):
                table.pop(key, None)
        gate = gr.SCHEDULING_GATE
        loose_now = {id(p) for p in members if out._file(p, gate)}
        was = [p for p in prev.loose if p.gpr in affected]
        if not regrouped and not added and not deleted and len(loose_now) == len(was) and all(
                id(swapped.get(id(p), p)) in loose_now for p in was):
            out.loose = [swapped.get(id(p), p) for p in prev.loose]  # the same pods loose, in their places
        else:
            keep = {id(p) for p in prev.loose if p.gpr not in affected} | loose_now
            out.loose = [p for p in seen if id(p) in keep] if keep else []
        return out


def last_active(g: GPR, tally: PodTally, now: float) -> float:
    """When the GPR last had a running pod: now if one runs, else the latest end of one of its pods after
    admission, else its start (or admission). An Admitted GPR whose pods never start is idle since admission."""
    if tally.any_running:
        return now
    since = g.started_at or g.admitted_at or now
    return tally.last_end if tally.last_end > since else since


class PodTally(NamedTuple):
    """What a pass reads of an allocated GPR's pods: a function of the pods and the GPR's admission time alone."""

    counted: int  # pods of this admission (not bound, nor ended, before it)
    running: int  # of those, Running
    ended: int  # of those, Succeeded or Failed
    failed: int  # of those, Failed
    any_running: bool  # any pod Running (of this admission or not)
    last_end: float  # the latest end of any pod (0 if none ended)


NO_PODS: tuple[PodView, ...] = ()


def pod_tally(pods: Sequence[PodView], since: float) -> PodTally:
    counted = running = ended = failed = 0
    any_running, last_end = False, 0.0
    for p in pods:
        phase = p.phase
        if phase == "Running":
            any_running = True
        if p.ended_at > last_end:
            last_end = p.ended_at
        terminal = phase in TERMINAL_POD_PHASES
        # pods of an earlier admission of this GPR (bound or ended before this one) say nothing about this one
        if (p.bound_at and p.bound_at < since) or (terminal and p.ended_at and p.ended_at < since):
            continue
        counted += 1
        if phase == "Running":
            running += 1
        elif terminal:
            ended += 1
            failed += phase == "Failed"
    return PodTally(counted, running, ended, failed, any_running, last_end)


class PodTallies:
    """:func:`pod_tally` of each allocated GPR, kept while its pods are the very views (or equal ones) and its
    admission time the one seen last time: 4,800 running GPRs cost a pass a lookup each, not a count of their
    pods twice."""

    def __init__(self) -> None:
        self.kept: dict[str, tuple[Sequence[PodView], float, PodTally]] = {}

    def of(self, key: str, g: GPR, pods: Sequence[PodView]) -> PodTally:
        since = g.admitted_at or 0.0
        hit = self.kept.get(key)
        if hit is not None and hit[1] == since and hit[0] == pods:
            return hit[2]
        tally = pod_tally(pods, since)
        self.kept[key] = (pods, since, tally)
        return tally

    def prune(self, live: Collection[str]) -> None:
        """Forget the GPRs not in ``live`` once they are as many as those in it (amortised: not every pass)."""
        if len(self.kept) > 2 * len(live) + 64:
            self.kept = {key: hit for key, hit in self.kept.items() if key in live}


MOVED_LIMIT = 256  # pods changed since the last pass up to which only their nodes are counted again


def _list_changes(old: list[PodView], new: list[PodView], limit: int
                  ) -> tuple[list[tuple[PodView, PodView]], list[PodView], list[PodView]] | None:
    """How ``new`` came from ``old`` when pods were replaced in place (same UID), deleted, and appended at the
    end, as the informer changes its table: (replaced (old, new) pairs, deleted, appended); None for anything
    else or more than ``limit`` changes. The unchanged stretches are skipped in C (identity)."""
    pairs: list[tuple[PodView, PodView]] = []
    deleted: list[PodView] = []
    i = j = 0
    size = len(old)
    while i < size and j < len(new):
        # the next place where the lists differ, from (i, j) on, found in C (list iterators set to a position in
        # O(1): no stretch is walked twice)
        new_it, old_it = iter(new), iter(old)
        new_it.__setstate__(j)  # type: ignore[attr-defined]
        old_it.__setstate__(i)  # type: ignore[attr-defined]
        k = next(itertools.compress(itertools.count(), map(operator.is_not, new_it, old_it)), None)
        if k is None:
            step = min(size - i, len(new) - j)
            i, j = i + step, j + step
            break
        i, j = i + k, j + k
        if i >= size or j >= len(new):
            break
        a, b = old[i], new[j]
        if a.uid == b.uid:
            pairs.append((a, b))
            i, j = i + 1, j + 1
        else:  # a deleted: b is what follows it
            deleted.append(a)
            i += 1
        if len(pairs) + len(deleted) > limit:
            return None
    deleted += old[i:]
    added = new[j:]
    if len(pairs) + len(deleted) + len(added) > limit:
        return None
    # what was appended must be new: a pod deleted with its UID reused (or a table rebuilt) starts afresh
    if added and deleted and {p.uid for p in added} & {p.uid for p in deleted}:
        return None
    return pairs, deleted, added


def pods_moved_between(old: list[PodView], new: list[PodView]) -> frozenset[str] | None:
    """The nodes the pods that changed between two snapshots' pod lists were or are on ("" left out); None when
    more than :data:`MOVED_LIMIT` changed, or the lists are not one made from the other by the informer's
    changes (see :func:`_list_changes`)."""
    diff = _list_changes(old, new, MOVED_LIMIT)
    if diff is None:
        return None
    return _moved_nodes(*diff)


def _moved_nodes(pairs: list[tuple[PodView, PodView]], deleted: list[PodView], added: list[PodView]) -> frozenset[str]:
    """The nodes the changed pods of :func:`_list_changes` were or are on, or take devices of (PodView.place;
    "" left out)."""
    return frozenset([n for a, b in pairs for n in (a.place, b.place) if n] + [p.place for p in deleted if p.place]
                     + [p.place for p in added if p.place])


def same_ledgers(old: list[NodeView], new: list[NodeView]) -> bool:
    """Whether two lists of nodes agree, node by node, in all that :func:`used_outside_reservations` reads of
    them: the name, the ledger and whether it could be read."""
    return len(old) == len(new) and all(
        a is b or (a.name == b.name and a.ledger_error == b.ledger_error and a.ledger == b.ledger)
        for a, b in zip(old, new, strict=True))


def cannot_run(pods: Sequence[PodView], nodes: Sequence[NodeView | None]) -> str:
    """Why the first unbound, live pod that kube-scheduler's own filters (taints, nodeSelector, node affinity)
    keep off every one of ``nodes`` cannot go there; "" when each can go to one of them."""
    known = [n for n in nodes if n is not None]
    for p in pods:
        if p.node or not p.live or p.terminating or not known:
            continue
        if any(not why_not(p, n) for n in known):  # stops at the first node it can go to (one, once narrowed)
            continue
        listed = "; ".join(f"{n.name}: {why_not(p, n)}" for n in known[:3])
        return f"pod {p.name} cannot run on the reserved nodes ({listed}{'; ...' if len(known) > 3 else ''})"
    return ""
