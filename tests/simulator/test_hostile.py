"""Hostile simulator input (issue 38.6, 38.5): every bad file or flag is one short error line and exit 2, never a
traceback, a hang, a silently dropped job or a run over nothing with exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_extender.simulator.cli import build_parser, main

JOBS_HEADER = "job_id,submit_time_s,duration_s,num_gpu,vc\n"


def _nodes(tmp_path: Path) -> Path:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("node_id,gpu_count,gpu_mem\nm0,8,12GB\nm1,8,12GB\n")
    return nodes


@pytest.mark.parametrize(
    "second",
    [
        "a,5,10,1,x",  # while the first still runs: was a traceback (ValueError: a already exists)
        "a,50,10,1,x",  # after the first ended: was silently dropped (one job replayed, exit 0)
    ],
)
def test_duplicate_job_id_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], second: str) -> None:
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(f"{JOBS_HEADER}a,0,10,1,x\n{second}\n")
    assert main(["replay", "--jobs", str(jobs), "--nodes", str(_nodes(tmp_path)), "--no-quotas", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{jobs}:3:1: job_id 'a' repeated (first on line 2)" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("kind", "content", "where"),
    [
        ("nodes", "node_id,gpu_count,gpu_mem\nm0,8,12GB\nm0,8,12GB\n", "3:1: node_id 'm0' repeated"),
        ("quotas", "vc,gpus\nx,8\nx,16\n", "3:1: vc 'x' repeated"),
    ],
)
def test_other_repeated_names_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str,
                                          content: str, where: str) -> None:
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(f"{JOBS_HEADER}a,0,10,1,x\n")
    f = tmp_path / f"{kind}.csv"
    f.write_text(content)
    argv = ["replay", "--jobs", str(jobs), "--workers", "1", f"--{kind}", str(f)]
    if kind != "nodes":
        argv += ["--nodes", str(_nodes(tmp_path))]
    assert main(argv) == 2
    assert f"{f}:{where}" in capsys.readouterr().err


def test_repeated_pod_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,8,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,1,500\np0,1000,10,1,1000\n")
    assert main(["fill", "--nodes", str(nodes), "--workloads", str(pods), "--seeds", "1", "--policies", "bestfit"]) == 2
    assert f"{pods}:3:1: pod name 'p0' repeated" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["fill", "--inflation", "inf"],  # hung for ever
        ["fill", "--inflation", "nan"],  # a table of dashes, exit 0
        ["fill", "--inflation", "1.0"],  # no record at 130%: dashes again
        ["fill", "--first-seed", "-1"],  # numpy refuses negative seeds: a traceback
        ["fill", "--policies", ","],  # nothing to run
        ["replay", "--load", "nan"],
        ["replay", "--load", "inf"],
        ["replay", "--load", "1e-300"],  # stretches the trace past any clock
        ["replay", "--exit-factor", "1:inf"],
        ["replay", "--priority-mix", "low=nan,medium=0.3,high=0.1"],
        ["replay", "--priority-mix", "low=inf"],
        ["replay", "--priority-mix", "low=1,low=2"],
        ["replay", "--days", "nan"],  # replayed nothing, exit 0
        ["replay", "--start-day", "nan"],
        ["replay", "--start-day", "-1"],
        ["replay", "--estimate-every", "-1"],  # was accepted (every job sampled)
        ["replay", "--seed", "-1"],
        ["replay", "--fail-rate", "nan"],
        ["replay", "--schedulers", ","],  # ran nothing, exit 0
        ["replay", "--schedulers", "fifo,fifo"],
        ["replay", "--eviction-cost-ratio", "-1"],  # the eviction rule's K
        ["replay", "--eviction-cost-ratio", "nan"],
        ["replay", "--eviction-cost-ratio", "never"],
        ["demo", "--eviction-max-wait", "-5"],
        ["demo", "--eviction-max-wait", "inf"],
    ],
)
def test_bad_flag_values_are_refused_before_the_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"accelstack {argv[0]}: error: argument {argv[1]}") and len(lines[0]) < 200
    assert lines[1] == f"Run 'accelstack {argv[0]} --help' for the options." and len(lines) == 2


def test_flag_error_is_one_line_without_the_usage() -> None:
    proc = subprocess.run([sys.executable, "-m", "scheduler_extender.simulator", "simulate", "replay", "--load", "nan"],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2 and "usage:" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "accelstack simulate replay: error: argument --load: 'nan': expected a finite number",
        "Run 'accelstack simulate replay --help' for the options.",
    ]


def test_a_window_without_jobs_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(f"{JOBS_HEADER}a,0,10,1,x\nb,50,10,1,x\n")
    rc = main(["replay", "--jobs", str(jobs), "--nodes", str(_nodes(tmp_path)), "--no-quotas", "--start-day", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and f"accelstack replay: error: --start-day 5: no job of {jobs} in that window" in err


def test_a_file_without_newlines_is_refused_briefly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 3 MB file with no newline (the issue's was 100 MB: its error echoed all of it as the header)."""
    jobs = tmp_path / "jobs.csv"
    jobs.write_text("job_id," + "x" * 3_000_000)
    assert main(["replay", "--jobs", str(jobs), "--no-quotas"]) == 2
    err = capsys.readouterr().err
    assert f"{jobs}:1:1: line longer than 1,048,576 characters" in err and len(err) < 200 + len(str(jobs)) * 2


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("job_id," + "y" * 500_000 + "\na,0\n", "header lacks column 'submit_time_s'"),  # a long header under 1 MiB
        (JOBS_HEADER + "a,0," + "9" * 500_000 + ",1,x\n", "column 'duration_s': bad value '999"),  # a long value
    ],
)
def test_errors_never_echo_much_of_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                              words: str) -> None:
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(content)
    assert main(["replay", "--jobs", str(jobs), "--no-quotas"]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.splitlines()[0]) <= len("accelstack: error: ") + len(str(jobs)) + 20 + 200


def test_vcs_missing_from_the_quota_file_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(f"{JOBS_HEADER}a,0,10,1,x\nb,5,10,1,y\nc,6,10,1,z\n")
    quotas = tmp_path / "q.csv"
    quotas.write_text("vc,gpus\nx,8\n")
    rc = main(["replay", "--jobs", str(jobs), "--nodes", str(_nodes(tmp_path)), "--quotas", str(quotas),
               "--workers", "1", "--schedulers", "fifo"])
    err = capsys.readouterr().err
    assert rc == 0
    assert f"warning: 2 VC(s) have no quota in {quotas} and run without one: y, z" in err


def test_help_names_the_command_as_called(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: accelstack [simulate] MODE [options]")
    with pytest.raises(SystemExit):
        main(["simulate", "fill", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: accelstack simulate fill ") and "130% of GPU capacity" in out and "%%" not in out
