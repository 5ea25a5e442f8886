"""Wait-estimate accuracy on Philly jobs split by time: a tuning part and a held-out part never tuned on
(issue 35 point 8; the protocol is in docs/estimates.md).

The bundled cut (``data/traces/philly/jobs_oct_nov_11vc.csv``, 2017-10-01 to 2017-11-30) is split at its
31st day: **tuning** = jobs submitted in the first 31 days (2017-10-01 00:00:45 to 2017-11-01 00:00:45, trace
time), **held-out** = every job from then on (2017-11-01 to 2017-11-30). Each part is replayed on its own, from an
empty predictor and calibration, through ``accelstack`` (the simulator's replay, Helios quotas, bestfit, seed 0)
at each load; the estimate made right after arrival of every ``--estimate-every``-th job is scored as the
simulator scores it: for jobs that waited over 60 s the median relative error, the share within +-50% and the
P10-P90 coverage, and the coverage over all sampled jobs. Targets on the held-out part (issue 35.8): median
relative error <= 0.35 and coverage 75-85% at loads 1, 2 and 4. The mean wait is printed too: estimates must
not change decisions, so it must not move when only the estimator changes.

    .venv/bin/python bench/bench_estimates.py                    # both parts, loads 1, 2, 4 (~1.5 min wall, 2 cores)
    .venv/bin/python bench/bench_estimates.py --quick            # load 4, the first 7 days of each part
    .venv/bin/python bench/bench_estimates.py --parts tuning --loads 4   # while tuning: never the held-out part
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_extender.simulator.cli import BUNDLED
from scheduler_extender.simulator.replay import replay_run, window
from scheduler_extender.simulator.traces import read_philly_jobs, read_philly_nodes, read_quotas

SPLIT_DAY = 31.0  # tuning: days [0, 31) after the first job (October 2017); held-out: day 31 on (November 2017)
PARTS = {"tuning": (0.0, SPLIT_DAY), "held-out": (SPLIT_DAY, None)}
TARGET_REL_ERR = 0.35
TARGET_COVERAGE = (75.0, 85.0)


def _positive(kind: type) -> Any:
    def conv(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a {kind.__name__}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number above 0")
        return v

    return conv


def run_one(part: str, load: float, days: float | None, every: int) -> dict[str, Any]:
    """One replay of ``part`` at ``load`` (in a worker process): the estimate figures and the mean wait."""
    traces = BUNDLED / "philly"
    nodes = read_philly_nodes(traces / "nodes.csv")
    jobs = read_philly_jobs(traces / "jobs_oct_nov_11vc.csv", max_gpus=sum(n.devices for n in nodes))
    quotas = read_quotas(traces / "vc_config_helios_qssf.csv")
    start, length = PARTS[part]
    if days is not None:
        length = days if length is None else min(length, days)
    sel = window(jobs, days=length, start_day=start, load=load)
    res = replay_run(nodes, sel, "accelstack", quotas=quotas, estimate_every=every)
    e = res.estimate_error
    return {"part": part, "load": load, "jobs": res.jobs, "wait_mean_s": res.delay["all"]["mean"],
            "evictions": res.evictions, "cpu_s": res.cpu_seconds, **{k: e[k] for k in (
                "waited_n", "waited_median_rel_err", "waited_within_50_pct", "waited_coverage_pct", "all_n",
                "all_coverage_pct")}}


def meets(row: dict[str, Any]) -> bool:
    lo, hi = TARGET_COVERAGE
    return row["waited_median_rel_err"] <= TARGET_REL_ERR and lo <= row["waited_coverage_pct"] <= hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="load 4 only, the first 7 days of each part")
    ap.add_argument("--parts", default="tuning,held-out", help="comma list of tuning, held-out")
    ap.add_argument("--loads", default=None, help="comma list (default 1,2,4; --quick: 4)")
    ap.add_argument("--days", type=_positive(float), default=None, help="only the first DAYS of each part")
    ap.add_argument("--estimate-every", type=_positive(int), default=10, help="score every N-th arrival (10)")
    ap.add_argument("--workers", type=_positive(int), default=2, help="replays at once (2)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            ap.error(f"--parts: {p!r} is not one of {', '.join(PARTS)}")
    try:
        loads = [_positive(float)(x) for x in (args.loads or ("4" if args.quick else "1,2,4")).split(",")]
    except argparse.ArgumentTypeError as exc:
        ap.error(f"--loads: {exc}")
    days = args.days if args.days is not None else 7.0 if args.quick else None
    t0 = time.perf_counter()
    runs = [(p, load) for p in parts for load in loads]
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.workers, len(runs))) as pool:
        futs = [pool.submit(run_one, p, load, days, args.estimate_every) for p, load in runs]
        rows = [f.result() for f in futs]
    print(f"wait estimates at arrival, accelstack, every {args.estimate_every}th job"
          + (f", first {days:g} days of each part" if days is not None else ""))
    print("| part | load | jobs | waited > 60 s | median rel. error | within +-50% | P10-P90 coverage "
          "| coverage, all sampled | wait mean s | meets target | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['load']:g} | {r['jobs']:,} | {r['waited_n']:,} | {r['waited_median_rel_err']:.2f} "
              f"| {r['waited_within_50_pct']:.0f}% | {r['waited_coverage_pct']:.0f}% | {r['all_coverage_pct']:.0f}% "
              f"| {r['wait_mean_s']:,.0f} | {'yes' if meets(r) else 'no'} | {r['cpu_s']:.1f} |")
    print(f"targets: median relative error <= {TARGET_REL_ERR}, coverage {TARGET_COVERAGE[0]:.0f}-"
          f"{TARGET_COVERAGE[1]:.0f}% (jobs that waited over 60 s); wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
