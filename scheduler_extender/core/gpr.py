"""The GPU Provisioning Request (GPR): what a team asks for, and its life cycle.

Life cycle::

    Queued -> Admitted -> Running -> Complete | Failed | Evicted
    Admitted | Running -> Evicting -> Evicted | Queued   (a driver whose pods take time to leave)
    Failed | Evicted -> Queued          (requeued: after a failure with exponential backoff, after eviction at once)
    any non-final phase -> Cancelled

``Admitted`` means nodes and devices are reserved; ``Running`` means its pods started; ``Evicting`` means it was
chosen for eviction and still holds its devices until its pods are gone (the live controller; the simulator's
pods leave at once, so it goes straight to ``Evicted``). ``exitDuration`` is the
maximum time from admission: when it passes the GPR completes with reason ``ExitDurationReached`` and is not
requeued. An enforced idle timeout completes it with reason ``IdleTimeout``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .inventory import GPU, MILLI_PER_DEVICE, NR1, Placement
from .placement import Request

PRIORITY_MIN, PRIORITY_MAX = 1, 300
RESOURCES = (GPU, NR1)


class Phase(StrEnum):
    QUEUED = "Queued"
    ADMITTED = "Admitted"
    RUNNING = "Running"
    EVICTING = "Evicting"
    COMPLETE = "Complete"
    FAILED = "Failed"
    EVICTED = "Evicted"
    CANCELLED = "Cancelled"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.ADMITTED, Phase.CANCELLED}),
    # Admitted -> Queued: the reservation given back before any pod of it ran (see Scheduler.give_back)
    Phase.ADMITTED: frozenset({Phase.QUEUED, Phase.RUNNING, Phase.COMPLETE, Phase.FAILED, Phase.EVICTED,
                               Phase.EVICTING, Phase.CANCELLED}),
    Phase.RUNNING: frozenset({Phase.COMPLETE, Phase.FAILED, Phase.EVICTED, Phase.EVICTING, Phase.CANCELLED}),
    Phase.EVICTING: frozenset({Phase.EVICTED, Phase.QUEUED, Phase.CANCELLED}),
    Phase.FAILED: frozenset({Phase.QUEUED, Phase.CANCELLED}),
    Phase.EVICTED: frozenset({Phase.QUEUED, Phase.CANCELLED}),
    Phase.COMPLETE: frozenset(),
    Phase.CANCELLED: frozenset(),
}
HOLDING = frozenset({Phase.ADMITTED, Phase.RUNNING})
ALLOCATED = HOLDING | {Phase.EVICTING}  # phases in which the GPR's devices are taken


def clone(g: GPR) -> GPR:
    """A copy of ``g`` with its own history: a clone of its attribute table (1.6x as fast as ``copy.copy`` or an
    ``update()``; drivers copy every stored GPR at every pass)."""
    c = object.__new__(GPR)
    fields = g.__dict__.copy()
    fields["history"] = list(g.history)
    c.__dict__ = fields
    return c


class InvalidTransition(ValueError):
    pass


def priority_class(priority: int) -> str:
    """``low`` (1-100), ``medium`` (101-200) or ``high`` (201-300)."""
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority {priority} outside {PRIORITY_MIN}..{PRIORITY_MAX}")
    return "low" if priority <= 100 else "medium" if priority <= 200 else "high"


def backoff_delay(attempt: int, base_s: float = 60.0, cap_s: float = 3600.0) -> float:
    """Delay before the ``attempt``-th requeue (1-based): ``base * 2**(attempt-1)``, at most ``cap``."""
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    return float(min(cap_s, base_s * 2.0 ** min(attempt - 1, 62)))


@dataclass
class GPR:
    """One request. Spec fields first (what was asked), then status (what happened)."""

    name: str
    workspace: str = "default"
    resource: str = GPU
    devices_per_node: int = 1
    milli_per_device: int = MILLI_PER_DEVICE  # < 1000: a fraction of one device (devices_per_node must be 1)
    node_count: int = 1
    models: tuple[str, ...] = ()
    memory_mib_per_device: int = 0
    cpu_milli_per_node: int = 0
    memory_mib_per_node: int = 0
    priority: int = 100
    exit_duration_s: float | None = None
    idle_timeout_s: float | None = None
    enforce_idle_timeout: bool = False
    enable_eviction: bool = False
    preemptible: bool = True
    requeue_on_failure: bool = False
    retry_limit: int = 3
    backoff_base_s: float = 60.0
    backoff_cap_s: float = 3600.0
    template: str = ""  # the GPR template it was made from, if any (a key of the duration predictor)
    workload: str = ""  # its owner/workload name, e.g. the Job or notebook (a key of the duration predictor)
    submitted_at: float = 0.0
    # ---- status
    phase: Phase = Phase.QUEUED
    reason: str = ""
    failures: int = 0
    evictions: int = 0
    not_before: float = 0.0
    admitted_at: float | None = None
    started_at: float | None = None
    last_active_at: float | None = None
    finished_at: float | None = None
    idle_reported: bool = False
    placement: Placement | None = None
    seq: int = 0
    history: list[tuple[float, Phase, str]] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.resource not in RESOURCES:
            raise ValueError(f"resource: {self.resource!r} is not one of {', '.join(RESOURCES)}")
        if self.devices_per_node < 1:
            raise ValueError("devicesPerNode: at least 1")
        if not 1 <= self.milli_per_device <= MILLI_PER_DEVICE:
            raise ValueError(f"milliPerDevice: 1..{MILLI_PER_DEVICE}")
        if self.milli_per_device < MILLI_PER_DEVICE and self.devices_per_node != 1:
            raise ValueError("milliPerDevice: a fraction is only allowed with devicesPerNode 1")
        if self.node_count < 1:
            raise ValueError("nodeCount: at least 1")
        priority_class(self.priority)
        for f in ("exit_duration_s", "idle_timeout_s"):
            v = getattr(self, f)
            if v is not None and v <= 0:
                raise ValueError(f"{f}: must be positive")
        if self.retry_limit < 0:
            raise ValueError("retryLimit: must not be negative")
        if min(self.memory_mib_per_device, self.cpu_milli_per_node, self.memory_mib_per_node) < 0:
            raise ValueError("memory and CPU amounts must not be negative")

    @property
    def priority_class(self) -> str:
        return priority_class(self.priority)

    def request(self) -> Request:
        return Request(
            count=self.devices_per_node,
            milli=self.milli_per_device,
            node_count=self.node_count,
            resource=self.resource,
            models=frozenset(self.models),
            cpu_milli=self.cpu_milli_per_node,
            memory_mib=self.memory_mib_per_node,
            device_memory_mib=self.memory_mib_per_device,
        )

    def milli_total(self) -> int:
        return self.devices_per_node * self.milli_per_device * self.node_count

    def end_bound(self) -> float:
        """Latest time this GPR can hold its devices (admission + exitDuration); inf if unbounded."""
        if self.admitted_at is None or self.exit_duration_s is None:
            return float("inf")
        return self.admitted_at + self.exit_duration_s

    @property
    def holding(self) -> bool:
        return self.phase in HOLDING

    def transition(self, to: Phase, now: float, reason: str = "") -> None:
        """Move to ``to`` or raise :class:`InvalidTransition`; records the step in ``history``."""
        if to not in TRANSITIONS[self.phase]:
            raise InvalidTransition(f"{self.name}: {self.phase.value} -> {to.value} is not allowed")
        self.phase = to
        self.reason = reason
        self.history.append((now, to, reason))
        if to is Phase.ADMITTED:
            self.admitted_at = now
        elif to is Phase.RUNNING:
            self.started_at = now
            self.last_active_at = now
        elif to in (Phase.COMPLETE, Phase.FAILED, Phase.EVICTED, Phase.CANCELLED):
            self.finished_at = now
        elif to is Phase.QUEUED:
            self.admitted_at = self.started_at = self.last_active_at = self.finished_at = None
            self.idle_reported = False
            self.placement = None
