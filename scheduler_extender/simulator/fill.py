"""``fill`` mode: the FGD paper's evaluation protocol on the Alibaba openb workloads.

Protocol (``data/traces/README.md``): GPU nodes only; all trace pods sorted by name and shuffled with the
seed, each once; then pods drawn uniformly with replacement until requested GPU-milli reaches 130% of capacity;
pods are placed one at a time and never leave; a pod that fits nowhere fails and is not retried; ties go to a
seeded random node order. After every pod the allocation ratio is recorded; the value "at X%" is the mean of
the records taken while arrived GPU-milli / capacity rounds to X%. Fragmentation is FGD's measure over the
typical shapes of the original trace, recorded at 80%.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..core.inventory import Inventory, NodeSpec
from ..core.placement import Request, Shape, TypicalShapes, make_policy
from .traces import Pod


@dataclass
class FillResult:
    workload: str
    policy: str
    seed: int
    pods: int
    placed: int
    failed: int
    capacity_milli: int
    alloc_pct_at: dict[int, float]
    frag_amount_pct_at80: float
    frag_ratio_pct_at80: float
    unallocated_gpus_at130: float
    seconds: float
    curve: list[tuple[float, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["alloc_pct_at"] = {str(k): v for k, v in self.alloc_pct_at.items()}
        return d


def pod_shape(p: Pod) -> Shape:
    return Shape(p.cpu_milli, p.num_gpu, p.gpu_milli if p.num_gpu else 0, p.gpu_spec)


def pod_request(p: Pod) -> Request:
    return Request(
        count=p.num_gpu,
        milli=p.gpu_milli if p.num_gpu else 0,
        models=p.gpu_spec,
        cpu_milli=p.cpu_milli,
        memory_mib=p.memory_mib,
    )


def arrival_order(pods: list[Pod], seed: int, inflation: float = 1.3, capacity_milli: int = 0) -> list[Pod]:
    """Every pod once (sorted by name, then shuffled), then uniform resamples until the requested GPU-milli
    reaches ``inflation`` times capacity."""
    rng = np.random.default_rng(seed)
    base = sorted(pods, key=lambda p: p.name)
    order = [base[i] for i in rng.permutation(len(base))]
    target = inflation * capacity_milli
    requested = sum(p.gpu_request() for p in order)
    if not any(p.gpu_request() for p in base):
        return order
    while requested < target:
        p = base[int(rng.integers(len(base)))]
        order.append(p)
        requested += p.gpu_request()
    return order


def typical_shapes(pods: list[Pod], inv: Inventory, coverage: float = 0.95) -> TypicalShapes:
    return TypicalShapes.from_requests((pod_shape(p) for p in pods), inv.models, coverage)


def fill_run(
    nodes: list[NodeSpec],
    pods: list[Pod],
    policy: str,
    seed: int,
    workload: str = "",
    inflation: float = 1.3,
    keep_curve: bool = False,
    check: bool = False,
) -> FillResult:
    """One run: one policy, one seed. ``check`` verifies the inventory invariants after every pod (slow)."""
    t0 = time.perf_counter()
    inv = Inventory(nodes, tie_seed=seed)
    cap = inv.capacity_milli()
    shapes = typical_shapes(pods, inv)
    pol = make_policy(policy, shapes, seed)
    order = arrival_order(pods, seed, inflation, cap)
    arrived = allocated = 0
    sums: dict[int, list[float]] = {}
    frag80: list[tuple[float, float]] = []
    curve: list[tuple[float, float]] = []
    placed = 0
    for i, p in enumerate(order):
        req = pod_request(p)
        pl = pol.place(inv, req)
        arrived += p.gpu_request()
        if pl is not None:
            inv.allocate(f"pod-{i}", pl)
            allocated += p.gpu_request()
            placed += 1
        if check:
            inv.check()
        bucket = int(np.floor(arrived * 100 / cap + 0.5))
        ratio = allocated / cap
        acc = sums.setdefault(bucket, [0.0, 0.0])
        acc[0] += ratio
        acc[1] += 1
        if bucket == 80:
            avail = inv.avail()
            frag = float(shapes.frag(avail, inv.cpu_free, inv.model).sum())
            free = float(np.clip(avail, 0, None).sum())
            frag80.append((frag / cap, frag / free if free else 0.0))
        if keep_curve:
            curve.append((arrived / cap, ratio))
    alloc_at = {k: 100 * v[0] / v[1] for k, v in sorted(sums.items())}
    at130 = alloc_at.get(130, 100 * allocated / cap)
    return FillResult(
        workload=workload,
        policy=policy,
        seed=seed,
        pods=len(order),
        placed=placed,
        failed=len(order) - placed,
        capacity_milli=cap,
        alloc_pct_at=alloc_at,
        frag_amount_pct_at80=100 * float(np.mean([f[0] for f in frag80])) if frag80 else float("nan"),
        frag_ratio_pct_at80=100 * float(np.mean([f[1] for f in frag80])) if frag80 else float("nan"),
        unallocated_gpus_at130=(1 - at130 / 100) * cap / 1000,
        seconds=time.perf_counter() - t0,
        curve=curve,
    )


def workload_name(path: Path) -> str:
    return path.stem
