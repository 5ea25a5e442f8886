"""Inventory: nodes, their devices, health, and who holds what.

Every device is divided into ``MILLI_PER_DEVICE`` milli-units; a whole-device request takes all of them, a
fractional one takes part of one device. State lives in a few numpy arrays so placement policies can score
every node at once; the public surface is plain Python (names, ints, tuples).

Invariants, checked by :meth:`Inventory.check`: no device's free milli is ever negative or above capacity,
no node's free CPU or memory is negative, the free amounts equal capacity minus the recorded allocations,
and new work never lands on an unhealthy device (:meth:`Inventory.allocate` refuses it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

MILLI_PER_DEVICE = 1000
GPU = "nvidia.com/gpu"
NR1 = "neureality.com/nr1"


_uids = itertools.count(1)


class AllocationError(ValueError):
    """An allocation would over-commit a device or node, or use an unhealthy device."""


@dataclass(frozen=True)
class NodeSpec:
    """A node as the inventory sees it. One accelerator model and one resource name per node."""

    name: str
    devices: int
    model: str = ""
    resource: str = GPU
    device_memory_mib: int = 0
    cpu_milli: int = 1 << 40
    memory_mib: int = 1 << 40
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeAssignment:
    """What one node gives a request: ``milli`` on each listed device, plus host CPU and memory."""

    node: int
    devices: tuple[int, ...]
    milli: int
    cpu_milli: int = 0
    memory_mib: int = 0


@dataclass(frozen=True)
class Placement:
    """Nodes and devices chosen for a request (one :class:`NodeAssignment` per node)."""

    assignments: tuple[NodeAssignment, ...]

    def nodes(self) -> tuple[int, ...]:
        return tuple(a.node for a in self.assignments)

    def milli_total(self) -> int:
        return sum(a.milli * len(a.devices) for a in self.assignments)

    def describe(self, inv: Inventory) -> list[dict[str, object]]:
        """Plain-data form for status fields and annotations: node name, device indices, milli each."""
        return [
            {"node": inv.names[a.node], "devices": list(a.devices), "milli": a.milli} for a in self.assignments
        ]


class Inventory:
    """Nodes, devices and allocations, held as arrays (row = node, column = device slot).

    ``free[n, d]`` is the free milli of device ``d`` on node ``n``; slots past a node's device count hold -1.
    ``rank[n]`` orders nodes for tie-breaking (a permutation; identity unless a seed is given).
    ``stamp[n]`` changes whenever node ``n``'s free amounts or health change, and ``uid`` is unique per
    inventory object (copies included), so policies can cache per-node scores safely. Code that edits the
    arrays directly must call :meth:`touch`.
    """

    def __init__(self, nodes: Iterable[NodeSpec], tie_seed: int | None = None) -> None:
        specs = list(nodes)
        self.specs = specs
        self.names = [s.name for s in specs]
        self.index = {name: i for i, name in enumerate(self.names)}
        if len(self.index) != len(specs):
            raise ValueError("duplicate node names in inventory")
        n = len(specs)
        width = max([s.devices for s in specs] + [1])
        self.width = width
        self.models: list[str] = sorted({s.model for s in specs})
        self.model_index = {m: i for i, m in enumerate(self.models)}
        self.resources: list[str] = sorted({s.resource for s in specs})
        self.resource_index = {r: i for i, r in enumerate(self.resources)}
        self.model = np.array([self.model_index[s.model] for s in specs], dtype=np.int32)
        self.resource = np.array([self.resource_index[s.resource] for s in specs], dtype=np.int32)
        self.ndev = np.array([s.devices for s in specs], dtype=np.int32)
        slot = np.arange(width)[None, :]
        self.present = slot < self.ndev[:, None]
        self.free = np.where(self.present, MILLI_PER_DEVICE, -1).astype(np.int32)
        self.healthy = self.present.copy()
        self.dev_mem = np.array([s.device_memory_mib for s in specs], dtype=np.int64)
        self.cpu_cap = np.array([s.cpu_milli for s in specs], dtype=np.int64)
        self.mem_cap = np.array([s.memory_mib for s in specs], dtype=np.int64)
        self.cpu_free = self.cpu_cap.copy()
        self.mem_free = self.mem_cap.copy()
        if tie_seed is None:
            self.rank = np.arange(n, dtype=np.int64)
        else:
            self.rank = np.random.default_rng(tie_seed).permutation(n).astype(np.int64)
        self.allocations: dict[str, Placement] = {}
        # host CPU and memory an owner's work takes beside its placement (its pods' requests on its nodes, see
        # own_host): owner -> (the placement it was taken with, ((node, cpu, memory), ...)); released and taken
        # again with that very placement. Never changed in place (copies share it); ``_host_out``: the owners whose
        # share is given back (released), per copy
        self.host_owned: dict[str, tuple[Placement, tuple[tuple[int, int, int], ...]]] = {}
        self._host_out: set[str] = set()
        self.stamp = np.zeros(n, dtype=np.int64)
        self.uid = next(_uids)
        # node-name sets (Request.nodes) as boolean masks: shared by every copy, which has the same nodes
        self._name_masks: dict[frozenset[str], np.ndarray] = {}

    def touch(self, node: int) -> None:
        self.stamp[node] += 1

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.names)

    def avail(self) -> np.ndarray:
        """Free milli per device slot, -1 where there is no device or it is unhealthy."""
        return np.where(self.healthy, self.free, -1)

    def capacity_milli(self, resource: str | None = None, healthy_only: bool = False) -> int:
        mask = self.healthy if healthy_only else self.present
        if resource is not None:
            if resource not in self.resource_index:
                return 0
            mask = mask & (self.resource == self.resource_index[resource])[:, None]
        return int(mask.sum()) * MILLI_PER_DEVICE

    def used_milli(self, resource: str | None = None) -> int:
        used = np.where(self.present, MILLI_PER_DEVICE - self.free, 0)
        if resource is not None:
            if resource not in self.resource_index:
                return 0
            used = used * (self.resource == self.resource_index[resource])[:, None]
        return int(used.sum())

    def models_mask(self, models: Iterable[str] | None) -> np.ndarray:
        """Boolean per node: its model is acceptable (all nodes when ``models`` is empty or None)."""
        if not models:
            return np.ones(len(self.names), dtype=bool)
        idx = [self.model_index[m] for m in models if m in self.model_index]
        return np.isin(self.model, np.array(idx, dtype=np.int32))

    def names_mask(self, names: frozenset[str]) -> np.ndarray:
        """Boolean per node: its name is in ``names`` (names of nodes not here are ignored). Cached per set, and
        the cache is shared with this inventory's copies (the same nodes); read only."""
        hit = self._name_masks.get(names)
        if hit is None:
            if len(self._name_masks) >= 1024:  # sets of pods long gone: start again rather than grow
                self._name_masks.clear()
            hit = np.zeros(len(self.names), dtype=bool)
            index = self.index
            hit[[index[n] for n in names if n in index]] = True
            hit.flags.writeable = False
            self._name_masks[names] = hit
        return hit

    # ------------------------------------------------------------- mutation
    def allocate(self, owner: str, placement: Placement, healthy_only: bool = True) -> None:
        """Record ``placement`` for ``owner``; raise :class:`AllocationError` (changing nothing) if it
        would over-commit anything or (``healthy_only``) touch an unhealthy device: a placement put back as it
        was may hold devices that turned unhealthy, or of a node closed, since."""
        if owner in self.allocations:
            raise AllocationError(f"{owner} already holds an allocation")
        nodes_seen = [a.node for a in placement.assignments]
        if len(set(nodes_seen)) != len(nodes_seen):
            raise AllocationError(f"{owner}: a node appears twice in one placement")
        ndev = self.ndev
        for a in placement.assignments:  # small rows read as Python lists: far cheaper than numpy scalar access
            if not 0 <= a.node < len(self.names):
                raise AllocationError(f"{owner}: no node {a.node}")
            if a.milli < 0 or a.milli > MILLI_PER_DEVICE or a.cpu_milli < 0 or a.memory_mib < 0:
                raise AllocationError(f"{owner}: bad amounts in {a}")
            if (a.cpu_milli or a.memory_mib) and (self.cpu_free[a.node] < a.cpu_milli
                                                  or self.mem_free[a.node] < a.memory_mib):
                raise AllocationError(f"{owner}: host CPU or memory exhausted on {self.names[a.node]}")
            if not a.devices:
                continue
            if len(set(a.devices)) != len(a.devices):
                raise AllocationError(f"{owner}: a device of {self.names[a.node]} listed twice")
            width = int(ndev[a.node])
            free, healthy = self.free[a.node].tolist(), self.healthy[a.node].tolist()
            for d in a.devices:
                if not 0 <= d < width:
                    raise AllocationError(f"{owner}: node {self.names[a.node]} has no device {d}")
                if healthy_only and not healthy[d]:
                    raise AllocationError(f"{owner}: device {d} of {self.names[a.node]} is unhealthy")
                if free[d] < a.milli:
                    raise AllocationError(f"{owner}: device {d} of {self.names[a.node]} over-allocated")
        for a in placement.assignments:
            if a.cpu_milli or a.memory_mib:
                self.cpu_free[a.node] -= a.cpu_milli
                self.mem_free[a.node] -= a.memory_mib
            self.stamp[a.node] += 1
            row = self.free[a.node]
            for d in a.devices:
                row[d] -= a.milli
        self.allocations[owner] = placement
        if owner in self._host_out and self.host_owned[owner][0] is placement:  # put back as it was
            self._host_out.discard(owner)
            for n, cpu, mem in self.host_owned[owner][1]:
                self.cpu_free[n] -= cpu
                self.mem_free[n] -= mem

    def release(self, owner: str) -> Placement | None:
        """Return ``owner``'s devices to the pool (unhealthy ones stay out of new placements)."""
        placement = self.allocations.pop(owner, None)
        if placement is None:
            return None
        owned = self.host_owned.get(owner) if self.host_owned else None
        if owned is not None and owner not in self._host_out:
            self._host_out.add(owner)
            for n, cpu, mem in owned[1]:
                self.cpu_free[n] += cpu
                self.mem_free[n] += mem
        for a in placement.assignments:
            if a.cpu_milli or a.memory_mib:
                self.cpu_free[a.node] += a.cpu_milli
                self.mem_free[a.node] += a.memory_mib
            self.stamp[a.node] += 1
            row = self.free[a.node]
            for d in a.devices:
                row[d] += a.milli
        return placement

    def whole_free(self, node: int, count: int, healthy_only: bool = True) -> tuple[int, ...]:
        """Up to ``count`` devices of ``node`` with nothing allocated (healthy ones only, by default)."""
        width = int(self.ndev[node])
        free = self.free[node].tolist()
        healthy = self.healthy[node].tolist() if healthy_only else None
        out = [d for d in range(width) if free[d] == MILLI_PER_DEVICE and (healthy is None or healthy[d])]
        return tuple(out[:count])

    def set_health(self, node: str, device: int | None, healthy: bool) -> None:
        """Mark one device (or, with ``device=None``, every device of the node) healthy or not."""
        n = self.index[node]
        self.stamp[n] += 1
        if device is None:
            self.healthy[n] = self.present[n] & healthy
        else:
            if not 0 <= device < self.ndev[n]:
                raise ValueError(f"node {node} has no device {device}")
            self.healthy[n, device] = healthy

    def rebuild(self, nodes: Iterable[NodeSpec]) -> tuple[Inventory, list[str]]:
        """A new inventory for a changed node set (nodes joined, left or changed), keeping the tie-break
        order of surviving nodes, device health, and every allocation whose nodes and devices still exist
        and still fit. Returns it and the owners whose allocations could not be kept."""
        new = Inventory(nodes)
        old_rank = {name: int(self.rank[i]) for i, name in enumerate(self.names)}
        order = sorted(range(len(new)), key=lambda i: (old_rank.get(new.names[i], len(self) + i), i))
        new.rank = np.empty(len(new), dtype=np.int64)
        new.rank[order] = np.arange(len(new))
        lost: list[str] = []
        for owner, p in self.allocations.items():  # health is applied afterwards: existing work stays put
            try:
                moved = Placement(
                    tuple(
                        NodeAssignment(new.index[self.names[a.node]], a.devices, a.milli, a.cpu_milli, a.memory_mib)
                        for a in p.assignments
                    )
                )
                new.allocate(owner, moved)
            except (KeyError, AllocationError):
                lost.append(owner)
        for i, name in enumerate(new.names):
            j = self.index.get(name)
            if j is not None:
                w = min(int(new.ndev[i]), int(self.ndev[j]))
                new.healthy[i, :w] = self.healthy[j, :w]
        return new, lost

    def withhold_host(self, nodes: np.ndarray, cpu_milli: np.ndarray, memory_mib: np.ndarray) -> None:
        """Take host CPU and memory of ``nodes`` (indices) out of what may be placed, for work no placement here
        records (pods already running there, say): each node's capacity shrinks by as much as is free of it
        (over-committed work leaves none free)."""
        if not len(nodes):
            return
        cpu = np.minimum(np.maximum(cpu_milli, 0), self.cpu_free[nodes])
        mem = np.minimum(np.maximum(memory_mib, 0), self.mem_free[nodes])
        self.cpu_cap, self.mem_cap = self.cpu_cap.copy(), self.mem_cap.copy()  # the capacity arrays are shared
        np.subtract.at(self.cpu_cap, nodes, cpu)
        np.subtract.at(self.mem_cap, nodes, mem)
        np.subtract.at(self.cpu_free, nodes, cpu)
        np.subtract.at(self.mem_free, nodes, mem)
        self.stamp[nodes] += 1

    def own_host(self, owned: dict[str, tuple[tuple[int, int, int], ...]]) -> None:
        """Take host CPU and memory for owners that hold a placement here, on their nodes (the requests of their
        pods, bound there or to come): ``owner -> ((node, cpu, memory), ...)``. Each share is clamped to what is
        free, given back when its owner is released and taken again when that placement is allocated again (an
        eviction plan's scratch copy puts victims back so), so freeing a holder frees its pods' CPU too."""
        table = dict(self.host_owned)
        touched = []
        # by owner name: where a node is over-committed, which share is cut short depends on nothing else
        for owner, shares in sorted(owned.items()):
            placement = self.allocations.get(owner)
            if placement is None or owner in table:
                continue
            taken = []
            for n, cpu, mem in shares:
                cpu = min(max(0, cpu), int(self.cpu_free[n]))
                mem = min(max(0, mem), int(self.mem_free[n]))
                if cpu or mem:
                    self.cpu_free[n] -= cpu
                    self.mem_free[n] -= mem
                    taken.append((n, cpu, mem))
                    touched.append(n)
            if taken:
                table[owner] = (placement, tuple(taken))
        self.host_owned = table
        if touched:
            self.stamp[np.array(touched, dtype=np.int64)] += 1

    def take_host(self, owned: dict[str, tuple[Placement, tuple[tuple[int, int, int], ...]]], nodes: np.ndarray,
                  cpu: np.ndarray, memory: np.ndarray) -> None:
        """:meth:`own_host` for shares worked out before, kept as :attr:`host_owned` keeps them (``owned``, never
        changed afterwards) and flat (``nodes``, ``cpu``, ``memory``): taken at once when every node has room for
        its shares, else one by one, each clamped to what is left."""
        if self.host_owned or any(self.allocations.get(o) is not p for o, (p, _) in owned.items()):
            self.own_host({o: shares for o, (_, shares) in owned.items()})
            return
        cpu_total, mem_total = np.zeros(len(self.names), dtype=np.int64), np.zeros(len(self.names), dtype=np.int64)
        np.add.at(cpu_total, nodes, cpu)
        np.add.at(mem_total, nodes, memory)
        if (cpu_total > self.cpu_free).any() or (mem_total > self.mem_free).any():
            self.own_host({o: shares for o, (_, shares) in owned.items()})
            return
        self.cpu_free -= cpu_total
        self.mem_free -= mem_total
        self.stamp[np.flatnonzero(cpu_total | mem_total)] += 1
        self.host_owned = owned

    def copy(self) -> Inventory:
        """An independent copy (shares the immutable node specs)."""
        new = object.__new__(Inventory)
        new.__dict__.update(self.__dict__)
        for name in ("free", "healthy", "cpu_free", "mem_free", "stamp"):
            setattr(new, name, getattr(self, name).copy())
        new.allocations = dict(self.allocations)
        new._host_out = set(self._host_out)
        new.uid = next(_uids)
        return new

    def empty_copy(self) -> Inventory:
        """A copy with the same nodes and health and nothing allocated."""
        new = self.copy()
        new.free = np.where(self.present, MILLI_PER_DEVICE, -1).astype(np.int32)
        new.cpu_free = self.cpu_cap.copy()
        new.mem_free = self.mem_cap.copy()
        new.allocations = {}
        new.host_owned, new._host_out = {}, set()
        return new

    def check(self) -> None:
        """Raise AssertionError if any invariant is broken (used by tests and the simulator's --check)."""
        free = np.where(self.present, MILLI_PER_DEVICE, -1).astype(np.int64)
        cpu = self.cpu_cap.copy()
        mem = self.mem_cap.copy()
        for p in self.allocations.values():
            for a in p.assignments:
                cpu[a.node] -= a.cpu_milli
                mem[a.node] -= a.memory_mib
                for d in a.devices:
                    free[a.node, d] -= a.milli
        for owner, (_, shares) in self.host_owned.items():
            if owner in self.allocations and owner not in self._host_out:
                for n, c, m in shares:
                    cpu[n] -= c
                    mem[n] -= m
        assert np.array_equal(free, self.free), "free milli disagrees with allocations"
        assert np.array_equal(cpu, self.cpu_free) and np.array_equal(mem, self.mem_free), "host accounting"
        assert (self.free[self.present] >= 0).all(), "a device is over-allocated"
        assert (self.free[self.present] <= MILLI_PER_DEVICE).all(), "a device has more than capacity free"
        assert (self.cpu_free >= 0).all() and (self.mem_free >= 0).all(), "host CPU/memory over-allocated"

