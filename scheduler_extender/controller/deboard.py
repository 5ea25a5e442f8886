"""The GPR pass's deboarding step (issue 39.4): a Node tainted ``accelstack.io/deboarding=<until>:NoSchedule`` by
the accelerator-node controller takes no new reservation (closed, like a cordoned node); an Admitted GPR reserved
there none of whose pods is bound yet gives its reservation back and is queued again at once (reason
``NodeDeboarding``, no failure); a Running GPR there is drained once the grace ends (``<until>``, Unix seconds):
``Evicting`` with reason ``NodeDeboarding``, its pods evicted by the controller's eviction path (the Eviction
API, so PodDisruptionBudgets hold them), then requeued, again with that reason. A GPR whose ``exitDuration`` ends
first simply ends. Everything is read from the Node and the GPR objects: a restart decides the same."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_extender.core.gpr import Phase
from scheduler_extender.core.scheduler import Event, Scheduler
from scheduler_extender.objects import accelerator_nodes as an
from scheduler_extender.objects.cluster import NodeView, PodView

REASON = an.DEBOARD_REASON


def deboard_step(sched: Scheduler, nodes: Iterable[NodeView], pods_of: dict[str, list[PodView]],
                 now: float) -> list[Event]:
    events: list[Event] = []
    index = sched.inv.index
    for node in nodes:
        if not node.taints:
            continue
        until = an.deboard_until(node.taints)
        n = index.get(node.name)
        if until is None or n is None:
            continue
        sched.close(node.name)
        for g in list(sched.holders.values()):
            if g.placement is None or all(a.node != n for a in g.placement.assignments):
                continue
            if g.phase is Phase.ADMITTED and not any(p.node for p in pods_of.get(g.name, ())):
                sched.give_back(g.name, now, REASON)
                events.append(Event(now, "requeued", g.name,
                                    f"{REASON}: node {node.name} is being deboarded; no pod of it had started"))
            elif g.phase is Phase.RUNNING and now >= until:
                sched.drain(g.name, now, REASON)
                events.append(Event(now, "evicted", g.name,
                                    f"{REASON}: node {node.name} is being deboarded and the grace has ended"))
    return events


def draining(sched: Scheduler) -> list[str]:
    """The Evicting GPRs leaving a deboarded node (see :func:`requeued_from`)."""
    return [name for name, g in sched.evicting.items() if g.reason == REASON]


def requeued_from(sched: Scheduler, names: list[str]) -> None:
    """Those of ``names`` requeued once their pods left keep ``NodeDeboarding`` as their reason (the core writes
    its generic 'Requeued after eviction')."""
    for name in names:
        g = sched.gprs.get(name)
        if g is not None and g.phase is Phase.QUEUED:
            g.reason = REASON
