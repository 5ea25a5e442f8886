"""Policy-core benchmark: decision latency at scale and simulator throughput, each beside a baseline.

1. Placement decision on 5,000 nodes (40,000 GPUs, three models, ~70% allocated with fractions): FGD scoring
   vectorised with numpy vs the same FGD measure computed node by node in plain Python (the baseline), and
   best-fit. Reports the median latency per decision and the speed-up.
2. Scheduling pass with 10,000 queued GPRs on those 5,000 nodes (cluster nearly full, so the queue blocks and
   reservations/backfill are evaluated): the median latency of ``Scheduler.tick`` (one whole pass), and of an
   admission decision (one GPR submitted, then a pass), with the wait-time estimate (point and P10-P90 range)
   for the whole queue beside the estimate it replaced (every queued GPR placed in turn on a projected
   inventory) measured in the same run. Queue order: the default, priority level then predicted size.
3. Simulator throughput: one week of the Philly trace at 4x load through the engine (admissions per second,
   passes per second), beside the same run without the inversion audit.

    .venv/bin/python bench/bench_core.py                 # about a minute on 2 cores
    .venv/bin/python bench/bench_core.py --repeat 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_extender.core.gpr import GPR
from scheduler_extender.core.inventory import Inventory, NodeAssignment, NodeSpec, Placement
from scheduler_extender.core.placement import FGD, BestFit, Request, Shape, TypicalShapes
from scheduler_extender.core.scheduler import Scheduler, SchedulerConfig
from scheduler_extender.core.waittime import Holder, Waiting, estimate_starts
from tests.core.test_placement import _ref_frag as reference_frag

MODELS = ("A100", "H100", "L4")


def cluster(n_nodes: int, seed: int) -> Inventory:
    rng = np.random.default_rng(seed)
    specs = [
        NodeSpec(f"node-{i:05d}", 8, model=MODELS[int(rng.integers(3))], cpu_milli=128_000, memory_mib=1 << 20)
        for i in range(n_nodes)
    ]
    return Inventory(specs, tie_seed=seed)


def preload(inv: Inventory, fill: float, seed: int) -> None:
    """Allocate about ``fill`` of all device milli directly (mixed whole devices and fractions)."""
    rng = np.random.default_rng(seed)
    k = 0
    for n in range(len(inv)):
        for d in range(int(inv.ndev[n])):
            r = rng.random()
            if r < fill * 0.8:
                milli = 1000
            elif r < fill * 1.2:
                milli = int(rng.choice([250, 500, 750]))
            else:
                continue
            inv.allocate(f"pre-{k}", Placement((NodeAssignment(n, (d,), milli, 1000, 1024),)))
            k += 1


def shapes_for(inv: Inventory) -> TypicalShapes:
    pool = [Shape(4000, 1, 250)] * 20 + [Shape(8000, 1, 500)] * 15 + [Shape(8000, 1, 1000)] * 30
    pool += [Shape(16000, 2, 1000)] * 10 + [Shape(32000, 4, 1000)] * 8 + [Shape(64000, 8, 1000)] * 5
    pool += [Shape(8000, 1, 1000, frozenset({"H100"}))] * 7 + [Shape(2000, 0, 0)] * 5
    return TypicalShapes.from_requests(pool, inv.models)


def naive_fgd_cost(inv: Inventory, shapes: TypicalShapes, req: Request) -> tuple[int, int]:
    """The FGD choice computed node by node and device by device in plain Python (the baseline)."""

    def frag(free: list[int], cpu: int, model: str) -> float:
        return reference_frag(shapes, free, cpu, model)  # the same oracle the placement tests check against

    best = (float("inf"), -1, -1)
    avail = inv.avail().tolist()
    for n in range(len(inv)):
        if inv.cpu_free[n] < req.cpu_milli or inv.mem_free[n] < req.memory_mib:
            continue
        free = avail[n]
        model = inv.models[inv.model[n]]
        before = frag(free, int(inv.cpu_free[n]), model)
        for d, f in enumerate(free):
            if f >= req.milli:
                after_free = list(free)
                after_free[d] -= req.milli
                delta = frag(after_free, int(inv.cpu_free[n]) - req.cpu_milli, model) - before
                if delta < best[0]:
                    best = (delta, n, d)
    return best[1], best[2]


def timed(fn, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_placement(n_nodes: int, repeat: int) -> dict[str, float]:
    inv = cluster(n_nodes, 1)
    preload(inv, 0.7, 2)
    shapes = shapes_for(inv)
    fgd, bf = FGD(shapes), BestFit()
    frac = Request(count=1, milli=250, cpu_milli=4000, memory_mib=1024)
    whole = Request(count=4, cpu_milli=32000, memory_mib=1024)
    fgd.place(inv, frac)  # warm the per-node cache, as a long-running extender would have it
    res = {
        "fgd_fraction_ms": statistics.median(timed(lambda: fgd.place(inv, frac), repeat)) * 1e3,
        "fgd_4gpu_ms": statistics.median(timed(lambda: fgd.place(inv, whole), repeat)) * 1e3,
        "bestfit_fraction_ms": statistics.median(timed(lambda: bf.place(inv, frac), repeat)) * 1e3,
        "fgd_fraction_cold_ms": statistics.median(
            timed(lambda: FGD(shapes).place(inv, frac), max(3, repeat // 4))
        ) * 1e3,
        "naive_fgd_fraction_ms": statistics.median(
            timed(lambda: naive_fgd_cost(inv, shapes, frac), 3)
        ) * 1e3,
    }
    res["speedup_vectorised_vs_naive"] = res["naive_fgd_fraction_ms"] / res["fgd_fraction_ms"]
    res["speedup_cold_vs_naive"] = res["naive_fgd_fraction_ms"] / res["fgd_fraction_cold_ms"]
    return res


def bench_queue(n_nodes: int, n_queued: int, repeat: int, policy: str) -> dict[str, float]:
    inv = cluster(n_nodes, 3)
    shapes = shapes_for(inv)
    pol = FGD(shapes) if policy == "fgd" else BestFit()
    eng = Scheduler(inv, pol, SchedulerConfig(max_reservations=8))
    rng = np.random.default_rng(4)
    now = 0.0
    # fill the cluster with running work (bounded, so reservations are finite)
    i = 0
    while inv.used_milli() < 0.97 * inv.capacity_milli():
        eng.submit(GPR(f"run-{i}", devices_per_node=int(rng.choice([1, 2, 4, 8])), priority=int(rng.integers(1, 301)),
                       exit_duration_s=float(rng.integers(600, 86_400))), now)
        eng.tick(now)
        i += 1
        if len(eng.queue) > 50:
            break
    for g in eng.queue.ordered():
        eng.cancel(g.name, now)
    now = 1.0
    for k in range(n_queued):
        whole = rng.random() < 0.7
        eng.submit(
            GPR(
                f"q-{k}",
                workspace=f"team-{k % 20}",
                devices_per_node=int(rng.choice([1, 2, 4, 8])) if whole else 1,
                milli_per_device=1000 if whole else int(rng.choice([250, 500])),
                node_count=int(rng.choice([1, 1, 1, 2])),
                models=(str(rng.choice(MODELS)),) if rng.random() < 0.2 else (),
                priority=int(rng.integers(1, 301)),
                exit_duration_s=float(rng.integers(60, 7200)),
                enable_eviction=False,
            ),
            now,
        )
    t0 = time.perf_counter()
    first = eng.tick(now)
    first_pass = time.perf_counter() - t0
    passes = timed(lambda: eng.tick(now), repeat)

    def admission() -> None:
        nonlocal now
        now += 0.001
        eng.submit(GPR(f"new-{now}", devices_per_node=1, milli_per_device=250, priority=300, exit_duration_s=60), now)
        eng.tick(now)

    admissions = timed(admission, repeat)
    est = timed(lambda: eng.estimate_ranges(now), max(3, repeat // 5))

    def placement_projection() -> None:  # the estimate before issue 12: every queued GPR placed in turn
        holders = [Holder(g.name, g.end_bound(), g.workspace, g.milli_total()) for g in eng.holders.values()]
        waiting = [Waiting(g.name, g.request(), g.exit_duration_s, g.not_before, g.workspace) for g in eng.queued()]
        estimate_starts(eng.inv, holders, waiting, now, BestFit(), None)

    old = timed(placement_projection, 1)
    return {
        "nodes": n_nodes,
        "queued": len(eng.queue),
        "holders": len(eng.holders),
        "first_pass_s": first_pass,
        "first_pass_admitted": sum(e.kind in ("admitted", "backfilled") for e in first),
        "pass_ms_median": statistics.median(passes) * 1e3,
        "admission_ms_median": statistics.median(admissions) * 1e3,
        "estimate_all_queued_s_median": statistics.median(est),
        "estimate_placement_projection_s": statistics.median(old),
        "estimate_speedup": statistics.median(old) / statistics.median(est),
    }


def bench_sim() -> dict[str, float]:
    from scheduler_extender.simulator.cli import BUNDLED
    from scheduler_extender.simulator.replay import replay_run, window
    from scheduler_extender.simulator.traces import read_philly_jobs, read_philly_nodes, read_quotas

    jobs = window(read_philly_jobs(BUNDLED / "philly" / "jobs_oct_nov_11vc.csv"), days=7, load=4.0)
    nodes = read_philly_nodes(BUNDLED / "philly" / "nodes.csv")
    quotas = read_quotas(BUNDLED / "philly" / "vc_config_helios_qssf.csv")
    out: dict[str, float] = {"jobs": len(jobs)}
    for audit in (False, True):
        r = replay_run(nodes, jobs, "accelstack", "bestfit", quotas=quotas, estimate_every=0, audit=audit)
        tag = "audit" if audit else "plain"
        out[f"{tag}_seconds"] = r.seconds
        out[f"{tag}_admissions_per_s"] = r.admissions / r.seconds
        out[f"{tag}_passes_per_s"] = r.passes / r.seconds
    out["audit_cost_ratio"] = out["audit_seconds"] / out["plain_seconds"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res: dict[str, object] = {}
    print(f"placement on {args.nodes} nodes ...", flush=True)
    res["placement"] = p = bench_placement(args.nodes, args.repeat)
    print(f"  FGD fraction {p['fgd_fraction_ms']:.2f} ms (cold cache {p['fgd_fraction_cold_ms']:.1f} ms), "
          f"FGD 4 GPUs {p['fgd_4gpu_ms']:.2f} ms, best-fit {p['bestfit_fraction_ms']:.2f} ms; "
          f"naive Python FGD {p['naive_fgd_fraction_ms']:.0f} ms -> vectorised is "
          f"{p['speedup_vectorised_vs_naive']:.0f}x faster ({p['speedup_cold_vs_naive']:.0f}x cold)")
    for policy in ("bestfit", "fgd"):
        print(f"queue of {args.queued} on {args.nodes} nodes, {policy} ...", flush=True)
        res[f"queue_{policy}"] = q = bench_queue(args.nodes, args.queued, args.repeat, policy)
        print(f"  first pass {q['first_pass_s']:.2f} s ({q['first_pass_admitted']} admitted); pass median "
              f"{q['pass_ms_median']:.1f} ms; submit+pass median {q['admission_ms_median']:.1f} ms; "
              f"wait estimates (with P10-P90) for all {q['queued']} queued {q['estimate_all_queued_s_median'] * 1e3:.0f} ms "
              f"(placement projection, as before: {q['estimate_placement_projection_s']:.2f} s, "
              f"{q['estimate_speedup']:.0f}x slower)")
    print("simulator throughput (Philly, 1 week at 4x load, accelstack) ...", flush=True)
    res["simulator"] = s = bench_sim()
    print(f"  {s['jobs']:.0f} jobs: {s['plain_admissions_per_s']:.0f} admissions/s, {s['plain_passes_per_s']:.0f} "
          f"passes/s ({s['plain_seconds']:.1f} s); with inversion audit {s['audit_seconds']:.1f} s "
          f"(x{s['audit_cost_ratio']:.2f})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
