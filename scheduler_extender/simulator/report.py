"""Readable tables, JSON and PNG plots for fill and replay results."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .fill import FillResult
from .replay import SCHEDULERS, ReplayResult


def _fmt(v: float, nd: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in cells]
    return "\n".join([out[0], line, *out[1:]])


def fill_summary(results: list[FillResult]) -> list[dict[str, object]]:
    """Mean over seeds per (workload, policy)."""
    groups: dict[tuple[str, str], list[FillResult]] = {}
    for r in results:
        groups.setdefault((r.workload, r.policy), []).append(r)
    out = []
    for (wl, pol), rs in groups.items():
        out.append(
            {
                "workload": wl,
                "policy": pol,
                "seeds": [r.seed for r in rs],
                "alloc_pct@100": float(np.mean([r.alloc_pct_at.get(100, math.nan) for r in rs])),
                "alloc_pct@130": float(np.mean([r.alloc_pct_at.get(130, math.nan) for r in rs])),
                "frag_amount_pct@80": float(np.mean([r.frag_amount_pct_at80 for r in rs])),
                "frag_ratio_pct@80": float(np.mean([r.frag_ratio_pct_at80 for r in rs])),
                "unallocated_gpus@130": float(np.mean([r.unallocated_gpus_at130 for r in rs])),
                "seconds_per_run": float(np.median([r.seconds for r in rs])),
            }
        )
    return out


def fill_table(summary: list[dict[str, object]], published: dict[tuple[str, str], dict[str, float]]) -> str:
    rows = []
    for s in summary:
        pub = published.get((str(s["workload"]), str(s["policy"]).replace("-exact", "")), {})
        p130 = pub.get("alloc_ratio_pct@arrived130", math.nan)
        rows.append(
            [
                s["workload"],
                s["policy"],
                len(s["seeds"]),  # type: ignore[arg-type]
                _fmt(s["alloc_pct@100"]),  # type: ignore[arg-type]
                _fmt(pub.get("alloc_ratio_pct@arrived100", math.nan)),
                _fmt(s["alloc_pct@130"]),  # type: ignore[arg-type]
                _fmt(p130),
                _fmt(float(s["alloc_pct@130"]) - p130) if not math.isnan(p130) else "-",  # type: ignore[arg-type]
                _fmt(s["frag_amount_pct@80"]),  # type: ignore[arg-type]
                _fmt(pub.get("frag_amount_pct@arrived80", math.nan)),
                _fmt(s["seconds_per_run"], 1),  # type: ignore[arg-type]
            ]
        )
    return table(
        ["workload", "policy", "seeds", "alloc%@100", "paper", "alloc%@130", "paper", "diff", "frag%@80", "paper", "s/run"],
        rows,
    )


def eviction_lines(results: list[ReplayResult]) -> list[str]:
    """What each evicting scheduler's evictions cost (work lost, GPU-hours) beside the wait they bought: its mean
    wait against the same scheduler without eviction (``NAME-no-eviction``) when that ran on the same jobs."""
    by = {r.scheduler: r for r in results}
    out = []
    for r in results:
        if not SCHEDULERS.get(r.scheduler, {}).get("eviction"):
            continue
        if not r.evictions:
            out.append(f"{r.scheduler}: no evictions" + (f" under the rule '{r.eviction_rule}' "
                                                         f"({r.evictions_declined:,} plans declined)"
                                                         if r.eviction_rule else ""))
            continue
        cost = (f"{r.scheduler}: {r.evictions:,} evictions lost {r.lost_gpu_hours:,.0f} GPU-hours of work "
                f"({r.lost_gpu_hours / r.evictions:.1f} each)")
        if r.eviction_rule:
            cost += f" under the rule '{r.eviction_rule}' ({r.evictions_declined:,} plans declined)"
        base = by.get(f"{r.scheduler}-no-eviction")
        if base is None:
            out.append(f"{cost}; run {r.scheduler}-no-eviction too (--schedulers) to see the wait they buy")
            continue
        mean, base_mean = r.delay["all"]["mean"], base.delay["all"]["mean"]
        hi, base_hi = (r.delay.get("priority:high", {}).get("mean", math.nan),
                       base.delay.get("priority:high", {}).get("mean", math.nan))
        saved = base_mean - mean
        out.append(f"{cost} and {'bought' if saved >= 0 else 'cost'} {abs(saved):,.0f} s of mean wait "
                   f"({mean:,.0f} s against {base_mean:,.0f} s without eviction; high priority {_fmt(hi, 0)} s "
                   f"against {_fmt(base_hi, 0)} s)")
    return out


def _workspace_label(name: str, quotas: dict[str, int] | None, jobs: float) -> str:
    quota = f"quota {quotas[name]:,} GPUs" if quotas and name in quotas else "no quota"
    return f"{name} ({quota}, {int(jobs):,} jobs)"


def replay_table(results: list[ReplayResult], quotas: dict[str, int] | None = None) -> str:
    """The replay's tables, each with a line per figure saying what it is. ``quotas``: the workspaces' quotas
    (GPUs) the replay ran with, shown beside their names."""
    rows = []
    for r in results:
        d = r.delay["all"]
        rows.append(
            [
                r.scheduler,
                r.policy,
                r.finished,
                _fmt(d["mean"], 0),
                _fmt(d["p50"], 0),
                _fmt(d["p95"], 0),
                _fmt(d["p99"], 0),
                _fmt(r.jct["mean"], 0),
                _fmt(r.utilisation_pct, 1),
                r.evictions,
                _fmt(r.lost_gpu_hours, 0),
                "n/a" if r.inversions is None else r.inversions,
                _fmt(r.seconds, 1),
                _fmt(r.cpu_seconds, 1),
            ]
        )
    main = table(
        ["scheduler", "placement", "jobs", "wait mean s", "p50", "p95", "p99", "JCT mean s", "util%*", "evictions",
         "lost GPU-h", "inversions", "wall s", "CPU s"],
        rows,
    )
    note = ("* GPU allocation over the submission window; wait = first admission - submission; JCT = finish - "
            "submission;\n  lost GPU-h = work evicted jobs had done and redo;\n  inversions = admissions that moved a "
            "waiting higher-ordered job's reservation later")
    if any(r.inversions is None for r in results):
        note += " (n/a: run with --audit)"
    evict = eviction_lines(results)
    if evict:
        note += "\n  eviction's cost beside the wait it buys:\n" + "\n".join(f"    {line}" for line in evict)
    erows = []
    for r in results:
        e = r.estimate_error
        erows.append([r.scheduler, e.get("waited_n", 0), _fmt(e.get("waited_median_rel_err", math.nan)),
                      _fmt(e.get("waited_within_50_pct", math.nan), 0), _fmt(e.get("waited_coverage_pct", math.nan), 0),
                      e.get("all_n", 0), _fmt(e.get("all_coverage_pct", math.nan), 0)])
    est = table(["wait estimate at arrival", "waited>60s", "median rel.err", "within ±50%", "P10-P90 cover %",
                 "all sampled", "cover %"], erows)
    enote = "\n".join([
        "waited>60s: sampled jobs (every --estimate-every-th arrival) that waited more than 60 s, what the next "
        "columns measure",
        "median rel.err: median of |estimated - actual wait| / actual wait over them (0 = exact, 0.5 = off by half)",
        "within ±50%: share of them whose estimate was within half of the actual wait either way",
        "P10-P90 cover %: share of them whose start fell inside the estimate's P10-P90 range (aim: about 80%)",
        "all sampled / cover %: every sampled job, waiting or not, and the same coverage over them",
        "FIFO is the easiest to estimate: nobody overtakes, so the queue ahead at arrival is the whole wait; "
        "under priority and size order a job's wait also depends on higher-priority or shorter jobs that arrive "
        "after it and pass it, which no estimate at arrival can know",
    ])
    keys = sorted((k for k in results[0].delay if k.startswith("priority:")),
                  key=lambda k: ("high", "medium", "low").index(k.split(":", 1)[1])) if results else []
    prow = [[k.split(":", 1)[1]] + [" / ".join(_fmt(r.delay.get(k, {}).get(m, math.nan), 0) for m in ("mean", "p95", "max"))
                                     for r in results] for k in keys]
    per_prio = table(["priority (wait mean / p95 / max s)"] + [r.scheduler for r in results], prow)
    wkeys = [k for k in results[0].delay if k.startswith("workspace:")] if results else []
    wrow = [[_workspace_label(k.split(":", 1)[1], quotas, results[0].delay[k]["n"])]
            + [_fmt(r.delay.get(k, {}).get("mean", math.nan), 0) for r in results] for k in wkeys]
    per_ws = table(["workspace (wait mean s)"] + [r.scheduler for r in results], wrow)
    wnote = "workspaces are the trace's VCs, named as the trace names them (Philly publishes only hashed VC names)"
    parts = [main + "\n" + note, est + "\n" + enote, per_prio, per_ws + "\n" + wnote]
    if any(r.failures.get("injected") for r in results):
        frow = [[r.scheduler, r.failures["injected"], r.failures["requeued"], r.failures["gave_up"]] for r in results]
        parts.append(table(["scheduler (injected failures)", "failures", "requeued", "gave up"], frow))
    return "\n\n".join(parts)


def write_json(path: Path, payload: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(o: object) -> object:
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [clean(v) for v in o]
        return o

    path.write_text(json.dumps(clean(payload), indent=2) + "\n", encoding="utf-8")


def delay_tail(delays: Sequence[float], floor_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The delay's tail for a log-log plot: for each sorted delay x of at least ``floor_s``, the share of all jobs
    that waited x or longer. A CDF of delays on a linear share axis is a flat line at the top
    when 99% of jobs wait under a second (issue 38.6); the tail keeps the 1% that matter readable, down to one
    job in the whole trace."""
    d = np.sort(np.asarray(delays, dtype=float))
    n = len(d)
    if not n:
        return np.empty(0), np.empty(0)
    first = int(np.searchsorted(d, floor_s, side="left"))
    xs = d[first:]
    ys = (n - np.arange(first, n)) / n  # share waiting at least xs[k]
    return xs, ys


PLOTS_EXTRA = "accelstack[plots]"


def plotting_missing() -> str:
    """Why ``--plot`` cannot draw here ('' when it can): matplotlib is the ``plots`` extra, not a dependency of
    every install (about 95 MB of a 313 MB runtime install and of every image), so the simulator checks before
    a run that may last an hour rather than failing at its end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return (f"--plot needs matplotlib, which cannot be imported here ({exc}); "
                f"install it with: pip install '{PLOTS_EXTRA}'")
    return ""


def plot(path: Path, fill: list[FillResult] | None = None, replay: list[ReplayResult] | None = None,
         published: dict[tuple[str, str], dict[str, float]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = int(bool(fill)) + int(bool(replay))
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(6.5 * max(panels, 1), 4.5), squeeze=False)
    i = 0
    if fill:
        ax = axes[0][i]
        i += 1
        colour: dict[str, str] = {}
        for r in fill:
            if r.curve:
                xs, ys = zip(*r.curve, strict=True)
                (line,) = ax.plot([100 * x for x in xs], [100 * y for y in ys], label=f"{r.policy} (seed {r.seed})", lw=1)
                colour.setdefault(r.policy, line.get_color())
        if published:
            for (wl, pol), v in published.items():
                if wl == fill[0].workload and pol in colour:
                    ax.scatter([130], [v["alloc_ratio_pct@arrived130"]], marker="x", s=30, color=colour[pol])
        ax.plot([0, 130], [0, 130], ls=":", c="grey", lw=0.8)
        ax.set_xlabel("arrived GPU requests, % of capacity")
        ax.set_ylabel("GPU allocation, % of capacity")
        ax.set_title(f"fill: {fill[0].workload} (x = published at 130%)")
        ax.legend(fontsize=7)
    if replay:
        ax = axes[0][i]
        drawn = False
        for rr in replay:
            tx, ty = delay_tail(rr.delays)
            if len(tx):
                ax.step(tx, ty, where="post", label=f"{rr.scheduler} ({100 * ty[0]:.1f}% wait 1 s or more)")
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no job waited 1 s or more", ha="center", transform=ax.transAxes)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("queueing delay x, s")
        ax.set_ylabel("share of jobs that waited x or longer")
        ax.set_title("replay: queueing delay tail (log-log)")
        if drawn:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
