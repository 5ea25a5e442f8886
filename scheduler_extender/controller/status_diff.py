"""Whether a GPR's status is worth a write: the fields compared, the queue spot (position and estimate) and how far
it must move, the wait detail a pass found, and estimates withheld where the controller will not admit."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from scheduler_extender.core.gpr import GPR, Phase
from scheduler_extender.core.waittime import Interval
from scheduler_extender.objects import gpr_codec as gr

# status fields a pass compares with what it would write (positions and estimates are refreshed apart)
QUEUE_FIELDS = ("queuePosition", "estimatedStart", "estimatedStartRange")  # refreshed apart from the rest


COMPARED = ("phase", "reason", "failures", "evictions", "reservation", "admittedAt", "startedAt", "finishedAt",
            "nextRetryTime", "observedGeneration")


SOON_S = 60.0  # a quota-held GPR's estimate closer than this to now is not written: "about now" is no promise


def honest(g: GPR, estimate: Interval | None, now: float) -> Interval | None:
    """A queued GPR's estimate as written. None while a model cap holds it (the fluid projection does not model
    the caps, so it could say "now" where the controller will not admit); while its workspace's quota holds it,
    the projection's estimate (it releases the workspace's holders at their predicted ends and keeps the
    workspace under its quota: the same as for any waiting GPR), but none within ``SOON_S`` of now (where the
    projection and the quota disagree, devices of the workspace's evicted GPRs still held, "now" would be a
    promise the controller will not keep); never before the end of its backoff (the earliest time it may
    start)."""
    if estimate is None or g.phase is not Phase.QUEUED:
        return estimate
    if g.reason == "ModelQuota" or (g.reason == "WorkspaceQuota" and not estimate.start >= now + SOON_S):
        return None
    nb = g.not_before
    if math.isfinite(estimate.start) and estimate.start < nb:
        return Interval(nb, max(estimate.low, nb), max(estimate.high, nb))
    return estimate


WAIT_DETAIL = {"workspacequota": "WorkspaceQuota", "modelquota": "ModelQuota", "unschedulable": "Unschedulable",
                "insufficientcapacity": "InsufficientCapacity", "behindhigherpriority": "BehindHigherPriority",
                "behindblockedgprs": "BehindBlockedGPRs", "backoff": "Backoff"}


def wait_detail(g: GPR, found: str | None, current: Mapping[str, Any]) -> str:
    """The detail of a queued GPR's reason for its message: what this pass found when it set the reason (the
    quota's use, the caps), else what the stored message says for the same reason (the core says it once, when
    the reason starts), else nothing."""
    if g.phase is not Phase.QUEUED or g.reason not in WAIT_DETAIL.values():
        return ""
    if found:
        # a backoff says until when: its retry time, fixed when the failure requeued it
        return f"until {gr.rfc3339(math.ceil(g.not_before))} {found}" if g.reason == "Backoff" else found
    said, mark = current.get("message"), f"; {g.reason}: "
    if current.get("reason") == g.reason and isinstance(said, str) and mark in said:
        return said.split(mark, 1)[1]
    return ""


EXTRA_CONDITIONS = ("Idle", "EvictionBlocked")


def differs(current: Mapping[str, Any], new: Mapping[str, Any], queue_too: bool, now: float = 0.0) -> bool:
    if any(current.get(k) != new.get(k) for k in COMPARED):
        return True
    if queue_too and queue_moved(spot_of(current), spot_of(new), now):
        return True

    def kinds(status: Mapping[str, Any]) -> set[tuple[str, str]]:
        return {(str(c.get("type")), str(c.get("status"))) for c in status.get("conditions") or []
                if isinstance(c, dict)}

    return kinds(current) != kinds(new)


Spot = tuple[Any, float | None, float | None, float | None]  # queuePosition, estimatedStart, its range


def spot_of(status: Mapping[str, Any]) -> Spot:
    """A status's place in the queue, its times as epoch seconds."""
    raw = status.get("estimatedStartRange")
    span: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    return (status.get("queuePosition"), gr.parse_time(status.get("estimatedStart")),
            gr.parse_time(span.get("earliest")), gr.parse_time(span.get("latest")))


def queue_moved(old: Spot, new: Spot, now: float) -> bool:
    """Whether a queued GPR's position or estimate moved enough to be worth a write: a position by at least a
    tenth (any change in the first ten), an estimated start by at least a tenth of the wait (and a minute).
    A time that was due (at or before ``now``) and is still due has not moved: "any moment now" rewritten as the
    new now every minute told the user nothing, and cost a write a minute for every GPR whose predicted start
    had come (200 a minute at 10,000 queued). Rewriting every position behind each admission would cost the API
    server a write per queued GPR per refresh; this keeps the numbers a user reads honest at a fraction of it."""
    if _position_moved(old[0], new[0]):
        return True
    for old_at, new_at in zip(old[1:], new[1:], strict=True):
        if (old_at is None) != (new_at is None):
            return True
        if old_at is not None and new_at is not None and _time_moved(old_at, new_at, now):
            return True
    return False


def _position_moved(old_pos: Any, new_pos: int | None) -> bool:
    """The position rule of :func:`queue_moved` (a stored position that is not a number never moves)."""
    if (old_pos is None) != (new_pos is None):
        return True
    return isinstance(old_pos, int) and isinstance(new_pos, int) and abs(new_pos - old_pos) >= max(1, old_pos // 10)


def _time_moved(old_at: float, new_at: float, now: float) -> bool:
    """The rule of :func:`queue_moved` for one time, both known."""
    return not (old_at <= now and new_at <= now) and abs(new_at - old_at) >= max(60.0, max(new_at - now, 0) / 10)


def spot_moved_from(old: Spot, position: int | None, estimate: Interval | None, now: float) -> bool:
    """``queue_moved(old, new, now)`` where ``new`` is :func:`spot_of` the fields ``gpr_resource.queue_fields``
    would write for ``position`` and ``estimate``, without writing them or building ``new``, and stopping at the
    first field that moved."""
    if _position_moved(old[0], position):
        return True
    at, low_at, high_at = old[1], old[2], old[3]
    if estimate is None or not math.isfinite(start := estimate.start):
        return at is not None or low_at is not None or high_at is not None
    if at is None or _time_moved(at, math.floor(start), now):
        return True
    low, high = estimate.low, estimate.high
    if not (math.isfinite(low) and math.isfinite(high)):
        return low_at is not None or high_at is not None
    return (low_at is None or high_at is None or _time_moved(low_at, math.floor(min(low, start)), now)
            or _time_moved(high_at, math.floor(max(high, start)), now))


POSITION_CLIP = 2 ** 52  # stored positions beyond it move as it does (either way: by more than a tenth), exactly


def spot_numbers_of(spot: Spot) -> tuple[float, float, float, float, float]:
    """A stored spot as numbers for :func:`spots_moved`: the position's kind (0 none, 1 an integer, 2 anything
    else), the position (clipped), and each time (NaN: none)."""
    pos = spot[0]
    kind, value = (0.0, 0.0) if pos is None else (
        (1.0, float(max(-POSITION_CLIP, min(POSITION_CLIP, pos)))) if isinstance(pos, int) else (2.0, 0.0))
    return (kind, value, *(math.nan if t is None else float(t) for t in spot[1:]))  # type: ignore[return-value]


def spots_moved(spots: list[tuple[float, float, float, float, float]], estimates: list[Interval | None],
                 now: float) -> np.ndarray:
    """``[spot_moved_from(old, i + 1, estimate, now) for i, ...]`` over a whole queue (``spots``: each queued GPR's
    :func:`spot_numbers_of`, in queue order), in a few array operations instead of 10,000 calls."""
    n = len(spots)
    if not n:
        return np.zeros(0, dtype=bool)
    old = np.array(spots, dtype=np.float64).reshape(n, 5)
    nan = math.nan
    est = np.array([(e.start, e.low, e.high) if e is not None else (nan, nan, nan) for e in estimates],
                   dtype=np.float64).reshape(n, 3)
    kind, pos = old[:, 0], old[:, 1]
    new_pos = np.arange(1, n + 1, dtype=np.float64)
    moved = (kind == 0) | ((kind == 1) & (np.abs(new_pos - pos) >= np.maximum(1.0, np.floor_divide(pos, 10.0))))
    at, low_at, high_at = old[:, 2], old[:, 3], old[:, 4]
    no_at, no_low, no_high = np.isnan(at), np.isnan(low_at), np.isnan(high_at)
    start, low, high = est[:, 0], est[:, 1], est[:, 2]
    finite = np.isfinite(start)
    ranged = finite & np.isfinite(low) & np.isfinite(high)
    with np.errstate(invalid="ignore"):
        def shifted(old_at: np.ndarray, new_at: np.ndarray) -> np.ndarray:  # _time_moved, element-wise
            return ~((old_at <= now) & (new_at <= now)) & (
                np.abs(new_at - old_at) >= np.maximum(60.0, np.maximum(new_at - now, 0.0) / 10))

        floor_start = np.floor(start)
        moved |= ~finite & ~(no_at & no_low & no_high)
        moved |= finite & (no_at | shifted(at, floor_start))
        moved |= finite & ~ranged & ~(no_low & no_high)
        moved |= ranged & (no_low | no_high | shifted(low_at, np.floor(np.minimum(low, start)))
                           | shifted(high_at, np.floor(np.maximum(high, start))))
    return moved
