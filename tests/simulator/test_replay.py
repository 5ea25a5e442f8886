"""Replay pieces: the seeded assignment of what the trace lacks, job shapes, windows."""

from __future__ import annotations

import math
from collections import Counter

from scheduler_extender.core.gpr import priority_class
from scheduler_extender.simulator.replay import Assignment, job_shape, window
from scheduler_extender.simulator.traces import Job

JOBS = [Job(f"j{i}", 1000 + 10 * i, 100 + i, 1 + i % 8, "vc") for i in range(3000)]


def test_assignment_is_seeded_and_follows_the_mix() -> None:
    a = Assignment(seed=5, priority_mix=(("low", 0.5), ("high", 0.5)), exit_factor=(1.5, 2.0))
    drawn = a.draw(JOBS)
    assert drawn == a.draw(JOBS) and drawn != Assignment(seed=6).draw(JOBS)
    classes = Counter(priority_class(p) for p, _ in drawn)
    assert set(classes) == {"low", "high"} and abs(classes["low"] - 1500) < 150
    for job, (_, exit_s) in zip(JOBS, drawn, strict=True):
        assert 1.5 * job.duration_s <= exit_s <= 2.0 * job.duration_s + 1


def test_job_shapes_use_whole_nodes_beyond_eight() -> None:
    assert [job_shape(n) for n in (1, 8, 12, 16, 24, 32)] == [(1, 1), (8, 1), (6, 2), (8, 2), (8, 3), (8, 4)]


def test_window_and_load() -> None:
    w = window(JOBS, days=None, max_jobs=10, load=2.0)
    assert len(w) == 10 and w[0].submit_s == 1000 and w[1].submit_s == 1005
    assert [j.duration_s for j in w] == [j.duration_s for j in JOBS[:10]]


def test_injected_failures_requeue_with_backoff_until_the_limit() -> None:
    from scheduler_extender.core.inventory import NodeSpec
    from scheduler_extender.simulator.replay import replay_run

    jobs = [Job(f"j{i}", 10 * i, 500, 1 + i % 4, f"vc{i % 2}") for i in range(200)]
    nodes = [NodeSpec(f"n{i}", 8) for i in range(4)]
    r = replay_run(nodes, jobs, "accelstack", fail_rate=0.5, retry_limit=1, estimate_every=0, audit=True)
    f = r.failures
    assert f["injected"] == f["requeued"] + f["gave_up"] and f["requeued"] > 0 and f["gave_up"] > 0
    assert r.finished + f["gave_up"] == len(jobs) and r.inversions == 0
    again = replay_run(nodes, jobs, "accelstack", fail_rate=0.5, retry_limit=1, estimate_every=0)
    assert again.failures == f  # seeded


def test_two_pools_trace_a_stuck_head_does_not_hold_the_other_pool() -> None:
    """Issue 35.1 in the simulator (data/traces/two-pools): an 8-GPU job with no exitDuration holds the only A100
    node for 10 h; the next A100 job waits for it, unbounded; the four H100 jobs of the same level behind it start
    on the two free H100 nodes within one job length (before: all waited the 10 h), with zero inversions."""
    from pathlib import Path

    from scheduler_extender.simulator.replay import replay_run
    from scheduler_extender.simulator.traces import read_philly_jobs, read_philly_nodes

    here = Path(__file__).resolve().parents[2] / "data" / "traces" / "two-pools"
    nodes, jobs = read_philly_nodes(here / "nodes.csv"), read_philly_jobs(here / "jobs.csv")
    assert [n.model for n in nodes] == ["A100", "H100", "H100"] and math.isinf(jobs[0].exit_s or 0)
    r = replay_run(nodes, jobs, "accelstack", assignment=Assignment(priority_mix=(("low", 1.0),)), audit=True,
                   estimate_every=0)
    waits = sorted(r.delays)
    assert r.finished == len(jobs) and r.inversions == 0
    assert waits[-1] >= 35_000  # the A100 job behind the squatter
    assert waits[-2] <= 600  # every H100 job: at most one H100 job's length


def test_estimates_from_a_time_warm_up_on_the_jobs_before_and_decide_nothing() -> None:
    """``estimate_from_s``: only jobs submitted at or after it are estimated (every N-th of them, counted from the
    first), the earlier ones only warm the history up; the decisions are the same as with every job estimated."""
    from scheduler_extender.core.inventory import NodeSpec
    from scheduler_extender.simulator.replay import replay_run

    jobs = [Job(f"j{i}", 30 * i, 600 + 7 * (i % 13), 1 + i % 4, f"vc{i % 2}") for i in range(300)]
    nodes = [NodeSpec(f"n{i}", 8) for i in range(2)]  # busy: most jobs wait
    every = replay_run(nodes, jobs, "accelstack", estimate_every=1)
    later = replay_run(nodes, jobs, "accelstack", estimate_every=1, estimate_from_s=30 * 200)
    assert every.estimate_error["all_n"] == 300 and later.estimate_error["all_n"] == 100
    assert later.delay["all"] == every.delay["all"] and later.admissions == every.admissions
    tenth = replay_run(nodes, jobs, "accelstack", estimate_every=10, estimate_from_s=30 * 195)
    assert tenth.estimate_error["all_n"] == 11  # jobs 195, 205, ..., 295


def test_asking_for_estimates_never_changes_a_decision() -> None:
    """An estimate is a read: 5 days of the bundled Philly cut at load 4 make the same decisions (every wait, every
    eviction) whether every arrival is estimated or none. A holder's predicted end depends on when it is
    predicted, so the estimates once refreshed the eviction rule's copy of it at their own moments: 12 evictions
    with every arrival estimated against 15 with none."""
    from scheduler_extender.simulator.cli import BUNDLED
    from scheduler_extender.simulator.replay import replay_run
    from scheduler_extender.simulator.traces import read_philly_jobs, read_philly_nodes, read_quotas

    traces = BUNDLED / "philly"
    nodes = read_philly_nodes(traces / "nodes.csv")
    jobs = window(read_philly_jobs(traces / "jobs_oct_nov_11vc.csv", max_gpus=sum(n.devices for n in nodes)),
                  days=5.0, load=4.0)
    quotas = read_quotas(traces / "vc_config_helios_qssf.csv")
    every, none = (replay_run(nodes, jobs, "accelstack", quotas=quotas, estimate_every=n) for n in (1, 0))
    assert every.estimate_error["all_n"] > 1000 and none.estimate_error.get("all_n", 0) == 0
    assert every.evictions == none.evictions > 0
    assert every.delay == none.delay
