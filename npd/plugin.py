"""How a check runs as a node-problem-detector custom plugin (UPSTREAM.md §F).

NPD starts the executable every ``invoke_interval``, kills it after the rule's ``timeout`` and reads: the exit
code (0 OK -> condition False, 1 NonOK -> True, anything else Unknown) and stdout, cut to
``max_output_length``, as the message. A plugin killed by NPD's timeout leaves only "Timeout when running
plugin", so this runner makes sure NPD never has to: the check runs in a daemon thread and the process answers
by ``plugin.deadline`` (set below the rule's timeout) whatever the check is doing. A check stuck in an NVML call
or a sysfs read reports Unknown naming the step it was stuck in, and the process leaves with ``os._exit`` so a
thread blocked in C cannot hold up interpreter shutdown.

NPD cuts stdout at ``max_output_length`` bytes wherever that falls, so the message is composed to fit
(``render``): one finding is cut at a word boundary with "…"; several become "3 NR1 problems: 41:00.0 nr1p0
link down; 42:00.0 health 'fault'; +1 more", as many whole items as fit and how many were left out.

``--report`` adapts one check to NPD's two kinds of rule (UPSTREAM.md §F): a permanent rule sets its condition
from the exit code (``all``: NonOK on a problem, Unknown when the check cannot tell); a temporary rule makes a
Warning event of *any* exit other than 0, Unknown included, so the rule that names a problem reports problems
only (``problems``: Unknown exits 0, no event: a threshold event for a GPU that could not be measured would be
false) and a separate rule reports that the check cannot tell (``unknown``: exit 2 with the reason when the
verdict is Unknown, 0 otherwise) under its own reason (``GPUCheckUnknown``, ``NR1CheckUnknown``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

OK, NONOK, UNKNOWN = 0, 1, 2
STATUS_NAMES = {OK: "OK", NONOK: "NonOK", UNKNOWN: "Unknown"}
REPORT_MODES = ("all", "problems", "unknown")
DEFAULT_MAX_OUTPUT = 80  # NPD's default max_output_length; what a message must fit before the config is read
ELLIPSIS = "…"
SEPARATOR = "; "
MIN_FIRST_ITEM = 12  # bytes: below this, a cut first item says nothing

log = logging.getLogger("accelstack.npd")


@dataclass
class Result:
    status: int
    message: str  # the whole message (logs, tests); what NPD gets is ``render(result, limit)``
    head: str = ""  # with ``items``: "3 NR1 problems: " before as many items as fit
    items: tuple[str, ...] = ()


@dataclass
class Progress:
    """What the check is doing now; named in the Unknown message when the deadline passes."""

    step: str = "starting"
    history: list[str] = field(default_factory=list)

    def __call__(self, step: str) -> None:
        self.step = step


@dataclass
class Findings:
    """Problems (NonOK) and doubts (Unknown) collected by a check; the verdict and message come from them.
    ``short`` gives a problem's form in a list of several (e.g. without the subject's long name); ``noun``
    names them in the summary ("3 NR1 problems: ...")."""

    problems: list[str] = field(default_factory=list)
    doubts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    short: dict[str, str] = field(default_factory=dict)
    noun: str = "problems"

    def problem(self, text: str, short: str | None = None) -> None:
        self.problems.append(text)
        if short is not None:
            self.short[text] = short

    def result(self, ok_message: str) -> Result:
        if self.problems:
            return summary(NONOK, self.problems, self.doubts, self.noun, self.short)
        if self.doubts:
            return summary(UNKNOWN, self.doubts, [], "unanswered", self.short)
        return Result(OK, "; ".join([ok_message, *self.notes]))


def summary(status: int, findings: list[str], extra: list[str], noun: str, short: Mapping[str, str]) -> Result:
    """One finding as it is; several counted ("3 NR1 problems: ") in their short forms; ``extra`` (the doubts
    beside problems) after them, not counted."""
    if len(findings) == 1:
        if not extra:
            return Result(status, findings[0])
        items = (findings[0], *extra)
        return Result(status, SEPARATOR.join(items), "", items)
    items = (*(short.get(f, f) for f in findings), *extra)
    head = f"{len(findings)} {noun}: "
    return Result(status, head + SEPARATOR.join(items), head, items)


def _size(text: str) -> int:
    return len(text.encode())


def truncate(message: str, limit: int) -> str:
    """At most ``limit`` bytes of UTF-8, cut on a character boundary, on one line."""
    text = " ".join(message.split())
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit].decode(errors="ignore")


def word_cut(message: str, limit: int) -> str:
    """On one line in at most ``limit`` bytes; when too long, cut at a word boundary and marked with "…"."""
    text = " ".join(message.split())
    if _size(text) <= limit:
        return text
    room = limit - _size(ELLIPSIS)
    if room <= 0:
        return truncate(text, limit)
    cut = truncate(text, room)
    if not text[len(cut)].isspace():  # the cut fell inside a word: back to the word's start
        space = cut.rfind(" ")
        if space > 0:
            cut = cut[:space]
    return cut.rstrip(" ;,:(") + ELLIPSIS


def fit(head: str, items: tuple[str, ...] | list[str], limit: int) -> str:
    """``head`` and as many whole ``items`` as fit in ``limit`` bytes, then "+N more"; never cut mid-word."""
    items = [" ".join(i.split()) for i in items]
    whole = head + SEPARATOR.join(items)
    if _size(whole) <= limit:
        return whole
    for kept in range(len(items) - 1, 0, -1):
        text = head + SEPARATOR.join(items[:kept]) + f"{SEPARATOR}+{len(items) - kept} more"
        if _size(text) <= limit:
            return text
    tail = f"{SEPARATOR}+{len(items) - 1} more" if len(items) > 1 else ""
    room = limit - _size(head) - _size(tail)
    if room >= MIN_FIRST_ITEM:
        return head + word_cut(items[0], room) + tail
    return word_cut(whole, limit)


def render(result: Result, limit: int) -> str:
    """The message as NPD gets it: within ``limit`` bytes, one line, nothing cut mid-word."""
    if result.items:
        return fit(result.head, result.items, limit)
    return word_cut(result.message, limit)


def apply_report(result: Result, mode: str) -> Result:
    """The verdict for the kind of NPD rule (``--report``, module docstring)."""
    if mode == "problems" and result.status == UNKNOWN:
        return Result(OK, f"nothing to judge: {result.message}")
    if mode == "unknown" and result.status != UNKNOWN:
        return Result(OK, result.message, result.head, result.items)
    return result


def add_report_argument(parser: Any) -> None:
    parser.add_argument("--report", choices=REPORT_MODES, default="all",
                        help="all: NonOK on a problem, Unknown when the check cannot tell (permanent rules); "
                             "problems: Unknown exits 0 (temporary rules naming a problem); unknown: exit 2 "
                             "only when the check cannot tell (the rule reporting that)")


def run_with_deadline(check: Callable[[Progress], Result], deadline: float,
                      progress: Progress | None = None) -> Result:
    """Run ``check`` in a daemon thread; Unknown naming the step it is in when ``deadline`` seconds pass."""
    progress = progress or Progress()
    box: list[Result] = []

    def work() -> None:
        try:
            box.append(check(progress))
        except Exception as exc:  # a bug or an unexpected error: Unknown with the reason, never a traceback
            log.exception("check failed")
            box.append(Result(UNKNOWN, f"check failed in {progress.step}: {type(exc).__name__}: {exc}"))

    started = time.monotonic()
    thread = threading.Thread(target=work, name="check", daemon=True)
    thread.start()
    thread.join(deadline)
    if box:
        return box[0]
    return Result(UNKNOWN, f"no answer within {deadline:g}s (stuck in {progress.step}, "
                           f"{time.monotonic() - started:.1f}s)")


def emit(result: Result, limit: int) -> int:
    """Write the message as NPD reads it and return the exit code."""
    sys.stdout.write(render(result, limit) + "\n")
    sys.stdout.flush()
    return result.status


def finish(code: int) -> None:
    """Leave now, even with a check thread stuck in a C call."""
    sys.stderr.flush()
    os._exit(code)


def run_plugin(main: Callable[[list[str] | None], None], argv: list[str] | None = None) -> None:
    """A plugin's entry point: any failure outside the check itself is Unknown (exit 2), because Python's own exit
    code for an uncaught exception, 1, would read as NonOK to NPD."""
    try:
        main(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, details on stderr)
        if exc.code not in (0, None):
            finish(emit(Result(UNKNOWN, "bad arguments (see stderr)"), DEFAULT_MAX_OUTPUT))
        raise
    except BaseException as exc:
        finish(emit(Result(UNKNOWN, f"plugin failed: {type(exc).__name__}: {exc}"), DEFAULT_MAX_OUTPUT))
