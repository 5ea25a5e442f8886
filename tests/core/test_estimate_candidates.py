"""The estimate candidates of ``bench/bench_estimates.py`` (docs/estimates.md): the factors are
worked out as documented and scored as the estimate is, so the figures the docs cite measure what they say."""

from __future__ import annotations

import math
import sys

import pytest

from scheduler_extender.core.waittime import Calibrator
from tests.bench_module import load_bench

bench = load_bench("bench_estimates")


def refusal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What ``bench_estimates.py ARGV`` says on stderr as it refuses (exits through argparse)."""
    monkeypatch.setattr(sys, "argv", ["bench_estimates.py", *argv])
    with pytest.raises(SystemExit):
        bench.main()
    return capsys.readouterr().err


def test_lateness_is_the_censored_median_and_only_shows_lateness() -> None:
    lat = bench.Lateness()
    # (elapsed since the first projection, first projected wait, class); slack 60 s
    early = [(0.0, 600.0, "low"), (100.0, 600.0, "low")]
    assert lat.factor(early, "low") == 1.0  # not started yet and not late: a lower bound of 1, never below
    late = [(540.0, 0.0, "low"), (1140.0, 0.0, "low"), (0.0, 600.0, "low")]  # ratios 10, 20, floored 1
    assert lat.factor(late, "low") == pytest.approx(10.0)
    assert lat.factor([], "low") == 1.0


def test_lateness_variants_filter_shrink_and_cap() -> None:
    smp = [(540.0, 0.0, "high"), (1140.0, 0.0, "high"), (30.0, 600.0, "low"), (90.0, 600.0, "low")]
    # past their projection only: the two late ones (ratios 10 and 20: their geometric middle)
    assert bench.Lateness(frac=1.0).factor(smp, "low") == pytest.approx(math.sqrt(200.0))
    # own level only: the two low ones, neither late
    assert bench.Lateness(level=True).factor(smp, "low") == 1.0
    # waited over 60 s only: 540, 1140, 90 -> ratios 10, 20, 1 -> median 10
    assert bench.Lateness(waited=True).factor(smp, "low") == pytest.approx(10.0)
    # shrunk: log factor x n / (n + 3) with n = 2
    assert bench.Lateness(frac=1.0, shrink=3.0).factor(smp, "low") == pytest.approx(200.0 ** (0.5 * 2 / 5))
    assert bench.Lateness(frac=1.0, cap=4.0).factor(smp, "low") == 4.0


def test_burst_extrapolates_the_arrival_rate_over_the_queues_projected_wait() -> None:
    now = 1000.0
    # queued: (submitted at, level rank, projected remaining wait); arrivals: (submitted at, level rank)
    queued = [(400.0, 0, 300.0), (700.0, 0, 600.0), (900.0, 2, 900.0)]
    arrivals = [(100.0, 0), (400.0, 0), (500.0, 2), (700.0, 0), (900.0, 2)]
    # since 400: 4 arrivals in 600 s, over the median remaining 600 s: 4 more, against 3 queued: (3 + 1 + 4) / 4
    assert bench.Burst().factor(queued, arrivals, 0, now) == pytest.approx(2.0)
    # higher levels than low only: 2 arrivals -> 2 more, 1 queued ranks ahead: (1 + 1 + 2) / 2
    assert bench.Burst(levels="higher").factor(queued, arrivals, 0, now) == pytest.approx(2.0)
    # own level and above for a high GPR: the high ones only, as "higher" is for low
    assert bench.Burst(levels="ahead").factor(queued, arrivals, 2, now) == pytest.approx(2.0)
    assert bench.Burst(cap=1.5).factor(queued, arrivals, 0, now) == 1.5
    assert bench.Burst().factor([], arrivals, 0, now) == 1.0


def test_scoring_calibrates_each_candidate_from_its_own_corrected_first_projections() -> None:
    k = len(bench.CANDIDATES)
    doubled = [2.0] * k  # every candidate doubles every (wait + slack)
    log: list[tuple[object, ...]] = []
    for i in range(40):  # first projections of 0 s, each GPR then waits 60 s: (60 + 60) / (0 + 60) = 2
        log += [("first", f"g{i}", 100.0 * i, "low", 0.0, doubled), ("adm", f"g{i}", 100.0 * i + 60.0)]
    # the sampled GPR: projected 240 s, starts after 540 s
    log += [("est", "s", 10_000.0, "low", 240.0, doubled), ("adm", "s", 10_540.0)]
    out = bench.score_lateness(log)
    cal = Calibrator()
    for _ in range(40):
        cal.observe("low", 0.0, 60.0)
    today = cal.estimate("low", 10_000.0, 10_240.0).start - 10_000.0  # (240 + 60) x 2 - 60 = 540: exact
    assert today == pytest.approx(540.0, abs=31.0)  # the histogram's bins are 0.1 wide in the log
    assert out["today (factor 1)"]["waited_median_rel_err"] == pytest.approx(abs(today - 540.0) / 540.0)
    # a candidate that doubles them: its calibration sees (0 + 60) x 2 - 60 = 60 s projected against 60 s actual
    # (ratio 1), and its estimate is the sampled GPR's (240 + 60) x 2 - 60 = 540 s unscaled: exact
    cand = out[bench.CANDIDATES[0].label()]
    assert cand["waited_n"] == 1 and cand["waited_median_rel_err"] == pytest.approx(0.0, abs=0.06)
    assert cand["share_factor_above_1_pct"] == 100.0


def test_lateness_refuses_the_held_out_part(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "--parts tuning only" in refusal(monkeypatch, capsys, "--lateness")


def test_the_oracle_bound_changes_estimates_never_decisions() -> None:
    """``--oracle`` gives the projection every GPR's exact hold time: the estimates move (here, closer), the
    replay's decisions do not (the same mean wait and evictions), and the scheduler is left as it was."""
    from scheduler_extender.core.scheduler import Scheduler

    methods = (Scheduler.predicted_hold, Scheduler.estimate_ranges)
    today = bench.run_one("tuning", 4.0, 3.0, 5)
    exact = bench.run_oracle("tuning", 4.0, 3.0, 5)
    assert (Scheduler.predicted_hold, Scheduler.estimate_ranges) == methods
    assert exact["wait_mean_s"] == today["wait_mean_s"] and exact["evictions"] == today["evictions"]
    assert exact["waited_n"] == today["waited_n"] > 20
    assert exact["waited_median_rel_err"] != today["waited_median_rel_err"]


def test_the_arrivals_bounds_change_estimates_never_decisions_and_leave_the_projection_as_it_was() -> None:
    """``--clairvoyant`` (exact hold times and the arrivals that rank ahead known) and ``--clairvoyant-arrivals``
    (the arrivals alone) move the estimates and nothing else; with both known the fluid projection is exact for
    most of the GPRs that wait (median relative error near 0), and the module's ``project`` is restored."""
    from scheduler_extender.core import scheduler as core_scheduler

    project = core_scheduler.project
    today = bench.run_one("tuning", 4.0, 3.0, 5)
    both = bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True)
    arrivals = bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True, exact_holds=False)
    assert core_scheduler.project is project
    for row in (both, arrivals):
        assert (row["wait_mean_s"], row["evictions"], row["waited_n"]) == (
            today["wait_mean_s"], today["evictions"], today["waited_n"])
    assert both["waited_median_rel_err"] < 0.05 < today["waited_median_rel_err"]
    assert arrivals["waited_median_rel_err"] < today["waited_median_rel_err"]
    assert both["part"] == "tuning (clairvoyant)" and arrivals["part"] == "tuning (arrivals known)"


def test_a_forecast_is_a_candidate_and_refuses_the_held_out_part(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "--parts tuning only" in refusal(monkeypatch, capsys, "--forecast", "6")
    row = bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True, exact_holds=False, forecast_s=6 * 3600.0)
    assert row["part"] == "tuning (forecast 6 h)" and row["wait_mean_s"] == bench.run_one("tuning", 4.0, 3.0, 5)[
        "wait_mean_s"]


def test_the_horizon_bounds_what_the_arrivals_bound_is_told() -> None:
    """``--horizon``: the arrivals bound told nothing (a horizon shorter than any gap between arrivals) is today's
    estimate exactly; told 10 minutes, it moves the estimates and nothing else."""
    today = bench.run_one("tuning", 4.0, 3.0, 5)
    none = bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True, exact_holds=False, horizon_s=1e-6)
    ten = bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True, exact_holds=False, horizon_s=600.0)
    assert none["waited_median_rel_err"] == today["waited_median_rel_err"]
    assert none["waited_coverage_pct"] == today["waited_coverage_pct"]
    assert ten["waited_median_rel_err"] != today["waited_median_rel_err"]
    assert ten["wait_mean_s"] == today["wait_mean_s"] and ten["part"] == "tuning (arrivals known, 10 min ahead)"


def test_a_forecast_takes_minutes_a_scale_and_refuses_them_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench._hours("10m") == pytest.approx(1 / 6) and bench._hours("6h") == bench._hours("6") == 6.0
    for argv, said in ((["--forecast", "10x", "--parts", "tuning"], "expected hours (6, 6h) or minutes (10m)"),
                       (["--horizon", "10", "--parts", "tuning"], "--horizon: only with"),
                       (["--forecast-scale", "0.5", "--parts", "tuning"], "--forecast-scale: only with --forecast")):
        err = refusal(monkeypatch, capsys, *argv)
        assert said in err and "Traceback" not in err
    full = bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True, exact_holds=False, forecast_s=600.0, horizon_s=600.0)
    half = bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True, exact_holds=False, forecast_s=600.0, horizon_s=600.0,
                            scale=0.5)
    assert half["part"] == "tuning (forecast 10 min, 10 min ahead, holds x 0.5)"
    assert half["wait_mean_s"] == full["wait_mean_s"]
    assert half["waited_median_rel_err"] != full["waited_median_rel_err"]


def test_one_bound_or_candidate_set_at_a_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "one at a time" in refusal(monkeypatch, capsys, "--oracle", "--lateness", "--parts", "tuning")


def test_the_overtaking_load_counts_only_what_would_pass_and_slows_the_drain() -> None:
    """The overtaking load (``--overtake``): rho is the windowed work of arrivals that would rank ahead (a higher level, or
    the same level and smaller; half of the same size bin) over GPUs x window; the factor is 1 / (1 - rho),
    rho capped. The window forgets what arrived before it."""
    hour = 3600.0
    small, big = bench.size_bin(600.0), bench.size_bin(600_000.0)
    assert small < big
    # 8 GPUs, a 1-hour window: 4 GPU-hours of higher-level work, 2 of small same-level, 2 of big same-level work
    arrivals = [(10.0, 2, small, 4 * hour), (20.0, 1, small, 2 * hour), (30.0, 1, big, 2 * hour)]
    window = bench._Window(hour)
    sums = window.at(arrivals, 100.0)
    one = bench.Overtake(1.0, 0.8)
    assert one.factor(sums, 1, big, 8.0) == pytest.approx(1 / (1 - 0.8))  # rho 7/8 (4 + 2 + half of 2), capped
    assert bench.Overtake(1.0, 0.95).factor(sums, 1, big, 8.0) == pytest.approx(1 / (1 - 7 / 8))
    assert bench.Overtake(1.0, 0.95).factor(sums, 1, small, 8.0) == pytest.approx(1 / (1 - 5 / 8))
    assert bench.Overtake(1.0, 0.95, "higher").factor(sums, 1, big, 8.0) == pytest.approx(1 / (1 - 4 / 8))
    assert bench.Overtake(1.0, 0.95).factor(sums, 2, small, 8.0) == pytest.approx(1 / (1 - 2 / 8))  # top level
    later = window.at(arrivals, 25.0 + hour)  # the first two have left the window
    assert bench.Overtake(1.0, 0.95).factor(later, 1, big, 8.0) == pytest.approx(1 / (1 - 1 / 8))


def test_overtake_scores_the_candidates_and_refuses_the_held_out_part(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "--parts tuning only" in refusal(monkeypatch, capsys, "--overtake")
    row = bench.run_lateness("tuning", 4.0, 3.0, 5, overtake=True)
    assert row["wait_mean_s"] == bench.run_one("tuning", 4.0, 3.0, 5)["wait_mean_s"]
    scores = row["variants"]
    assert list(scores) == ["today (factor 1)", *(v.label() for v in bench.OVERTAKE)]
    assert all(v["waited_n"] == scores["today (factor 1)"]["waited_n"] > 20 for v in scores.values())
    assert any(v["share_factor_above_1_pct"] > 50 for v in scores.values())  # the loads did scale estimates


def test_the_arrivals_bound_split_by_level_tells_each_half_and_moves_no_decision() -> None:
    """``--ahead-levels``: told only the higher levels' arrivals, or only its own level's, the bound moves the
    estimates and nothing else; the two halves and ``all`` each tell the projection something else (three
    different scores); an unknown choice is refused."""
    today = bench.run_one("tuning", 4.0, 3.0, 5)
    rows = {lv: bench.run_oracle("tuning", 4.0, 3.0, 5, ahead=True, exact_holds=False, horizon_s=600.0, levels=lv)
            for lv in bench.AHEAD_LEVELS}
    for row in rows.values():
        assert (row["wait_mean_s"], row["evictions"], row["waited_n"]) == (
            today["wait_mean_s"], today["evictions"], today["waited_n"])
    assert rows["higher"]["part"] == "tuning (arrivals known, 10 min ahead, higher levels only)"
    assert rows["same"]["part"] == "tuning (arrivals known, 10 min ahead, own level only)"
    assert rows["all"]["part"] == "tuning (arrivals known, 10 min ahead)"
    errs = {lv: (r["waited_median_rel_err"], r["waited_coverage_pct"]) for lv, r in rows.items()}
    assert len(set(errs.values())) == 3, errs  # each choice tells the projection something else
    with pytest.raises(ValueError, match="levels: 'lower' is not one of all, higher, same"):
        bench.run_oracle("tuning", 4.0, 0.1, 5, ahead=True, exact_holds=False, levels="lower")


def test_another_scheduler_replays_its_own_decisions_and_only_plainly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--scheduler accelstack-fifo``: FIFO within a level decides otherwise (another mean wait), the row names
    it; the bounds and candidates refuse it, ``--ahead-levels`` needs a bound, and an unknown name is refused."""
    today = bench.run_one("tuning", 4.0, 3.0, 5)
    fifo = bench.run_one("tuning", 4.0, 3.0, 5, scheduler="accelstack-fifo")
    assert fifo["part"] == "tuning (accelstack-fifo)" and fifo["wait_mean_s"] != today["wait_mean_s"]
    assert fifo["waited_n"] > 20
    for argv, said in ((["--scheduler", "accelstack-fifo", "--oracle"], "--scheduler: only with the plain replay"),
                       (["--scheduler", "fifo", "--parts", "tuning", "--lateness"], "--scheduler: only with"),
                       (["--ahead-levels", "same", "--oracle"], "--ahead-levels: only with --clairvoyant"),
                       (["--scheduler", "slurm"], "invalid choice: 'slurm'")):
        err = refusal(monkeypatch, capsys, *argv)
        assert said in err and "Traceback" not in err


def test_what_a_better_estimate_would_have_to_explain() -> None:
    """``--explained``: explaining none of the log error's variance leaves today's median relative error; all of
    it leaves only the bias (here none: every error the same distance above and below); more explained, less
    error; the replay's row carries the same figures for its own waited jobs."""
    pairs = [(100.0, 200.0), (200.0, 100.0), (100.0, 100.0), (400.0, 100.0), (100.0, 400.0)]
    out = bench.explained_errors(pairs, (0.0, 0.5, 1.0))
    rel = sorted(abs(e - a) / a for e, a in pairs)
    assert out["explained"][0.0] == pytest.approx(rel[2]) and out["median_log"] == pytest.approx(0.0)
    assert out["explained"][1.0] == pytest.approx(0.0)
    assert out["explained"][0.0] > out["explained"][0.5] > 0.0
    late = bench.explained_errors([(100.0, 200.0), (100.0, 220.0), (100.0, 180.0)], (1.0,))
    assert late["median_log"] == pytest.approx(math.log(2.0))
    assert late["explained"][1.0] == pytest.approx(0.5)  # the bias is left: each estimate still half its wait
    assert math.isnan(bench.explained_errors([])["explained"][0.0])

    row = bench.run_one("tuning", 4.0, 3.0, 5, explained=True)
    assert row["explained"][0.0] == pytest.approx(row["waited_median_rel_err"], abs=0.01)
    errs = [row["explained"][f] for f in bench.EXPLAINED]
    assert errs == sorted(errs, reverse=True) and errs[0] > errs[-1]
    assert "explained" not in bench.run_one("tuning", 4.0, 3.0, 5)


def test_the_lateness_models_fit_what_they_say() -> None:
    """Round 8's models (``--learned``): the ridge halves a standardized feature's slope (penalty 1 x n) around a
    free intercept; the median regression finds the line the majority lies on, outliers or not; an unknown model
    is refused."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, len(bench.FEATURES)))
    y = 0.3 + 0.8 * x[:, 0]
    ridge = bench.fit_lateness(x, y, "ridge")(x)
    assert np.corrcoef(ridge, y)[0, 1] > 0.99
    assert float(np.mean(ridge)) == pytest.approx(float(np.mean(y)))  # the intercept is not shrunk
    assert float(np.polyfit(y, ridge, 1)[0]) == pytest.approx(0.5, abs=0.05)  # 1 / (1 + penalty)
    bad = y.copy()
    bad[:60] += 25.0  # a few wild outcomes
    median = bench.fit_lateness(x, bad, "quantile")(x)
    assert float(np.median(np.abs(median - y))) < 0.01
    assert float(np.median(np.abs(bench.fit_lateness(x, bad, "ridge")(x) - y))) > 0.5
    with pytest.raises(ValueError, match="not ridge or quantile"):
        bench.fit_lateness(x, y, "trees")


def test_a_learned_shift_moves_the_estimate_and_its_range_as_the_calibration_does() -> None:
    """Scored as the simulator scores: no shift, today's figures; a factor k scales (wait + 60 s), range too."""
    feats = [0.0] * len(bench.FEATURES)
    waited = [(0.0, 140.0, 40.0, 240.0, 340.0, feats),  # estimated 140 s, waited 340 s
              (0.0, 940.0, 440.0, 1940.0, 470.0, feats)]  # estimated 940 s, waited 470 s
    today = bench.score_shifted(waited, 0.0)
    assert today["n"] == 2 and today["cover"] == 50.0
    assert today["err"] == pytest.approx((200 / 340 + 470 / 470) / 2)
    both = bench.score_shifted(waited, [math.log(2.0), math.log(0.5)])  # 140 -> 340 s, 940 -> 440 s
    assert both["err"] == pytest.approx((0.0 + 30 / 470) / 2) and both["cover"] == 100.0
    x, y = bench.lateness_of(waited)
    assert x.shape == (2, len(bench.FEATURES))
    assert list(y) == pytest.approx([math.log(400 / 200), math.log(530 / 1000)])


def test_cross_fitting_predicts_each_block_from_the_others_only() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(500, len(bench.FEATURES)))
    y = 1.0 + x[:, 1]
    p = bench.cross_fitted(x, y)
    assert float(np.max(np.abs(p - y))) < 1e-3  # the same line in every block: each learned from the others
    y2 = y.copy()
    y2[:100] += 5.0  # the first block alone is off: the others cannot know it
    p2 = bench.cross_fitted(x, y2)
    assert float(np.median(y2[:100] - p2[:100])) == pytest.approx(5.0, abs=0.01)
    assert list(bench.cross_fitted(x[:40], y[:40])) == [0.0] * 40  # too few to learn from: today's estimate


def test_the_learned_round_records_every_sampled_estimate_and_moves_no_decision(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--learned`` replays as today (same decisions, same scored estimates: its own scoring of the recorded
    estimates gives the row's figures), records every feature finite, and reports the candidates for the tuning
    part only; beside another bound or candidate it is refused."""
    from scheduler_extender.core.scheduler import Scheduler

    methods = (Scheduler.estimate_ranges, Scheduler._admit, Scheduler.submit)
    today = bench.run_one("tuning", 4.0, 3.0, 5)
    row = bench.run_learned("tuning", 4.0, 3.0, 5)
    assert (Scheduler.estimate_ranges, Scheduler._admit, Scheduler.submit) == methods
    assert (row["wait_mean_s"], row["evictions"], row["waited_n"]) == (
        today["wait_mean_s"], today["evictions"], today["waited_n"])
    waited = row["learned"]["waited"]
    assert len(waited) == today["waited_n"] > 20
    assert all(len(w[5]) == len(bench.FEATURES) and all(math.isfinite(v) for v in w[5]) for w in waited)
    assert bench.score_shifted(waited, 0.0)["err"] == pytest.approx(today["waited_median_rel_err"])
    report = bench.learned_report([row])
    assert report[0]["second_half"]["today"]["n"] == sum(w[0] >= row["learned"]["split"] for w in waited)
    assert set(report[0]["second_half"]) == {"today", "ridge", "median"} and "tuning_ridge" not in report[0]
    held = {**row, "part": "held-out"}
    assert "second_half" not in bench.learned_report([held])[0]
    assert "tuning_ridge" in bench.learned_report([row, held])[1]
    assert "one at a time" in refusal(monkeypatch, capsys, "--learned", "--oracle")


def test_a_priority_mix_is_drawn_as_given_and_only_plainly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--priority-mix low=1``: every job drawn at the low level, so nothing passes a waiting GPR for its level
    and no high-level GPR evicts; the row names the mix; the bounds and candidates refuse it, a bad mix is
    refused in one line."""
    today = bench.run_one("tuning", 4.0, 3.0, 5)
    one = bench.run_one("tuning", 4.0, 3.0, 5, mix=(("low", 1.0),))
    assert one["part"] == "tuning (low=1)" and one["wait_mean_s"] != today["wait_mean_s"]
    assert one["evictions"] == 0 and one["waited_n"] > 20
    for argv, said in ((["--priority-mix", "low=1", "--oracle"], "--priority-mix: only with the plain replay"),
                       (["--priority-mix", "low=x"], "expected CLASS=SHARE"),
                       (["--priority-mix", "urgent=1"], "use low, medium, high")):
        err = refusal(monkeypatch, capsys, *argv)
        assert "Traceback" not in err and said in err.strip().splitlines()[-1]  # usage, then the one error line
