"""What a backend discovers and what the kubelet is told: physical devices, advertised IDs and their health.

A backend (NVML, NR1) discovers *physical* devices. The ``DeviceTable`` turns them into the IDs advertised to
the kubelet — the physical ID, or ``<id>::<k>`` replicas when time-slicing — keeps their health, and wakes
every ``ListAndWatch`` stream when anything changes. Physical IDs never change across re-registration, so
the kubelet's checkpointed allocations stay valid when the plugin or the kubelet restarts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
REPLICA_SEPARATOR = "::"
MAX_ID_LENGTH = 63  # the kubelet's limit on Device.ID
MAX_LISTED_IDS = 10  # device IDs an error message names before it only counts the rest


@dataclass
class PhysicalDevice:
    """One GPU or NR1 module as its backend sees it."""

    id: str  # GPU UUID or NR1 PCI address
    index: int
    numa_node: int | None = None
    model: str = ""
    memory_mib: int = 0
    attrs: dict[str, Any] = field(default_factory=dict)  # backend-specific: minor number, bus ID, interfaces


HealthReport = Callable[[str, bool, str], None]  # (physical id, healthy, reason)


class Backend(Protocol):
    """The narrow interface between the gRPC server and a kind of hardware."""

    resource_name: str
    replicas: int
    devices: list[PhysicalDevice]  # as of the last discover()

    def discover(self) -> list[PhysicalDevice]: ...

    def allocate(self, physical_ids: list[str], advertised_ids: list[str]) -> Any:
        """A v1beta1 ContainerAllocateResponse for one container."""

    def preferred(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        """A preferred set of ``size`` advertised IDs from ``available``, containing ``must_include``."""

    def run_health(self, report: HealthReport, stopped: Callable[[], bool]) -> None:
        """Blocking health loop (run in a thread): call ``report`` on every change until ``stopped()``."""

    def labels(self) -> dict[str, str]: ...

    def close(self) -> None: ...


def describe_ids(ids: Iterable[str], limit: int = MAX_LISTED_IDS) -> str:
    """Device IDs for an error message, bounded whatever the request held: the distinct IDs counted, the first
    ``limit`` (sorted) quoted as JSON strings, so that an empty ID reads ``""``, and each cut to
    ``MAX_ID_LENGTH`` characters (no advertised ID is longer). ``3: "a", "b", ""`` or ``10000: "a", ... and 9990
    more``. A gRPC status message travels in a header, which clients cap at 8 or 16 KiB."""
    distinct = sorted(set(ids))
    shown = [json.dumps(i if len(i) <= MAX_ID_LENGTH else i[:MAX_ID_LENGTH] + "...") for i in distinct[:limit]]
    more = f" and {len(distinct) - limit} more" if len(distinct) > limit else ""
    return f"{len(distinct)}: {', '.join(shown)}{more}"


def replica_id(physical_id: str, k: int) -> str:
    return f"{physical_id}{REPLICA_SEPARATOR}{k}"


def physical_of(advertised_id: str) -> str:
    return advertised_id.split(REPLICA_SEPARATOR, 1)[0]


class DeviceTable:
    """Advertised devices and their health; ``changed`` wakes ListAndWatch streams.

    Only touched from the event loop thread; backends' health threads hand reports over with
    ``loop.call_soon_threadsafe(table.set_health, ...)``.
    """

    def __init__(self, devices: Iterable[PhysicalDevice], replicas: int = 1) -> None:
        self.physical: dict[str, PhysicalDevice] = {d.id: d for d in devices}
        self.replicas = replicas
        self.health: dict[str, str] = {pid: HEALTHY for pid in self.physical}
        self.reasons: dict[str, str] = {}
        # devices reported Unhealthy whatever their own health, while the kubelet lists device IDs assigned to
        # pods that this plugin does not serve (handover.py): kept apart so that neither overwrites the other
        self.fenced: frozenset[str] = frozenset()
        self.generation = 0
        self.changed_at = time.monotonic()
        self._changed = asyncio.Condition()
        self.advertised: dict[str, str] = {}  # advertised id -> physical id
        for pid in self.physical:
            for aid in self._advertised_ids(pid):
                if len(aid) > MAX_ID_LENGTH:
                    raise ValueError(f"device ID longer than {MAX_ID_LENGTH} characters: {aid!r}")
                self.advertised[aid] = pid

    def _advertised_ids(self, pid: str) -> list[str]:
        if self.replicas <= 1:
            return [pid]
        return [replica_id(pid, k) for k in range(self.replicas)]

    def unknown(self, ids: Iterable[str]) -> list[str]:
        return [i for i in ids if i not in self.advertised]

    def set_health(self, physical_id: str, healthy: bool, reason: str = "") -> bool:
        """Record a device's health; returns whether it changed (and then wakes the watchers)."""
        if physical_id not in self.physical:
            return False
        state = HEALTHY if healthy else UNHEALTHY
        if self.health[physical_id] == state:
            return False
        self.health[physical_id] = state
        if healthy:
            self.reasons.pop(physical_id, None)
        else:
            self.reasons[physical_id] = reason
        self.generation += 1
        self.changed_at = time.monotonic()
        asyncio.get_running_loop().create_task(self._notify())
        return True

    def set_fenced(self, physical_ids: Iterable[str]) -> bool:
        """Report exactly these physical devices Unhealthy on top of their own health (empty: none); returns
        whether the set changed (and then wakes the watchers). Their own health is kept and shows again once
        they are no longer fenced."""
        fenced = frozenset(p for p in physical_ids if p in self.physical)
        if fenced == self.fenced:
            return False
        self.fenced = fenced
        self.generation += 1
        self.changed_at = time.monotonic()
        asyncio.get_running_loop().create_task(self._notify())
        return True

    def effective_health(self, physical_id: str) -> str:
        """What the kubelet is told: Unhealthy when fenced, else the device's own health."""
        return UNHEALTHY if physical_id in self.fenced else self.health[physical_id]

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_change(self, seen_generation: int) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: self.generation != seen_generation)
            return self.generation

    def listing(self) -> list[tuple[str, str, int | None]]:
        """(advertised id, health, NUMA node) for every advertised device, in a stable order."""
        return [(aid, self.effective_health(pid), self.physical[pid].numa_node)
                for aid, pid in self.advertised.items()]

    def counts(self) -> dict[str, int]:
        out = {HEALTHY: 0, UNHEALTHY: 0}
        for pid in self.advertised.values():
            out[self.effective_health(pid)] += 1
        return out
