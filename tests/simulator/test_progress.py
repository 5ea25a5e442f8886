"""Progress and output of long simulator runs (issue 38.4, 35.8): progress on stderr, each result as its run ends,
the figures explained, eviction cost beside the wait it buys, a readable delay tail."""

from __future__ import annotations

import functools
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

from scheduler_extender.core.inventory import NodeSpec
from scheduler_extender.simulator.cli import BUNDLED, main, run_all
from scheduler_extender.simulator.progress import Progress
from scheduler_extender.simulator.replay import ReplayResult, replay_run
from scheduler_extender.simulator.report import delay_tail, replay_table
from scheduler_extender.simulator.traces import Job


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_off_a_terminal_come_every_period_only() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("replay", ["accelstack", "fifo"], stream=out, every_s=10, clock=clock, tty=False)
    p.update("accelstack", 0.5)
    clock.t += 9
    p.update("fifo", 0.25)
    assert out.getvalue() == ""  # a short run prints nothing extra
    clock.t += 1
    p.update("fifo", 0.3)
    assert out.getvalue() == "replay: 40% after 0m10s (accelstack 50%, fifo 30%)\n"
    clock.t += 5
    p.update("fifo", 0.4)
    assert out.getvalue().count("\n") == 1


def test_progress_on_a_terminal_is_one_bar_that_results_do_not_mix_with() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("replay", ["a"], stream=out, redraw_s=0.2, clock=clock, tty=True)
    clock.t += 1
    p.update("a", 0.5)
    assert out.getvalue().startswith("\r\x1b[K[" + "#" * 12 + "-" * 12 + "] replay: 50%")
    p.line("  replay a done")
    p.close()
    text = out.getvalue()
    assert "\r\x1b[K  replay a done\n" in text and text.endswith("\r\x1b[K") and "\n" not in text.split("done\n")[1]


def test_replay_reports_its_progress_up_to_the_end() -> None:
    jobs = [Job(f"j{i}", 10 * i, 500, 1 + i % 4, "vc") for i in range(400)]
    seen: list[float] = []
    replay_run([NodeSpec(f"n{i}", 8) for i in range(4)], jobs, "fifo", estimate_every=0, progress=seen.append)
    assert len(seen) > 50 and seen == sorted(seen) and seen[-1] == 1.0 and seen[-2] < 1.0


# run_all's worker (module level: it crosses into the worker processes); the slow run waits for the parent to
# print the fast one's result line, which it does only if results come out as runs end (bounded: never hangs)
def _ordered_run(name: str, progress: object, marker: str = "") -> ReplayResult:
    if name == "slow":
        for _ in range(600):
            if Path(marker).exists():
                break
            time.sleep(0.05)
    r = replay_run([NodeSpec("n0", 8)], [Job("j", 0, 10, 1, "vc")], "fifo", estimate_every=0)
    r.scheduler = name
    return r


class Recorder(Progress):
    def __init__(self, marker: Path) -> None:
        super().__init__("replay", ["slow", "fast"], stream=io.StringIO(), tty=False)
        self.marker = marker
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)
        self.marker.touch()


def test_results_print_as_each_run_ends_not_in_order(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "fast-printed")
    run = functools.partial(_ordered_run, marker=str(rec.marker))
    res = run_all(run, ["slow", "fast"], workers=2, progress=rec, poll_s=0.05)
    assert [r.scheduler for r in res] == ["slow", "fast"]  # the tables keep the asked order
    assert [line.split()[1] for line in rec.lines] == ["fast", "slow"]  # the lines come as runs end


def test_delay_tail_keeps_the_one_percent_readable() -> None:
    delays = [0.0] * 990 + [float(x) for x in (2, 5, 30, 60, 600, 3600, 7200, 10_000, 50_000, 86_400)]
    xs, ys = delay_tail(delays)
    assert list(xs) == delays[990:] and ys[0] == 0.01 and ys[-1] == 0.001
    assert np.all(np.diff(ys) < 0)


def test_replay_output_explains_its_figures_and_prices_evictions(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    philly = BUNDLED / "philly"
    jobs = tmp_path / "jobs.csv"
    jobs.write_text("".join((philly / "jobs_oct_nov_11vc.csv").read_text().splitlines(keepends=True)[:601]))
    nodes = tmp_path / "nodes.csv"
    lines = (philly / "nodes.csv").read_text().splitlines()
    nodes.write_text("\n".join(lines[:1] + lines[1::8]) + "\n")
    out = tmp_path / "r.json"
    assert main(["replay", "--jobs", str(jobs), "--nodes", str(nodes), "--load", "30", "--audit",
                 "--json", str(out), "--workers", "1", "--eviction-cost-ratio", "off"]) == 0
    text = capsys.readouterr().out
    res = {r["scheduler"]: r for r in json.loads(out.read_text())["replay"]}
    a, base = res["accelstack"], res["accelstack-no-eviction"]
    assert a["evictions"] > 0 and "under the rule 'evict whenever it makes room'" in text
    saved = base["delay"]["all"]["mean"] - a["delay"]["all"]["mean"]
    assert (f"accelstack: {a['evictions']:,} evictions lost {a['lost_gpu_hours']:,.0f} GPU-hours of work" in text
            and f"{abs(saved):,.0f} s of mean wait" in text and "without eviction" in text)
    assert "n/a" not in text  # audited: the footnote does not say inversions are n/a
    assert "FIFO is the easiest to estimate" in text and "median rel.err: median of" in text
    assert "6214e9 (quota 512 GPUs," in text  # workspaces beside their quota and job count


def test_unaudited_table_says_how_to_get_inversions() -> None:
    r = replay_run([NodeSpec("n0", 8)], [Job("j", 0, 10, 1, "vc")], "fifo", estimate_every=0)
    assert "(n/a: run with --audit)" in replay_table([r])
