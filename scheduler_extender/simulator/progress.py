"""Progress of long simulator runs on stderr (issue 38.4: a 21-day replay ran 20 minutes with nothing shown).

On a terminal one bar is redrawn in place (at most every ``redraw_s``); otherwise — a log, a pipe, CI — one
plain line every ``every_s`` seconds, the first only after ``every_s``, so short runs print nothing extra.
Result lines go through :meth:`Progress.line`, which clears the bar first, so the two never mix on one line.
The clock is injectable (tests drive it by hand); only the standard library is used.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import TextIO

BAR_WIDTH = 24


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Fractions done (0-1) of several named runs going on at once, shown together."""

    def __init__(self, label: str, names: Iterable[str], stream: TextIO | None = None, every_s: float = 10.0,
                 redraw_s: float = 0.2, clock: Callable[[], float] = time.monotonic, tty: bool | None = None) -> None:
        self.label = label
        self.fractions = dict.fromkeys(names, 0.0)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s, self.redraw_s, self.clock = every_s, redraw_s, clock
        self.start = clock()
        self.last = self.start  # the last line (not a terminal) or redraw (terminal)
        self.drawn = False  # a bar is on the terminal's current line

    def total(self) -> float:
        return sum(self.fractions.values()) / len(self.fractions) if self.fractions else 1.0

    def text(self) -> str:
        each = ", ".join(f"{n} {100 * f:.0f}%" for n, f in self.fractions.items())
        return f"{self.label}: {100 * self.total():.0f}% after {_elapsed(self.clock() - self.start)} ({each})"

    def update(self, name: str, fraction: float) -> None:
        self.fractions[name] = min(max(fraction, 0.0), 1.0)
        self.show()

    def show(self, force: bool = False) -> None:
        now = self.clock()
        if self.tty:
            if force or now - self.last >= self.redraw_s:
                done = int(BAR_WIDTH * self.total())
                bar = "#" * done + "-" * (BAR_WIDTH - done)
                self.stream.write(f"\r\x1b[K[{bar}] {self.text()}")
                self.stream.flush()
                self.last, self.drawn = now, True
        elif force or now - self.last >= self.every_s:
            self.stream.write(self.text() + "\n")
            self.stream.flush()
            self.last = now

    def line(self, text: str) -> None:
        """A line of its own (a result), with the bar cleared before and redrawn after it."""
        if self.tty and self.drawn:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.tty and self.drawn:
            self.show(force=True)

    def close(self) -> None:
        """Take the bar off the terminal (the result lines stay)."""
        if self.tty and self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False
