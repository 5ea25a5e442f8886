"""bench/bench_hub_latency.py without its control planes: its arguments, the objects it feeds the hub and the
simulated agents, and the arithmetic of its figures (the run itself needs KUBEBUILDER_ASSETS and minutes)."""

from __future__ import annotations

import random

import pytest

from scheduler_extender.multicluster.clusters import summarize_node
from scheduler_extender.multicluster.placement import demand_of
from scheduler_extender.objects.cluster import GPU
from tests.bench_module import load_bench

bench = load_bench("bench_hub_latency")


def test_defaults_are_the_issues_world() -> None:
    args = bench.parse_args([])
    assert (args.members, args.nodes, args.gpus, args.gprs) == (20, 1000, 8, 10_000)
    assert args.changes >= 50 and args.admits >= 30  # the figures' sample counts (issue 40)


@pytest.mark.parametrize(("argv", "says"), [
    (["--members", "1"], "at least 2"),
    (["--nodes", "0"], "above 0"),
    (["--gprs", "many"], "whole number"),
    (["--too-big", "1.5"], "from 0 to 1"),
    (["--changes", "2", "--rounds", "3"], "at least one per round"),
    (["--timeout", "-1"], "above 0"),
])
def test_bad_arguments_are_one_line_naming_the_flag(argv: list[str], says: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_quantile_is_nearest_rank_and_refuses_nothing() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench.quantile(values, 0.5) == 51.0
    assert bench.quantile(values, 0.99) == 100.0
    assert bench.quantile([3.0, 1.0, 2.0], 0.99) == 3.0  # p99 of few samples is the largest
    with pytest.raises(ValueError, match="no values"):
        bench.quantile([], 0.5)


def test_a_node_change_is_what_the_agent_counts() -> None:
    """The synthetic node the simulated agents get is summarised by the product's own projection: 8 GPUs, and a
    change to 7 allocatable is a change of one device (what the bench then waits for on the hub)."""
    full = summarize_node(bench.node_object("m-n0001", 8, bench.MODELS[0]))
    lowered = summarize_node(bench.node_object("m-n0001", 8, bench.MODELS[0], 7))
    assert full is not None and lowered is not None
    assert (full.capacity[GPU], full.allocatable[GPU], lowered.allocatable[GPU]) == (8, 8, 7)
    assert full.models[GPU] == bench.MODELS[0] and not full.unhealthy


def test_load_is_pinned_to_simulated_members_or_too_big_for_any() -> None:
    rng = random.Random(1)
    simulated = ["member-01", "member-02"]
    pinned = [bench.load_gpr(i, simulated, 0.0, 8000, rng) for i in range(50)]
    assert all(g["spec"]["clusterName"] in simulated for g in pinned)
    assert len({g["metadata"]["name"] for g in pinned}) == 50
    big = bench.load_gpr(7, simulated, 1.0, 8000, rng)
    assert "clusterName" not in big["spec"]
    assert demand_of(big["spec"]).devices > 8000  # more than the largest member: Unschedulable on the hub
    assert big["metadata"]["namespace"] == "load-07"


def test_settled_means_placed_or_judged() -> None:
    assert not bench.settled({})
    assert bench.settled({"cluster": "member-01"})
    assert bench.settled({"phase": "Queued", "reason": "Unschedulable"})


def test_the_hubs_part_leaves_the_members_pass_out() -> None:
    a = bench.Admit(created=10.0, member_seen=10.3, member_admitted=10.8, hub_admitted=11.0)
    assert a.done()
    assert a.hub_part() == pytest.approx(0.5)  # 0.3 to the member + 0.2 back; the member's 0.5 is its own
    assert a.member_pass() == pytest.approx(0.5)
    assert not bench.Admit(created=1.0, member_seen=1.1).done()


def test_rewritten_counts_moved_versions_by_kind() -> None:
    before = {"a": ("1", True, True), "b": ("2", True, False), "c": ("3", True, False)}
    after = {"a": ("1", True, True), "b": ("9", True, False), "c": ("8", True, False), "d": ("4", True, True)}
    assert bench.rewritten(before, after) == (0, 2)


def test_a_row_says_met_or_not_against_p99() -> None:
    met = bench.row("x", [[0.1, 0.2], [0.3]], 2.0)
    assert met.startswith("| x | 200 ms | 300 ms | 3 | 150, 300 |") and met.endswith("p99 <= 2 s: met |")
    assert "NOT met" in bench.row("y", [[0.5, 1.5]], 1.0)
    assert bench.row("z", [[0.5]], None).endswith("|  |")


def test_the_report_labels_the_world_and_says_both_verdicts() -> None:
    args = bench.parse_args(["--gprs", "2000"])
    s = bench.Samples(inventory_real=[[0.03]], inventory_sim=[[0.02, 2.5]], hub_part=[[0.3]], to_member=[[0.2]],
                      member_pass=[[0.25]], mirrored=[[0.1]], load_rewritten=(0, 3), load_seconds=42.0)
    text = "\n".join(bench.report(args, s, "accelstack_hub_status_writes 10.0"))
    assert "real hub kube-apiserver v1.36.2, 1 real + 19 simulated members x 1,000 nodes x 8 GPUs" in text
    assert "2,000 hub GPRs queued" in text and "CPUs, load average" in text
    inventory, hub_part = (next(line for line in text.splitlines() if line.startswith(f"| {what}"))
                           for what in ("member change -> hub inventory, all", "hub -> member Admitted"))
    assert inventory.endswith("p99 <= 2 s: NOT met |") and hub_part.endswith("p99 <= 1 s: met |")
    assert "load placed or judged 42 s" in text and "0 pinned, 3 too big" in text
