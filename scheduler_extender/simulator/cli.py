"""``accelstack simulate``: run the GPR policy core against real traces on a virtual clock.

Modes:
  fill    the FGD paper's protocol on Alibaba openb (GPU allocation at 100%/130% arrivals, fragmentation at
          80%), per placement policy, beside the published figures
  replay  a timed trace (Microsoft Philly) through the scheduler: queueing delay, JCT, utilisation,
          evictions, priority inversions and wait-estimate error, against FIFO and strict-priority baselines
  demo    a short run of both (well under a minute) that prints the tables

Inputs default to the traces bundled in data/traces/. Malformed input files are reported as
FILE:LINE:COLUMN: message, with exit status 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .fill import FillResult, fill_run
from .replay import DEFAULT_SCHEDULERS, SCHEDULERS, Assignment, ReplayResult, replay_run, window
from .report import fill_summary, fill_table, plot, replay_table, write_json
from .traces import (
    TraceError,
    read_openb_nodes,
    read_openb_pods,
    read_philly_jobs,
    read_philly_nodes,
    read_published,
    read_quotas,
)

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "traces"
WORKLOADS = ("default", "gpushare40", "multigpu30", "gpuspec10")
PLACEMENTS = ("random", "bestfit", "fgd", "fgd-exact")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _mix(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in _csv(text):
        name, _, val = part.partition("=")
        if name not in ("low", "medium", "high"):
            raise argparse.ArgumentTypeError(f"priority class {name!r}: use low, medium, high")
        try:
            v = float(val)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{part!r}: expected CLASS=SHARE") from exc
        if v < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: share must not be negative")
        out.append((name, v))
    if not out or sum(v for _, v in out) <= 0:
        raise argparse.ArgumentTypeError("give at least one positive share, e.g. low=0.6,medium=0.3,high=0.1")
    return tuple(out)


def _range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = float(lo), float(hi if sep else lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW:HIGH, e.g. 1.0:3.0") from exc
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < LOW <= HIGH")
    return a, b


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def conv(text: str) -> float:
        v = kind(text)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text}: must be positive")
        return v

    return conv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accelstack simulate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(__doc__ or "").replace("``", "").split("\n\nInputs", 1)[0],
        epilog="Run 'accelstack simulate MODE --help' for a mode's options. Docs: docs/simulator.md",
    )
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")

    def outputs(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
        sp.add_argument("--plot", type=Path, metavar="PATH", help="also draw a PNG plot")
        sp.add_argument("--traces", type=Path, default=BUNDLED, metavar="DIR",
                        help="folder holding openb/ and philly/ (default: the bundled data/traces)")

    f = sub.add_parser("fill", help="FGD paper protocol on Alibaba openb", description=(
        "Fill the openb cluster (1,213 GPU nodes) with every trace pod once in shuffled order plus resampled "
        "pods up to 130%% of GPU capacity; no departures. Prints GPU allocation at 100%% and 130%% arrivals "
        "and fragmentation at 80%%, mean over seeds, beside the published FGD figures."))
    f.add_argument("--workloads", type=_csv, default=list(WORKLOADS), metavar="W[,W…]",
                   help=f"openb workloads by name or pod-list path (default: {','.join(WORKLOADS)})")
    f.add_argument("--policies", type=_csv, default=["random", "bestfit", "fgd"], metavar="P[,P…]",
                   help=f"placement policies: {', '.join(PLACEMENTS)} (default: random,bestfit,fgd)")
    f.add_argument("--seeds", type=_positive(int), default=10, metavar="N", help="seeds per policy (default 10)")
    f.add_argument("--first-seed", type=int, default=42, metavar="S", help="seeds are S, S+1, … (default 42)")
    f.add_argument("--nodes", type=Path, metavar="FILE", help="node list (default: openb GPU nodes)")
    f.add_argument("--published", type=Path, metavar="FILE", help="published summary CSV to compare with")
    f.add_argument("--inflation", type=_positive(float), default=1.3, metavar="X",
                   help="stop adding pods when requests reach X times capacity (default 1.3)")
    f.add_argument("--check", action="store_true", help="verify inventory invariants after every pod (slow)")
    outputs(f)

    r = sub.add_parser("replay", help="timed Philly trace through the scheduler", description=(
        "Replay a timed job trace through the scheduler with accelstack's policy and the FIFO and "
        "strict-priority baselines on the same jobs. Priorities and exit durations are drawn per job from "
        "--seed (see --priority-mix and --exit-factor)."))
    r.add_argument("--jobs", type=Path, metavar="FILE", help="job trace (default: bundled Philly Oct-Nov 2017)")
    r.add_argument("--nodes", type=Path, metavar="FILE", help="node list (default: Philly nodes.csv)")
    r.add_argument("--quotas", type=Path, metavar="FILE", help="VC quotas (default: Helios VC config)")
    r.add_argument("--no-quotas", action="store_true", help="no workspace quotas")
    r.add_argument("--schedulers", type=_csv, default=list(DEFAULT_SCHEDULERS), metavar="S[,S…]",
                   help=f"which to run: {', '.join(SCHEDULERS)} (default: {','.join(DEFAULT_SCHEDULERS)})")
    r.add_argument("--placement", choices=PLACEMENTS, default="bestfit", help="placement policy (default bestfit)")
    r.add_argument("--days", type=_positive(float), metavar="D", help="only jobs submitted in the first D days")
    r.add_argument("--start-day", type=float, default=0.0, metavar="D", help="skip the first D days")
    r.add_argument("--max-jobs", type=_positive(int), metavar="N", help="at most N jobs")
    r.add_argument("--load", type=_positive(float), default=1.0, metavar="X",
                   help="shrink gaps between submissions X-fold: X times the offered load (default 1)")
    r.add_argument("--seed", type=int, default=0, help="seed for priorities, exit durations, tie-breaks")
    r.add_argument("--priority-mix", type=_mix, default=Assignment().priority_mix, metavar="low=A,medium=B,high=C",
                   help="share of jobs per priority class (default low=0.6,medium=0.3,high=0.1)")
    r.add_argument("--exit-factor", type=_range, default=Assignment().exit_factor, metavar="LOW:HIGH",
                   help="exitDuration = duration x U[LOW, HIGH) (default 1.0:3.0)")
    r.add_argument("--estimate-every", type=int, default=10, metavar="N",
                   help="record the wait estimate of every Nth arrival (0: none; default 10)")
    r.add_argument("--audit", action="store_true", help="re-check every backfill for priority inversions")
    r.add_argument("--fail-rate", type=float, default=0.0, metavar="P",
                   help="each run attempt fails with probability P (0-1) midway; jobs requeue with backoff")
    r.add_argument("--retry-limit", type=int, default=3, metavar="N", help="requeues after failures (default 3)")
    r.add_argument("--workers", type=_positive(int), metavar="N",
                   help="run up to N schedulers at once, one process each (default: the CPU count)")
    outputs(r)

    d = sub.add_parser("demo", help="a short run of fill and replay (< 1 minute)", description=(
        "openb 'default' fill, seed 42, random/bestfit/fgd placement; then one week of Philly jobs at 4x "
        "load through accelstack, strict-priority and FIFO, with the inversion audit on."))
    outputs(d)
    return p


def _resolve_workload(traces: Path, w: str) -> Path:
    path = Path(w)
    if path.suffix == ".csv" or path.exists():
        return path
    return traces / "openb" / f"openb_pod_list_{w}.csv"


def run_fill(args: argparse.Namespace, workloads: list[str], policies: list[str], seeds: list[int],
             keep_curve: bool = False) -> tuple[list[FillResult], dict[tuple[str, str], dict[str, float]]]:
    traces: Path = args.traces
    nodes = read_openb_nodes(getattr(args, "nodes", None) or traces / "openb" / "openb_node_list_gpu_node.csv")
    pub_path = getattr(args, "published", None) or traces / "openb" / "fgd_atc23_published_summary.csv"
    published = read_published(pub_path) if pub_path.exists() else {}
    results = []
    for w in workloads:
        path = _resolve_workload(traces, w)
        pods = read_openb_pods(path, max_gpus=max(n.devices for n in nodes))
        for pol in policies:
            for seed in seeds:
                res = fill_run(nodes, pods, pol, seed, workload=path.stem,
                               inflation=getattr(args, "inflation", 1.3), keep_curve=keep_curve,
                               check=getattr(args, "check", False))
                print(f"  fill {path.stem} {pol} seed {seed}: {res.alloc_pct_at.get(130, float('nan')):.2f}% "
                      f"at 130% ({res.seconds:.1f}s)", file=sys.stderr)
                results.append(res)
    return results, published


def run_replay(args: argparse.Namespace, schedulers: list[str], days: float | None, load: float,
               audit: bool, estimate_every: int | None = None) -> list[ReplayResult]:
    traces: Path = args.traces
    nodes = read_philly_nodes(getattr(args, "nodes", None) or traces / "philly" / "nodes.csv")
    jobs = read_philly_jobs(getattr(args, "jobs", None) or traces / "philly" / "jobs_oct_nov_11vc.csv",
                            max_gpus=sum(n.devices for n in nodes))
    quotas = None
    if not getattr(args, "no_quotas", False):
        quotas = read_quotas(getattr(args, "quotas", None) or traces / "philly" / "vc_config_helios_qssf.csv")
    jobs = window(jobs, days=days, max_jobs=getattr(args, "max_jobs", None),
                  start_day=getattr(args, "start_day", 0.0), load=load)
    assignment = Assignment(
        seed=getattr(args, "seed", 0),
        priority_mix=getattr(args, "priority_mix", Assignment().priority_mix),
        exit_factor=getattr(args, "exit_factor", Assignment().exit_factor),
    )
    run = functools.partial(
        replay_run, nodes, jobs, policy=getattr(args, "placement", "bestfit"), assignment=assignment, quotas=quotas,
        estimate_every=estimate_every if estimate_every is not None else getattr(args, "estimate_every", 10),
        audit=audit, fail_rate=getattr(args, "fail_rate", 0.0), retry_limit=getattr(args, "retry_limit", 3))
    workers = min(len(schedulers), getattr(args, "workers", None) or os.cpu_count() or 1)
    out: list[ReplayResult] = []
    if workers <= 1:
        results: Iterable[ReplayResult] = (run(s) for s in schedulers)
    else:  # the schedulers are independent runs over the same jobs: one process each (deterministic all the same)
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        results = pool.map(run, schedulers)
    for res in results:
        print(f"  replay {res.scheduler}: {res.finished} jobs, mean wait {res.delay['all']['mean']:.0f}s "
              f"({res.seconds:.1f}s wall, {res.cpu_seconds:.1f}s CPU)", file=sys.stderr)
        out.append(res)
    if workers > 1:
        pool.shutdown()
    return out


def _main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    payload: dict[str, object] = {"mode": args.mode}
    fill_res: list[FillResult] = []
    replay_res: list[ReplayResult] = []
    published: dict[tuple[str, str], dict[str, float]] = {}
    if args.mode == "fill":
        bad = [p for p in args.policies if p not in PLACEMENTS]
        if bad:
            build_parser().error(f"unknown policy {bad[0]!r} (choose from {', '.join(PLACEMENTS)})")
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
        fill_res, published = run_fill(args, args.workloads, args.policies, seeds, keep_curve=bool(args.plot))
    elif args.mode == "replay":
        bad = [s for s in args.schedulers if s not in SCHEDULERS]
        if bad:
            build_parser().error(f"unknown scheduler {bad[0]!r} (choose from {', '.join(SCHEDULERS)})")
        if not 0 <= args.fail_rate < 1 or args.retry_limit < 0:
            build_parser().error("--fail-rate must be in [0, 1) and --retry-limit must not be negative")
        replay_res = run_replay(args, args.schedulers, args.days, args.load, args.audit)
    else:  # demo
        fill_res, published = run_fill(args, ["default"], ["random", "bestfit", "fgd"], [42], keep_curve=True)
        replay_res = run_replay(args, list(DEFAULT_SCHEDULERS), days=7, load=4.0, audit=True, estimate_every=25)
    if fill_res:
        summary = fill_summary(fill_res)
        print("GPU allocation (%) and fragmentation (%), mean over seeds; 'paper' = FGD ATC'23 artifact")
        print(fill_table(summary, published))
        runs = [r.to_dict() for r in fill_res]
        for run in runs:
            run.pop("curve", None)
        payload["fill"] = {"summary": summary, "runs": runs}
    if replay_res:
        if fill_res:
            print()
        print("Queueing (seconds) on the replayed trace; the same jobs for every scheduler")
        print(replay_table(replay_res))
        payload["replay"] = [r.to_dict() for r in replay_res]
    payload["wall_seconds"] = time.perf_counter() - t0
    if args.json:
        write_json(args.json, payload)
        print(f"\nJSON written to {args.json}")
    if args.plot:
        plot(args.plot, fill_res, replay_res, published)
        print(f"plot written to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``accelstack``; accepts ``accelstack simulate MODE …`` and ``… MODE …``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "simulate":
        args = args[1:]
    try:
        return _main(args)
    except TraceError as exc:
        print(f"accelstack simulate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"accelstack simulate: error: {exc}", file=sys.stderr)
        return 2
