"""``replay`` mode: a timed trace (Philly) through the scheduling engine on a virtual clock.

Each job becomes a GPR in its VC's workspace (quota = the VC's GPUs, when quotas are on). The trace carries no
priorities or exit durations, so they are drawn, seeded, per job (:class:`Assignment`, documented in
``docs/simulator.md``):

- priority class by ``priority_mix`` (default low 60%, medium 30%, high 10%), the value uniform in the class
  range (1-100, 101-200, 201-300);
- ``exitDuration`` = duration x U[``exit_factor``) (default 1.0-3.0: users over-estimate, never under);
- low-priority jobs are preemptible; high-priority jobs may evict (``enableEviction``).

A job runs for its trace duration once admitted (pods start at once); an evicted job restarts from the
beginning when it is admitted again (the work it had done is counted as lost). Three schedulers run on the same
jobs: ``accelstack`` (priority + bounded backfill + eviction), ``strict-priority`` (priority order, no
backfill, no eviction) and ``fifo`` (submission order, no backfill, no eviction).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..core.eviction import EVICTION_COST_RATIO, EVICTION_MAX_WAIT_S, EvictionRule
from ..core.gpr import GPR, priority_class
from ..core.inventory import Inventory, NodeSpec
from ..core.placement import make_policy
from ..core.scheduler import Scheduler, SchedulerConfig
from .traces import Job

SCHEDULERS: dict[str, dict[str, bool | str]] = {
    "accelstack": {"use_priority": True, "order": "size", "backfill": True, "eviction": True},
    "strict-priority": {"use_priority": True, "order": "priority", "backfill": False, "eviction": False},
    "fifo": {"use_priority": False, "backfill": False, "eviction": False},
    # not run by default: accelstack without eviction, what the eviction's cost is weighed against (issue 35.8)
    "accelstack-no-eviction": {"use_priority": True, "order": "size", "backfill": True, "eviction": False},
    # not run by default: accelstack with FIFO within each priority (the ordering before predictions)
    "accelstack-fifo": {"use_priority": True, "order": "priority", "backfill": True, "eviction": True},
}
# accelstack-no-eviction runs by default so the report can weigh what eviction costs (work lost) against the wait
# it buys (issue 35.8); the demo keeps to three to stay well under a minute
DEFAULT_SCHEDULERS = ("accelstack", "accelstack-no-eviction", "strict-priority", "fifo")
DEMO_SCHEDULERS = ("accelstack", "accelstack-no-eviction", "strict-priority", "fifo")
WAITED_S = 60.0  # estimate accuracy is reported for jobs that waited longer than this
CLASS_RANGE = {"low": (1, 100), "medium": (101, 200), "high": (201, 300)}


@dataclass(frozen=True)
class Assignment:
    """How trace jobs get the fields the trace lacks. All draws come from one generator seeded with ``seed``."""

    seed: int = 0
    priority_mix: tuple[tuple[str, float], ...] = (("low", 0.6), ("medium", 0.3), ("high", 0.1))
    exit_factor: tuple[float, float] = (1.0, 3.0)
    preemptible_classes: frozenset[str] = frozenset({"low"})
    evicting_classes: frozenset[str] = frozenset({"high"})

    def draw(self, jobs: list[Job]) -> list[tuple[int, float]]:
        """(priority, exitDuration) per job, in job order."""
        rng = np.random.default_rng(self.seed)
        names = [c for c, _ in self.priority_mix]
        probs = np.array([p for _, p in self.priority_mix], dtype=float)
        probs = probs / probs.sum()
        cls = rng.choice(len(names), size=len(jobs), p=probs)
        u = rng.random(len(jobs))
        lo, hi = self.exit_factor
        factor = lo + (hi - lo) * rng.random(len(jobs))
        out = []
        for j, c, uu, f in zip(jobs, cls, u, factor, strict=True):
            a, b = CLASS_RANGE[names[c]]
            out.append((int(a + uu * (b - a + 1 - 1e-9)), max(1.0, math.ceil(j.duration_s * f))))
        return out


def job_shape(num_gpu: int, per_node_max: int = 8) -> tuple[int, int]:
    """(devices per node, node count): up to 8 GPUs on one node, more spread evenly over whole nodes."""
    if num_gpu <= per_node_max:
        return num_gpu, 1
    nodes = math.ceil(num_gpu / per_node_max)
    while num_gpu % nodes:
        nodes += 1
    return num_gpu // nodes, nodes


@dataclass
class JobOutcome:
    submit: float
    duration: float
    gpus: int
    workspace: str
    priority: int
    first_start: float | None = None
    finish: float | None = None
    estimate: float | None = None  # estimated start, made right after arrival (sampled jobs only)
    est_low: float | None = None  # its P10-P90 range
    est_high: float | None = None
    evictions: int = 0


@dataclass
class ReplayResult:
    scheduler: str
    policy: str
    jobs: int
    finished: int
    seconds: float  # wall
    cpu_seconds: float  # process CPU time (what a shared machine's neighbours do not inflate)
    passes: int
    admissions: int
    evictions: int
    lost_gpu_hours: float
    inversions: int | None  # None: not audited
    utilisation_pct: float  # over the submission window (first to last arrival)
    utilisation_all_pct: float  # until the last job finished
    span_s: float
    delay: dict[str, dict[str, float]]
    jct: dict[str, float]
    estimate_error: dict[str, float]
    failures: dict[str, int] = field(default_factory=dict)
    delays: list[float] = field(default_factory=list)
    evictions_declined: int = 0  # eviction plans the eviction rule found not worth their cost (passes, not GPRs)
    eviction_rule: str = ""  # the rule, in words ("" for a scheduler that never evicts)

    def to_dict(self, with_samples: bool = False) -> dict[str, object]:
        d = dict(self.__dict__)
        if not with_samples:
            d.pop("delays")
        return d


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}
    a = np.asarray(xs, dtype=float)
    return {
        "n": len(xs),
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def estimate_accuracy(outcomes: list[JobOutcome], waited_s: float = WAITED_S) -> dict[str, float]:
    """How good the arrival estimates were, over the sampled jobs that started: for those that waited more than
    ``waited_s``, the median relative error of the estimated wait (|estimated - actual| / actual), the share
    within +-50%, and the share whose start fell inside the P10-P90 range ("coverage"); the same for all."""
    rel, cover, rel_all, cover_all = [], [], [], []
    for o in outcomes:
        if o.first_start is None or o.estimate is None or not math.isfinite(o.estimate):
            continue
        wait = o.first_start - o.submit
        est_wait = o.estimate - o.submit
        inside = (o.est_low or 0.0) - 1e-6 <= o.first_start <= (o.est_high or 0.0) + 1e-6
        cover_all.append(inside)
        if wait > 0:
            rel_all.append(abs(est_wait - wait) / wait)
        if wait > waited_s:
            rel.append(abs(est_wait - wait) / wait)
            cover.append(inside)

    def med(xs: list[float]) -> float:
        return float(np.median(xs)) if xs else math.nan

    def share(xs: list[bool]) -> float:
        return 100 * float(np.mean(xs)) if xs else math.nan

    return {
        "waited_n": len(rel),
        "waited_median_rel_err": med(rel),
        "waited_within_50_pct": share([r <= 0.5 for r in rel]),
        "waited_coverage_pct": share(cover),
        "all_n": len(cover_all),
        "all_median_rel_err": med(rel_all),
        "all_coverage_pct": share(cover_all),
    }


def replay_run(
    nodes: list[NodeSpec],
    jobs: list[Job],
    scheduler: str = "accelstack",
    policy: str = "bestfit",
    assignment: Assignment | None = None,
    quotas: dict[str, int] | None = None,
    estimate_every: int = 10,
    audit: bool = False,
    max_reservations: int = 8,
    fail_rate: float = 0.0,
    retry_limit: int = 3,
    progress: Callable[[float], None] | None = None,
    eviction_cost_ratio: float | None = EVICTION_COST_RATIO,
    eviction_max_wait_s: float = EVICTION_MAX_WAIT_S,
    estimate_from_s: float = -math.inf,
) -> ReplayResult:
    """Replay ``jobs`` (sorted by submit time) on ``nodes``. ``quotas``: GPUs per workspace.

    ``estimate_every``: the arrival estimate is made (and scored) for every N-th job submitted at or after
    ``estimate_from_s`` (trace time): the jobs before it only warm the duration history and the calibration up,
    as the months before do for a controller that keeps them.

    ``fail_rate``: each run attempt fails with this probability at a uniform point of its run (seeded); jobs
    then requeue with the GPR backoff (60 s doubling, at most 1 h) up to ``retry_limit`` times.
    ``progress`` is called with the fraction done, (jobs submitted + jobs ended) / 2 x jobs, about every 0.5%
    of it and once with 1.0 at the end: submissions alone would say 100% while a busy queue still drains.
    ``eviction_cost_ratio``, ``eviction_max_wait_s``: the eviction rule (:class:`..core.eviction.EvictionRule`)
    of the schedulers that evict.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    assignment = assignment or Assignment()
    drawn = assignment.draw(jobs)
    inv = Inventory(nodes, tie_seed=assignment.seed)
    if policy.startswith("fgd"):
        from ..core.placement import Shape, TypicalShapes

        shapes = TypicalShapes.from_requests(
            (Shape(0, *job_shape(j.num_gpu)[:1], 1000) for j in jobs), inv.models
        )
        pol = make_policy(policy, shapes, assignment.seed)
    else:
        pol = make_policy(policy, None, assignment.seed)
    cfg = SchedulerConfig(
        **SCHEDULERS[scheduler],  # type: ignore[arg-type]
        quotas={ws: q * 1000 for ws, q in quotas.items()} if quotas else None,
        audit=audit,
        max_reservations=max_reservations,
        eviction_cost_ratio=eviction_cost_ratio,
        eviction_max_wait_s=eviction_max_wait_s,
    )
    eng = Scheduler(inv, pol, cfg)
    out: dict[str, JobOutcome] = {}
    completions: list[tuple[float, str, float, bool]] = []  # (time, name, admitted_at, succeeds)
    fail_rng = np.random.default_rng(assignment.seed + 1)
    failures = requeues = gave_up = 0
    i, n = 0, len(jobs)
    scored = 0  # jobs submitted at or after estimate_from_s so far (every estimate_every-th is estimated)
    used = 0  # allocated milli, for utilisation
    busy = 0.0  # integral of used milli over time
    last_t = float(jobs[0].submit_s) if jobs else 0.0
    admissions = evictions = 0
    lost = 0.0
    busy_at_last_submit = -1.0
    ended = 0  # jobs that will not run again: succeeded, stopped at their bound, gave up after failures
    step = max(1, n // 100)
    next_mark = step
    while True:
        if progress is not None and i + ended >= next_mark:
            progress((i + ended) / (2 * n))
            next_mark = i + ended + step
        t = min(
            float(jobs[i].submit_s) if i < n else math.inf,
            completions[0][0] if completions else math.inf,
            eng.next_wakeup(),
        )
        if math.isinf(t):
            break
        busy += used * (t - last_t)
        last_t = t
        while completions and completions[0][0] <= t:
            _, name, adm, ok = heapq.heappop(completions)
            g = eng.gprs[name]
            if g.holding and g.admitted_at == adm:
                evs = eng.finish(name, t, ok=ok, reason="" if ok else "InjectedFailure")
                used -= g.milli_total()
                if ok:
                    out[name].finish = t
                    ended += 1
                else:
                    failures += 1
                    if any(e.kind == "requeued" for e in evs):
                        requeues += 1
                    else:
                        gave_up += 1
                        ended += 1
        new: list[str] = []
        while i < n and jobs[i].submit_s <= t:
            j = jobs[i]
            prio, exit_s = drawn[i]
            per_node, node_count = job_shape(j.num_gpu)
            cls = priority_class(prio)
            g = GPR(
                name=j.job_id,
                workspace=j.vc,
                devices_per_node=per_node,
                node_count=node_count,
                priority=prio,
                exit_duration_s=exit_s if j.exit_s is None else None if math.isinf(j.exit_s) else j.exit_s,
                models=(j.model,) if j.model else (),
                preemptible=cls in assignment.preemptible_classes,
                enable_eviction=cls in assignment.evicting_classes,
                requeue_on_failure=fail_rate > 0,
                retry_limit=retry_limit,
                submitted_at=float(j.submit_s),
            )
            eng.submit(g, t)
            out[j.job_id] = JobOutcome(float(j.submit_s), float(j.duration_s), j.num_gpu, j.vc, prio)
            if j.submit_s >= estimate_from_s:
                if estimate_every and scored % estimate_every == 0:
                    new.append(j.job_id)
                scored += 1
            i += 1
            if i == n:
                busy_at_last_submit = busy
        for ev in eng.tick(t):
            g = eng.gprs[ev.gpr]
            if ev.kind in ("admitted", "backfilled"):
                admissions += 1
                used += g.milli_total()
                o = out[ev.gpr]
                if o.first_start is None:
                    o.first_start = t
                eng.start(ev.gpr, t)
                if fail_rate > 0 and fail_rng.random() < fail_rate:
                    heapq.heappush(completions, (t + o.duration * float(fail_rng.random()), ev.gpr, t, False))
                else:
                    heapq.heappush(completions, (t + o.duration, ev.gpr, t, True))
            elif ev.kind == "evicted":
                evictions += 1
                used -= g.milli_total()
                out[ev.gpr].evictions += 1
                started = next(h for h in reversed(g.history) if h[1].value == "Admitted")[0]
                lost += (t - started) * g.milli_total() / 1000
            elif ev.kind == "expired":
                used -= g.milli_total()
                out[ev.gpr].finish = t
                ended += 1
        # estimates for sampled new arrivals that are still waiting after this pass
        for name in new:
            o = out[name]
            if name in eng.queue:
                iv = eng.estimate_ranges(t, upto=name).get(name)
                if iv is not None:
                    o.estimate, o.est_low, o.est_high = iv
            else:
                o.estimate = o.est_low = o.est_high = t
    if progress is not None:
        progress(1.0)
    span = max(last_t - (jobs[0].submit_s if jobs else 0), 1.0)
    window_s = float(jobs[-1].submit_s - jobs[0].submit_s) if jobs else 0.0
    cap = inv.capacity_milli()
    done = [o for o in out.values() if o.first_start is not None]
    delays = [o.first_start - o.submit for o in done]  # type: ignore[operator]
    by_class: dict[str, list[float]] = {}
    by_ws: dict[str, list[float]] = {}
    for o in done:
        d = o.first_start - o.submit  # type: ignore[operator]
        by_class.setdefault(priority_class(o.priority), []).append(d)
        by_ws.setdefault(o.workspace, []).append(d)
    delay = {"all": _stats(delays)}
    delay.update({f"priority:{k}": _stats(v) for k, v in sorted(by_class.items())})
    delay.update({f"workspace:{k}": _stats(v) for k, v in sorted(by_ws.items())})
    jcts = [o.finish - o.submit for o in done if o.finish is not None]
    est: list[float] = [
        o.first_start - o.estimate  # type: ignore[operator]
        for o in done
        if o.estimate is not None and math.isfinite(o.estimate)
    ]
    n_inf = sum(1 for o in done if o.estimate is not None and not math.isfinite(o.estimate))
    est_err = {
        "n": len(est),
        "unbounded": n_inf,
        "mean_abs_s": float(np.mean(np.abs(est))) if est else math.nan,
        "median_abs_s": float(np.median(np.abs(est))) if est else math.nan,
        "mean_signed_s": float(np.mean(est)) if est else math.nan,
        "late_pct": 100 * float(np.mean(np.array(est) > 1e-6)) if est else math.nan,
    }
    est_err.update(estimate_accuracy(done))
    return ReplayResult(
        scheduler=scheduler,
        policy=policy,
        jobs=n,
        finished=len(jcts),
        seconds=time.perf_counter() - t0,
        cpu_seconds=time.process_time() - c0,
        passes=eng.passes,
        admissions=admissions,
        evictions=evictions,
        lost_gpu_hours=lost / 3600,
        inversions=eng.inversions if audit else None,
        utilisation_pct=100 * busy_at_last_submit / (cap * window_s) if window_s > 0 else math.nan,
        utilisation_all_pct=100 * busy / (cap * span),
        span_s=span,
        delay=delay,
        jct=_stats(jcts),
        estimate_error=est_err,
        failures={"injected": failures, "requeued": requeues, "gave_up": gave_up},
        delays=delays,
        evictions_declined=eng.evictions_declined,
        eviction_rule=EvictionRule(eviction_cost_ratio, eviction_max_wait_s).describe() if cfg.eviction else "",
    )


def window(
    jobs: list[Job],
    days: float | None = None,
    max_jobs: int | None = None,
    start_day: float = 0,
    load: float = 1.0,
) -> list[Job]:
    """The jobs submitted in ``[start_day, start_day + days)`` days after the first (trace time), at most
    ``max_jobs``; with ``load`` > 1 the gaps between submissions shrink by that factor (durations unchanged),
    which multiplies the offered load."""
    if not jobs:
        return jobs
    t0 = jobs[0].submit_s + start_day * 86400
    sel = [j for j in jobs if j.submit_s >= t0 and (days is None or j.submit_s < t0 + days * 86400)]
    sel = sel[:max_jobs] if max_jobs is not None else sel
    if load != 1.0:
        if load <= 0:
            raise ValueError("load must be positive")
        sel = [replace(j, submit_s=int(t0 + (j.submit_s - t0) / load)) for j in sel]
    return sel
