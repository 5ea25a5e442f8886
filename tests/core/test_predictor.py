"""The duration predictor: remaining-time estimates on known distributions, the exitDuration cap, fallbacks,
model choice, bounded memory and its persisted state."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler_extender.core.predictor import DurationPredictor, JobKey

KEY = JobKey("team", shape="gpu:1x1000x1")


def _trained(samples: list[float], exits: list[float | None] | None = None, **kw: object) -> DurationPredictor:
    p = DurationPredictor(**kw)  # type: ignore[arg-type]
    for i, d in enumerate(samples):
        p.observe(KEY, d, exits[i] if exits else None)
    return p


def test_exponential_is_memoryless() -> None:
    rnd = random.Random(1)
    p = _trained([rnd.expovariate(1 / 1000) for _ in range(5000)])
    for elapsed in (0, 500, 1000, 2000):
        # E[D - a | D > a] = 1000 for every a (binning costs a few percent)
        assert p.remaining(KEY, elapsed).mean == pytest.approx(1000, rel=0.12)


def test_uniform_remaining_shrinks_with_age() -> None:
    rnd = random.Random(2)
    p = _trained([rnd.uniform(0, 4000) for _ in range(5000)])
    for elapsed in (0, 1000, 2000, 3000):
        assert p.remaining(KEY, elapsed).mean == pytest.approx((4000 - elapsed) / 2, rel=0.12)


def test_heavy_tail_remaining_grows_with_age() -> None:
    rnd = random.Random(3)
    # Pareto, x_m = 100 s, alpha 1.5 (all samples kept: the tail needs them)
    p = _trained([rnd.paretovariate(1.5) * 100 for _ in range(5000)], max_count=1e6)
    young, old = p.remaining(KEY, 200).mean, p.remaining(KEY, 2000).mean
    # E[D - a | D > a] = a / (alpha - 1) for a >= x_m: 400 s and 4,000 s (an infinite-variance tail: loose)
    assert young == pytest.approx(400, rel=0.5) and old == pytest.approx(4000, rel=0.5)
    assert old > 5 * young  # not mean - elapsed, which would be negative here


def test_deterministic_duration() -> None:
    p = _trained([1000.0] * 50)
    pred = p.predict(KEY)
    assert pred.p10 == pred.p50 == pred.p90 and pred.mean == pytest.approx(1000, rel=0.1)
    assert p.remaining(KEY, 600).mean == pytest.approx(400, rel=0.25)


def test_outliving_every_sample_expects_as_long_again() -> None:
    p = _trained([100.0] * 20)
    assert p.remaining(KEY, 5000).mean == pytest.approx(5000)
    assert p.remaining(KEY, 5000, exit_s=6000).mean == 1000  # capped by what exitDuration leaves


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1e7), st.one_of(st.none(), st.floats(1, 1e7))), min_size=0, max_size=40),
    st.floats(1, 1e7),
    st.floats(0, 2e7),
)
@example(history=[(0.0, 1.0)], exit_s=1.0, elapsed=5e-324)  # a remaining time of -5e-324 once
def test_never_exceeds_exit_duration(history: list[tuple[float, float | None]], exit_s: float, elapsed: float) -> None:
    p = DurationPredictor(min_samples=1, max_count=4)
    for d, e in history:
        p.observe(KEY, d, e)
    pred = p.predict(KEY, exit_s)
    assert 0 <= pred.p10 <= pred.p50 <= pred.p90 <= exit_s and 0 <= pred.mean <= exit_s
    rem = p.remaining(KEY, elapsed, exit_s)
    assert 0 <= rem.mean <= max(0.0, exit_s - elapsed) and rem.p90 <= max(0.0, exit_s - elapsed)


def test_no_history_uses_exit_duration_or_the_prior() -> None:
    p = DurationPredictor(prior_s=1800)
    assert p.predict(KEY, 7200).mean == 7200 and p.predict(KEY).mean == 1800
    assert p.remaining(KEY, 3600, 7200).mean == 3600


def test_falls_back_up_the_hierarchy() -> None:
    p = DurationPredictor(min_samples=5)
    specific = JobKey("team", template="train", shape="gpu:8x1000x1")
    for _ in range(5):
        p.observe(JobKey("team", template="train", shape="gpu:8x1000x1"), 20_000)
    for _ in range(50):
        p.observe(JobKey("team", shape="gpu:1x1000x1"), 100)
    assert p.predict(specific).source.startswith("t:team:train")
    assert p.predict(specific).mean == pytest.approx(20_000, rel=0.1)
    # another template of the same workspace and shape: the workspace+shape level knows it
    other = JobKey("team", template="notebook", shape="gpu:8x1000x1")
    assert p.predict(other).source.startswith("s:team:gpu:8x1000x1")
    # an unseen workspace: the shape across workspaces, then everything
    assert p.predict(JobKey("new", shape="gpu:1x1000x1")).source.startswith("S:gpu:1x1000x1")
    assert p.predict(JobKey("new", shape="nr1:1x1000x1")).source.startswith("*")


def test_learns_which_model_fits() -> None:
    rnd = random.Random(4)
    # users who ask for exactly twice what they need, whatever the job: the exit fraction wins
    frac = DurationPredictor()
    for _ in range(300):
        d = rnd.lognormvariate(8, 2)
        frac.observe(KEY, d, 2 * d)
    assert frac.predict(KEY, 10_000).source.endswith("exit-fraction")
    assert frac.predict(KEY, 10_000).mean == pytest.approx(5_000, rel=0.1)
    # jobs that always take 600 s while exitDuration is arbitrary: seconds win
    secs = DurationPredictor()
    for _ in range(300):
        secs.observe(KEY, 600, rnd.uniform(700, 100_000))
    assert secs.predict(KEY, 50_000).source.endswith("seconds")
    assert secs.predict(KEY, 50_000).mean == pytest.approx(600, rel=0.1)


def test_memory_is_bounded_and_recent_keys_stay() -> None:
    p = DurationPredictor(max_keys=10)
    for i in range(100):
        p.observe(JobKey(f"ws{i}", shape="s"), 10)
    assert len(p) == 10
    assert p.predict(JobKey("ws99", shape="s")).source.startswith(("s:ws99", "w:ws99", "S:s", "*"))


def test_state_round_trips_and_bad_state_is_refused() -> None:
    rnd = random.Random(5)
    p = _trained([rnd.expovariate(1 / 300) for _ in range(200)], [None] * 200)
    q = DurationPredictor.from_state(p.to_state())
    assert q.predict(KEY) == p.predict(KEY) and q.remaining(KEY, 400) == p.remaining(KEY, 400)
    for bad in ({"version": 99}, {"version": 1, "bins": [1, 2, 3], "keys": []},
                {"version": 1, "bins": p.to_state()["bins"], "keys": [{"k": ["*"], "d": [[10_000, 1]], "r": []}]}):
        with pytest.raises(ValueError, match="predictor state"):
            DurationPredictor.from_state(bad)


def test_bad_samples_are_refused() -> None:
    p = DurationPredictor()
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="hold time"):
            p.observe(KEY, bad)
