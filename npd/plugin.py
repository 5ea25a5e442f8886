"""How a check runs as a node-problem-detector custom plugin (UPSTREAM.md §F).

NPD starts the executable every ``invoke_interval``, kills it after the rule's ``timeout`` and reads: the exit
code (0 OK -> condition False, 1 NonOK -> True, anything else Unknown) and stdout, cut to
``max_output_length``, as the message. A plugin killed by NPD's timeout leaves only "Timeout when running
plugin", so this runner makes sure NPD never has to: the check runs in a daemon thread and the process answers
by ``plugin.deadline`` (set below the rule's timeout) whatever the check is doing. A check stuck in an NVML call
or a sysfs read reports Unknown naming the step it was stuck in, and the process leaves with ``os._exit`` so a
thread blocked in C cannot hold up interpreter shutdown.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

OK, NONOK, UNKNOWN = 0, 1, 2
STATUS_NAMES = {OK: "OK", NONOK: "NonOK", UNKNOWN: "Unknown"}

log = logging.getLogger("accelstack.npd")


@dataclass
class Result:
    status: int
    message: str


@dataclass
class Progress:
    """What the check is doing now; named in the Unknown message when the deadline passes."""

    step: str = "starting"
    history: list[str] = field(default_factory=list)

    def __call__(self, step: str) -> None:
        self.step = step


@dataclass
class Findings:
    """Problems (NonOK) and doubts (Unknown) collected by a check; the verdict and message come from them."""

    problems: list[str] = field(default_factory=list)
    doubts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def result(self, ok_message: str) -> Result:
        if self.problems:
            return Result(NONOK, "; ".join(self.problems + self.doubts))
        if self.doubts:
            return Result(UNKNOWN, "; ".join(self.doubts))
        return Result(OK, "; ".join([ok_message, *self.notes]))


def truncate(message: str, limit: int) -> str:
    """At most ``limit`` bytes of UTF-8, cut on a character boundary, on one line."""
    text = " ".join(message.split())
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit].decode(errors="ignore")


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
    sys.stdout.write(truncate(result.message, limit) + "\n")
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
            finish(emit(Result(UNKNOWN, "bad arguments (usage on stderr)"), 200))
        raise
    except BaseException as exc:
        finish(emit(Result(UNKNOWN, f"plugin failed: {type(exc).__name__}: {exc}"), 200))
