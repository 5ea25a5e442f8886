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
    .venv/bin/python bench/bench_estimates.py --parts tuning --variants  # round 3's candidates, scored offline
    .venv/bin/python bench/bench_estimates.py --parts tuning --lateness  # round 4's candidates, scored offline
    .venv/bin/python bench/bench_estimates.py --warm             # the history of the days before each part kept
    .venv/bin/python bench/bench_estimates.py --clairvoyant      # a bound: exact hold times and the later arrivals
    .venv/bin/python bench/bench_estimates.py --parts tuning --forecast 24   # round 5's candidate
    .venv/bin/python bench/bench_estimates.py --clairvoyant-arrivals --horizon 10   # a bound: the next 10 min known
    .venv/bin/python bench/bench_estimates.py --parts tuning --forecast 10m --horizon 10   # round 6's candidate
    .venv/bin/python bench/bench_estimates.py --parts tuning --overtake      # the cluster's overtaking load
    .venv/bin/python bench/bench_estimates.py --clairvoyant-arrivals --horizon 10 --ahead-levels same  # round 7
    .venv/bin/python bench/bench_estimates.py --scheduler accelstack-fifo    # FIFO within a level (round 7)
    .venv/bin/python bench/bench_estimates.py --explained       # what a predictor of the lateness must explain
    .venv/bin/python bench/bench_estimates.py --learned         # round 8: every quantity at once, learned
    .venv/bin/python bench/bench_estimates.py --scheduler fifo  # where nothing passes a waiting GPR
    .venv/bin/python bench/bench_estimates.py --priority-mix low=1   # every job at one priority level

``--variants`` (tuning part only) records, at every sampled estimate and at every GPR's first projection, the
projection of each candidate estimator of round 3 besides today's, with the actual starts, and scores each
calibrated as the estimate is: holders and queued GPRs at their conditional *median* remaining / hold time
instead of the mean, and ``--draws`` Monte-Carlo draws of every holder's remaining and every queued GPR's hold
time (stratified, seeded by the GPR's name) projected once per draw (the median over draws; the weighted median,
weights 1/wait; the P10-P90 over draws as the range). The replay's decisions are untouched (the candidates are
worked out beside the estimate), so one replay scores them all.

``--oracle`` replays with the projection given every GPR's exact hold time from the trace (queued GPRs hold for
their true duration, holders release at their true end), the eviction rule and every other decision keeping the
predictor's (the mean wait is the same as without it): not an estimator (it knows what cannot be known at
arrival) but a bound on what any better hold-time predictor could give; what error it leaves comes from what
happens after the estimate (arrivals that rank ahead, the fluid approximation). It chooses nothing, so it may be
run on the held-out part too.

``--clairvoyant`` adds to ``--oracle`` the arrivals still to come that will rank ahead of each estimated GPR
(:func:`_arrivals_ahead`); ``--clairvoyant-arrivals`` gives those arrivals alone, hold times predicted as today:
bounds that split the error between hold times and later arrivals. ``--forecast HOURS`` (tuning part only) is a
candidate estimator: the arrivals of the last HOURS, shifted that much later, stand for the ones to come.
``--horizon MINUTES`` sets how far after each estimate those arrivals are told (the bounds) or forecast (720;
with ``--forecast 10m --horizon 10`` the last 10 minutes come once again), ``--forecast-scale A`` multiplies the
forecast arrivals' predicted hold times. ``--ahead-levels higher`` or ``same`` tells the bounds only the arrivals of a
higher priority level, or only those of the estimated GPR's own level (smaller predicted work, which its queue
order lets pass): which overtaking the error comes from.

``--explained`` measures what a better estimate would have to know: for each row, the median relative error left
if a predictor of each waited job's remaining lateness (the log of actual over estimated wait) explained 20, 40,
60 or 80% of its variance, the bias the calibration leaves kept (:func:`explained_errors`).

``--learned`` (round 8) records :data:`FEATURES`, every quantity known at each sampled estimate, and models the
log lateness left in today's estimate linearly (:func:`fit_lateness`): learned on the tuning part's first halves,
scored on its second halves (:func:`learned_report`); beside them two bounds, a median regression fitted on each
row's own waited jobs (hindsight) and the same cross-fitted over five blocks of the replay (:func:`cross_fitted`).

``--scheduler NAME`` replays another of the simulator's schedulers (``accelstack-fifo``: FIFO within each priority
level, no size order): its decisions differ too, so its mean wait is printed beside its estimates' accuracy. ``--priority-mix``
sets the shares of the priority levels the simulator draws (``low=1``: every job at one level); its decisions
differ too.

``--warm`` changes the protocol, not the estimator: each part's estimates start from the duration history and
calibration the days before it left (the held-out part after the whole tuning part is replayed, as a controller
that kept October's history meets November; the tuning part's second half after its first half), where the
default replays each part from nothing. The queue those days leave is carried over too. It chooses nothing.

``--lateness`` (tuning part only) does the same for round 4's candidates, factors applied to the projected wait
before calibration and calibrated from their own corrected first projections: a workspace's lateness (how late
its queued GPRs run against their first projections, :class:`Lateness`) and its burst rate (its arrivals since
its oldest queued GPR, extrapolated over the queue's projected wait, :class:`Burst`). Each candidate's row also
gives how often it scaled an estimate and how its factor correlates with the remaining lateness of today's
estimate. ``--overtake`` (tuning part only) scores, the same way, the cluster's overtaking load instead
(:class:`Overtake`): each projected wait stretched by 1 / (1 - rho), rho the recent arrivals' predicted work that
would rank ahead of the GPR, over the cluster's GPUs.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import dataclasses
import itertools
import json
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from scheduler_extender.core import scheduler as core_scheduler
from scheduler_extender.core.gpr import GPR, priority_class
from scheduler_extender.core.predictor import PER_OCTAVE, DurationPredictor, JobKey
from scheduler_extender.core.waittime import CAL_SLACK_S, Calibrator, Job, Release, project
from scheduler_extender.simulator import replay
from scheduler_extender.simulator.cli import BUNDLED, priority_mix
from scheduler_extender.simulator.replay import SCHEDULERS, Assignment, job_shape, replay_run, window
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


def _hours(text: str) -> float:
    """A duration in hours: ``6``, ``6h`` or ``10m``."""
    unit = 1 / 60 if text.endswith("m") else 1.0
    try:
        return _positive(float)(text[:-1] if text[-1:] in ("m", "h") else text) * unit
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected hours (6, 6h) or minutes (10m) above 0") from None


def _selection(part: str, load: float, days: float | None, warm: bool = False) -> tuple[Any, list[Any], Any, float]:
    """The nodes, the jobs of ``part`` at ``load`` (see :func:`run_one`), the quotas and the first arrival scored."""
    traces = BUNDLED / "philly"
    nodes = read_philly_nodes(traces / "nodes.csv")
    jobs = read_philly_jobs(traces / "jobs_oct_nov_11vc.csv", max_gpus=sum(n.devices for n in nodes))
    quotas = read_quotas(traces / "vc_config_helios_qssf.csv")
    start, length = PARTS[part]
    scored_from = -math.inf
    if warm:
        start, warm_days = (0.0, SPLIT_DAY) if part == "held-out" else (0.0, SPLIT_DAY / 2)
        length = None if length is None else SPLIT_DAY
        if days is not None:
            length = warm_days + days if length is None else min(length, warm_days + days)
        # window() shrinks the gaps from the first job on: the scored arrivals start at the warm days / load
        scored_from = jobs[0].submit_s + warm_days * 86400 / load
    elif days is not None:
        length = days if length is None else min(length, days)
    sel = window(jobs, days=length, start_day=start, load=load)
    return nodes, sel, quotas, scored_from


EXPLAINED = (0.0, 0.2, 0.4, 0.6, 0.8)  # --explained: shares of the log error's variance a predictor would explain


def explained_errors(pairs: list[tuple[float, float]], shares: tuple[float, ...] = EXPLAINED) -> dict[str, Any]:
    """What a better estimate would have to know (``--explained``). ``pairs``: (estimated wait, actual wait) of the
    jobs that waited over 60 s. Their log error eps = ln(actual / estimated) (estimated at least 1 s) has a median
    m (the bias the calibration leaves) and a spread; a predictor of eps that correlates sqrt(f) with it, applied
    exactly, would leave m + (eps - m) * sqrt(1 - f). For each share f: the median relative error then."""
    if not pairs:
        return {"sd_log": math.nan, "median_log": math.nan, "explained": {f: math.nan for f in shares}}
    est = np.maximum(np.array([e for e, _ in pairs], dtype=float), 1.0)
    act = np.array([a for _, a in pairs], dtype=float)
    eps = np.log(act / est)
    m = float(np.median(eps))
    out = {}
    for f in shares:
        left = m + (eps - m) * math.sqrt(1.0 - f)
        out[f] = float(np.median(np.abs(act * np.exp(-left) - act) / act))
    return {"sd_log": float(eps.std()), "median_log": m, "explained": out}


def run_one(part: str, load: float, days: float | None, every: int, warm: bool = False,
            scheduler: str = "accelstack", explained: bool = False,
            mix: tuple[tuple[str, float], ...] | None = None) -> dict[str, Any]:
    """One replay of ``part`` at ``load`` (in a worker process): the estimate figures and the mean wait. ``warm``:
    the days before the part are replayed first (the held-out part: the whole tuning part; the tuning part: its
    first half, the second half then scored), and only the part's own arrivals are estimated, so its estimates
    start from the duration history and calibration those days left, as a controller's do that kept them.
    ``scheduler`` (``--scheduler``): the simulator's scheduler replayed (its decisions, not only its estimates,
    differ from accelstack's: the mean wait says by how much). ``explained`` (``--explained``): the row also
    carries :func:`explained_errors` of its waited jobs. ``mix`` (``--priority-mix``): the shares of the priority
    levels the simulator draws from (default low 60%, medium 30%, high 10%)."""
    nodes, sel, quotas, scored_from = _selection(part, load, days, warm)
    pairs: list[tuple[float, float]] = []
    score = replay.estimate_accuracy

    def keep(outcomes: list[Any], waited_s: float = replay.WAITED_S) -> dict[str, float]:
        pairs.extend((o.estimate - o.submit, o.first_start - o.submit) for o in outcomes
                     if o.first_start is not None and o.estimate is not None and math.isfinite(o.estimate)
                     and o.first_start - o.submit > waited_s)
        return score(outcomes, waited_s)

    if explained:
        replay.estimate_accuracy = keep  # type: ignore[assignment]
    try:
        res = replay_run(nodes, sel, scheduler, quotas=quotas, estimate_every=every, estimate_from_s=scored_from,
                         assignment=None if mix is None else Assignment(priority_mix=mix))
    finally:
        replay.estimate_accuracy = score  # type: ignore[assignment]
    e = res.estimate_error
    label = ", ".join(([] if scheduler == "accelstack" else [scheduler]) + (["warm"] if warm else [])
                      + ([] if mix is None else [",".join(f"{c}={v:g}" for c, v in mix)]))
    return {"part": part + (f" ({label})" if label else ""), "load": load,
            "jobs": sum(1 for j in sel if j.submit_s >= scored_from), "wait_mean_s": res.delay["all"]["mean"],
            "evictions": res.evictions, "cpu_s": res.cpu_seconds, **{k: e[k] for k in (
                "waited_n", "waited_median_rel_err", "waited_within_50_pct", "waited_coverage_pct", "all_n",
                "all_coverage_pct")}, **(explained_errors(pairs) if explained else {})}


# ------------------------------------------------------------------ a bound: exact hold times (--oracle)
def run_oracle(part: str, load: float, days: float | None, every: int, ahead: bool = False,
               exact_holds: bool = True, forecast_s: float | None = None, horizon_s: float | None = None,
               scale: float = 1.0, levels: str = "all") -> dict[str, Any]:
    """:func:`run_one` with the projection told every GPR's true hold time (the trace's duration): queued GPRs
    hold for it, holders release at admission + it. Only the estimate's inputs change (its own copy of the
    holders' ends, ``_est_releases``; the eviction rule's are never an estimate's). ``ahead`` (``--clairvoyant``): each estimate's projection is
    also told the arrivals still to come that will rank ahead of the estimated GPR (see :func:`_arrivals_ahead`);
    with ``exact_holds`` false (``--clairvoyant-arrivals``) only those, every hold time left to the predictor.
    ``forecast_s`` (``--forecast``, a candidate estimator, not a bound): no exact hold times, and instead of the
    real arrivals a forecast of them: those of the last ``forecast_s`` seconds again, shifted that much later
    (and again, to the horizon), their hold times times ``scale`` (``--forecast-scale``). ``horizon_s``
    (``--horizon``): how far after an estimate the arrivals are told or forecast (None: :data:`AHEAD_HORIZON_S`).
    ``levels`` (``--ahead-levels``): which of them: ``all``, ``higher`` (a higher priority level only) or ``same``
    (the estimated GPR's own level only: those its queue order lets pass, smaller predicted work)."""
    traces = BUNDLED / "philly"
    true = {j.job_id: float(j.duration_s) for j in read_philly_jobs(traces / "jobs_oct_nov_11vc.csv",
                                                                     max_gpus=1 << 30)}
    cls = core_scheduler.Scheduler
    hold, estimate = cls.predicted_hold, cls.estimate_ranges

    def exact_hold(self: Any, g: Any) -> float:
        return true.get(g.name) or hold(self, g)

    def exact_estimate(self: Any, now: float, upto: str | None = None) -> Any:
        kept = self._est_releases
        exact = {}
        for h in self.holders.values():
            if h.name in true and h.admitted_at is not None:
                end = max(h.admitted_at + true[h.name], now + 1.0)  # an end due now: the next tick's
                exact[h.name] = Release(min(end, h.end_bound()), h.milli_total(), h.resource, h.workspace)
        if exact_holds:
            self._est_releases = exact
        seen["eng"], seen["upto"] = self, upto
        try:
            return estimate(self, now, upto)
        finally:
            self._est_releases = kept
            seen.clear()

    seen: dict[str, Any] = {}
    base = core_scheduler.project
    if ahead:
        core_scheduler.project = _arrivals_ahead(part, load, days, true if exact_holds else None, seen,  # type: ignore[assignment]
                                                 forecast_s, horizon_s, scale, levels)
    cls.predicted_hold, cls.estimate_ranges = exact_hold if exact_holds else hold, exact_estimate  # type: ignore[method-assign]
    what = ("oracle" if not ahead else (f"forecast {forecast_s / 3600:g} h" if forecast_s >= 3600
                                        else f"forecast {forecast_s / 60:g} min") if forecast_s
            else "clairvoyant" if exact_holds else "arrivals known")
    if ahead and horizon_s is not None:
        what += f", {horizon_s / 60:g} min ahead"
    if ahead and levels != "all":
        what += ", higher levels only" if levels == "higher" else ", own level only"
    if forecast_s and scale != 1.0:
        what += f", holds x {scale:g}"
    try:
        return {**run_one(part, load, days, every), "part": f"{part} ({what})"}
    finally:
        cls.predicted_hold, cls.estimate_ranges = hold, estimate  # type: ignore[method-assign]
        core_scheduler.project = base


AHEAD_HORIZON_S = 12 * 3600.0  # trace seconds after an estimate whose arrivals --clairvoyant tells it
AHEAD_LEVELS = ("all", "higher", "same")  # --ahead-levels: which of those arrivals


def _arrivals_ahead(part: str, load: float, days: float | None, true: dict[str, float] | None,
                    seen: dict[str, Any], forecast_s: float | None = None, horizon_s: float | None = None,
                    scale: float = 1.0, levels: str = "all") -> Any:
    """The projection of :func:`run_oracle` told the future too: for an estimate of one GPR (``upto``), every GPR
    that arrives in the next ``horizon_s`` (:data:`AHEAD_HORIZON_S` if None) and will rank ahead of it in the
    queue (a higher level, or its level and an ageing-shifted submission earlier than its own) joins the
    projection from its arrival, at its place in queue order, holding for its true duration (``true``; None: its
    predicted one). Each arrival's GPR is made as the replay makes it (the same drawn priorities). Still a fluid
    projection: what it leaves is the projection's own approximation (one pool per resource, no placement),
    evictions and backfill. ``forecast_s``: the arrivals of the last ``forecast_s`` seconds, shifted that much
    later (and again, up to the horizon), stand for the real ones (a candidate estimator: nothing it uses is
    unknown at the estimate), holding for their predicted times ``scale``. ``levels``: ``all`` of them, those of
    a ``higher`` level only, or those of the ``same`` level only."""
    if levels not in AHEAD_LEVELS:
        raise ValueError(f"levels: {levels!r} is not one of {', '.join(AHEAD_LEVELS)}")
    horizon = AHEAD_HORIZON_S if horizon_s is None else horizon_s
    _, sel, _, _ = _selection(part, load, days)
    drawn = Assignment().draw(sel)
    arrivals = [float(j.submit_s) for j in sel]
    later: list[GPR] = []
    for j, (prio, exit_s) in zip(sel, drawn, strict=True):
        per_node, node_count = job_shape(j.num_gpu)
        later.append(GPR(name=j.job_id, workspace=j.vc, devices_per_node=per_node, node_count=node_count,
                         priority=prio, models=(j.model,) if j.model else (), submitted_at=float(j.submit_s),
                         exit_duration_s=exit_s if j.exit_s is None else None if math.isinf(j.exit_s) else j.exit_s))
    base = core_scheduler.project

    def coming(now: float) -> Any:
        if forecast_s is None:  # what will arrive
            i = bisect.bisect_right(arrivals, now)
            while i < len(arrivals) and arrivals[i] <= now + horizon:
                yield later[i]
                i += 1
            return
        lo, hi = bisect.bisect_right(arrivals, now - forecast_s), bisect.bisect_right(arrivals, now)
        k = 1
        while (k - 1) * forecast_s < horizon:  # what arrived lately, again
            shift = k * forecast_s
            for g in later[lo:hi]:
                if g.submitted_at + shift <= now + horizon:
                    yield dataclasses.replace(g, name=f"{g.name}~{k}", submitted_at=g.submitted_at + shift)
            k += 1

    def projection(capacity: dict[str, int], quotas: dict[str, int], holders: Any, jobs: Any, now: float,
                   kept: Any = None) -> dict[str, float]:
        eng, upto = seen.get("eng"), seen.get("upto")
        if eng is None or upto is None or upto not in eng.gprs:
            return base(capacity, quotas, holders, jobs, now, kept)
        top = eng._key(eng.gprs[upto])
        keyed = [(eng._key(eng.gprs[j.name]), j) for j in jobs]
        for g in coming(now):
            level = -3 if g.priority > 200 else -2 if g.priority > 100 else -1
            if level > top[0] or (level == top[0] and g.submitted_at >= top[1]):
                continue  # ranks behind it whatever its size
            if (levels == "higher" and level == top[0]) or (levels == "same" and level < top[0]):
                continue
            lv, at, pred = eng.size_rank(g)
            key = (lv, at, 1 << 62, g.name)
            if key < top:
                hold = pred * scale if true is None else true.get(g.name, pred)
                keyed.append((key, Job(g.name, g.milli_total(), hold, g.submitted_at, 0, g.resource, g.workspace)))
        keyed.sort(key=lambda kj: kj[0])
        out = base(capacity, quotas, holders, [j._replace(order=r) for r, (_, j) in enumerate(keyed)], now, kept)
        return {j.name: out[j.name] for j in jobs}

    return projection


# ------------------------------------------------------------------ round 3's candidates (--variants)
_M32 = 0xFFFFFFFF


def _mix(x: int) -> int:
    """murmur3's 32-bit finaliser: neighbouring inputs give unrelated outputs."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def draw_probabilities(name: str, k: int, salt: int = 0) -> list[float]:
    """``k`` probabilities in (0, 1), a function of ``name``, ``k`` and ``salt`` alone (crc32, not the
    process-seeded ``hash``: a replay draws the same every run); one in each of ``k`` equal slices, the slices
    dealt in an order of the name's own, so draw i of two GPRs is not the same slice."""
    h = _mix(zlib.crc32(name.encode()) ^ _mix(salt * 0x9E3779B1 + 0x7F4A7C15))
    keys = [_mix(h + i * 0x9E3779B1) for i in range(k)]
    out = [0.0] * k
    for slot, i in enumerate(sorted(range(k), key=keys.__getitem__)):
        out[i] = (slot + (_mix(keys[i] ^ 0x5BD1E995) + 0.5) / 4294967296.0) / k
    return out


def remaining_at(pred: DurationPredictor, key: JobKey, elapsed: float, exit_s: float | None,
                 us: list[float]) -> list[float]:
    """The remaining hold time at each probability of ``us``: the predictor's distribution conditioned on
    ``elapsed`` as :meth:`DurationPredictor.remaining` takes it, read continuously (log-uniform within a bin)."""
    if exit_s is not None and (not math.isfinite(exit_s) or exit_s <= 0):
        exit_s = None
    cap = math.inf if exit_s is None else max(0.0, exit_s - elapsed)
    parts: list[tuple[float, float, float]] = []
    total = 0.0
    for lo, hi, w in pred.distribution(key, exit_s)[0]:
        if hi <= elapsed:
            continue
        if math.isinf(hi):
            hi = max(lo, elapsed) * 2 ** (1 / PER_OCTAVE)
        if lo < elapsed:
            w *= math.log(hi / elapsed) / math.log(hi / lo) if lo > 0 else (hi - elapsed) / hi
            lo = elapsed
        if w > 0 and hi > lo:
            parts.append((lo, hi, w))
            total += w
    if total <= 0:
        return [pred.remaining(key, elapsed, exit_s).p50] * len(us)
    out = []
    for u in us:
        target, run, x = u * total, 0.0, parts[-1][1]
        for lo, hi, w in parts:
            if run + w >= target:
                f = (target - run) / w
                x = lo + f * (hi - lo) if lo <= 0 else lo * (hi / lo) ** f
                break
            run += w
        out.append(max(0.0, min(x - elapsed, cap)))
    return out


class _Recorder:
    """Works out the candidates' projections beside each sampled estimate (wrapping the engine's
    ``estimate_ranges`` and ``_admit`` in this worker process only) and logs them with the actual starts."""

    def __init__(self, draws: int) -> None:
        self.k = draws
        self.log: list[tuple[Any, ...]] = []
        self.first: dict[str, tuple[Any, ...]] = {}
        self.held: dict[str, list[Any]] = {}  # holder -> [admitted_at, draw ends, redraws, median end]
        self.queued: dict[str, tuple[list[float], float]] = {}  # GPR -> (draw holds, median hold)

    def holder(self, eng: Any, h: Any, now: float) -> list[Any]:
        adm = h.admitted_at if h.admitted_at is not None else now
        key, bound, c = eng.job_key(h), h.end_bound(), self.held.get(h.name)
        at = lambda us: remaining_at(eng.predictor, key, now - adm, h.exit_duration_s, us)  # noqa: E731
        if c is None or c[0] != adm:
            ends = [min(now + v, bound) for v in at(draw_probabilities(h.name, self.k))]
            c = self.held[h.name] = [adm, ends, 0, min(now + at([0.5])[0], bound)]
        stale = [i for i, e in enumerate(c[1]) if e <= now]
        if stale:  # a draw passed while it still holds: drawn again given how long it has held now
            c[2] += 1
            us = draw_probabilities(h.name, self.k, c[2])
            for i, v in zip(stale, at([us[i] for i in stale]), strict=True):
                c[1][i] = min(now + v, bound)
        if c[3] <= now:
            c[3] = min(now + at([0.5])[0], bound)
        return c

    def job(self, eng: Any, g: Any) -> tuple[list[float], float]:
        c = self.queued.get(g.name)
        if c is None:
            key = eng.job_key(g)
            c = self.queued[g.name] = (
                remaining_at(eng.predictor, key, 0.0, g.exit_duration_s, draw_probabilities(g.name, self.k, 1000)),
                remaining_at(eng.predictor, key, 0.0, g.exit_duration_s, [0.5])[0])
        return c

    def estimated(self, eng: Any, now: float, upto: str) -> None:
        raw = eng.projection
        order = sorted((eng.gprs[n] for n in raw), key=eng._key)
        shared, restored_at = eng.queue.is_shared, eng._restored_at
        jd = [self.job(eng, g) for g in order]
        hs = list(eng.holders.values())
        hd = [self.holder(eng, h, now) for h in hs]
        extra = [Release(now, g.milli_total(), g.resource, g.workspace) for g in eng.evicting.values()]
        for p in eng.external.values():
            res = eng.inv.resources[int(eng.inv.resource[p.assignments[0].node])] if p.assignments else ""
            extra.append(Release(math.inf, p.milli_total(), res, ""))
        capacity = {r: eng.inv.capacity_milli(r, healthy_only=True) for r in {g.resource for g in order}}

        def run(ends: list[float], holds: list[float]) -> dict[str, float]:
            jobs = [Job(g.name, g.milli_total(), d, restored_at if shared(g.name) else g.not_before, i, g.resource,
                        g.workspace) for i, (g, d) in enumerate(zip(order, holds, strict=True))]
            rel = [Release(e, h.milli_total(), h.resource, h.workspace) for h, e in zip(hs, ends, strict=True)]
            saved = eng._est_releases
            eng._est_releases = {h.name: r for h, r in zip(hs, rel, strict=True)}
            try:
                kept = eng._kept_jobs(order, jobs, now)
            finally:
                eng._est_releases = saved
            return project(capacity, eng.cfg.quotas or {}, rel + extra, jobs, now, kept)

        med = run([c[3] for c in hd], [c[1] for c in jd])
        mc = [run([c[1][k] for c in hd], [c[0][k] for c in jd]) for k in range(self.k)]
        for g in order:
            if g.name not in self.first and raw[g.name] < math.inf:
                self.first[g.name] = (now, priority_class(g.priority), raw[g.name], med[g.name],
                                      [m[g.name] for m in mc])
        self.log.append(("est", upto, now, priority_class(eng.gprs[upto].priority), raw[upto], med[upto],
                         [m[upto] for m in mc]))

    def admitted(self, name: str, now: float) -> None:
        f = self.first.pop(name, None)
        if f is not None:
            self.log.append(("obs", name, now, *f))
        self.log.append(("adm", name, now))


def _quantile(xs: list[float], now: float, q: float, weighted: bool = False) -> float:
    xs = sorted(xs)
    w = np.array([1.0 / (max(x - now, 0.0) + CAL_SLACK_S) if weighted else 1.0 for x in xs])
    return xs[min(len(xs) - 1, int(np.searchsorted(np.cumsum(w) / w.sum(), q)))]


def score_variants(log: list[tuple[Any, ...]]) -> dict[str, dict[str, float]]:
    """Each candidate's figures for the sampled GPRs that waited over 60 s (as ``estimate_accuracy``): its
    projection calibrated by a :class:`Calibrator` that learned from the candidate's own first projections."""
    starts: dict[str, float] = {}
    for e in log:
        if e[0] == "adm":
            starts.setdefault(e[1], e[2])
    points = {  # (now, mean, median, draws) -> projected start
        "mean hold (as kept)": lambda n, m, p, d: m,
        "median hold": lambda n, m, p, d: p,
        "draws, median": lambda n, m, p, d: _quantile(d, n, 0.5),
        "draws, weighted median": lambda n, m, p, d: _quantile(d, n, 0.5, True),
    }
    out: dict[str, dict[str, float]] = {}
    for name, point in points.items():
        for ranged in (False, True) if name.startswith("draws") else (False,):
            cal, rel, cover = Calibrator(), [], []
            for e in log:
                if e[0] == "obs":
                    t, t0, cls, m, p, d = e[2:8]
                    s = point(t0, m, p, d)
                    if math.isfinite(s):
                        cal.observe(cls, s - t0, t - t0)
                elif e[0] == "est" and e[1] in starts and starts[e[1]] - e[2] > 60:
                    now, cls, m, p, d = e[2:7]
                    s = point(now, m, p, d)
                    if not math.isfinite(s):
                        continue
                    est, lo, hi = cal.estimate(cls, now, s)
                    if ranged:  # uncalibrated: the point and range over the draws
                        est, lo, hi = s, _quantile(d, now, 0.1), _quantile(d, now, 0.9)
                    actual = starts[e[1]]
                    rel.append(abs(est - actual) / (actual - now))
                    cover.append(lo - 1e-6 <= actual <= hi + 1e-6)
            out[name + (", uncalibrated, P10-P90 of draws" if ranged else "")] = {
                "waited_n": len(rel), "waited_median_rel_err": float(np.median(rel)) if rel else math.nan,
                "waited_within_50_pct": 100 * float(np.mean([r <= 0.5 for r in rel])) if rel else math.nan,
                "waited_coverage_pct": 100 * float(np.mean(cover)) if cover else math.nan}
    return out


def run_variants(part: str, load: float, days: float | None, every: int, draws: int) -> dict[str, Any]:
    """:func:`run_one` with round 3's candidates recorded beside the estimates and scored (see the module
    docstring); the replay itself, and so the mean wait, is the same."""
    rec = _Recorder(draws)
    cls_ = core_scheduler.Scheduler
    estimate_ranges, admit = cls_.estimate_ranges, cls_._admit

    def estimate_ranges_(self: Any, now: float, upto: str | None = None) -> Any:
        out = estimate_ranges(self, now, upto)
        if upto is not None:
            rec.estimated(self, now, upto)
        return out

    def admit_(self: Any, g: Any, *args: Any) -> Any:
        rec.admitted(g.name, args[1])
        return admit(self, g, *args)

    cls_.estimate_ranges, cls_._admit = estimate_ranges_, admit_  # type: ignore[method-assign,assignment]
    try:
        row = run_one(part, load, days, every)
    finally:
        cls_.estimate_ranges, cls_._admit = estimate_ranges, admit  # type: ignore[method-assign,assignment]
    row["variants"] = score_variants(rec.log)
    return row


# ------------------------------------------------------------------ round 4's candidates (--lateness)
class Lateness(NamedTuple):
    """One candidate lateness factor: the median over a workspace's queued GPRs (with a first projection) of
    (elapsed since it + slack) / (first projected wait + slack), each at least 1 (censored: they have not
    started, so only lateness shows). ``frac``: only those whose elapsed time exceeds ``frac`` of their first
    projected wait; ``waited``: only those that have waited over 60 s; ``level``: only the estimated GPR's own
    priority level; ``shrink``: the log factor times n / (n + shrink) for n samples; ``cap``: at most this;
    ``slacked``: applied to (projected wait + slack) rather than the wait."""

    frac: float = 0.0
    waited: bool = False
    level: bool = False
    shrink: float = 0.0
    cap: float = math.inf
    slacked: bool = True

    def label(self) -> str:
        return (f"frac {self.frac:g}" + (", waited > 60 s" if self.waited else "") + (", same level" if self.level
                else "") + (f", shrink {self.shrink:g}" if self.shrink else "")
                + (f", cap {self.cap:g}" if math.isfinite(self.cap) else "") + ("" if self.slacked else ", wait only"))

    def factor(self, samples: list[tuple[float, float, str]], cls: str) -> float:
        """``samples``: (elapsed, first projected wait, class) of the workspace's queued GPRs."""
        rs = sorted(max(1.0, (e + CAL_SLACK_S) / (w + CAL_SLACK_S)) for e, w, c in samples
                    if e >= self.frac * w and (not self.waited or e > 60.0) and (not self.level or c == cls))
        if not rs:
            return 1.0
        n = len(rs)
        med = rs[n // 2] if n % 2 else math.sqrt(rs[n // 2 - 1] * rs[n // 2])
        return min(self.cap, math.exp(math.log(med) * n / (n + self.shrink)))


LATENESS = [Lateness(frac, waited, level, shrink, cap, slacked)
            for frac in (0.0, 0.5, 1.0) for waited in (False, True) for level in (False, True)
            for shrink in (0.0, 3.0) for cap in (math.inf, 4.0) for slacked in (True, False)]
_RANK = {"low": 0, "medium": 1, "high": 2}


class Burst(NamedTuple):
    """One candidate burst factor: the workspace's arrivals since its oldest still-queued GPR was submitted, as a
    rate, extrapolated over the median projected remaining wait of its queued GPRs (E further arrivals), against
    the n queued GPRs that rank ahead: (n + 1 + E) / (n + 1). ``levels``: which arrivals and queued GPRs count
    (``all``; ``ahead``: the estimated GPR's level or higher; ``higher``: only higher levels); ``shrink`` and
    ``cap`` as for :class:`Lateness`; applied to (projected wait + slack)."""

    levels: str = "all"
    shrink: float = 0.0
    cap: float = math.inf
    slacked: bool = True

    def label(self) -> str:
        return (f"burst rate, {self.levels}" + (f", shrink {self.shrink:g}" if self.shrink else "")
                + (f", cap {self.cap:g}" if math.isfinite(self.cap) else ""))

    def counts(self, rank: int, other: int) -> bool:
        return self.levels == "all" or (other >= rank if self.levels == "ahead" else other > rank)

    def factor(self, queued: list[tuple[float, int, float]], arrivals: list[tuple[float, int]], rank: int,
               now: float) -> float:
        """``queued``: (submitted at, level rank, projected remaining wait) of the workspace's queued GPRs;
        ``arrivals``: (submitted at, level rank) of all its GPRs, in submission order."""
        if not queued:
            return 1.0
        oldest = min(q[0] for q in queued)
        lo = bisect.bisect_left(arrivals, (oldest, -1))
        came = sum(1 for t, r in arrivals[lo:] if t <= now and self.counts(rank, r))
        rem = sorted(q[2] for q in queued if math.isfinite(q[2]))
        wait = max(0.0, rem[len(rem) // 2]) if rem else 0.0
        extra = came / max(now - oldest, 60.0) * wait
        n = sum(1 for q in queued if self.counts(rank, q[1]))
        f = (n + 1 + extra) / (n + 1)
        return min(self.cap, math.exp(math.log(f) * len(queued) / (len(queued) + self.shrink)))


BURST = [Burst(levels, shrink, cap) for levels in ("all", "ahead", "higher") for shrink in (0.0, 3.0)
         for cap in (math.inf, 2.0)]
CANDIDATES: list[Lateness | Burst] = [*LATENESS, *BURST]
SIZE_BINS = 64  # half-octaves of 1 + predicted GPU-seconds / 60: the size order's ageing shift, binned


def size_bin(gpu_s: float) -> int:
    return min(SIZE_BINS - 1, int(2 * math.log2(1.0 + max(0.0, gpu_s) / core_scheduler.SIZE_UNIT_GPU_S)))


class Overtake(NamedTuple):
    """One overtaking-load candidate (docs/estimates.md, "What was tried"): the work still to arrive that will pass the estimated GPR, as a load. rho = the
    predicted GPU-seconds of the GPRs that arrived in the last ``hours`` and would rank ahead of it had they come
    after it (``scope`` ``size``: a higher level, or its level and a smaller predicted size, the size order's rule
    with the ageing shift left out; ``higher``: a higher level only), over the cluster's GPUs x the window. Work
    ahead that drains at 1 while more arrives at rho takes 1 / (1 - rho) as long (the priority queue's classic
    slowdown): the factor, with rho at most ``cap``."""

    hours: float
    cap: float
    scope: str = "size"
    slacked: bool = True

    def label(self) -> str:
        return f"overtaking load, last {self.hours:g} h, {self.scope}, rho at most {self.cap:g}"

    def factor(self, sums: Any, level: int, b: int, gpus: float) -> float:
        """``sums``: the window's predicted GPU-seconds by (level rank, size bin); ``level``, ``b``: the GPR's."""
        work = float(sums[level + 1:].sum())
        if self.scope == "size":
            work += float(sums[level, :b].sum()) + 0.5 * float(sums[level, b])
        rho = work / max(1.0, gpus * self.hours * 3600.0)
        return 1.0 / (1.0 - min(rho, self.cap))


OVERTAKE = [Overtake(hours, cap, scope) for scope in ("size", "higher") for hours in (6.0, 24.0, 72.0)
            for cap in (0.5, 0.8)]


class _Window:
    """The arrivals of the last ``seconds`` (appended in time order), summed by (level rank, size bin)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.lo, self.hi = seconds, 0, 0
        self.sums = np.zeros((3, SIZE_BINS))

    def at(self, arrivals: list[tuple[float, int, int, float]], now: float) -> Any:
        while self.hi < len(arrivals) and arrivals[self.hi][0] <= now:
            _, lv, b, w = arrivals[self.hi]
            self.sums[lv, b] += w
            self.hi += 1
        while self.lo < self.hi and arrivals[self.lo][0] <= now - self.seconds:
            _, lv, b, w = arrivals[self.lo]
            self.sums[lv, b] -= w
            self.lo += 1
        return self.sums


class _LatenessRecorder:
    """Works out each candidate's factor for the sampled GPR and for every GPR first projected, from the engine's
    first projections of the GPRs queued *before* the estimate (as a live pass would see them), and logs them
    with the raw projection and the actual starts."""

    def __init__(self, candidates: list[Any] | None = None) -> None:
        self.candidates: list[Any] = CANDIDATES if candidates is None else candidates
        self.log: list[tuple[Any, ...]] = []
        self.arrivals: dict[str, list[tuple[float, int]]] = {}  # workspace -> (submitted at, level rank)
        self.every: list[tuple[float, int, int, float]] = []  # (submitted at, level rank, size bin, GPU-seconds)
        self.sizes: dict[str, tuple[int, int]] = {}  # GPR -> (level rank, size bin) at its submission
        self.windows = {h: _Window(h * 3600.0) for h in {v.hours for v in self.candidates
                                                          if isinstance(v, Overtake)}}
        self.gpus = 0.0

    def submitted(self, g: Any, now: float, eng: Any = None) -> None:
        rank = _RANK[priority_class(g.priority)]
        self.arrivals.setdefault(g.workspace, []).append((now, rank))
        if self.windows and eng is not None:
            pred = eng.size_rank(g)[2]
            work = pred * g.milli_total() / 1000.0
            self.sizes[g.name] = (rank, size_bin(work))
            self.every.append((now, rank, size_bin(work), work))
            if not self.gpus:
                self.gpus = sum(eng.inv.capacity_milli(r, healthy_only=False) for r in {g.resource}) / 1000.0

    def estimated(self, eng: Any, now: float, upto: str, before: dict[str, tuple[float, float, str]],
                  _out: Any = None) -> None:
        raw = eng.projection
        by_ws: dict[str, list[tuple[float, float, str]]] = {}
        queued: dict[str, list[tuple[float, int, float]]] = {}
        for name, (t0, w0, cls) in before.items():
            g = eng.gprs.get(name)
            if g is not None and name in raw:
                by_ws.setdefault(g.workspace, []).append((now - t0, w0, cls))
                queued.setdefault(g.workspace, []).append((g.submitted_at, _RANK[cls], raw[name] - now))
        memo: dict[tuple[str, str], list[float]] = {}
        sums = {h: w.at(self.every, now) for h, w in self.windows.items()}

        def factors(name: str) -> list[float]:
            g = eng.gprs[name]
            if self.windows:  # overtaking loads: a factor per GPR (its size)
                level, b = self.sizes.get(name, (_RANK[priority_class(g.priority)], 0))
                return [v.factor(sums[v.hours], level, b, self.gpus) for v in self.candidates]
            cls = priority_class(g.priority)
            got = memo.get((g.workspace, cls))
            if got is None:
                smp, qd = by_ws.get(g.workspace, []), queued.get(g.workspace, [])
                arr = self.arrivals.get(g.workspace, [])
                got = memo[g.workspace, cls] = [v.factor(smp, cls) if isinstance(v, Lateness)
                                                else v.factor(qd, arr, _RANK[cls], now) for v in self.candidates]
            return got

        for name, (_t0, w0, cls) in eng._first_est.items():
            if name not in before:
                self.log.append(("first", name, now, cls, w0, factors(name)))
        if upto in raw and raw[upto] < math.inf:
            self.log.append(("est", upto, now, priority_class(eng.gprs[upto].priority), raw[upto] - now,
                             factors(upto)))

    def admitted(self, name: str, now: float) -> None:
        self.log.append(("adm", name, now))


def _corrected(v: Lateness | Burst | Overtake, wait: float, f: float) -> float:
    return max(0.0, (wait + CAL_SLACK_S) * f - CAL_SLACK_S) if v.slacked else wait * f


def score_lateness(log: list[tuple[Any, ...]], candidates: list[Any] | None = None) -> dict[str, dict[str, float]]:
    """Today's estimator (factor 1) and each candidate, scored as ``estimate_accuracy`` scores the sampled GPRs
    that waited over 60 s, each calibrated from its own corrected first projections. ``r_residual``: over those
    GPRs, the correlation of the candidate's log factor with today's remaining log lateness, log((actual wait +
    slack) / (today's estimated wait + slack)): what a factor could correct at best (nan where it is constant)."""
    starts: dict[str, float] = {}
    for e in log:
        if e[0] == "adm":
            starts.setdefault(e[1], e[2])
    out: dict[str, dict[str, float]] = {}
    residual: list[float] = []  # today's, in the order of the scored estimates
    for k, v in [(-1, Lateness()), *enumerate(CANDIDATES if candidates is None else candidates)]:
        cal, first, rel, cover, logf = Calibrator(), {}, [], [], []
        for e in log:
            if e[0] == "first":
                f = 1.0 if k < 0 else e[5][k]
                first[e[1]] = (e[2], e[3], _corrected(v, e[4], f))
            elif e[0] == "adm":
                fe = first.pop(e[1], None)
                if fe is not None:
                    cal.observe(fe[1], fe[2], e[2] - fe[0])
            elif e[1] in starts and starts[e[1]] - e[2] > 60:
                now, cls, w = e[2], e[3], e[4]
                f = 1.0 if k < 0 else e[5][k]
                est, lo, hi = cal.estimate(cls, now, now + _corrected(v, w, f))
                actual = starts[e[1]]
                rel.append(abs(est - actual) / (actual - now))
                cover.append(lo - 1e-6 <= actual <= hi + 1e-6)
                logf.append(math.log(f))
                if k < 0:
                    residual.append(math.log((actual - now + CAL_SLACK_S) / (est - now + CAL_SLACK_S)))
        spread = len(logf) > 2 and float(np.std(logf)) > 0
        out["today (factor 1)" if k < 0 else v.label()] = {
            "waited_n": len(rel), "waited_median_rel_err": float(np.median(rel)) if rel else math.nan,
            "waited_within_50_pct": 100 * float(np.mean([r <= 0.5 for r in rel])) if rel else math.nan,
            "waited_coverage_pct": 100 * float(np.mean(cover)) if cover else math.nan,
            "share_factor_above_1_pct": 100 * float(np.mean([x > 0 for x in logf])) if logf else math.nan,
            "r_residual": float(np.corrcoef(logf, residual)[0, 1]) if spread else math.nan}
    return out


def _watched(part: str, load: float, days: float | None, every: int, rec: Any) -> dict[str, Any]:
    """:func:`run_one` with ``rec`` told of every submission (``rec.submitted(g, now, eng)``), every estimate of
    one GPR (``rec.estimated(eng, now, upto, before, out)``: ``before``, the first projections of the GPRs queued
    before it; ``out``, what it answered) and every admission (``rec.admitted(name, now)``); the scheduler's
    methods are restored after."""
    cls_ = core_scheduler.Scheduler
    estimate_ranges, admit, submit = cls_.estimate_ranges, cls_._admit, cls_.submit

    def submit_(self: Any, g: Any, now: float, *args: Any, **kw: Any) -> Any:
        rec.submitted(g, now, self)
        return submit(self, g, now, *args, **kw)

    def estimate_ranges_(self: Any, now: float, upto: str | None = None) -> Any:
        before = dict(self._first_est) if upto is not None else {}
        out = estimate_ranges(self, now, upto)
        if upto is not None:
            rec.estimated(self, now, upto, before, out)
        return out

    def admit_(self: Any, g: Any, *args: Any) -> Any:
        rec.admitted(g.name, args[1])
        return admit(self, g, *args)

    cls_.estimate_ranges, cls_._admit = estimate_ranges_, admit_  # type: ignore[method-assign,assignment]
    cls_.submit = submit_  # type: ignore[method-assign]
    try:
        return run_one(part, load, days, every)
    finally:
        cls_.estimate_ranges, cls_._admit = estimate_ranges, admit  # type: ignore[method-assign,assignment]
        cls_.submit = submit  # type: ignore[method-assign]


def run_lateness(part: str, load: float, days: float | None, every: int, overtake: bool = False) -> dict[str, Any]:
    """:func:`run_one` with round 4's lateness factors (``overtake``: the overtaking loads instead) recorded
    beside the estimates and scored offline."""
    rec = _LatenessRecorder(OVERTAKE if overtake else None)
    row = _watched(part, load, days, every, rec)
    row["variants"] = score_lateness(rec.log, rec.candidates)
    return row


# ------------------------------------------------------------------ round 8: every quantity at once (--learned)
# What each sampled estimate's GPR, its workspace and the cluster look like when the estimate is made: every
# quantity the earlier rounds tried one by one, and a few more. Logs are log(1 + x).
FEATURES = (
    ("projected", "the projected wait, before calibration (log)"),
    ("estimated", "today's calibrated estimated wait (log)"),
    ("low", "its level is low (0/1)"),
    ("medium", "its level is medium (0/1)"),
    ("gpus", "its GPUs (log2)"),
    ("hold", "its predicted hold time (log)"),
    ("exit", "its exitDuration (log)"),
    ("ws_ahead", "its workspace's queued GPRs ahead of it (log)"),
    ("ws_ahead_higher", "those of a higher level (log)"),
    ("ws_ahead_same", "those of its own level (log)"),
    ("ahead", "every queued GPR ahead of it (log)"),
    ("ws_holders", "its workspace's holders (log)"),
    ("ws_remaining", "their median predicted remaining time (log)"),
    ("ws_remaining_min", "their soonest predicted release (log)"),
    ("ws_age", "their median time held so far (log)"),
    ("quota", "its workspace's quota in GPUs (log)"),
    ("quota_used", "the share of that quota held"),
    ("ws_arrivals_5m", "its workspace's arrivals in the last 5 min (log)"),
    ("ws_arrivals_30m", "... in the last 30 min (log)"),
    ("ws_arrivals_2h", "... in the last 2 h (log)"),
    ("ws_higher_arrivals_30m", "its workspace's arrivals of a higher level in the last 30 min (log)"),
    ("arrivals_30m", "the cluster's arrivals in the last 30 min (log)"),
    ("queued", "the cluster's queued GPRs (log)"),
)
LEARNED_RIDGE = 1.0  # the ridge's penalty, x the number of samples (features standardized)


class _FeatureRecorder:
    """:data:`FEATURES` of every sampled estimate, with today's estimate and range; the first starts."""

    def __init__(self) -> None:
        self.arrivals: dict[str, tuple[list[float], list[float], list[float]]] = {}  # all, above low, above medium
        self.cluster: list[float] = []
        self.samples: dict[str, tuple[float, float, float, float, list[float]]] = {}
        self.starts: dict[str, float] = {}

    def submitted(self, g: Any, now: float, _eng: Any = None) -> None:
        rank = _RANK[priority_class(g.priority)]
        per = self.arrivals.setdefault(g.workspace, ([], [], []))
        per[0].append(now)
        for higher_than in range(rank):  # per[1 + r]: arrivals of a level above r
            per[1 + higher_than].append(now)
        self.cluster.append(now)

    @staticmethod
    def _since(times: list[float], now: float, window_s: float) -> int:
        return len(times) - bisect.bisect_left(times, now - window_s)

    def estimated(self, eng: Any, now: float, upto: str, _before: Any, out: dict[str, Any]) -> None:
        if upto not in out:
            return
        g, raw, iv = eng.gprs[upto], eng.projection, out[upto]
        wait = raw[upto] - now
        if not math.isfinite(wait):
            return
        ws, rank = g.workspace, _RANK[priority_class(g.priority)]
        ahead = ws_ahead = higher = same = 0
        for name in raw:
            h = eng.gprs.get(name)
            if name == upto or h is None or name not in eng.queue:
                continue
            ahead += 1
            if h.workspace == ws:
                ws_ahead += 1
                r = _RANK[priority_class(h.priority)]
                higher += r > rank
                same += r == rank
        holders = [h for h in eng.holders.values() if h.workspace == ws]
        ends = [eng._est_releases[h.name].end - now for h in holders if h.name in eng._est_releases]
        ages = [now - h.admitted_at for h in holders if h.admitted_at is not None]
        quota = (eng.cfg.quotas or {}).get(ws, 0) or 0
        per = self.arrivals.get(ws, ([], [], []))
        hold = eng.predicted_hold(g)
        est = iv[0]
        x = [math.log1p(wait), math.log1p(max(0.0, est - now)), float(rank == 0), float(rank == 1),
             math.log2(max(g.milli_total(), 1) / 1000.0), math.log1p(hold), math.log1p(g.exit_duration_s or hold),
             math.log1p(ws_ahead), math.log1p(higher), math.log1p(same), math.log1p(ahead), math.log1p(len(holders)),
             math.log1p(max(0.0, float(np.median(ends)))) if ends else 0.0,
             math.log1p(max(0.0, min(ends))) if ends else 0.0,
             math.log1p(float(np.median(ages))) if ages else 0.0,
             math.log1p(quota / 1000.0), eng.usage.get(ws, 0) / quota if quota else 0.0,
             *(math.log1p(self._since(per[0], now, w)) for w in (300.0, 1800.0, 7200.0)),
             math.log1p(self._since(per[1 + rank], now, 1800.0)) if rank < 2 else 0.0,
             math.log1p(self._since(self.cluster, now, 1800.0)), math.log1p(len(eng.queue))]
        self.samples[upto] = (now, *iv, x)

    def admitted(self, name: str, now: float) -> None:
        self.starts.setdefault(name, now)


def run_learned(part: str, load: float, days: float | None, every: int) -> dict[str, Any]:
    """:func:`run_one` with :data:`FEATURES` recorded at every sampled estimate (``--learned``). The row's
    ``learned``: ``waited``, (made at, estimate, P10, P90, actual start, features) of the sampled GPRs that then
    waited over 60 s, in the order they were made; ``split``, the median time the part's sampled estimates
    were made at (its first and second halves)."""
    rec = _FeatureRecorder()
    row = _watched(part, load, days, every, rec)
    made = sorted(s[0] for s in rec.samples.values())
    waited = sorted((now, est, lo, hi, rec.starts[name], x) for name, (now, est, lo, hi, x) in rec.samples.items()
                    if name in rec.starts and rec.starts[name] - now > replay.WAITED_S)
    row["learned"] = {"waited": waited, "split": made[len(made) // 2] if made else math.inf}
    return row


def lateness_of(waited: list[tuple[Any, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Features and the log lateness left in today's estimate, log((actual + 60 s) / (estimated + 60 s)), of
    ``waited`` (rows of :func:`run_learned`)."""
    x = np.array([w[5] for w in waited], dtype=float).reshape(len(waited), len(FEATURES))
    y = np.array([math.log((w[4] - w[0] + CAL_SLACK_S) / (max(0.0, w[1] - w[0]) + CAL_SLACK_S)) for w in waited])
    return x, y


def _design(x: np.ndarray, mu: np.ndarray, sd: np.ndarray) -> np.ndarray:
    return np.hstack([np.ones((len(x), 1)), (x - mu) / sd])


def fit_lateness(x: np.ndarray, y: np.ndarray, how: str = "ridge", q: float = 0.5, iters: int = 200) -> Any:
    """A linear model of the log lateness on standardized features: ``ridge`` (least squares, penalty
    :data:`LEARNED_RIDGE` x n, the intercept free) or ``quantile`` (the ``q``-th conditional quantile, by
    iteratively reweighted least squares). Returns the predictor, features -> log factor."""
    mu, sd = x.mean(0), x.std(0)
    sd[sd == 0] = 1.0
    z = _design(x, mu, sd)
    pen = np.eye(z.shape[1])
    pen[0, 0] = 0.0
    if how == "ridge":
        b = np.linalg.solve(z.T @ z + LEARNED_RIDGE * len(y) * pen, z.T @ y)
    elif how == "quantile":
        b = np.linalg.lstsq(z, y, rcond=None)[0]
        for _ in range(iters):
            r = y - z @ b
            w = np.where(r >= 0, q, 1.0 - q) / np.maximum(np.abs(r), 1e-4)
            b = np.linalg.solve(z.T @ (z * w[:, None]) + 1e-6 * pen, z.T @ (w * y))
    else:
        raise ValueError(f"how: {how!r} is not ridge or quantile")
    return lambda x2: _design(np.asarray(x2, dtype=float).reshape(-1, len(mu)), mu, sd) @ b


def cross_fitted(x: np.ndarray, y: np.ndarray, folds: int = 5) -> np.ndarray:
    """Each of ``folds`` consecutive blocks (the rows in the order the estimates were made) predicted by a median
    regression fitted on the other blocks: what the same month's other weeks would have taught, not the jobs'
    own outcomes. A block with too few others to fit on is left at 0 (today's estimate)."""
    p = np.zeros(len(y))
    edges = np.linspace(0, len(y), folds + 1).astype(int)
    for a, b in itertools.pairwise(edges):
        rest = np.r_[0:a, b:len(y)]
        if a < b and len(rest) > 2 * x.shape[1]:
            p[a:b] = fit_lateness(x[rest], y[rest], "quantile")(x[a:b])
    return p


def score_shifted(waited: list[tuple[Any, ...]], shift: Any) -> dict[str, float]:
    """``waited`` (rows of :func:`run_learned`) scored as ``estimate_accuracy`` scores them, each estimated wait
    and its range scaled by exp(``shift``) as the calibration scales waits (with its 60 s slack)."""
    rel, cover = [], []
    for w, d in zip(waited, np.broadcast_to(np.asarray(shift, dtype=float), (len(waited),)), strict=True):
        now, est, lo, hi, start = w[:5]
        k = math.exp(float(d))

        def moved(t: float, now: float = now, k: float = k) -> float:
            return now + max(0.0, (t - now + CAL_SLACK_S) * k - CAL_SLACK_S)

        rel.append(abs(moved(est) - start) / (start - now))
        cover.append(moved(lo) - 1e-6 <= start <= moved(hi) + 1e-6)
    return {"n": len(rel), "err": float(np.median(rel)) if rel else math.nan,
            "cover": 100 * float(np.mean(cover)) if cover else math.nan}


def learned_report(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Round 8's figures from :func:`run_learned` rows. For the tuning part's loads (the candidates, chosen there):
    a ridge model and a median regression of the lateness, learned on the first halves of every tuning load
    pooled and scored on each load's second half, with today's estimate on that half beside them. For every row,
    two bounds: a median regression fitted on the row's own waited jobs and scored on them (hindsight: it knows
    the outcomes it is scored on; on few jobs it overfits), and the same cross-fitted (:func:`cross_fitted`). With
    both parts, the ridge learned on the whole
    tuning part, applied to the held-out part (not a choice: it is not kept)."""
    out: list[dict[str, Any]] = []
    tuning = [r for r in rows if r["part"] == "tuning"]
    first = [w for r in tuning for w in r["learned"]["waited"] if w[0] < r["learned"]["split"]]
    models = {}
    if len(first) > 2 * len(FEATURES):
        x, y = lateness_of(first)
        models = {"ridge": fit_lateness(x, y, "ridge"), "median": fit_lateness(x, y, "quantile")}
    whole = [w for r in tuning for w in r["learned"]["waited"]]
    pooled = fit_lateness(*lateness_of(whole), "ridge") if len(whole) > 2 * len(FEATURES) else None
    for r in rows:
        waited = r["learned"]["waited"]
        res: dict[str, Any] = {"part": r["part"], "load": r["load"], "n": len(waited)}
        if len(waited) > len(FEATURES) + 1:
            x, y = lateness_of(waited)
            res["hindsight"] = score_shifted(waited, fit_lateness(x, y, "quantile")(x))
            res["cross"] = score_shifted(waited, cross_fitted(x, y))
        res["today"] = score_shifted(waited, 0.0)
        if r["part"] == "tuning" and models:
            second = [w for w in waited if w[0] >= r["learned"]["split"]]
            res["second_half"] = {"today": score_shifted(second, 0.0)}
            if second:
                x2, y2 = lateness_of(second)
                for name, f in models.items():
                    p = f(x2)
                    res["second_half"][name] = {**score_shifted(second, p),
                                                "r": float(np.corrcoef(p, y2)[0, 1]) if len(y2) > 2 else math.nan}
        elif r["part"] == "held-out" and pooled is not None and waited:
            x, y = lateness_of(waited)
            p = pooled(x)
            res["tuning_ridge"] = {**score_shifted(waited, p),
                                   "r": float(np.corrcoef(p, y)[0, 1]) if len(y) > 2 else math.nan}
        out.append(res)
    return out


def print_learned(report: list[dict[str, Any]]) -> None:
    def cell(v: dict[str, float] | None, r: bool = False) -> str:
        if v is None or not v["n"]:
            return "-"
        return f"{v['err']:.2f} / {v['cover']:.0f}%" + (f" (r {v['r']:+.2f})" if r else "")

    print(f"\nround 8: {len(FEATURES)} quantities known at each estimate (--learned), log lateness modelled "
          "linearly; error / coverage")
    print("| part | load | waited > 60 s | today | hindsight bound: median regression fitted on these jobs "
          "| the same, cross-fitted over 5 blocks of the replay | 2nd half: n, today | ridge learned on the 1st "
          "halves | median regression, 1st halves | ridge learned on the whole tuning part |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report:
        sh = r.get("second_half", {})
        print(f"| {r['part']} | {r['load']:g} | {r['n']:,} | {cell(r['today'])} | {cell(r.get('hindsight'))} "
              f"| {cell(r.get('cross'))} | {sh['today']['n'] if sh else '-'}, {cell(sh.get('today'))} "
              f"| {cell(sh.get('ridge'), True)} | {cell(sh.get('median'), True)} | {cell(r.get('tuning_ridge'), True)} |")


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
    ap.add_argument("--variants", action="store_true", help="score round 3's candidates too (tuning part only)")
    ap.add_argument("--lateness", action="store_true",
                    help="score round 4's lateness factors too (tuning part only)")
    ap.add_argument("--overtake", action="store_true",
                    help="score the cluster's overtaking load as a factor (tuning part only)")
    ap.add_argument("--draws", type=_positive(int), default=16, help="Monte-Carlo draws for --variants (16)")
    ap.add_argument("--oracle", action="store_true",
                    help="a bound, not an estimator: the projection given every GPR's exact hold time")
    ap.add_argument("--clairvoyant", action="store_true",
                    help="a bound: --oracle's exact hold times and the arrivals that will rank ahead of each "
                         "estimated GPR known too")
    ap.add_argument("--clairvoyant-arrivals", action="store_true",
                    help="a bound: the arrivals that will rank ahead of each estimated GPR known, hold times "
                         "predicted as today")
    ap.add_argument("--forecast", type=_hours, default=None, metavar="HOURS",
                    help="a candidate (tuning part only): the arrivals of the last HOURS (6, 6h or 10m) taken as "
                         "what comes next, again and again up to --horizon")
    ap.add_argument("--forecast-scale", type=_positive(float), default=1.0, metavar="A",
                    help="with --forecast: the forecast arrivals hold for their predicted time x A (1)")
    ap.add_argument("--horizon", type=_positive(float), default=None, metavar="MINUTES",
                    help="with --clairvoyant, --clairvoyant-arrivals or --forecast: how far after each estimate the "
                         "arrivals are told or forecast (720)")
    ap.add_argument("--ahead-levels", choices=AHEAD_LEVELS, default=None,
                    help="with --clairvoyant or --clairvoyant-arrivals: which of the arrivals that rank ahead are "
                         "told: all (default), those of a higher priority level only, or those of the estimated "
                         "GPR's own level only (smaller predicted work its queue order lets pass)")
    ap.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="accelstack",
                    help="the simulator's scheduler replayed (accelstack); another one makes other decisions too, "
                         "so only with the plain replay or --warm")
    ap.add_argument("--priority-mix", type=priority_mix, default=None, metavar="low=A,medium=B,high=C",
                    help="the shares of the priority levels the simulator draws each job's from (default "
                         "low=0.6,medium=0.3,high=0.1); only with the plain replay or --warm")
    ap.add_argument("--explained", action="store_true",
                    help="also: the error a predictor of each waited job's remaining lateness would leave if it "
                         "explained 20/40/60/80%% of that lateness's variance (what a better estimate must know)")
    ap.add_argument("--learned", action="store_true",
                    help="round 8: every quantity known at an estimate at once, a linear model of the lateness "
                         "learned on the tuning part's first half and scored on its second; and a bound, the same "
                         "model fitted in hindsight on each row's own waited jobs, and cross-fitted on its other "
                         "weeks")
    ap.add_argument("--warm", action="store_true",
                    help="replay the days before each part first and score only the part's arrivals (the held-out "
                         "part after the whole tuning part; the tuning part's second half after its first)")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            ap.error(f"--parts: {p!r} is not one of {', '.join(PARTS)}")
    try:
        loads = [_positive(float)(x) for x in (args.loads or ("4" if args.quick else "1,2,4")).split(",")]
    except argparse.ArgumentTypeError as exc:
        ap.error(f"--loads: {exc}")
    # the bounds and candidates: each replays accelstack with something of its own beside today's estimate
    special = (args.lateness, args.overtake, args.variants, args.oracle, args.clairvoyant, args.clairvoyant_arrivals,
               args.forecast is not None, args.learned)
    if sum((*special, args.warm)) > 1:
        ap.error("--lateness, --overtake, --variants, --oracle, --clairvoyant, --clairvoyant-arrivals, --forecast, "
                 "--learned and --warm: one at a time")
    if args.horizon is not None and not (args.clairvoyant or args.clairvoyant_arrivals or args.forecast):
        ap.error("--horizon: only with --clairvoyant, --clairvoyant-arrivals or --forecast")
    if args.forecast_scale != 1.0 and args.forecast is None:
        ap.error("--forecast-scale: only with --forecast")
    if args.ahead_levels is not None and not (args.clairvoyant or args.clairvoyant_arrivals):
        ap.error("--ahead-levels: only with --clairvoyant or --clairvoyant-arrivals")
    if args.scheduler != "accelstack" and any(special):
        ap.error("--scheduler: only with the plain replay or --warm (the bounds and candidates are accelstack's)")
    if args.priority_mix is not None and any(special):
        ap.error("--priority-mix: only with the plain replay or --warm (the bounds and candidates draw the default mix)")
    if args.explained and any(special):
        ap.error("--explained: only with the plain replay or --warm (it measures today's estimate)")
    levels = args.ahead_levels or "all"
    horizon_s = None if args.horizon is None else args.horizon * 60
    if args.forecast is not None and parts != ["tuning"]:
        ap.error("--forecast chooses between estimators: run it on --parts tuning only, never the held-out part")
    for flag, on in (("--lateness", args.lateness), ("--overtake", args.overtake)):
        if on and parts != ["tuning"]:
            ap.error(f"{flag} chooses between estimators: run it on --parts tuning only, never the held-out part")
    if args.variants and parts != ["tuning"]:
        ap.error("--variants chooses between estimators: run it on --parts tuning only, never the held-out part")
    days = args.days if args.days is not None else 7.0 if args.quick else None
    t0 = time.perf_counter()
    runs = [(p, load) for p in parts for load in loads]
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.workers, len(runs))) as pool:
        futs = [pool.submit(run_variants, p, load, days, args.estimate_every, args.draws) if args.variants
                else pool.submit(run_lateness, p, load, days, args.estimate_every, args.overtake)
                if args.lateness or args.overtake
                else pool.submit(run_oracle, p, load, days, args.estimate_every) if args.oracle
                else pool.submit(run_oracle, p, load, days, args.estimate_every, True, True, None, horizon_s,
                                 1.0, levels)
                if args.clairvoyant
                else pool.submit(run_oracle, p, load, days, args.estimate_every, True, False, None, horizon_s,
                                 1.0, levels)
                if args.clairvoyant_arrivals
                else pool.submit(run_oracle, p, load, days, args.estimate_every, True, False, args.forecast * 3600,
                                 horizon_s, args.forecast_scale)
                if args.forecast is not None
                else pool.submit(run_learned, p, load, days, args.estimate_every) if args.learned
                else pool.submit(run_one, p, load, days, args.estimate_every, args.warm, args.scheduler,
                                 args.explained, args.priority_mix)
                for p, load in runs]
        rows = [f.result() for f in futs]
    print(("bound, not an estimator: the projection given every GPR's exact hold time (--oracle); " if args.oracle
           else "bound, not an estimator: exact hold times and the arrivals that rank ahead known "
           "(--clairvoyant); " if args.clairvoyant
           else "bound, not an estimator: the arrivals that rank ahead known, hold times predicted "
           "(--clairvoyant-arrivals); " if args.clairvoyant_arrivals
           else "warm: the days before each part replayed first, only the part's arrivals scored (the tuning part: "
           "its second half); " if args.warm
           else "") + f"wait estimates at arrival, {args.scheduler}, every {args.estimate_every}th job"
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
    if args.explained:
        print("\n| part | load | waited > 60 s | log(actual / estimated wait): median / sd | median rel. error if a "
              "predictor explained " + " / ".join(f"{f:.0%}" for f in EXPLAINED) + " of its variance |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['part']} | {r['load']:g} | {r['waited_n']:,} | {r['median_log']:+.2f} / {r['sd_log']:.2f} | "
                  + " / ".join(f"{r['explained'][f]:.2f}" for f in EXPLAINED) + " |")
    if args.learned:
        for r, figures in zip(rows, learned_report(rows), strict=True):
            r["round8"] = figures
        print_learned([r["round8"] for r in rows])
    if args.lateness or args.overtake:  # one row per candidate, the loads side by side
        print("\n| candidate | " + " | ".join(f"load {r['load']:g}: error / coverage (share of estimates scaled, r with "
                                             "today's residual)" for r in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for name in rows[0]["variants"]:
            print(f"| {name} | " + " | ".join(
                f"{r['variants'][name]['waited_median_rel_err']:.2f} / {r['variants'][name]['waited_coverage_pct']:.0f}%"
                f" (>1: {r['variants'][name]['share_factor_above_1_pct']:.0f}%, r {r['variants'][name]['r_residual']:+.2f})"
                for r in rows) + " |")
    elif args.variants:
        print("\n| load | candidate | waited > 60 s | median rel. error | within +-50% | P10-P90 coverage |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            for name, v in r["variants"].items():
                print(f"| {r['load']:g} | {name} | {v['waited_n']:,} | {v['waited_median_rel_err']:.2f} "
                      f"| {v['waited_within_50_pct']:.0f}% | {v['waited_coverage_pct']:.0f}% |")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "learned"} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
