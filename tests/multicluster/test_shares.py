"""Shares of a workspace limit across members (scheduler_extender/multicluster/shares.py): the safety invariant
under random demand and random delays/orders of the hub's writes and the members' reports, and the concrete
hand-over of 8 GPUs between two members."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_extender.multicluster.shares import MemberShare, plan_shares, targets


@dataclass
class Member:
    """A member as the product behaves: it enforces the share its copy last got (None: no copy yet, admits
    nothing), admits queued GPRs in order while they fit, and reports (enforced, held, queued) snapshots that
    reach the hub later, in order."""
    enforced: int | None = None
    queue: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    sent: list[tuple[int | None, int, int]] = field(default_factory=list)  # reports on their way to the hub
    seen: tuple[int | None, int, int] | None = None  # the last report the hub has
    carried: int | None = None  # what the hub's carrier says now

    @property
    def held(self) -> int:
        return sum(self.running)

    def view(self, live: bool = True) -> MemberShare:
        reported, held, queued = self.seen if self.seen is not None else (None, 0, 0)
        return MemberShare(self.carried, reported, held, queued, live)


def hub_pass(limit: int, members: dict[str, Member], lost: frozenset[str] = frozenset()) -> None:
    plan = plan_shares(limit, {n: m.view(n not in lost) for n, m in members.items()})
    for name, share in plan.items():
        members[name].carried = share


def check(limit: int, members: dict[str, Member]) -> None:
    """The invariant, over what is true in the members (not only what the hub sees), and the real goal."""
    true = sum(max(m.carried or 0, m.enforced or 0, m.held, (m.seen or (0, 0, 0))[0] or 0,
                   max((s[0] or 0 for s in m.sent), default=0)) for m in members.values())
    assert true <= limit, {n: (m.carried, m.enforced, m.held) for n, m in members.items()}
    assert sum(m.held for m in members.values()) <= limit


ACTIONS = st.lists(st.tuples(st.sampled_from(["hub", "deliver", "report", "see", "sync", "queue", "admit", "release"]),
                             st.integers(0, 2), st.integers(1, 9)), min_size=40, max_size=200)


@settings(max_examples=400, deadline=None)
@given(limit=st.integers(0, 16), n=st.integers(1, 3), actions=ACTIONS, lost=st.sets(st.integers(0, 2), max_size=1))
def test_the_limit_holds_across_members_whatever_order_things_happen_in(
        limit: int, n: int, actions: list[tuple[str, int, int]], lost: set[int]) -> None:
    names = [f"m{i}" for i in range(n)]
    members = {name: Member() for name in names}
    gone = frozenset(names[i] for i in lost if i < n)
    for action, who, size in actions:
        m = members[names[who % n]]
        if action == "hub":
            hub_pass(limit, members, gone)
        elif action == "deliver" and m.carried is not None:  # the agent's copy gets the carried share
            m.enforced = m.carried
        elif action == "report":  # the member's controller writes its usage rows; the agent carries them back
            m.sent.append((m.enforced, m.held, sum(m.queue)))
        elif action == "see" and m.sent:  # the hub's watch brings the oldest report not seen yet
            m.seen = m.sent.pop(0)
        elif action == "sync":  # the member takes the carried share and reports at once, the hub sees it all
            m.enforced = m.carried if m.carried is not None else m.enforced
            m.sent.append((m.enforced, m.held, sum(m.queue)))
            m.seen, m.sent = m.sent[-1], []
        elif action == "queue":
            m.queue.append(size)
        elif action == "admit" and m.queue and m.enforced is not None and m.held + m.queue[0] <= m.enforced:
            m.running.append(m.queue.pop(0))
        elif action == "release" and m.running:
            m.running.pop(0)
        check(limit, members)


def settle(limit: int, members: dict[str, Member], rounds: int = 6) -> None:
    """Every message delivered, in order, a few times over: hub pass, copies, admissions, reports."""
    for _ in range(rounds):
        hub_pass(limit, members)
        for m in members.values():
            if m.carried is not None:
                m.enforced = m.carried
            while m.queue and m.enforced is not None and m.held + m.queue[0] <= m.enforced:
                m.running.append(m.queue.pop(0))
            m.seen = (m.enforced, m.held, sum(m.queue))
            m.sent.clear()
        check(limit, members)


def test_eight_gpus_over_two_members_go_where_the_demand_is() -> None:
    members = {"member-a": Member(), "member-b": Member()}
    settle(8, members)
    assert {n: m.enforced for n, m in members.items()} == {"member-a": 4, "member-b": 4}  # idle: even
    members["member-a"].queue.append(8)
    settle(8, members)
    assert members["member-a"].running == [8] and members["member-b"].enforced == 0
    members["member-b"].queue.append(8)
    settle(8, members)
    assert members["member-b"].queue == [8] and members["member-b"].running == []  # waits: a holds the limit
    members["member-a"].running.clear()  # a finishes
    settle(8, members)
    assert members["member-b"].running == [8] and members["member-a"].enforced == 0


def test_a_lowered_share_frees_devices_only_once_the_member_reports_it() -> None:
    a = MemberShare(carried=8, reported=8, held=0, queued=0)
    b = MemberShare(carried=0, reported=0, held=0, queued=8)
    assert plan_shares(8, {"a": a, "b": b}) == {"a": 0, "b": 0}  # a lowered; nothing free for b yet
    a = MemberShare(carried=0, reported=8, held=0, queued=0)  # carried, not yet acknowledged
    assert plan_shares(8, {"a": a, "b": b}) == {"a": 0, "b": 0}
    a = MemberShare(carried=0, reported=0, held=0, queued=0)  # acknowledged
    assert plan_shares(8, {"a": a, "b": b}) == {"a": 0, "b": 8}


def test_one_member_gets_the_whole_limit_and_a_lost_member_keeps_its_share() -> None:
    assert plan_shares(8, {"only": MemberShare(None, None)}) == {"only": 8}
    lost = MemberShare(carried=4, reported=4, held=2, queued=0, live=False)
    busy = MemberShare(carried=4, reported=4, held=4, queued=8)
    assert plan_shares(8, {"lost": lost, "busy": busy}) == {"lost": 4, "busy": 4}
    assert targets(8, {"lost": lost, "busy": busy}) == {"lost": 4, "busy": 4}


def test_two_whole_limit_requests_are_not_split_into_halves_neither_can_use() -> None:
    idle = {n: MemberShare(carried=0, reported=0, held=0, queued=8) for n in ("a", "b")}
    assert targets(8, idle) == {"a": 8, "b": 0}
