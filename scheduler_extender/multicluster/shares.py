"""Quotas that hold across a workspace's clusters (issue 40.2): the share of one ``spec.policy.devices`` limit that
the hub carries to each member, as a pure function.

Each member enforces only its own copy of the workspace, so a limit of L carried whole to N members lets the
workspace hold N x L. The hub instead carries each member a *share*, and keeps one invariant for every entry:

    sum over members of committed(m) <= L,   committed(m) = max(share carried, share the member reports, held)

where "the member reports" is the ``max`` of the matching usage row the member's workspace controller wrote
(carried back in the carrier's ``status``) and "held" its ``inUse + reserved``. The invariant holds whatever order
writes land in because of one rule: **a member's share changes only once the member reports the share last
carried** (it acknowledged it). Then the member enforces either the carried share or the one it reports, both
counted in ``committed``; a lowered share frees devices only when the member's report comes down to it, and a
raise is granted only from ``L - sum committed``. A member that has not acknowledged (slow, Lost, not answering)
keeps what it committed until it does.

Targets follow demand: each member first gets what it holds, then the rest goes to queued demand, smallest demand
first and whole (ties by name), so two members each queueing a GPR of the whole limit never split it into two
halves neither can use; what is left is spread evenly, so an idle member can admit a first GPR without waiting for
the hub. One member gets the whole limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class MemberShare:
    """What the hub knows of one member for one limit."""
    carried: int | None  # the share in the member's carrier now; None: no carrier yet (nothing enforced there)
    reported: int | None  # the share the member reports it enforces (its usage row's max); None: no report
    held: int = 0  # devices it holds (inUse + reserved)
    queued: int = 0  # devices its Queued GPRs ask for
    live: bool = True  # False: Lost (or otherwise not to be moved); it keeps what it committed

    @property
    def committed(self) -> int:
        return max(self.carried or 0, self.reported or 0, self.held)

    @property
    def acknowledged(self) -> bool:
        """The member enforces what was carried: a new share may be sent (no carrier yet counts as 0, settled)."""
        return self.carried is None or self.reported == self.carried


def _fill(pool: int, wants: Mapping[str, int]) -> dict[str, int]:
    """``pool`` over ``wants``: smallest want first, each whole while it fits, then the rest to the next in order."""
    got = dict.fromkeys(wants, 0)
    for name in sorted(wants, key=lambda n: (wants[n], n)):
        give = min(pool, max(0, wants[name]))
        got[name] = give
        pool -= give
    return got


def targets(limit: int, members: Mapping[str, MemberShare]) -> dict[str, int]:
    """The shares the hub aims at (the sum is at most ``limit``): held, then queued demand, then even. A member
    that may not move now (not live or not acknowledged) is aimed at what it committed."""
    frozen = {n: m for n, m in members.items() if not (m.live and m.acknowledged)}
    movable = [n for n in sorted(members) if n not in frozen]
    pool = max(0, limit - sum(m.committed for m in frozen.values()))
    out = {n: m.committed for n, m in frozen.items()}
    held = _fill(pool, {n: members[n].held for n in movable})
    pool -= sum(held.values())
    queued = _fill(pool, {n: members[n].queued for n in movable})
    pool -= sum(queued.values())
    for i, n in enumerate(movable):
        even = pool // len(movable) + (1 if i < pool % len(movable) else 0)
        out[n] = held[n] + queued[n] + even
    return out


def plan_shares(limit: int, members: Mapping[str, MemberShare]) -> dict[str, int]:
    """The share to carry to each member now. Lowers are carried at once (they only ever lower ``committed``);
    raises only out of what is free under the invariant, counting each member's committed amount as it stands
    after the lowers (a lowered, acknowledged member still counts its old share until it reports the new one).
    A member that has not acknowledged keeps its carried share (None stays None: nothing to carry it yet)."""
    aim = targets(limit, members)
    out: dict[str, int] = {}
    for name, m in members.items():
        if not (m.live and m.acknowledged):
            out[name] = m.carried if m.carried is not None else 0
        elif m.carried is not None and aim[name] <= m.carried:
            out[name] = aim[name]
        else:
            out[name] = m.carried or 0
    after = {n: max(out[n], members[n].reported or 0, members[n].held) for n in members}
    free = limit - sum(after.values())
    raises = [n for n in sorted(members) if aim[n] > out[n] and members[n].live and members[n].acknowledged]
    for name in sorted(raises, key=lambda n: (aim[n] - out[n], n)):
        if free <= 0:
            break
        want = min(aim[name], after[name] + free)
        if want <= out[name]:
            continue
        out[name] = want
        grown = max(want, after[name])
        free -= grown - after[name]
        after[name] = grown
    return out
