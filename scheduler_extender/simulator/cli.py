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
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..core.eviction import EVICTION_COST_RATIO, EVICTION_MAX_WAIT_S
from .fill import FillResult, fill_run
from .progress import Progress
from .replay import (
    DEFAULT_SCHEDULERS,
    DEMO_SCHEDULERS,
    SCHEDULERS,
    Assignment,
    ReplayResult,
    replay_run,
    window,
)
from .report import fill_summary, fill_table, plot, plotting_missing, replay_table, write_json
from .traces import (
    TraceError,
    clip,
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
MAX_DAYS = 3660.0  # ten years of trace: any window beyond is a typo


class OptionError(Exception):
    """A flag's value that only the run can judge (a window with no jobs): reported like argparse's errors."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error and a pointer to --help instead of the whole usage before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the options.\n")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _names(kind: str, known: Sequence[str] | None = None) -> Callable[[str], list[str]]:
    """A comma-separated list: at least one name, none twice, each one of ``known`` (when given)."""

    def conv(text: str) -> list[str]:
        names = _csv(text)
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one {kind}")
        for n in names:
            if known is not None and n not in known:
                raise argparse.ArgumentTypeError(f"unknown {kind} {clip(n)} (choose from {', '.join(known)})")
            if names.count(n) > 1:
                raise argparse.ArgumentTypeError(f"{kind} {clip(n)} given twice")
        return names

    return conv


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{clip(text)}: expected a number") from None
    if not math.isfinite(v):  # nan compares false with every bound, inf never ends a loop: refuse both
        raise argparse.ArgumentTypeError(f"{clip(text)}: expected a finite number")
    return v


def _number(low: float, high: float, low_open: bool = False, high_open: bool = False,
            why: str = "") -> Callable[[str], float]:
    """A finite number in [low, high] (either end open on request); ``why`` follows the range in the error."""

    def conv(text: str) -> float:
        v = _float(text)
        if v < low or (low_open and v == low) or v > high or (high_open and v == high):
            lo, hi = f"{'more than' if low_open else 'from'} {low:g}", f"{'below' if high_open else 'up to'} {high:g}"
            raise argparse.ArgumentTypeError(f"{text}: must be {lo} and {hi}{why}")
        return v

    return conv


def _count(low: int, high: int = 2**31) -> Callable[[str], int]:
    """A whole number from ``low`` to ``high``."""

    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{clip(text)}: expected a whole number") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{text}: must be {'at least' if high == 2**31 else 'from'} {low}"
                                             + ("" if high == 2**31 else f" to {high}"))
        return v

    return conv


def _cost_ratio(text: str) -> float | None:
    """The eviction rule's K: a finite number from 0, or 'off' (evict whenever it makes room)."""
    if text.strip().lower() == "off":
        return None
    return _number(0, 1e9)(text)


def _eviction_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--eviction-cost-ratio", type=_cost_ratio, default=EVICTION_COST_RATIO, metavar="K|off",
                    help="evict only when the victims' lost GPU-hours are at most K x the GPU-hours of waiting the "
                         f"preemptor is spared (default {EVICTION_COST_RATIO:g}; off: whenever eviction makes room)")
    sp.add_argument("--eviction-max-wait", type=_number(0, 1e9), default=EVICTION_MAX_WAIT_S, metavar="S",
                    help="... or whatever the cost when the preemptor would otherwise wait S seconds or more in all "
                         f"(default {EVICTION_MAX_WAIT_S:g})")


def priority_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``--priority-mix``: ``low=0.6,medium=0.3,high=0.1`` (each class at most once, shares finite and not
    negative, at least one positive) as :class:`.replay.Assignment` takes it."""
    out: list[tuple[str, float]] = []
    for part in _csv(text):
        name, _, val = part.partition("=")
        if name not in ("low", "medium", "high"):
            raise argparse.ArgumentTypeError(f"priority class {clip(name)}: use low, medium, high")
        if name in (n for n, _ in out):
            raise argparse.ArgumentTypeError(f"priority class {name!r} given twice")
        try:
            v = float(val)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{clip(part)}: expected CLASS=SHARE") from exc
        if not math.isfinite(v) or v < 0:
            raise argparse.ArgumentTypeError(f"{clip(part)}: a share is a finite number, not negative")
        out.append((name, v))
    if not out or sum(v for _, v in out) <= 0:
        raise argparse.ArgumentTypeError("give at least one positive share, e.g. low=0.6,medium=0.3,high=0.1")
    return tuple(out)


MAX_EXIT_FACTOR = 1000.0


def _range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = float(lo), float(hi if sep else lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{clip(text)}: expected LOW:HIGH, e.g. 1.0:3.0") from exc
    if not 0 < a <= b <= MAX_EXIT_FACTOR:  # false for nan and inf too
        raise argparse.ArgumentTypeError(f"{clip(text)}: need 0 < LOW <= HIGH <= {MAX_EXIT_FACTOR:g}")
    return a, b


def build_parser(prog: str = "accelstack") -> argparse.ArgumentParser:
    """``prog``: how the command was called (``accelstack`` or ``accelstack simulate``); modes are under it."""
    p = Parser(
        prog=prog,
        usage=f"{prog}{' [simulate]' if prog == 'accelstack' else ''} MODE [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(__doc__ or "").replace("``", "").split("\n\nInputs", 1)[0],
        epilog=f"Run '{prog} MODE --help' for a mode's options. Docs: docs/simulator.md",
    )
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE", prog=prog)

    def outputs(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
        sp.add_argument("--plot", type=Path, metavar="PATH", help="also draw a PNG plot")
        sp.add_argument("--traces", type=Path, default=BUNDLED, metavar="DIR",
                        help="folder holding openb/ and philly/ (default: the bundled data/traces)")

    # descriptions are printed as written (no %-formatting): one % sign each
    f = sub.add_parser("fill", help="FGD paper protocol on Alibaba openb", description=(
        "Fill the openb cluster (1,213 GPU nodes) with every trace pod once in shuffled order plus resampled "
        "pods up to 130% of GPU capacity; no departures. Prints GPU allocation at 100% and 130% arrivals "
        "and fragmentation at 80%, mean over seeds, beside the published FGD figures."))
    f.add_argument("--workloads", type=_names("workload"), default=list(WORKLOADS), metavar="W[,W…]",
                   help=f"openb workloads by name or pod-list path (default: {','.join(WORKLOADS)})")
    f.add_argument("--policies", type=_names("policy", PLACEMENTS), default=["random", "bestfit", "fgd"],
                   metavar="P[,P…]", help=f"placement policies: {', '.join(PLACEMENTS)} (default: random,bestfit,fgd)")
    f.add_argument("--seeds", type=_count(1), default=10, metavar="N", help="seeds per policy (default 10)")
    f.add_argument("--first-seed", type=_count(0), default=42, metavar="S", help="seeds are S, S+1, … (default 42)")
    f.add_argument("--nodes", type=Path, metavar="FILE", help="node list (default: openb GPU nodes)")
    f.add_argument("--published", type=Path, metavar="FILE", help="published summary CSV to compare with")
    f.add_argument("--inflation", type=_number(1.3, 10, why=": the table reports allocation at 130% arrivals"),
                   default=1.3, metavar="X",
                   help="stop adding pods when requests reach X times capacity, 1.3-10 (default 1.3)")
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
    r.add_argument("--schedulers", type=_names("scheduler", list(SCHEDULERS)), default=list(DEFAULT_SCHEDULERS),
                   metavar="S[,S…]",
                   help=f"which to run: {', '.join(SCHEDULERS)} (default: {','.join(DEFAULT_SCHEDULERS)})")
    r.add_argument("--placement", choices=PLACEMENTS, default="bestfit", help="placement policy (default bestfit)")
    r.add_argument("--days", type=_number(0, MAX_DAYS, low_open=True), metavar="D",
                   help="only jobs submitted in the first D days")
    r.add_argument("--start-day", type=_number(0, MAX_DAYS), default=0.0, metavar="D", help="skip the first D days")
    r.add_argument("--max-jobs", type=_count(1), metavar="N", help="at most N jobs")
    r.add_argument("--load", type=_number(0.001, 1000), default=1.0, metavar="X",
                   help="shrink gaps between submissions X-fold: X times the offered load, 0.001-1000 (default 1)")
    r.add_argument("--seed", type=_count(0), default=0, help="seed for priorities, exit durations, tie-breaks")
    r.add_argument("--priority-mix", type=priority_mix, default=Assignment().priority_mix, metavar="low=A,medium=B,high=C",
                   help="share of jobs per priority class (default low=0.6,medium=0.3,high=0.1)")
    r.add_argument("--exit-factor", type=_range, default=Assignment().exit_factor, metavar="LOW:HIGH",
                   help="exitDuration = duration x U[LOW, HIGH) (default 1.0:3.0)")
    r.add_argument("--estimate-every", type=_count(0), default=10, metavar="N",
                   help="record the wait estimate of every Nth arrival (0: none; default 10)")
    r.add_argument("--audit", action="store_true", help="re-check every backfill for priority inversions")
    r.add_argument("--fail-rate", type=_number(0, 1, high_open=True), default=0.0, metavar="P",
                   help="each run attempt fails with probability P (0-1) midway; jobs requeue with backoff")
    r.add_argument("--retry-limit", type=_count(0), default=3, metavar="N", help="requeues after failures (default 3)")
    r.add_argument("--workers", type=_count(1), metavar="N",
                   help="run up to N schedulers at once, one process each (default: the CPU count)")
    _eviction_flags(r)
    outputs(r)

    d = sub.add_parser("demo", help="a short run of fill and replay (< 1 minute)", description=(
        "openb 'default' fill, seed 42, random/bestfit/fgd placement; then one week of Philly jobs at 4x "
        "load through accelstack, strict-priority and FIFO, with the inversion audit on."))
    _eviction_flags(d)
    outputs(d)
    return p


def _resolve_workload(traces: Path, w: str) -> Path:
    path = Path(w)
    if path.suffix == ".csv" or path.exists():
        return path
    return traces / "openb" / f"openb_pod_list_{w}.csv"


def run_fill(args: argparse.Namespace, workloads: list[str], policies: list[str], seeds: list[int],
             keep_curve: bool = False) -> tuple[list[FillResult], dict[tuple[str, str], dict[str, float]]]:
    """Every (workload, policy, seed) in turn; one stderr line per run, numbered k/N (the progress of a long
    table: 120 runs take about 5 minutes)."""
    traces: Path = args.traces
    nodes = read_openb_nodes(getattr(args, "nodes", None) or traces / "openb" / "openb_node_list_gpu_node.csv")
    pub_path = getattr(args, "published", None) or traces / "openb" / "fgd_atc23_published_summary.csv"
    published = read_published(pub_path) if pub_path.exists() else {}
    results = []
    total, k, t0 = len(workloads) * len(policies) * len(seeds), 0, time.monotonic()
    for w in workloads:
        path = _resolve_workload(traces, w)
        pods = read_openb_pods(path, max_gpus=max(n.devices for n in nodes))
        for pol in policies:
            for seed in seeds:
                res = fill_run(nodes, pods, pol, seed, workload=path.stem,
                               inflation=getattr(args, "inflation", 1.3), keep_curve=keep_curve,
                               check=getattr(args, "check", False))
                k += 1
                print(f"  fill {k}/{total} {path.stem} {pol} seed {seed}: "
                      f"{res.alloc_pct_at.get(130, float('nan')):.2f}% at 130% ({res.seconds:.1f}s; "
                      f"{time.monotonic() - t0:.0f}s so far)", file=sys.stderr, flush=True)
                results.append(res)
    return results, published


# The progress of replays running in worker processes: one slot per scheduler, written by the workers (the
# array is inherited when the pool forks them), read by the parent between results.
_shared: Any = None
_slots: dict[str, int] = {}


def _init_worker(shared: Any, names: list[str]) -> None:
    global _shared, _slots
    _shared, _slots = shared, {n: i for i, n in enumerate(names)}


def _in_worker(run: Callable[..., ReplayResult], name: str) -> ReplayResult:
    slot = _slots[name]

    def progress(fraction: float) -> None:
        _shared[slot] = fraction

    return run(name, progress=progress)


def result_line(res: ReplayResult) -> str:
    d = res.delay["all"]
    return (f"  replay {res.scheduler} done: {res.finished} jobs, wait mean {d['mean']:.0f}s p95 {d['p95']:.0f}s, "
            f"{res.evictions} evictions ({res.seconds:.1f}s wall, {res.cpu_seconds:.1f}s CPU)")


def run_all(run: Callable[..., ReplayResult], names: list[str], workers: int,
            progress: Progress | None = None, poll_s: float = 0.5) -> list[ReplayResult]:
    """``run(name, progress=callback)`` for each name, up to ``workers`` at once (one process each), results in
    ``names``' order; each result's line is printed as soon as that run ends, not behind a slower one before
    it, and ``progress`` is updated meanwhile."""
    progress = progress or Progress("replay", names)
    done: dict[str, ReplayResult] = {}
    if workers <= 1:
        for n in names:
            res = run(n, progress=functools.partial(progress.update, n))
            done[n] = res
            progress.line(result_line(res))
    else:  # the runs are independent: one process each (deterministic all the same)
        ctx = multiprocessing.get_context("fork")
        shared = ctx.Array("d", len(names), lock=False)
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                      initargs=(shared, names))
        try:
            pending = {pool.submit(_in_worker, run, n): n for n in names}
            while pending:
                finished, _ = concurrent.futures.wait(pending, timeout=poll_s,
                                                      return_when=concurrent.futures.FIRST_COMPLETED)
                for i, n in enumerate(names):
                    if n not in done:
                        progress.fractions[n] = shared[i]
                for fut in finished:
                    n = pending.pop(fut)
                    done[n] = fut.result()
                    progress.fractions[n] = 1.0
                    progress.line(result_line(done[n]))
                progress.show()
        finally:
            pool.shutdown(cancel_futures=True)
    progress.close()
    return [done[n] for n in names]


def run_replay(args: argparse.Namespace, schedulers: list[str], days: float | None, load: float,
               audit: bool, estimate_every: int | None = None) -> tuple[list[ReplayResult], dict[str, int] | None]:
    """The replay of every scheduler, and the quotas it ran with."""
    traces: Path = args.traces
    nodes = read_philly_nodes(getattr(args, "nodes", None) or traces / "philly" / "nodes.csv")
    jobs_path = getattr(args, "jobs", None) or traces / "philly" / "jobs_oct_nov_11vc.csv"
    all_jobs = read_philly_jobs(jobs_path, max_gpus=sum(n.devices for n in nodes))
    quotas = None
    if not getattr(args, "no_quotas", False):
        quota_path = getattr(args, "quotas", None) or traces / "philly" / "vc_config_helios_qssf.csv"
        quotas = read_quotas(quota_path)
    start_day = getattr(args, "start_day", 0.0)
    jobs = window(all_jobs, days=days, max_jobs=getattr(args, "max_jobs", None), start_day=start_day, load=load)
    if not jobs:
        span = (all_jobs[-1].submit_s - all_jobs[0].submit_s) / 86400
        raise OptionError(f"--start-day {start_day:g}" + (f" --days {days:g}" if days is not None else "")
                          + f": no job of {jobs_path} in that window (its {len(all_jobs):,} jobs span "
                          f"{span:.1f} days)")
    if quotas is not None:
        missing = sorted({j.vc for j in jobs} - set(quotas))
        if missing:
            names = ", ".join(clip(v, 20).strip("'") for v in missing[:8]) + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            print(f"warning: {len(missing)} VC(s) have no quota in {quota_path} and run without one: {names}",
                  file=sys.stderr)
    assignment = Assignment(
        seed=getattr(args, "seed", 0),
        priority_mix=getattr(args, "priority_mix", Assignment().priority_mix),
        exit_factor=getattr(args, "exit_factor", Assignment().exit_factor),
    )
    run = functools.partial(
        replay_run, nodes, jobs, policy=getattr(args, "placement", "bestfit"), assignment=assignment, quotas=quotas,
        estimate_every=estimate_every if estimate_every is not None else getattr(args, "estimate_every", 10),
        audit=audit, fail_rate=getattr(args, "fail_rate", 0.0), retry_limit=getattr(args, "retry_limit", 3),
        eviction_cost_ratio=getattr(args, "eviction_cost_ratio", EVICTION_COST_RATIO),
        eviction_max_wait_s=getattr(args, "eviction_max_wait", EVICTION_MAX_WAIT_S))
    workers = min(len(schedulers), getattr(args, "workers", None) or os.cpu_count() or 1)
    print(f"  replay: {len(jobs):,} jobs on {sum(n.devices for n in nodes):,} GPUs through "
          f"{', '.join(schedulers)} ({workers} at once)", file=sys.stderr, flush=True)
    return run_all(run, schedulers, workers), quotas


def _main(argv: Sequence[str], prog: str) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.plot and (why := plotting_missing()):  # before a run that may take an hour, not after it
        print(f"{prog} {args.mode}: error: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    payload: dict[str, object] = {"mode": args.mode}
    fill_res: list[FillResult] = []
    replay_res: list[ReplayResult] = []
    quotas: dict[str, int] | None = None
    published: dict[tuple[str, str], dict[str, float]] = {}
    try:
        if args.mode == "fill":
            seeds = list(range(args.first_seed, args.first_seed + args.seeds))
            fill_res, published = run_fill(args, args.workloads, args.policies, seeds, keep_curve=bool(args.plot))
        elif args.mode == "replay":
            replay_res, quotas = run_replay(args, args.schedulers, args.days, args.load, args.audit)
        else:  # demo
            fill_res, published = run_fill(args, ["default"], ["random", "bestfit", "fgd"], [42], keep_curve=True)
            replay_res, quotas = run_replay(args, list(DEMO_SCHEDULERS), days=7, load=4.0, audit=True,
                                            estimate_every=25)
    except OptionError as exc:
        print(f"{prog} {args.mode}: error: {exc}\nRun '{prog} {args.mode} --help' for the options.",
              file=sys.stderr)
        return 2
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
        print(replay_table(replay_res, quotas))
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
    """Entry point of ``accelstack``; accepts ``accelstack simulate MODE …`` and ``accelstack MODE …``."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = "accelstack"
    if args and args[0] == "simulate":
        args, prog = args[1:], "accelstack simulate"
    try:
        return _main(args, prog)
    except (TraceError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
