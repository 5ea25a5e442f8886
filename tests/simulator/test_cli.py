"""The simulator CLI: malformed inputs (file:line:col, exit 2), a tiny fill and replay end to end, --help."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from scheduler_extender.simulator.cli import BUNDLED, main
from scheduler_extender.simulator.fill import arrival_order, fill_run
from scheduler_extender.simulator.traces import (
    TraceError,
    read_openb_nodes,
    read_openb_pods,
    read_philly_jobs,
)

OPENB = BUNDLED / "openb"
PHILLY = BUNDLED / "philly"


def _head(src: Path, dst: Path, n: int) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[: n + 1]))
    return dst


@pytest.mark.parametrize(
    ("content", "where", "words"),
    [
        ("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,2,T4\nn2,64000,lots,2,T4\n", "3:10", "memory_mib"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,-2,T4\n", "2:15", "negative"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,2\n", "2:", "expected 5 fields"),
        ("sn,cpu_milli,gpu,model\nn1,64000,2,T4\n", "1:1", "memory_mib"),
        ("", "1:1", "empty"),
    ],
)
def test_malformed_node_file_names_file_line_column(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    content: str, where: str, words: str) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(content)
    pods = _head(OPENB / "openb_pod_list_default.csv", tmp_path / "pods.csv", 5)
    rc = main(["simulate", "fill", "--nodes", str(nodes), "--workloads", str(pods), "--seeds", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{nodes}:{where}" in err and words in err


def test_malformed_pod_and_job_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,1,500\np1,1000,10,1,1500\n")
    assert main(["fill", "--workloads", str(pods), "--seeds", "1", "--policies", "bestfit"]) == 2
    assert f"{pods}:3:14:" in capsys.readouterr().err
    jobs = tmp_path / "jobs.csv"
    jobs.write_text("job_id,submit_time_s,duration_s,num_gpu,vc\nj1,0,10,1,a\nj2,5,x,1,a\n")
    assert main(["replay", "--jobs", str(jobs), "--no-quotas"]) == 2
    assert f"{jobs}:3:6:" in capsys.readouterr().err
    assert main(["replay", "--jobs", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["replay", "--priority-mix", "urgent=1"], ["replay", "--exit-factor", "3:1"], ["fill", "--policies", "worst"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


def test_trace_error_carries_position(tmp_path: Path) -> None:
    f = tmp_path / "j.csv"
    f.write_text("job_id,submit_time_s,duration_s,num_gpu,vc\nj1,0,10,0,a\n")
    with pytest.raises(TraceError) as exc:
        read_philly_jobs(f)
    assert (exc.value.line, exc.value.column) == (2, 1)


def test_arrival_order_follows_the_protocol() -> None:
    nodes = read_openb_nodes(OPENB / "openb_node_list_gpu_node.csv")
    pods = read_openb_pods(OPENB / "openb_pod_list_default.csv")
    assert (len(nodes), sum(n.devices for n in nodes), len(pods)) == (1213, 6212, 8152)
    cap = 6212 * 1000
    order = arrival_order(pods, 42, 1.3, cap)
    counts = Counter(p.name for p in order)
    assert set(counts) == {p.name for p in pods}  # every pod at least once
    requested = [p.gpu_request() for p in order]
    assert sum(requested) >= 1.3 * cap > sum(requested[:-1])  # stop as soon as 130% is reached
    assert order[:8152] != sorted(pods, key=lambda p: p.name)  # shuffled
    assert arrival_order(pods, 42, 1.3, cap) == order  # seeded


def test_tiny_fill_end_to_end(tmp_path: Path) -> None:
    nodes = _head(OPENB / "openb_node_list_gpu_node.csv", tmp_path / "nodes.csv", 1213)
    lines = (OPENB / "openb_node_list_gpu_node.csv").read_text().splitlines()
    nodes.write_text("\n".join([lines[0], *lines[1::12]]) + "\n")  # every 12th node: ~100 nodes
    pods = _head(OPENB / "openb_pod_list_default.csv", tmp_path / "openb_pod_list_default.csv", 800)
    out = tmp_path / "fill.json"
    png = tmp_path / "fill.png"
    rc = main(["fill", "--nodes", str(nodes), "--workloads", str(pods), "--seeds", "2",
               "--policies", "random,bestfit,fgd", "--json", str(out), "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 1000
    data = json.loads(out.read_text())
    by = {s["policy"]: s for s in data["fill"]["summary"]}
    assert set(by) == {"random", "bestfit", "fgd"} and by["fgd"]["seeds"] == [42, 43]
    for s in by.values():
        assert 0 < s["alloc_pct@130"] <= 100 and s["alloc_pct@100"] <= s["alloc_pct@130"] + 1e-9
    assert by["fgd"]["alloc_pct@130"] >= by["random"]["alloc_pct@130"]
    # the inventory invariants hold after every pod
    res = fill_run(read_openb_nodes(nodes), read_openb_pods(pods), "fgd", 7, check=True)
    assert res.placed + res.failed == res.pods


def test_tiny_replay_end_to_end(tmp_path: Path) -> None:
    jobs = _head(PHILLY / "jobs_oct_nov_11vc.csv", tmp_path / "jobs.csv", 600)
    nodes = tmp_path / "nodes.csv"
    lines = (PHILLY / "nodes.csv").read_text().splitlines()
    nodes.write_text("\n".join(lines[:1] + lines[1::8]) + "\n")  # ~70 machines, both kinds
    out = tmp_path / "replay.json"
    rc = main(["replay", "--jobs", str(jobs), "--nodes", str(nodes), "--load", "30", "--audit",
               "--estimate-every", "5", "--json", str(out), "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    res = {r["scheduler"]: r for r in json.loads(out.read_text())["replay"]}
    assert set(res) == {"accelstack", "accelstack-no-eviction", "strict-priority", "fifo"}
    for r in res.values():
        assert r["finished"] == 600 and r["inversions"] == 0
        assert r["delay"]["all"]["p50"] <= r["delay"]["all"]["p95"] <= r["delay"]["all"]["p99"]
    assert res["fifo"]["evictions"] == res["strict-priority"]["evictions"] == 0
    assert res["accelstack-no-eviction"]["evictions"] == 0
    # the default eviction rule weighed plans and turned some down (issue 35.8)
    assert res["accelstack"]["evictions_declined"] > 0 and res["accelstack"]["eviction_rule"].startswith(
        "evict when the victims' lost GPU-hours are at most 1 x")
    hi = "priority:high"
    assert res["accelstack"]["delay"][hi]["mean"] <= res["fifo"]["delay"][hi]["mean"]


def test_help_and_module_entry_point() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    proc = subprocess.run([sys.executable, "-m", "scheduler_extender.simulator", "replay", "--help"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "--priority-mix" in proc.stdout


@pytest.mark.parametrize(
    ("row", "col", "words"),
    [
        ("j2,100000000000000000000000,10,1,a", 4, "submit_time_s"),  # 1e23 s: hung the replay once
        ("j2,1500000000000000000,10,1,a", 4, "ms or ns"),  # a nanosecond timestamp
        ("j2,5,100000000000000000000000,1,a", 6, "ten years"),
        ("j2,5,10,1000000,a", 9, "fewer GPUs"),  # more than the whole cluster
    ],
)
def test_out_of_range_job_values_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             row: str, col: int, words: str) -> None:
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(f"job_id,submit_time_s,duration_s,num_gpu,vc\nj1,0,10,1,a\n{row}\n")
    assert main(["replay", "--jobs", str(jobs), "--no-quotas"]) == 2
    err = capsys.readouterr().err
    assert f"{jobs}:3:{col}:" in err and words in err


@pytest.mark.parametrize("num_gpu", ["100000000000000000000000", str(2**63), "9"])
def test_pod_larger_than_any_node_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], num_gpu: str) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,8,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text(f"name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,1,500\np1,1000,10,{num_gpu},1000\n")
    assert main(["fill", "--nodes", str(nodes), "--workloads", str(pods), "--seeds", "1", "--policies", "bestfit"]) == 2
    assert f"{pods}:3:12:" in capsys.readouterr().err


def test_byte_order_mark_is_not_part_of_the_first_column(tmp_path: Path) -> None:
    f = tmp_path / "j.csv"
    f.write_bytes("\ufeffjob_id,submit_time_s,duration_s,num_gpu,vc\nj1,0,10,1,a\n".encode())
    assert [j.job_id for j in read_philly_jobs(f)] == ["j1"]
