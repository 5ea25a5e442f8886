"""What the controller does to pods: narrow a gated pod's node affinity to its reservation and lift the gate (the
PATCH body), evict bound pods whose GPR no longer holds their node, and find auto-created GPRs left without
pods."""

from __future__ import annotations

from scheduler_extender.controller.pass_cache import Decoded
from scheduler_extender.controller.pass_types import Eviction, Snapshot
from scheduler_extender.core.gpr import Phase
from scheduler_extender.core.scheduler import Scheduler
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import PodView
from scheduler_extender.objects.podfit import (
    narrowed,
    selector_mismatch,
)


def evictions_of(sched: Scheduler, placed: dict[str, list[PodView]], final: dict[str, str],
               deleting: set[str], uid_of: dict[str, str]) -> list[Eviction]:
    """Bound, live pods that hold devices outside their GPR's reservation: pods of Evicting, finished, requeued
    or deleted GPRs. Pods without a GPR and pods never bound are left alone (they hold nothing of ours).
    ``placed``: the GPRs' pods that are bound or past the gate (a gated pod never goes)."""
    out: list[Eviction] = []
    gate, holding = gr.SCHEDULING_GATE, (Phase.ADMITTED, Phase.RUNNING)
    for key, pods in placed.items():
        g = sched.gprs.get(key)
        if g is not None and g.phase in holding:
            continue
        # bound pods hold devices; an ungated, unbound pod narrowed to an old reservation could never be placed
        # again (a node affinity cannot be widened): it goes too, and its owner makes a new one, gated. (Most
        # pods here are a queued GPR's, at the gate: looked at first, before a reason is written for them.)
        going = [p for p in pods if (p.node or gate not in p.gates) and p.live and not p.terminating
                 and (p.node or narrowed(p))]
        if not going:
            continue
        if g is not None:
            why = f"GPR {key} is {g.phase.value}" + (f" ({g.reason})" if g.reason else "")
        elif key in final:
            why = f"GPR {key} is {final[key]}"
        elif key in deleting:
            why = f"GPR {key} was deleted"
        else:
            continue  # no such GPR (yet): its pods wait at the gate; never delete a user's pods on a guess
        out.extend(Eviction(p, why, uid_of.get(key, "")) for p in going)
    return out


def stale_narrowings(sched: Scheduler, loose: list[PodView], snap: Snapshot,
                      uid_of: dict[str, str]) -> list[Eviction]:
    """Ungated, unbound pods (``loose``) of a holding GPR narrowed to nodes it no longer holds (requeued and
    placed elsewhere in one pass, before they were evicted as pods of a queued GPR): a node affinity cannot be
    widened, so they go, and their owner makes new ones, gated."""
    out: list[Eviction] = []
    names = sched.inv.names
    for p in loose:
        g = sched.holders.get(p.gpr)
        if g is None or g.placement is None or not p.live or p.terminating or not narrowed(p):
            continue
        nodes = [n for a in g.placement.assignments if (n := snap.nodes.get(names[a.node])) is not None]
        if nodes and all(selector_mismatch(None, p.affinity, n.name, n.labels) for n in nodes):
            out.append(Eviction(p, f"narrowed to nodes GPR {p.gpr} no longer holds", uid_of.get(p.gpr, "")))
    return out


def orphans_of(decoded: list[Decoded], pods_of: dict[str, list[PodView]], now: float,
             grace: float) -> list[tuple[str, str, str]]:
    """GPRs the webhook created for a pod that was then never created (the API server gave up on the request
    after the webhook answered), or whose pods are all gone: nothing will ever use them."""
    out = []
    for d in decoded:
        if not d.auto or d.deleting:
            continue
        meta = d.source.get("metadata") or {}
        created = gr.parse_time(meta.get("creationTimestamp"))
        if created is None or now - created < grace or pods_of.get(d.key):
            continue
        out.append((str(meta.get("namespace") or ""), str(meta.get("name") or ""), d.uid))
    return out


