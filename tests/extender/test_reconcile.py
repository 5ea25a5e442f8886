"""The pass is a pure function of the cluster's objects: what its caches keep between passes (decoded objects,
specs, node specs, the inventory with allocated GPRs adopted) changes nothing — a pass planned with warm caches
equals one planned from nothing, as after a restart or on a new leader (property test over random clusters, with
the controller's duration predictor learning between passes)."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler_extender.controller.gpr_pass import plan_pass
from scheduler_extender.controller.pass_cache import Base, Holders, PassCache, ranked_fields
from scheduler_extender.controller.pass_types import PassConfig, Plan, Snapshot
from scheduler_extender.core.gpr import GPR, Phase
from scheduler_extender.core.inventory import Inventory, NodeSpec
from scheduler_extender.core.placement import make_policy
from scheduler_extender.core.predictor import DurationPredictor, JobKey
from scheduler_extender.core.scheduler import Scheduler, SchedulerConfig
from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import GPU, node_view, pod_view
from scheduler_extender.objects.gpr_codec import rfc3339
from scheduler_extender.objects.narrowing import ungate_patch
from scheduler_extender.objects.workspaces import WorkspaceIndex
from tests.extender.harness import gpr, node, pod


def world(seed: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    rng = random.Random(seed)
    host = random.Random(seed + 1_000_003)  # pods' CPU requests (8 cores a node): apart, so seeds keep their worlds
    nodes = {}
    for i in range(rng.randint(1, 6)):
        obj = node(f"n{i}", gpus=rng.choice([2, 4, 8]), labels={"nvidia.com/gpu.product": rng.choice(["A", "B"])})
        if rng.random() < 0.15:  # cordoned: no new reservation there
            obj["spec"]["unschedulable"] = True
        if rng.random() < 0.25:  # kept for one team: only pods that tolerate it go there
            obj["spec"]["taints"] = [{"key": "dedicated", "value": "a", "effect": "NoSchedule"}]
        nodes[f"n{i}"] = node_view(obj, (GPU,))
    pods: dict[str, Any] = {}
    gprs: dict[str, dict[str, Any]] = {}
    for i in range(rng.randint(0, 12)):
        idle: dict[str, Any] = {"idleTimeout": "90s", "enforceIdleTimeout": rng.random() < 0.5} if rng.random() < 0.3 else {}
        phase = rng.choice([None, "Queued", "Admitted", "Running", "Evicting", "Complete", "Failed"])
        target = rng.choice(sorted(nodes))
        obj = gpr(f"g{i}", phase=phase, devices=rng.choice([1, 2, 4]), priority=rng.choice([50, 100, 250]),
                  reservation={target: 2} if phase in ("Admitted", "Running", "Evicting") else None,
                  requeueOnFailure=rng.random() < 0.5, enableEviction=rng.random() < 0.5, exitDuration="1h",
                  **idle)
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 1),
                               creationTimestamp=f"2026-11-30T00:00:{i:02d}Z")
        if phase in ("Admitted", "Running", "Evicting"):  # long past its exitDuration, or still within it
            obj["status"]["admittedAt"] = rng.choice(["2026-11-30T00:01:00Z", rfc3339(time.time() - 600),
                                                      rfc3339(time.time() - 3600 + 45)])  # expires in pass 2
        gprs[obj["metadata"]["uid"]] = obj
        for k in range(rng.randint(0, 2)):
            state = rng.choice(["Pending", "Running", "Succeeded", "Failed"])
            p = pod(f"g{i}-{k}", 1, gpr=f"g{i}", uid=f"p{i}-{k}", gated=state == "Pending" and rng.random() < 0.7,
                    node_name=target if state != "Pending" else "", phase=state)
            if rng.random() < 0.3:  # pods that may go to some nodes only: the GPR is placed where they can run
                p["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": rng.choice(["A", "B"])}
            if rng.random() < 0.3:
                p["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
            if host.random() < 0.4:  # GPRs are placed where their pods' CPU fits
                p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = host.choice(["1", "3", "6"])
            view = pod_view(p, (GPU,))
            if view is not None:
                pods[view.uid] = view
    for k in range(rng.randint(0, 3)):  # work outside GPRs
        view = pod_view(pod(f"other-{k}", rng.choice([1, 2]), uid=f"o{k}", node_name=rng.choice(sorted(nodes)),
                            phase="Running"), (GPU,))
        if view is not None:
            pods[view.uid] = view
    return nodes, pods, gprs


def assert_kept_as_afresh(warm: PassCache, snap: Snapshot, cfg: PassConfig) -> None:
    """The inventory and holders block ``warm`` kept after planning ``snap`` are the ones a fresh start builds
    (the block from its second pass on the same objects)."""
    cold = PassCache()
    again = copy.deepcopy(snap)
    plan_pass(again, cfg, cold)
    plan_pass(again, cfg, cold)
    assert warm.base is not None and cold.base is not None
    assert warm.base.key == cold.base.key and warm.base.adopted == cold.base.adopted
    assert np.array_equal(warm.base.inv.free, cold.base.inv.free)
    assert warm.base.inv.allocations == cold.base.inv.allocations
    if warm.holders is None:
        return
    assert cold.holders is not None

    def block(h: Holders) -> tuple[Any, ...]:
        s = h.state
        return (s.holders, s.usage, s.held_models, s.model_usage, {ws: sorted(lst) for ws, lst in s.ws_ends.items()},
                s.ws_entry, sorted(s.expiry), h.uid_of, {k: d.version for k, d in h.objects.items()}, h.members,
                [(name, g.seq, g.placement, g.workspace, g.milli_total(), g.admitted_at, g.exit_duration_s, g.phase)
                 for name, g in h.templates])

    assert block(warm.holders) == block(cold.holders)


def with_status(obj: dict[str, Any], version: int, **status: Any) -> dict[str, Any]:
    """A new version of a GPR object: ``status`` fields replaced, under resourceVersion ``version``."""
    return {**obj, "status": {**obj["status"], **status},
            "metadata": {**obj["metadata"], "resourceVersion": str(version)}}


class Passes:
    """Passes planned with warm caches on GPR objects as the API server keeps them: each checked against a fresh
    start (its plan, its inventory and holders block), its status writes then stored under new resourceVersions
    (but those of the UIDs in ``lose``: writes that failed)."""

    def __init__(self, now: float, nodes: dict[str, Any], gprs: dict[str, dict[str, Any]],
                 pods: dict[str, Any] | None = None) -> None:
        self.now, self.nodes, self.gprs, self.pods = now, nodes, gprs, pods if pods is not None else {}
        self.warm, self.version = PassCache(), 100

    def step(self, lose: frozenset[str] = frozenset()) -> Plan:
        snap = Snapshot(self.now, self.nodes, self.pods, self.gprs)
        plan = plan_pass(snap, PassConfig(), self.warm)
        assert summary(plan) == summary(plan_pass(copy.deepcopy(snap), PassConfig(), PassCache()))
        assert_kept_as_afresh(self.warm, snap, PassConfig())
        kept = dataclasses.replace(plan, writes=[w for w in plan.writes if w.uid not in lose])
        self.gprs, self.version = stored(self.gprs, kept, self.version)
        return plan

    def rewrite(self, uid: str, **status: Any) -> None:
        """A new version of a GPR whose ``status`` fields someone else changed."""
        self.version += 1
        self.gprs[uid] = with_status(self.gprs[uid], self.version, **status)


def summary(plan: Plan) -> tuple[Any, ...]:
    return (sorted((w.uid, repr(sorted(w.status.items()))) for w in plan.writes),
            sorted((k, tuple(v)) for k, v in plan.ungate.items()),
            sorted((e.pod.uid, e.why) for e in plan.evictions), plan.queue)


def stored(gprs: dict[str, dict[str, Any]], plan: Plan, version: int) -> tuple[dict[str, dict[str, Any]], int]:
    """The GPR objects once the API server has stored the plan's status writes (each under a new
    resourceVersion), and the last version given."""
    out = dict(gprs)
    for w in plan.writes:
        version += 1
        obj = out[w.uid]
        out[w.uid] = {**obj, "status": w.status, "metadata": {**obj["metadata"], "resourceVersion": str(version)}}
    return out, version


def churn(gprs: dict[str, dict[str, Any]], rng: random.Random, now: float, i: int) -> dict[str, dict[str, Any]]:
    """What users and the API server do to GPRs between two passes: delete one, create one under the name of one
    deleted (a new UID), raise a queued one's priority (a new generation), put one into a backoff that ends
    within the next passes, store a holder's completion."""

    gprs = dict(gprs)
    uids = sorted(gprs)
    if not uids:
        return gprs
    what = rng.choice(["delete", "recreate", "edit", "backoff", "finish"])
    holding = [u for u in uids if (gprs[u].get("status") or {}).get("phase") in ("Admitted", "Running")]
    if what == "finish" and holding:  # a holder completes: the next pass admits into its room queued GPRs
        uid = rng.choice(holding)     # (often older than holders that stay: they waited)
        obj = copy.deepcopy(gprs[uid])
        obj["metadata"]["resourceVersion"] = f"{obj['metadata']['resourceVersion']}-{i}"
        obj["status"].update(phase="Complete", finishedAt=rfc3339(now))
        gprs[uid] = obj
        return gprs
    queued = [u for u in uids if (gprs[u].get("status") or {}).get("phase") == "Queued"]
    uid = rng.choice(queued if queued and rng.random() < 0.7 else uids)  # mostly the shared queue's members
    obj = copy.deepcopy(gprs[uid])
    meta = obj["metadata"]
    meta["resourceVersion"] = f"{meta['resourceVersion']}-{i}"
    if what in ("delete", "recreate"):
        del gprs[uid]
        if what == "recreate":
            obj.pop("status", None)
            meta.update(uid=f"{uid}-again{i}", resourceVersion=f"r{i}", generation=1)
            gprs[meta["uid"]] = obj
        return gprs
    if what == "edit":
        obj["spec"]["priority"] = rng.choice([60, 150, 290])
        meta["generation"] = meta.get("generation", 1) + 1
    elif obj.get("status", {}).get("phase") == "Queued":
        obj["status"]["nextRetryTime"] = rfc3339(now + rng.choice([10, 45, 75]))
    gprs[uid] = obj
    return gprs


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.sets(st.integers(0, 3)), st.sets(st.integers(1, 3)),
       st.sets(st.integers(1, 5)), st.sets(st.integers(0, 5)), st.sampled_from(["size", "priority"]))
def test_warm_caches_plan_what_a_fresh_start_plans(seed: int, passes: int, learn_before: set[int],
                                                   pod_before: set[int], churn_before: set[int],
                                                   in_workspace: set[int], order: str) -> None:
    nodes, pods, gprs = world(seed)
    rng = random.Random(seed)
    now = time.time()
    warm = PassCache()
    version = 1000
    predictor = DurationPredictor()  # the controller's, which learns between passes (queue ranks are kept by it)
    for i in range(passes + 2):
        if i in churn_before:
            for _ in range(rng.randint(1, 3)):
                gprs = churn(gprs, rng, now, i)
        if i in learn_before:
            for k in range(4):
                predictor.observe(JobKey("default", "", "", f"nvidia.com/gpu:{1 + k}x1000x1"), 500.0 * (i + 1) * (k + 1))
        if i in pod_before:  # work outside GPRs starts on a node, or one of its pods ends
            late = pod_view(pod(f"late-{i}", 1 + i % 2, uid=f"late{i}", node_name=sorted(nodes)[i % len(nodes)],
                                phase="Running"), (GPU,))
            assert late is not None
            pods = {**pods, late.uid: late}
            ended = next((p for p in pods.values() if p.phase == "Running" and p.uid != late.uid), None)
            if ended is not None:
                pods[ended.uid] = dataclasses.replace(ended, phase="Succeeded", ended_at=now - 1)
            # and a pod bound a moment ago, in a node's ledger before this replica's informer has it
            name = sorted(nodes)[-1]
            entry = ledger.Entry(f"bound{i}", f"default/bound-{i}", {GPU: 1}, "", now)
            nodes = {**nodes, name: dataclasses.replace(nodes[name], ledger={**nodes[name].ledger, entry.uid: entry})}
            # and a node tainted or untainted (pods that could go there may not any more, or the other way round)
            name = sorted(nodes)[i % len(nodes)]
            taints = () if nodes[name].taints else ({"key": "dedicated", "value": "a", "effect": "NoSchedule"},)
            nodes = {**nodes, name: dataclasses.replace(nodes[name], taints=taints)}
        snap = Snapshot(now, nodes, pods, gprs)
        # passes in which the namespace belongs to a workspace with a quota (its GPRs change quota unit)
        index = WorkspaceIndex({"default": "team"}, {f"team|{GPU}": 6000}) if i in in_workspace else None
        core = SchedulerConfig(instant_eviction=False, learn=False, quotas=dict(index.quotas) if index else None,
                               order=order)
        a = plan_pass(snap, PassConfig(core=core, predictor=predictor, workspaces=index), warm)
        cold = PassCache()
        b = plan_pass(copy.deepcopy(snap), PassConfig(core=core, predictor=predictor, workspaces=index), cold)
        assert summary(a) == summary(b)
        assert_kept_as_afresh(warm, snap, PassConfig(core=core, predictor=predictor, workspaces=index))
        # the block of queued prototypes, patched pass after pass, is the one a fresh start builds (the size
        # order only: the priority order queues every GPR as itself)
        assert (warm.waiting is None) == (cold.waiting is None) == (order != "size")
        if warm.waiting is not None and cold.waiting is not None:
            assert ({k: (ws, key) for k, (ws, key, _) in warm.waiting.block.items.items()}
                    == {k: (ws, key) for k, (ws, key, _) in cold.waiting.block.items.items()})
        gprs, version = stored(gprs, a, version)  # the API server stores the writes: the next pass starts there
        now += 30


def test_ungate_patch_narrows_and_lifts_in_one_request() -> None:
    p = pod_view(pod("a", 1, gpr="g", gated=True), (GPU,))
    assert p is not None
    ops = ungate_patch(p, ["n2", "n1"], "accelstack.io/gpr")
    assert ops is not None
    assert ops[0] == {"op": "test", "path": "/spec/schedulingGates", "value": [{"name": "accelstack.io/gpr"}]}
    assert ops[1]["path"] == "/spec/affinity"
    # a node field selector takes one value: a term per node (terms are ORed)
    assert ops[1]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}]
    assert ops[-1] == {"op": "replace", "path": "/spec/schedulingGates", "value": []}
    ungated = pod_view(pod("b", 1, gpr="g"), (GPU,))
    assert ungated is not None and ungate_patch(ungated, ["n1"], "accelstack.io/gpr") is None


def test_queue_refreshes_write_only_positions_and_estimates_that_moved_enough() -> None:
    from scheduler_extender.controller.status_diff import queue_moved, spot_of

    def moved(a: dict[str, object], b: dict[str, object]) -> bool:
        return queue_moved(spot_of(a), spot_of(b), now)

    now = 1_800_000_000.0
    at = {"queuePosition": 500, "estimatedStart": rfc3339(now + 36_000)}
    assert not moved(at, {**at, "queuePosition": 470})  # 6% of a long queue: not worth a write
    assert moved(at, {**at, "queuePosition": 449})
    assert moved({"queuePosition": 3}, {"queuePosition": 2})  # near the front every step counts
    assert not moved(at, {**at, "estimatedStart": rfc3339(now + 35_000)})  # 1,000 s of a 10 h wait
    assert moved(at, {**at, "estimatedStart": rfc3339(now + 30_000)})
    assert moved(at, {"queuePosition": 500})  # an estimate appeared or went away
    due = {"queuePosition": 5, "estimatedStart": rfc3339(now - 300),
           "estimatedStartRange": {"earliest": rfc3339(now - 300), "latest": rfc3339(now - 300)}}
    still_due = {"queuePosition": 5, "estimatedStart": rfc3339(now),
                 "estimatedStartRange": {"earliest": rfc3339(now), "latest": rfc3339(now)}}
    assert not moved(due, still_due)  # due five minutes ago and due now: "any moment", not worth a write
    assert moved(due, {**still_due, "estimatedStart": rfc3339(now + 3600)})  # no longer due: written
    assert moved(due, {**still_due, "estimatedStartRange": {"earliest": rfc3339(now), "latest": rfc3339(now + 900)}})


def new_spot(position: int | None, estimate: Any) -> Any:
    """The spot the refresh judges for a position and an estimate: :func:`spot_of` the fields
    :func:`gpr_resource.queue_fields` would write (checked against them below), without writing them."""
    if estimate is None or not math.isfinite(estimate.start):
        return (position, None, None, None)
    start = estimate.start
    if not (math.isfinite(estimate.low) and math.isfinite(estimate.high)):
        return (position, math.floor(start), None, None)
    return (position, math.floor(start), math.floor(min(estimate.low, start)), math.floor(max(estimate.high, start)))


def test_a_refresh_judges_a_queued_gpr_by_the_fields_it_would_write() -> None:
    """The refresh compares numbers (the spot new_spot gives, which spot_moved_from and spots_moved judge) instead of
    rendering and parsing each status: the same numbers as the status it would write (queue_fields) read back."""
    import random

    from scheduler_extender.controller.status_diff import spot_of
    from scheduler_extender.core.waittime import Interval
    from scheduler_extender.objects.gpr_codec import queue_fields

    rng = random.Random(5)
    now = 1_800_000_000.0
    inf = float("inf")
    for _ in range(2000):
        position = rng.choice([None, rng.randint(1, 10_000)])
        start = rng.choice([inf, now + rng.uniform(-100, 90_000)])
        low = rng.choice([inf, start - rng.uniform(-50, 5000)])
        high = rng.choice([inf, start + rng.uniform(-50, 9000)])
        estimate = rng.choice([None, Interval(start, low, high)])
        written = queue_fields(position, estimate.start if estimate else None,
                               (estimate.low, estimate.high) if estimate else None)
        assert new_spot(position, estimate) == spot_of(written), (position, estimate, written)


_times = st.one_of(st.just(float("inf")), st.just(float("nan")), st.floats(-2_000, 100_000))


@settings(max_examples=600, deadline=None)
@given(st.one_of(st.none(), st.integers(1, 2_000), st.just("7")), st.one_of(st.none(), st.integers(1, 2_000)),
       st.one_of(st.none(), st.tuples(_times, _times, _times)),
       st.tuples(*[st.one_of(st.none(), st.floats(-2_000, 100_000), st.integers(-60, 60)) for _ in range(3)]))
def test_the_refresh_check_equals_comparing_whole_spots(old_pos: Any, position: int | None, times: Any,
                                                        olds: tuple[Any, ...]) -> None:
    """spot_moved_from (what a refresh asks of each queued GPR) answers as queue_moved of the spot it would write,
    whatever was stored (a position that is not a number included), at and around every threshold (stored times
    drawn as offsets of the new ones)."""

    from scheduler_extender.controller.status_diff import queue_moved, spot_moved_from
    from scheduler_extender.core.waittime import Interval

    now = 1_800_000_000.0
    estimate = Interval(*(now + t for t in times)) if times is not None else None
    new = new_spot(position, estimate)

    def stored(offset: Any, at: Any) -> Any:
        """An int: ten times that many seconds from what would be written now (across the 60 s threshold); a
        float: that many seconds from now; None: no time stored."""
        if isinstance(offset, int):
            return None if at is None else at + 10 * offset
        return None if offset is None else now + offset

    old = (old_pos, *(stored(o, n) for o, n in zip(olds, new[1:], strict=True)))
    assert spot_moved_from(old, position, estimate, now) == queue_moved(old, new, now), (old, new)
    if estimate is not None and all(math.isfinite(t) for t in (estimate.start, estimate.low, estimate.high)):
        assert not spot_moved_from(new, position, estimate, now)  # what it would write has not moved


_stored_positions = st.one_of(st.none(), st.just("same"), st.tuples(st.just("from"), st.integers(-5, 5)),
                              st.integers(1, 2_000), st.just("7"), st.just(True),
                              st.just(3.0), st.integers(-(2 ** 70), 2 ** 70), st.integers(-(10 ** 400), 10 ** 400))
_estimates = st.one_of(st.none(), st.tuples(_times, _times, _times),  # due, soon, or later
                       st.tuples(*[st.one_of(st.integers(-700, 700), st.integers(600, 7_000)).map(float)
                                   for _ in range(3)]))
# a stored time: none; seconds from now (0: now itself); whole seconds from what would be written now (across the
# 60 s threshold); or a share of the wait from it (across a tenth of the wait)
_offset = st.one_of(st.just(("sec", 0)), st.just(("sec", 0)), st.just(("sec", 0)),  # as it would be written: often
                    st.none(), st.tuples(st.just("now"), st.one_of(st.just(0.0), st.floats(-2_000, 100_000))),
                    st.tuples(st.just("sec"), st.one_of(st.integers(-700, 700), st.sampled_from([-61, -60, -59, 59, 60, 61]))),
                    st.tuples(st.just("wait"), st.sampled_from([-0.11, -0.1, -0.09, 0.09, 0.1, 0.11])))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_stored_positions, _estimates, st.tuples(_offset, _offset, _offset)), max_size=40))
@example([("same", (100.0, 100.0, 100.0), (("sec", 59), ("sec", 0), ("sec", 0))),  # each threshold, exactly
          ("same", (100.0, 100.0, 100.0), (("sec", -60), ("sec", 0), ("sec", 0))),
          ("same", (-100.0, -200.0, -50.0), (("now", 0.0), ("sec", 0), ("sec", 0))),
          ("same", (-100.0, -200.0, -50.0), (("sec", 0), ("now", 0.0), ("sec", 0))),
          ("same", (2000.0, 1000.0, 3000.0), (("wait", 0.1), ("wait", 0.09), ("sec", 0))),
          ("same", (2000.0, 1000.0, 3000.0), (("sec", 0), ("sec", 0), ("wait", -0.11))),
          *[("same", None, (None, None, None))] * 18, (27, None, (None, None, None)),  # places 25 and 28: a tenth
          ("same", None, (None, None, None)), ("same", None, (None, None, None)), (30, None, (None, None, None))])
def test_a_refresh_checks_the_whole_queue_at_once_as_it_checks_each_gpr(queue: list[Any]) -> None:
    """spots_moved (the refresh's check of every queued GPR at once, in queue order) answers for each exactly as
    spot_moved_from does: positions that are not numbers, booleans, floats and integers beyond 2**52 included, times
    at and around every threshold, estimates with no start or no range."""
    from scheduler_extender.controller.status_diff import spot_moved_from, spot_numbers_of, spots_moved
    from scheduler_extender.core.waittime import Interval

    now = 1_800_000_000.0

    def stored(offset: Any, at: float | None) -> float | None:
        if offset is None:
            return None
        how, value = offset
        if how == "now":
            return now + value
        if at is None:
            return None
        return at + value if how == "sec" else at + value * max(at - now, 0.0)

    spots: list[Any] = []
    estimates: list[Any] = []
    for i, (old_pos, times, offsets) in enumerate(queue):
        estimate = Interval(*(now + t for t in times)) if times is not None else None
        new = new_spot(i + 1, estimate)
        if isinstance(old_pos, tuple):  # a few places from where it is now
            old_pos = i + 1 + old_pos[1]
        spots.append((i + 1 if old_pos == "same" else old_pos,
                      *(stored(o, at) for o, at in zip(offsets, new[1:], strict=True))))
        estimates.append(estimate)
    expected = [spot_moved_from(spot, i + 1, estimate, now)
                for i, (spot, estimate) in enumerate(zip(spots, estimates, strict=True))]
    assert spots_moved([spot_numbers_of(spot) for spot in spots], estimates, now).tolist() == expected


@pytest.mark.parametrize("change", ["ledger", "pod"])
def test_a_warm_pass_sees_devices_taken_outside_gprs_since_the_last(change: str) -> None:
    """Devices used outside reservations are kept between passes only while every pod and node is the one seen:
    a pod bound a moment ago (in the node's ledger) or one now running takes the device a new GPR would get."""
    nodes = {"n0": node_view(node("n0", gpus=2), (GPU,))}
    pods: dict[str, Any] = {}
    gprs: dict[str, dict[str, Any]] = {}
    now = time.time()
    warm = PassCache()
    for _ in range(2):  # the first builds the cached inventory, the second keeps what it finds outside GPRs
        plan_pass(Snapshot(now, nodes, pods, gprs), PassConfig(), warm)
    if change == "ledger":
        entry = ledger.Entry("late", "default/late", {GPU: 1}, "", now)
        nodes = {"n0": dataclasses.replace(nodes["n0"], ledger={"late": entry})}
    else:
        late = pod_view(pod("late", 1, uid="late", node_name="n0", phase="Running"), (GPU,))
        assert late is not None
        pods = {late.uid: late}
    obj = gpr("g", phase=None, devices=2)
    obj["metadata"].update(uid="ug", resourceVersion="7", creationTimestamp="2026-11-30T00:00:00Z")
    gprs = {"ug": obj}
    a = plan_pass(Snapshot(now + 30, nodes, pods, gprs), PassConfig(), warm)
    b = plan_pass(Snapshot(now + 30, nodes, pods, gprs), PassConfig(), PassCache())
    assert summary(a) == summary(b)
    assert [w.status["phase"] for w in a.writes] == ["Queued"]  # one device is taken: two do not fit


def test_a_node_heartbeat_keeps_the_devices_used_outside_gprs_and_a_ledger_change_does_not() -> None:
    """A node's status heartbeat (a new object, the same ledger) leaves the devices used outside reservations
    as the last pass found them (at 5,000 nodes ~17 nodes change a second); a new ledger entry on a node that
    looks otherwise the same is counted at once. Both warm passes plan what a cold one plans."""
    entry = ledger.Entry("old", "default/old", {GPU: 1}, "", time.time())
    nodes = {"n0": dataclasses.replace(node_view(node("n0", gpus=2), (GPU,)), ledger={"old": entry}),
             "n1": node_view(node("n1", gpus=2), (GPU,))}
    now, warm = time.time(), PassCache()
    for _ in range(2):
        plan_pass(Snapshot(now, nodes, {}, {}), PassConfig(), warm)
    assert warm.outside is not None
    kept = warm.outside[3]
    assert kept == {"n0": 1}
    obj = gpr("g", phase=None, devices=2, nodes=2)
    obj["metadata"].update(uid="ug", resourceVersion="7", creationTimestamp="2026-11-30T00:00:00Z")
    gprs = {"ug": obj}
    beat = {name: dataclasses.replace(v, resource_version=v.resource_version + "1") for name, v in nodes.items()}
    a = plan_pass(Snapshot(now + 30, beat, {}, gprs), PassConfig(), warm)
    assert warm.outside[3] is kept  # not worked out again
    assert summary(a) == summary(plan_pass(Snapshot(now + 30, beat, {}, gprs), PassConfig(), PassCache()))
    assert [w.status["phase"] for w in a.writes] == ["Queued"]  # n0 has one device left: 2 x 2 do not fit
    late = ledger.Entry("late", "default/late", {GPU: 1}, "", now)
    taken = {**beat, "n1": dataclasses.replace(beat["n1"], ledger={"late": late})}
    b = plan_pass(Snapshot(now + 60, taken, {}, gprs), PassConfig(), warm)
    assert warm.outside[3] == {"n0": 1, "n1": 1}
    assert summary(b) == summary(plan_pass(Snapshot(now + 60, taken, {}, gprs), PassConfig(), PassCache()))


def test_the_rank_kept_across_status_writes_reads_only_the_fields_it_is_checked_on() -> None:
    """A queued GPR's size-order rank is carried to its next object version when ranked_fields are equal: so
    Scheduler.size_rank may read nothing else of the GPR (a field it starts to read must join ranked_fields)."""
    sched = Scheduler(Inventory([NodeSpec("n0", 8)]), make_policy("bestfit"), SchedulerConfig(order="size"))
    base = GPR("default/g", exit_duration_s=3600.0, submitted_at=1000.0)
    ranked: dict[str, Any] = {"workspace": "team", "template": "t", "workload": "w", "resource": "neureality.com/nr1",
              "devices_per_node": 2, "milli_per_device": 500, "node_count": 2, "exit_duration_s": 60.0,
              "priority": 250, "submitted_at": 5.0}
    unranked: dict[str, Any] = {"name": "default/h", "phase": Phase.FAILED, "reason": "x", "failures": 3, "evictions": 2,
                "not_before": 5e9, "admitted_at": 1.0, "started_at": 2.0, "last_active_at": 3.0, "seq": 99,
                "finished_at": 4.0, "idle_timeout_s": 60.0, "enforce_idle_timeout": True, "enable_eviction": True,
                "preemptible": False, "requeue_on_failure": True, "retry_limit": 9, "backoff_base_s": 1.0,
                "backoff_cap_s": 2.0, "models": ("A",), "memory_mib_per_device": 5, "cpu_milli_per_node": 5,
                "memory_mib_per_node": 5, "idle_reported": True, "history": [(1.0, Phase.QUEUED, "x")],
                "placement": None}
    assert set(ranked) | set(unranked) == set(vars(base)), "a new GPR field: say here whether size_rank reads it"
    for name, value in unranked.items():
        assert sched.size_rank(dataclasses.replace(base, **{name: value})) == sched.size_rank(base), name
    for name, value in ranked.items():  # each of these is in ranked_fields (and most move the rank)
        other = dataclasses.replace(base, **{name: value})
        assert ranked_fields(other) != ranked_fields(base), name


def test_a_write_that_only_moves_a_queued_gprs_place_is_marked_as_news() -> None:
    """StatusWrite.queue_only marks a write whose only change is the position or the estimate (the controller
    paces those); a decision (a new GPR's first status, a phase change) never is."""
    now = time.time()
    nodes = {"n0": node_view(node("n0", gpus=8), (GPU,))}
    run = gpr("run", phase="Running", reservation={"n0": 8}, devices=8, exitDuration="1h")
    run["metadata"].update(uid="u-run", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")

    run["status"].update(admittedAt=rfc3339(now - 60), startedAt=rfc3339(now - 60))  # ends within the hour
    gprs = {"u-run": run}
    for i in range(5):
        q = gpr(f"q{i}", phase=None, devices=8, exitDuration="1h")
        q["metadata"].update(uid=f"u-q{i}", resourceVersion=str(2 + i), creationTimestamp=f"2026-11-30T00:02:0{i}Z")
        gprs[f"u-q{i}"] = q
    running = pod_view(pod("run-0", 8, gpr="run", uid="p-run", node_name="n0", phase="Running"), (GPU,))
    assert running is not None
    pods = {"p-run": running}
    cache, version = PassCache(), 100

    def apply(plan: Plan) -> None:
        nonlocal version
        for w in plan.writes:
            version += 1
            obj = gprs[w.uid]
            gprs[w.uid] = {**obj, "status": w.status, "metadata": {**obj["metadata"], "resourceVersion": str(version)}}

    first = plan_pass(Snapshot(now, nodes, pods, gprs), PassConfig(refresh_queue=True), cache)
    assert {f"default/q{i}" for i in range(5)} <= {w.key for w in first.writes}
    assert not any(w.queue_only for w in first.writes)  # a first status is a decision
    apply(first)
    urgent = gpr("urgent", phase=None, devices=8, priority=300, exitDuration="1h")
    urgent["metadata"].update(uid="u-urgent", resourceVersion="999", creationTimestamp="2026-11-30T00:03:00Z")
    gprs["u-urgent"] = urgent
    before = {uid: obj.get("status") or {} for uid, obj in gprs.items()}
    second = plan_pass(Snapshot(now + 5, nodes, pods, gprs), PassConfig(refresh_queue=True), cache)
    news = {w.key for w in second.writes if w.queue_only}
    assert news == {f"default/q{i}" for i in range(5)}  # each moved one place back, behind the urgent one
    assert [w.key for w in second.writes if not w.queue_only] == ["default/urgent"]
    for w in second.writes:
        if w.queue_only:
            moved = {k for k in w.status.keys() | before[w.uid].keys() if w.status.get(k) != before[w.uid].get(k)}
            assert moved <= {"queuePosition", "estimatedStart", "estimatedStartRange", "message"}, moved
            assert w.status["queuePosition"] == before[w.uid]["queuePosition"] + 1


def test_the_shared_queue_block_follows_deletes_recreates_edits_and_backoffs() -> None:
    """The queued prototypes kept between passes (PassCache.waiting) follow each kind of change by UID: a deleted
    GPR leaves, a GPR created under a deleted one's name joins once its status is written, an edited one is
    ranked again, one in a backoff leaves and comes back when the backoff ends; after each change the warm pass
    plans what a fresh start plans."""

    nodes = {"n0": node_view(node("n0", gpus=1), (GPU,))}
    gprs: dict[str, dict[str, Any]] = {}
    for i in range(6):
        obj = gpr(f"q{i}", phase=None, devices=2, exitDuration="1h")  # never fits: stays queued
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 1), creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        gprs[f"u{i}"] = obj
    now, version, warm = time.time(), 100, PassCache()
    predictor = DurationPredictor()  # kept across passes, as the controller keeps its own

    def step(expected: set[str]) -> Plan:
        nonlocal version, gprs
        snap = Snapshot(now, nodes, {}, gprs)
        plan = plan_pass(snap, PassConfig(predictor=predictor), warm)
        cold = PassCache()
        assert summary(plan) == summary(plan_pass(copy.deepcopy(snap), PassConfig(predictor=predictor), cold))
        assert warm.waiting is not None and cold.waiting is not None
        assert set(warm.waiting.members) == set(cold.waiting.members) == expected
        gprs, version = stored(gprs, plan, version)
        return plan

    def edit(uid: str, change: Any) -> None:
        nonlocal version, gprs
        version += 1
        obj = copy.deepcopy(gprs[uid])
        change(obj)
        obj["metadata"]["resourceVersion"] = str(version)
        gprs = {**gprs, uid: obj}

    step(set())  # new GPRs: their first status is written
    everyone = {f"u{i}" for i in range(6)}
    step(everyone)
    kept = warm.waiting
    gprs = {u: o for u, o in gprs.items() if u != "u0"}  # deleted
    again = copy.deepcopy(gprs["u1"])  # u1 deleted and created again under its name
    del gprs["u1"]
    again.pop("status")
    again["metadata"].update(uid="u1b", resourceVersion="1")
    gprs["u1b"] = again
    edit("u2", lambda o: (o["spec"].update(priority=250), o["metadata"].update(generation=2)))
    edit("u3", lambda o: o["status"].update(nextRetryTime=rfc3339(now + 45)))
    step({"u4", "u5"})  # u2's status no longer observes its generation; u3 waits
    for k in range(3):  # u3 changes while it waits (a label): one entry to wake it, however often it changes
        edit("u3", lambda o, k=k: o["metadata"].setdefault("labels", {}).update(touched=str(k)))
        step({"u1b", "u2", "u4", "u5"})  # (the statuses of u1b and u2 are written by now)
    assert warm.waiting is not None and len(warm.waiting.later) == 1
    now += 30
    step({"u1b", "u2", "u4", "u5"})  # statuses written: both back, u3 still in its backoff
    now += 30
    step({"u1b", "u2", "u3", "u4", "u5"})  # the backoff ended
    assert warm.waiting is kept  # patched pass after pass, never built afresh


def test_a_holders_status_write_keeps_the_cached_inventory_and_holders_and_a_new_reservation_does_not() -> None:
    """The cached inventory depends on each allocated GPR's UID, name and reservation alone: a holder's status
    write that keeps its reservation (its pods started: Admitted to Running) keeps it and patches the holders
    block in place; an edit that changes how a holder counts (its exitDuration) builds the block again from the
    second pass on the new objects; a reservation that changes rebuilds the inventory. Every warm pass plans
    what a fresh start plans."""
    now = time.time()
    nodes = {f"n{i}": node_view(node(f"n{i}", gpus=2), (GPU,)) for i in range(3)}
    gprs: dict[str, dict[str, Any]] = {}
    for i in range(2):
        obj = gpr(f"h{i}", phase="Admitted", reservation={f"n{i}": 2}, devices=2, exitDuration="1h")
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 1), creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        obj["status"].update(admittedAt=rfc3339(now - 60))
        gprs[f"u{i}"] = obj
    queued = gpr("q", phase=None, devices=2, nodes=2, exitDuration="1h")  # two whole nodes: only n2 is free
    queued["metadata"].update(uid="uq", resourceVersion="9", creationTimestamp="2026-11-30T00:01:00Z")
    gprs["uq"] = queued
    passes = Passes(now, nodes, gprs)
    step, rewrite, warm = passes.step, passes.rewrite, passes.warm

    for _ in range(3):
        step()
    base, holders = warm.base, warm.holders
    assert base is not None and holders is not None
    rewrite("u0", phase="Running", startedAt=rfc3339(now - 30))
    step()
    # the inventory kept, the block patched with h0's new object in the same pass
    assert warm.base is base and warm.holders is holders
    assert holders.objects["default/h0"].status["phase"] == "Running"
    assert dict(holders.templates)["default/h0"].started_at == pytest.approx(now - 30, abs=1)
    passes.version += 1  # h1's exitDuration edited: it counts differently in the indexes, so the block is built again
    edited = passes.gprs["u1"]
    passes.gprs["u1"] = {**edited, "spec": {**edited["spec"], "exitDuration": "2h"},
                         "metadata": {**edited["metadata"], "resourceVersion": str(passes.version), "generation": 2}}
    plan = step()
    assert warm.base is base and warm.holders is None  # not patched: dropped
    assert [w.uid for w in plan.writes] == ["u1"]  # the edit observed: one more version of h1 to take in
    step()
    step()  # the second pass on the same objects builds the block again
    assert warm.base is base and warm.holders is not None
    assert dict(warm.holders.templates)["default/h1"].exit_duration_s == 7200.0
    rewrite("u1", reservation=[{"node": "n2", "devices": 2}])  # h1's devices recorded on n2 now
    step()
    assert warm.base is not None and warm.base is not base
    inv, adopted = warm.base.inv, warm.base.adopted
    assert [inv.names[a.node] for a in adopted["default/h1"].assignments] == ["n2"]
    assert passes.gprs["uq"]["status"]["phase"] == "Queued"


def test_the_holders_block_takes_in_a_newest_holder_and_lets_go_of_one_that_stops_holding() -> None:
    """An admission stored (a new reservation) derives the cached inventory from the last one and adds the GPR to
    the holders block; a holder that stops holding (Evicting, deleted) leaves the block; a GPR that starts holding
    before a newer holder (its admission time stored late, or admitted after waiting in the queue) takes its
    place in creation order, as adopting afresh places it, instead of the block being built again. Every warm
    pass plans what a fresh start plans, and its inventory and holders block are the ones a fresh start builds."""
    now = time.time()
    nodes = {f"n{i}": node_view(node(f"n{i}", gpus=2), (GPU,)) for i in range(5)}
    gprs: dict[str, dict[str, Any]] = {}
    for i in range(3):  # h2 alone in its namespace (its workspace)
        obj = gpr(f"h{i}", phase="Running" if i != 1 else "Admitted", reservation={f"n{i}": 2}, devices=2,
                  exitDuration="1h", namespace="other" if i == 2 else "default")
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 1), creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        if i != 1:
            obj["status"].update(admittedAt=rfc3339(now - 60), startedAt=rfc3339(now - 60))
        gprs[f"u{i}"] = obj
    passes = Passes(now, nodes, gprs)
    step, rewrite, warm = passes.step, passes.rewrite, passes.warm

    for _ in range(3):
        step(lose=frozenset({"u1"}))  # h1's admission time never stored
    assert warm.holders is not None and warm.holders.members == {"u0", "u2"}
    block = warm.holders
    step()  # the stamp stored
    step()  # h1 holds now, older than h2: taken in at its place, as adopting afresh places it
    assert warm.holders is not None and warm.holders is not block and warm.holders.members == {"u0", "u1", "u2"}
    assert [name for name, _ in warm.holders.templates] == ["default/h0", "default/h1", "other/h2"]
    assert warm.holders.state.holders == ["default/h0", "default/h1", "other/h2"]
    base, block = warm.base, warm.holders
    # an admission stored: h3, the newest, on n3
    obj = gpr("h3", phase="Admitted", reservation={"n3": 2}, devices=2, exitDuration="1h")
    obj["metadata"].update(uid="u3", resourceVersion="50", creationTimestamp="2026-11-30T00:00:09Z")
    obj["status"].update(admittedAt=rfc3339(now - 1))
    passes.gprs["u3"] = obj
    step()
    assert warm.base is not base and warm.base is not None and warm.base.touched == {"n3"}
    assert warm.holders is not None and warm.holders is not block and warm.holders.base is warm.base
    assert [name for name, _ in warm.holders.templates] == ["default/h0", "default/h1", "other/h2", "default/h3"]
    base = warm.base
    del passes.gprs["u2"]  # deleted: its devices freed
    step()
    assert warm.base is not base and warm.base is not None and warm.base.touched == {"n2"}
    assert warm.holders is not None and warm.holders.members == {"u0", "u1", "u3"}
    assert "other" not in warm.holders.state.usage and "other" not in warm.holders.state.ws_ends
    base = warm.base
    rewrite("u0", phase="Evicting")  # same reservation: the same inventory, one holder fewer
    step()
    assert warm.base is base and warm.holders is not None and warm.holders.members == {"u1", "u3"}
    # its pods are gone (it has none): the same pass queued it again and admitted it at once
    assert passes.gprs["u0"]["status"]["phase"] == "Admitted"
    step()  # the oldest holder again: taken in first
    assert warm.holders is not None and warm.holders.members == {"u0", "u1", "u3"}
    assert [name for name, _ in warm.holders.templates] == ["default/h0", "default/h1", "default/h3"]


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000))
def test_gprs_admitted_out_of_creation_order_take_their_place_among_the_kept_holders(seed: int) -> None:
    """Holders complete one by one and queued GPRs created before some remaining holders are admitted into their
    room (they waited): each joins the kept holders block at its place in creation order. Every warm pass plans
    what a fresh start plans, with the inventory and holders block a fresh start builds."""
    rng = random.Random(seed)
    now = time.time()
    nodes = {f"n{i}": node_view(node(f"n{i}", gpus=2), (GPU,)) for i in range(6)}
    gprs: dict[str, dict[str, Any]] = {}
    for k, i in enumerate(rng.sample(range(12), 12)):  # created in a shuffled order; the first six hold a node
        holder = k < 6
        obj = gpr(f"g{i}", phase="Running" if holder else "Queued", reservation={f"n{k}": 2} if holder else None,
                  devices=2, exitDuration="1h", priority=rng.choice([50, 100, 250]))
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(k + 1), creationTimestamp=f"2026-11-30T00:00:{i:02d}Z")
        if holder:
            obj["status"].update(admittedAt=rfc3339(now - 60), startedAt=rfc3339(now - 60))
        gprs[f"u{i}"] = obj
    passes = Passes(now, nodes, gprs)
    for _ in range(3):  # the first statuses written, then the block kept from a second pass on the same objects
        passes.step()
    joined = 0
    for _ in range(6):
        holding = sorted(u for u, o in passes.gprs.items() if o["status"].get("phase") in ("Admitted", "Running"))
        passes.rewrite(rng.choice(holding), phase="Complete", finishedAt=rfc3339(passes.now))
        before = passes.warm.holders
        for _ in range(3):
            passes.step()
            assert passes.warm.holders is not None  # revised, never dropped and built again
        after = passes.warm.holders
        assert after is not None
        if before is not None and after.members - before.members:
            joined += 1
            order = [passes.gprs[after.uid_of[name]]["metadata"]["creationTimestamp"] for name, _ in after.templates]
            assert order == sorted(order) and after.state.holders == [name for name, _ in after.templates]
        passes.now += 1
    assert joined


def test_a_gpr_that_finishes_while_its_pod_runs_frees_its_reservation_but_not_the_pods_devices() -> None:
    """A holder's status says Complete while its pod still runs (stopping, or not yet evicted): the inventory
    derived from the last one frees its reservation, and the pod's devices count again as used outside GPRs on
    that node, so a queued GPR is not admitted there until the pod is gone. Warm passes plan what a fresh
    start plans."""
    now = time.time()
    nodes = {"n0": node_view(node("n0", gpus=2), (GPU,))}
    held = gpr("h", phase="Running", reservation={"n0": 2}, devices=2, exitDuration="1h")
    held["metadata"].update(uid="uh", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")
    held["status"].update(admittedAt=rfc3339(now - 60), startedAt=rfc3339(now - 60))
    queued = gpr("q", phase=None, devices=2, exitDuration="1h")
    queued["metadata"].update(uid="uq", resourceVersion="2", creationTimestamp="2026-11-30T00:01:00Z")
    gprs: dict[str, dict[str, Any]] = {"uh": held, "uq": queued}
    running = pod_view(pod("h-0", 2, gpr="h", uid="p0", node_name="n0", phase="Running"), (GPU,))
    assert running is not None
    passes = Passes(now, nodes, gprs, {"p0": running})
    step, warm = passes.step, passes.warm

    for _ in range(3):
        step()
    base = warm.base
    passes.version += 1
    passes.gprs["uh"] = with_status(held, passes.version, phase="Complete", finishedAt=rfc3339(now))
    plan = step()
    assert warm.base is not base and warm.base is not None and warm.base.touched == {"n0"}
    assert passes.gprs["uq"]["status"]["phase"] == "Queued"
    assert [e.pod.uid for e in plan.evictions] == ["p0"]  # the finished GPR's pod must go
    passes.pods = {"p0": dataclasses.replace(running, phase="Succeeded", ended_at=now)}
    step()
    assert passes.gprs["uq"]["status"]["phase"] == "Admitted"


def test_an_admission_stored_after_its_pod_was_seen_covers_the_pods_devices() -> None:
    """A GPR's pod already runs when its admission is first seen (the informer had the pod first): the derived
    inventory reserves the GPR's devices and the pod's devices are counted again, now covered by the
    reservation, so the node's other devices stay free for a queued GPR. Warm passes plan what a fresh start
    plans."""
    now = time.time()
    nodes = {"n0": node_view(node("n0", gpus=4), (GPU,))}
    running = pod_view(pod("h-0", 2, gpr="h", uid="p0", node_name="n0", phase="Running"), (GPU,))
    assert running is not None
    pods: dict[str, Any] = {"p0": running}
    warm = PassCache()

    def step(gprs: dict[str, dict[str, Any]]) -> Plan:
        snap = Snapshot(now, nodes, pods, gprs)
        plan = plan_pass(snap, PassConfig(), warm)
        assert summary(plan) == summary(plan_pass(copy.deepcopy(snap), PassConfig(), PassCache()))
        assert_kept_as_afresh(warm, snap, PassConfig())
        return plan

    step({})  # the pod's two devices are held outside any GPR
    held = gpr("h", phase="Admitted", reservation={"n0": 2}, devices=2, exitDuration="1h")
    held["metadata"].update(uid="uh", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")
    held["status"].update(admittedAt=rfc3339(now - 5))
    queued = gpr("q", phase=None, devices=2, exitDuration="1h")
    queued["metadata"].update(uid="uq", resourceVersion="2", creationTimestamp="2026-11-30T00:01:00Z")
    base = warm.base
    plan = step({"uh": held, "uq": queued})
    assert warm.base is not base and warm.base is not None and warm.base.touched == {"n0"}
    assert {w.uid: w.status["phase"] for w in plan.writes}.get("uq") == "Admitted"


def test_the_cached_holders_follow_their_pods_the_clock_and_the_workspaces() -> None:
    """The holders adopted once per cached base (PassCache.holders) are restored pass after pass with what
    depends on the pass: their last activity (from their pods: one stops, one idles out), the time (one
    reaches its exitDuration) and the workspace map (a namespace joins a workspace with a quota); after each
    change the warm pass plans what a fresh start plans."""
    now = time.time()
    nodes = {f"n{i}": node_view(node(f"n{i}", gpus=2), (GPU,)) for i in range(4)}
    gprs: dict[str, dict[str, Any]] = {}
    pods: dict[str, Any] = {}
    for i in range(4):
        obj = gpr(f"h{i}", phase="Running", reservation={f"n{i}": 2}, devices=2, exitDuration="1h",
                  idleTimeout="60s", enforceIdleTimeout=i == 1)
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 1), creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        admitted = now - (3600 - 45 if i == 3 else 600)  # h3 reaches its exitDuration in the second pass
        obj["status"].update(admittedAt=rfc3339(admitted), startedAt=rfc3339(admitted))
        gprs[f"u{i}"] = obj
        view = pod_view(pod(f"h{i}-0", 2, gpr=f"h{i}", uid=f"p{i}", node_name=f"n{i}", phase="Running"), (GPU,))
        assert view is not None
        pods[view.uid] = view
    queued = gpr("q", phase=None, devices=2, nodes=2, priority=250, enableEviction=True, exitDuration="1h")
    queued["metadata"].update(uid="uq", resourceVersion="9", creationTimestamp="2026-11-30T00:01:00Z")
    gprs["uq"] = queued
    warm, predictor = PassCache(), DurationPredictor()
    team = WorkspaceIndex({"default": "team"}, {f"team|{GPU}": 6000})

    def step(index: WorkspaceIndex | None = None) -> Plan:
        core = SchedulerConfig(instant_eviction=False, learn=False, quotas=dict(index.quotas) if index else None)
        snap = Snapshot(now, nodes, pods, gprs)
        plan = plan_pass(snap, PassConfig(core=core, predictor=predictor, workspaces=index), warm)
        cold = plan_pass(copy.deepcopy(snap), PassConfig(core=core, predictor=predictor, workspaces=index),
                         PassCache())
        assert summary(plan) == summary(cold)
        return plan

    step()
    assert warm.holders is None  # the first pass on a base keeps no holders (churn pays no copies)
    now += 10
    step()
    kept = warm.holders
    assert kept is not None and len(kept.templates) == 4
    pods["p1"] = dataclasses.replace(pods["p1"], phase="Pending")  # h1's pod stops running: idle since it started
    now += 20
    plan = step()
    assert warm.holders is kept  # nothing allocated changed: restored, not adopted again
    assert ("completed", "default/h1", "IdleTimeout") in [(e.kind, e.gpr, e.detail) for _, e in plan.events]
    now += 60  # past h3's exitDuration
    plan = step()
    assert warm.holders is kept
    assert ("expired", "default/h3") in [(e.kind, e.gpr) for _, e in plan.events]
    step(team)  # the namespace joins a workspace: its holders count against the workspace's quota
    assert warm.holders is not kept


def test_a_refresh_projects_only_the_gprs_whose_first_projection_is_not_kept_yet() -> None:
    """The first projection of each queued GPR calibrates the estimates (predictor_store keeps it until the GPR
    is admitted); a refresh hands the driver the projections of the GPRs it has not noted yet, and the same
    numbers for them as when it notes none."""
    nodes = {"n0": node_view(node("n0", gpus=2), (GPU,))}
    held = gpr("run", phase="Running", reservation={"n0": 2}, devices=2, exitDuration="1h")
    held["metadata"].update(uid="ur", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")
    now = time.time()
    held["status"].update(admittedAt=rfc3339(now - 60), startedAt=rfc3339(now - 60))
    gprs: dict[str, dict[str, Any]] = {"ur": held}
    for i in range(6):
        obj = gpr(f"q{i}", phase=None, devices=2, exitDuration="1h", priority=50 + 100 * (i % 3))
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 2), creationTimestamp=f"2026-11-30T00:01:0{i}Z")
        gprs[f"u{i}"] = obj
    predictor, cache, version = DurationPredictor(), PassCache(), 100
    for _ in range(2):  # statuses stored, then queued as prototypes
        plan = plan_pass(Snapshot(now, nodes, {}, gprs), PassConfig(predictor=predictor), cache)
        gprs, version = stored(gprs, plan, version)
    every = plan_pass(Snapshot(now, nodes, {}, gprs), PassConfig(predictor=predictor), cache).projections
    assert set(every) == {f"u{i}" for i in range(6)}
    assert all(math.isfinite(start) and hold > 0 for start, hold, _ in every.values())
    assert [every[f"u{i}"][2] for i in range(6)] == [50, 150, 250, 50, 150, 250]
    some = plan_pass(Snapshot(now, nodes, {}, gprs), PassConfig(predictor=predictor, noted={"u1", "u4", "gone"}),
                     cache).projections
    assert some == {u: v for u, v in every.items() if u not in ("u1", "u4")}
    quiet = plan_pass(Snapshot(now, nodes, {}, gprs), PassConfig(predictor=predictor, refresh_queue=False,
                                                                 refresh_on_change=False), cache)
    assert quiet.projections == {}  # no refresh, no estimates: nothing projected


def test_a_refresh_rewrites_the_positions_of_queued_prototypes_that_moved_and_no_others() -> None:
    """A refresh reads the queued prototypes without copying them (estimates and projections included) and still
    writes each one whose place moved: after the head of the queue is deleted, every other GPR moved up one
    place (any move counts in the first ten); a refresh with nothing moved writes nothing."""
    nodes = {"n0": node_view(node("n0", gpus=2), (GPU,))}
    held = gpr("run", phase="Running", reservation={"n0": 2}, devices=2, exitDuration="8h")
    held["metadata"].update(uid="ur", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")
    held["status"].update(admittedAt=rfc3339(time.time() - 60), startedAt=rfc3339(time.time() - 60))
    gprs: dict[str, dict[str, Any]] = {"ur": held}
    for i in range(20):  # behind the holder; the pass looks at the first few only, the rest stay prototypes
        obj = gpr(f"q{i:02d}", phase=None, devices=2, exitDuration="1h")
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 2), creationTimestamp=f"2026-11-30T00:01:{i:02d}Z")
        gprs[f"u{i}"] = obj
    now, version, warm, predictor = time.time(), 100, PassCache(), DurationPredictor()

    def step() -> Plan:
        nonlocal version, gprs
        snap = Snapshot(now, nodes, {}, gprs)
        plan = plan_pass(snap, PassConfig(predictor=predictor, refresh_queue=True), warm)
        assert summary(plan) == summary(plan_pass(copy.deepcopy(snap), PassConfig(predictor=predictor,
                                                                                   refresh_queue=True), PassCache()))
        gprs, version = stored(gprs, plan, version)
        return plan

    def positions(plan: Plan) -> dict[str, Any]:
        return {w.uid: w.status.get("queuePosition") for w in plan.writes if w.uid != "ur"}

    assert positions(step()) == {f"u{i}": i + 1 for i in range(20)}
    step()  # statuses as stored: from now on queued as prototypes
    assert positions(step()) == {}  # a refresh with nothing moved
    gprs = {u: o for u, o in gprs.items() if u != "u0"}
    moved = step()
    # one place counts up to position 19 (a tenth of it, at least one); u19 moved from 20 to 19: too little
    assert positions(moved) == {f"u{i}": i for i in range(1, 19)}
    # news for the user, not a decision; but the pass now looks one GPR further down (the head left), and that
    # one is told for the first time why it waits
    told = [w for w in moved.writes if not w.queue_only]
    assert [w.status["reason"] for w in told] == ["InsufficientCapacity"] and all(
        w.queue_only for w in moved.writes if w not in told)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 100_000))
def test_a_derived_inventory_is_the_one_built_afresh(seed: int) -> None:
    """Base.derive, when it derives, ends exactly where Base.build does (the same free devices, allocations and
    placements), over random changes of the entries on a few small nodes, a derived base deriving again:
    entries gone, added, moved to other nodes, a name reused by a new UID, a name listed twice, reservations
    that no longer fit; and it derives whenever only the newest entries change, on nodes of their own."""
    rng = random.Random(seed)
    specs = tuple(NodeSpec(f"n{i}", rng.choice([1, 2, 4])) for i in range(rng.randint(1, 5)))

    def reservation() -> tuple[tuple[str, int], ...]:
        nodes = sorted(rng.sample([s.name for s in specs], rng.randint(1, min(2, len(specs)))))
        return tuple((n, rng.randint(1, 3)) for n in nodes)

    entries = [(f"u{k}", f"default/g{k}", reservation()) for k in range(rng.randint(0, 8))]
    last = Base.build((specs, tuple(entries)))
    for step in range(3):
        freed: list[str] = []
        for k in range(rng.randint(1, 4)):
            what = rng.choice(["gone", "added", "moved", "status"])
            if what == "gone" and entries:
                freed.append(entries.pop(rng.randrange(len(entries)))[1])
            elif what == "moved" and entries:
                i = rng.randrange(len(entries))
                entries[i] = (entries[i][0], entries[i][1], reservation())
            elif what == "status" and entries:  # a status write: an equal entry, a new tuple
                i = rng.randrange(len(entries))
                entries[i] = (entries[i][0], entries[i][1], tuple(entries[i][2]))
            else:
                owner = rng.choice([*freed, f"default/h{step}-{k}", f"default/h{step}-{k}", f"default/g{k}"])
                entries.insert(rng.randint(0, len(entries)), (f"v{step}-{k}", owner, reservation()))
        key = (specs, tuple(entries))
        derived, afresh = last.derive(key), Base.build(key)
        if derived is not None:
            assert np.array_equal(derived.inv.free, afresh.inv.free)
            assert derived.inv.allocations == afresh.inv.allocations and derived.adopted == afresh.adopted
            assert derived.touched is not None and derived.key == key
            assert derived.on_node() == afresh.on_node()
        last = derived or afresh
    # the newest entries added on nodes nobody else names: derived whenever names are listed once
    if last.unique:
        spare = [NodeSpec(f"spare{i}", 2) for i in range(3)]
        wide = Base.build(((*specs, *spare), tuple(entries)))
        grown = (*entries, *((f"w{i}", f"default/new{i}", ((s.name, 2),)) for i, s in enumerate(spare)))
        assert wide.derive(((*specs, *spare), grown)) is not None


def test_a_burst_of_admissions_is_derived_up_to_a_share_of_the_entries() -> None:
    """A pass that takes in many admissions at once (a burst of one-GPR-per-pod admissions) still derives the
    inventory while the changed entries are at most a quarter of them (or 64), each node's new entries in
    creation order; beyond that it builds afresh."""
    from scheduler_extender.controller.pass_cache import DERIVE_LIMIT, DERIVE_SHARE

    specs = tuple(NodeSpec(f"n{i:03d}", 8) for i in range(1_000))
    old = tuple((f"u{i}", f"default/g{i}", ((f"n{i:03d}", 8),)) for i in range(800))
    last = Base.build((specs, old))
    share = int(DERIVE_SHARE * (len(old) + 150))
    assert share > DERIVE_LIMIT
    burst = old + tuple((f"v{i}", f"default/h{i}", ((f"n{800 + i % 100:03d}", 1),)) for i in range(150))
    derived = last.derive((specs, burst))
    assert derived is not None and derived.adopted == Base.build((specs, burst)).adopted
    assert [e[0] for e in derived.on_node()["n800"]] == ["v0", "v100"]
    flood = old + tuple((f"v{i}", f"default/h{i}", ((f"n{800 + i % 200:03d}", 1),)) for i in range(400))
    assert last.derive((specs, flood)) is None


def test_a_pass_leaves_no_reference_cycles() -> None:
    """What a pass builds (a scheduler, its holder and queue copies) dies by reference counting when the pass
    is dropped: the controller runs passes with the cyclic collector paused, and a pass that left cycles left
    its whole scheduler for the young collection after it (14,000-29,000 objects, ~20 ms, at 5,000 nodes:
    the queue held a bound method of its scheduler). Warm and cold passes, with and without a queue refresh."""
    import gc

    cache = PassCache()
    for seed in range(12):
        nodes, pods, gprs = world(seed)
        for refresh, kept in ((True, cache), (False, cache), (False, PassCache())):
            gc.collect()
            gc.disable()
            try:
                plan = plan_pass(Snapshot(time.time(), nodes, pods, gprs),
                                 PassConfig(refresh_queue=refresh, refresh_on_change=False), kept)
                del plan
                assert gc.collect() == 0, (seed, refresh)
            finally:
                gc.enable()


def test_narrowing_is_idempotent_and_in_forms_the_api_server_accepts() -> None:
    """A webhook may be called again on its own output (reinvocationPolicy: IfNeeded), a new leader may look at a
    pod the last one narrowed: narrowing what is narrowed changes nothing. Every form passes the API server's
    pod validation (a node field selector takes one value)."""
    from scheduler_extender.objects.narrowing import narrow_affinity
    from tests.apiserver_peer.pods import affinity_errors
    from tests.apiserver_peer.wire import json_patch

    hostnames = {f"n{i}": f"h{i}" for i in range(1, 41)}
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}
    shapes: list[dict[str, Any] | None] = [None, {}, {"nodeAffinity": {}}, own]
    for affinity in shapes:
        for nodes in (["n1"], ["n2", "n1"], [f"n{i}" for i in range(1, 41)]):
            obj = {"spec": {} if affinity is None else {"affinity": copy.deepcopy(affinity)}}
            ops = narrow_affinity(obj["spec"].get("affinity"), nodes, hostnames)
            assert ops, (affinity, nodes)
            once = json_patch(obj, ops)
            assert not affinity_errors(once["spec"]), (affinity, nodes, once)
            assert narrow_affinity(once["spec"]["affinity"], nodes, hostnames) == [], (affinity, nodes)
            # narrowed to other nodes (a new reservation): narrowed again, never widened
            again = narrow_affinity(once["spec"]["affinity"], ["n3"], {"n3": "h3"})
            assert again, (affinity, nodes)


def test_a_large_reservation_is_named_node_by_node_for_the_prefilter_shortcut() -> None:
    """100 reserved nodes: still one matchFields term a node (kube-scheduler's NodeAffinity PreFilter takes the
    union of the terms' names and filters only those nodes; a hostname label expression has no such shortcut)."""
    from scheduler_extender.objects.narrowing import narrow_affinity

    many = [f"n{i:03d}" for i in range(100)]
    hostnames = {n: f"host-{n}" for n in many}
    (op,) = narrow_affinity(None, many, hostnames)
    terms = op["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]} for n in many]


def _overlap(later_pod_running: bool, room: bool = True) -> Plan:
    """Two GPRs whose stored statuses both reserve all of n0 (a status write that landed after its writer gave
    up, while the next pass gave the node to another GPR); with ``room``, a free node n1."""
    nodes = {"n0": node_view(node("n0", gpus=4), (GPU,))}
    if room:
        nodes["n1"] = node_view(node("n1", gpus=4), (GPU,))
    gprs = {}
    for i, name in enumerate(("first", "second")):
        obj = gpr(name, phase="Admitted", devices=4, reservation={"n0": 4}, exitDuration="1h")
        obj["metadata"].update(uid=f"u-{name}", resourceVersion=str(i + 1),
                               creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        obj["status"]["admittedAt"] = rfc3339(time.time() - 30)
        gprs[f"u-{name}"] = obj
    pods = {}
    if later_pod_running:
        view = pod_view(pod("second-0", 4, gpr="second", uid="p-second", node_name="n0", phase="Running"), (GPU,))
        assert view is not None
        pods[view.uid] = view
    return plan_pass(Snapshot(time.time(), nodes, pods, gprs), PassConfig(), PassCache())


def test_a_reservation_that_no_longer_fits_fails_only_a_gpr_that_ran_there() -> None:
    plan = _overlap(later_pod_running=False)
    written = {w.key: w.status for w in plan.writes}
    # the later one never ran: requeued as it is, no failure, and placed again where there is room (n1)
    assert written["default/second"]["phase"] == "Admitted"
    assert written["default/second"]["reservation"] == [{"node": "n1", "devices": 4}]
    assert not written["default/second"].get("failures")
    assert "default/first" not in written or written["default/first"]["reservation"] == [{"node": "n0", "devices": 4}]
    # no room elsewhere: it waits in the queue, holding nothing
    written = {w.key: w.status for w in _overlap(later_pod_running=False, room=False).writes}
    assert written["default/second"]["phase"] == "Queued" and written["default/second"]["reservation"] == []
    assert not written["default/second"].get("failures") and "NodeLost" in written["default/second"]["reason"]
    # its pod ran on the devices it had: that is a failure (the default: no requeue)
    plan = _overlap(later_pod_running=True)
    written = {w.key: w.status for w in plan.writes}
    assert written["default/second"]["phase"] == "Failed" and written["default/second"]["failures"] == 1
    assert written["default/second"]["reason"] == "NodeLost"


def test_nodes_kube_scheduler_would_not_use_get_no_new_reservation_and_keep_their_old_ones() -> None:
    """A cordoned node, a node whose Ready condition is not True and a node the node lifecycle controller tainted
    unreachable take no new GPR (its pods could never be scheduled there); a GPR they already hold keeps them and
    nothing fails (a kubelet restart is no failure)."""
    cordoned = node("n0", gpus=4)
    cordoned["spec"]["unschedulable"] = True
    not_ready = node("n1", gpus=4)
    not_ready["status"]["conditions"] = [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                                          "lastHeartbeatTime": "2026-12-02T00:00:00Z"}]
    unreachable = node("n2", gpus=4, taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}])
    nodes = {n["metadata"]["name"]: node_view(n, (GPU,)) for n in (cordoned, not_ready, unreachable,
                                                                 node("n3", gpus=4))}
    assert [v.closed for v in nodes.values()] == ["cordoned (spec.unschedulable)", "not Ready (NodeStatusUnknown)",
                                                  "tainted node.kubernetes.io/unreachable", ""]
    gprs = {}
    for i, (name, phase, reservation) in enumerate((("held", "Running", {"n1": 4}), ("a", None, None),
                                                    ("b", None, None))):
        obj = gpr(name, phase=phase, devices=4, reservation=reservation, exitDuration="1h")
        obj["metadata"].update(uid=f"u-{name}", resourceVersion=str(i + 1),
                               creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        if phase:
            obj["status"]["admittedAt"] = rfc3339(time.time() - 30)
        gprs[f"u-{name}"] = obj
    running = pod_view(pod("held-0", 4, gpr="held", uid="p-held", node_name="n1", phase="Running"), (GPU,))
    assert running is not None
    plan = plan_pass(Snapshot(time.time(), nodes, {running.uid: running}, gprs), PassConfig(), PassCache())
    written = {w.key: w.status for w in plan.writes}
    assert written["default/a"]["phase"] == "Admitted"
    assert written["default/a"]["reservation"] == [{"node": "n3", "devices": 4}]
    assert written["default/b"]["phase"] == "Queued"  # three free nodes, none it may have
    assert "default/held" not in written or written["default/held"]["phase"] == "Running"


def test_a_heartbeat_is_no_change_a_readiness_change_is() -> None:
    before = node_view(node("n0"), (GPU,))
    beat = node("n0")
    beat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-12-02T06:00:10Z"
    assert before.same_capacity(node_view(beat, (GPU,)))
    down = node("n0")
    down["status"]["conditions"][0]["status"] = "False"
    assert not before.same_capacity(node_view(down, (GPU,)))
    # what pods must tolerate, and select nodes by: a pass places queued GPRs by them
    assert not before.same_capacity(node_view(node("n0", taints=[{"key": "k", "effect": "NoSchedule"}]), (GPU,)))
    relabelled = node_view(node("n0", labels={"pool": "batch"}), (GPU,))
    assert before.same_capacity(relabelled)  # a label no pod selects by (GFD's timestamp, say): nothing
    assert not before.same_capacity(relabelled, {"pool"})
    assert not before.same_capacity(node_view(node("n0", labels={"nvidia.com/gpu.product": "H100"}), (GPU,)))


def test_a_warm_pass_that_reads_only_what_was_replaced_still_sees_every_change() -> None:
    """A warm pass decodes only the GPR objects that were replaced since the last (the others are found by
    identity, all at once) and recounts only the pods of GPRs whose pods changed: a pod that ends, an object
    deleted and created again (its place in the informer's order moves), an object replaced by a new version of
    the same content, a new pod of a holder, each still planned as a fresh start plans it."""
    now = time.time()
    nodes = {f"n{i}": node_view(node(f"n{i}", gpus=2), (GPU,)) for i in range(4)}
    gprs: dict[str, dict[str, Any]] = {}
    pods: dict[str, Any] = {}
    for i in range(3):
        obj = gpr(f"h{i}", phase="Running", reservation={f"n{i}": 2}, devices=2, exitDuration="1h")
        obj["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 1), creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        obj["status"].update(admittedAt=rfc3339(now - 600), startedAt=rfc3339(now - 600))
        gprs[f"u{i}"] = obj
        view = pod_view(pod(f"h{i}-0", 2, gpr=f"h{i}", uid=f"p{i}", node_name=f"n{i}", phase="Running"), (GPU,))
        assert view is not None
        pods[view.uid] = view
    for i in range(2):
        obj = gpr(f"q{i}", phase=None, devices=2, exitDuration="1h")
        obj["metadata"].update(uid=f"uq{i}", resourceVersion=str(10 + i), creationTimestamp=f"2026-11-30T00:01:0{i}Z")
        gprs[f"uq{i}"] = obj
    p = Passes(now, nodes, gprs, pods)
    for _ in range(3):
        p.step()
    assert p.step().writes == []  # settled
    decoded = {d.uid: d for d in p.warm.sorted}
    p.pods["p0"] = dataclasses.replace(p.pods["p0"], phase="Succeeded", ended_at=now - 1)  # h0's pod ends
    p.now += 1
    plan = p.step()
    assert [(w.key, w.status["phase"]) for w in plan.writes if w.key == "default/h0"] == [("default/h0", "Complete")]
    assert all(d is decoded[d.uid] for d in p.warm.seen if d.uid != "u0")  # the others were not decoded again
    obj = p.gprs.pop("uq0")  # deleted and created again: the same UID at the end of the informer's order
    p.gprs["uq0"] = obj
    p.gprs["u1"] = {**p.gprs["u1"], "metadata": {**p.gprs["u1"]["metadata"], "resourceVersion": "900"}}
    p.now += 1
    plan = p.step()
    assert not [w for w in plan.writes if w.key in ("default/h1", "default/q0")]  # nothing new for either
    assert [d.uid for d in p.warm.seen] == list(p.gprs)
    # h2 gets a second pod, pending (its Job scaled up): the tally of h2's pods is taken again
    view = pod_view(pod("h2-1", 2, gpr="h2", uid="p2b", phase="Pending"), (GPU,))
    assert view is not None
    p.pods = {**p.pods, view.uid: view}
    p.now += 1
    p.step()
    p.pods["p2"] = dataclasses.replace(p.pods["p2"], phase="Failed", ended_at=p.now - 1)
    p.pods["p2b"] = dataclasses.replace(p.pods["p2b"], phase="Failed", ended_at=p.now - 1)
    p.now += 1
    plan = p.step()
    assert [w.status["phase"] for w in plan.writes if w.key == "default/h2"] in (["Failed"], ["Queued"])


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=10_000))
@example(449)  # a reservation given back to outside pods: its GPR's pod-fit limit, and the order nodes are counted
def test_devices_used_outside_gprs_counted_again_only_where_pods_moved_equal_a_full_count(seed: int) -> None:
    """Between passes, pods come, go, bind, end and change GPR; a warm pass counts the devices used outside
    reservations again only on the nodes those pods were or are on, and gets what a fresh count gets."""
    nodes, pods, gprs = world(seed)
    rng = random.Random(seed)
    now = time.time()
    warm = PassCache()
    for step in range(6):
        pods = dict(pods)
        names = sorted(nodes)
        for _ in range(rng.randint(0, 3)):
            kind = rng.choice(["add", "delete", "end", "bind", "relabel"])
            if kind == "add" or not pods:
                uid = f"x{step}-{rng.randrange(1000)}"
                view = pod_view(pod(uid, rng.choice([1, 2]), uid=uid, node_name=rng.choice([*names, ""]),
                                    gpr=rng.choice(["", "g0", "g1"]), phase="Running"), (GPU,))
                assert view is not None
                pods[uid] = view
                continue
            uid = rng.choice(sorted(pods))
            if kind == "delete":
                del pods[uid]
            elif kind == "end":
                pods[uid] = dataclasses.replace(pods[uid], phase="Succeeded")
            elif kind == "bind":
                pods[uid] = dataclasses.replace(pods[uid], node=rng.choice(names), gates=())
            else:
                pods[uid] = dataclasses.replace(pods[uid], gpr=rng.choice(["", "default/g0", "default/g1"]))
        snap = Snapshot(now + 10 * step, nodes, pods, gprs)
        a = plan_pass(snap, PassConfig(), warm)
        cold = PassCache()
        b = plan_pass(copy.deepcopy(snap), PassConfig(), cold)
        assert warm.outside is not None and cold.outside is not None
        assert warm.outside[3] == cold.outside[3], (step, warm.outside[3], cold.outside[3])
        assert summary(a) == summary(b)
        for w in a.writes:  # the API server stores what the pass wrote
            obj = gprs[w.uid]
            gprs[w.uid] = {**obj, "status": w.status,
                           "metadata": {**obj["metadata"], "resourceVersion": str(1000 + step)}}


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=10_000))
def test_the_pods_by_gpr_made_from_the_last_pass_are_those_made_afresh(seed: int) -> None:
    """Pods come, go, bind, lose their gate, end, move to another GPR or are replaced by an equal view; the tables
    made from the last pass's equal those made from nothing (lists in the snapshot's order), and where no pod
    was deleted (the rest keep their places) a GPR none of whose pods changed keeps its very lists."""
    from scheduler_extender.controller.pod_tables import PodsByGPR

    rng = random.Random(seed)
    groups = ["default/a", "default/b", "default/c", ""]

    def fresh_pod(uid: str) -> Any:
        view = pod_view(pod(uid, rng.choice([1, 2]), uid=uid, gated=rng.random() < 0.5,
                            node_name=rng.choice(["", "", "n0", "n1"]), phase="Pending"), (GPU,))
        assert view is not None
        return dataclasses.replace(view, gpr=rng.choice(groups), host=(rng.choice([0, 500]), 0))

    pods = {f"p{i}": fresh_pod(f"p{i}") for i in range(rng.randint(0, 30))}
    prev = PodsByGPR(list(pods.values()))
    for step in range(8):
        pods = dict(pods)
        changed: set[str] = set()
        deleted = False
        for _ in range(rng.randint(0, 4)):
            kind = rng.choice(["add", "delete", "bind", "ungate", "end", "regroup", "same"])
            if kind == "add" or not pods:
                uid = f"n{step}-{rng.randrange(10_000)}"
                pods[uid] = fresh_pod(uid)
                changed.add(pods[uid].gpr)
                continue
            uid = rng.choice(sorted(pods))
            old = pods[uid]
            changed.add(old.gpr)
            if kind == "delete":
                del pods[uid]
                deleted = True
                continue
            if kind == "bind":
                new = dataclasses.replace(old, node=rng.choice(["n0", "n1"]))
            elif kind == "ungate":
                new = dataclasses.replace(old, gates=())
            elif kind == "end":
                new = dataclasses.replace(old, phase="Succeeded")
            elif kind == "regroup":
                new = dataclasses.replace(old, gpr=rng.choice(groups))
            else:
                new = dataclasses.replace(old)
            pods[uid] = new
            changed.add(new.gpr)
        seen = list(pods.values())
        made, afresh = PodsByGPR.after(prev, seen), PodsByGPR(seen)
        for table in ("of", "placed", "gated", "hosted"):
            assert getattr(made, table) == getattr(afresh, table), (step, table)
        assert [p.uid for p in made.loose] == [p.uid for p in afresh.loose]
        for key, lst in prev.of.items():
            if key not in changed and not deleted:
                assert made.of[key] is lst
        prev = made


def test_the_pod_lists_of_two_passes_are_read_as_the_informer_changes_its_table() -> None:
    from scheduler_extender.controller.pod_tables import _list_changes

    def view(uid: str) -> Any:
        v = pod_view(pod(uid, 1, uid=uid), (GPU,))
        assert v is not None
        return v

    old = [view(f"p{i}") for i in range(10)]
    assert _list_changes(old, list(old), 4) == ([], [], [])
    new = list(old)
    new[3] = dataclasses.replace(old[3])  # replaced in its place
    del new[6], new[0]  # deleted
    new.append(view("q"))  # appended
    pairs, deleted, added = _list_changes(old, new, 4)  # type: ignore[misc]
    assert [(a.uid, b is new[2]) for a, b in pairs] == [("p3", True)]
    assert [p.uid for p in deleted] == ["p0", "p6"] and [p.uid for p in added] == ["q"]
    assert _list_changes(old, old[:7], 4) is not None  # the last three deleted
    assert _list_changes(old, old[:5], 4) is None  # more changes than the limit
    assert _list_changes(old, [old[1], old[0], *old[2:]], 4) is None  # reordered: not the informer's doing
    assert _list_changes(old, [*old[1:], view("p0")], 4) is None  # a UID deleted and appended again


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=10_000))
def test_where_queued_gprs_may_go_is_judged_again_only_for_those_whose_pods_changed(seed: int) -> None:
    """The GPR objects stay as they are while their gated pods come, go, change their node selector or move to
    another GPR between passes: a warm pass judges again only the GPRs whose pods changed, and keeps every queued
    GPR to the nodes a fresh start keeps it to."""
    nodes, _, gprs = world(seed)
    rng = random.Random(seed)
    names = sorted(gprs)
    keys = [f"default/{gprs[u]['metadata']['name']}" for u in names]
    now = time.time()

    def gated_pod(uid: str) -> Any:
        p = pod(uid, 1, uid=uid, gated=True)
        if rng.random() < 0.6:
            p["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": rng.choice(["A", "B"])}
        view = pod_view(p, (GPU,))
        assert view is not None
        return dataclasses.replace(view, gpr=rng.choice(keys) if keys else "")

    pods = {f"q{i}": gated_pod(f"q{i}") for i in range(rng.randint(0, 12))}
    warm = PassCache()
    for step in range(6):
        pods = dict(pods)
        for _ in range(rng.randint(0, 3)):
            kind = rng.choice(["add", "delete", "reselect", "regroup"])
            if kind == "add" or not pods:
                uid = f"n{step}-{rng.randrange(10_000)}"
                pods[uid] = gated_pod(uid)
                continue
            uid = rng.choice(sorted(pods))
            if kind == "delete":
                del pods[uid]
            elif kind == "reselect":
                pods[uid] = dataclasses.replace(pods[uid], node_selector={"nvidia.com/gpu.product": rng.choice(
                    ["A", "B"])})
            elif keys:
                pods[uid] = dataclasses.replace(pods[uid], gpr=rng.choice(keys))
        snap = Snapshot(now, nodes, pods, gprs)  # the same time: the GPR objects and the clock stay as they are
        a = plan_pass(snap, PassConfig(refresh_queue=False), warm)
        cold = PassCache()
        b = plan_pass(copy.deepcopy(snap), PassConfig(refresh_queue=False), cold)
        assert (warm.limits[3] if warm.limits else {}) == (cold.limits[3] if cold.limits else {}), step
        assert summary(a) == summary(b)


def test_an_admitted_gpr_whose_node_a_pod_outside_any_gpr_took_is_requeued() -> None:
    """Issue 35.2: an Admitted GPR with no pod bound, whose reserved node is then filled by a pod bound outside
    any GPR, gives the reservation back (reason ReservationTaken, a requeued event) and is placed on the free
    node; warm and cold passes agree. One with a pod of it bound would keep it (its work started)."""
    nodes = {n: node_view(node(n, gpus=2), (GPU,)) for n in ("n0", "n1")}
    now = time.time()
    obj = gpr("g", phase=None, devices=2)
    obj["metadata"].update(uid="ug", resourceVersion="7", creationTimestamp="2026-11-30T00:00:00Z")
    run = Passes(now, {"n0": nodes["n0"]}, {"ug": obj})
    first = run.step()
    assert [(w.status["phase"], [r["node"] for r in w.status["reservation"]]) for w in first.writes] == [
        ("Admitted", ["n0"])]
    squatter = pod_view(pod("squat", 2, uid="squat", node_name="n0", phase="Running"), (GPU,))
    assert squatter is not None
    run.pods, run.nodes, run.now = {squatter.uid: squatter}, nodes, now + 5
    second = run.step()
    requeued = [e for _, e in second.events if e.kind == "requeued"]
    assert requeued and "ReservationTaken" in requeued[0].detail and "n0" in requeued[0].detail
    assert [(w.status["phase"], [r["node"] for r in w.status.get("reservation") or []]) for w in second.writes] == [
        ("Admitted", ["n1"])]


def test_reservations_given_back_to_outside_pods_do_not_depend_on_the_order_nodes_are_counted() -> None:
    """Issue 35.2: outside pods take one device of each of two full nodes. The GPRs given back are the latest
    admitted first over both nodes at once, whichever node's pods come first (before: node by node in the order
    the pods were listed, so one order gave back x and g, the other g alone, and a warm pass, counting only the
    nodes whose pods moved, could plan otherwise than a cold one)."""
    views = {n: node_view(node(n, gpus=3), (GPU,)) for n in ("n0", "n1")}
    now = time.time()

    def made(name: str, devices: int, nodes: int = 1) -> dict[str, Any]:
        obj = gpr(name, phase=None, devices=devices, nodes=nodes)
        obj["metadata"].update(uid=f"u{name}", resourceVersion="7", creationTimestamp="2026-11-30T00:00:00Z")
        return obj

    outcomes = []
    for order in (("n0", "n1"), ("n1", "n0")):
        run = Passes(now, {"n1": views["n1"]}, {"uk": made("k", 2)})
        run.step()
        run.nodes, run.now, run.gprs = views, now + 1, {**run.gprs, "ug": made("g", 1, nodes=2)}
        run.step()
        run.now, run.gprs = now + 2, {**run.gprs, "ux": made("x", 2)}
        run.step()
        where = {obj["metadata"]["name"]: sorted(r["node"] for r in obj["status"]["reservation"])
                 for obj in run.gprs.values()}
        assert where == {"k": ["n1"], "g": ["n0", "n1"], "x": ["n0"]}  # both nodes full
        squat = [pod_view(pod(f"s{n}", 1, uid=f"s{n}", node_name=n, phase="Running"), (GPU,)) for n in order]
        run.pods, run.now = {p.uid: p for p in squat if p is not None}, now + 3
        plan = run.step()
        outcomes.append(([e.gpr for _, e in plan.events if e.kind == "requeued"],
                         {obj["metadata"]["name"]: obj["status"]["phase"] for obj in run.gprs.values()}))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == ["default/x", "default/g"]  # the latest admitted first, until both nodes are covered
    assert outcomes[0][1]["k"] == "Admitted"


def _team_of_two() -> tuple[WorkspaceIndex, SchedulerConfig, dict[str, dict[str, Any]]]:
    """Workspace "team" (namespace default) with a quota of 2 GPUs, and two queued 2-GPU GPRs a and b in it."""
    team = WorkspaceIndex({"default": "team"}, {f"team|{GPU}": 2000})
    core = SchedulerConfig(instant_eviction=False, learn=False, quotas=dict(team.quotas))
    gprs = {}
    for i, name in enumerate("ab"):
        obj = gpr(name, phase=None, devices=2)
        obj["metadata"].update(uid=f"u{name}", resourceVersion="7", creationTimestamp=f"2026-11-30T00:00:0{i}Z")
        gprs[f"u{name}"] = obj
    return team, core, gprs


def _passes(views: dict[str, Any], gprs: dict[str, dict[str, Any]], now: float, steps: int, gap: float,
            config: Callable[[int], PassConfig]) -> Iterator[dict[str, dict[str, Any]]]:
    """``steps`` passes ``gap`` seconds apart, each warm (one PassCache) and checked against a cold one, their
    writes stored: the GPRs after each."""
    warm, version = PassCache(), 100
    for step in range(steps):
        cfg = config(step)
        snap = Snapshot(now + gap * step, views, {}, gprs)
        plan = plan_pass(snap, cfg, warm)
        assert summary(plan) == summary(plan_pass(copy.deepcopy(snap), cfg, PassCache()))
        gprs, version = stored(gprs, plan, version)
        yield gprs


def test_a_workspace_quota_held_gpr_says_the_quota_in_its_message_and_keeps_saying_it() -> None:
    """Issue 35.4: a Queued GPR held by its workspace's quota carries reason WorkspaceQuota and, in status.message,
    the workspace, its devices in use of the limit and what the GPR needs (before: in the Event alone); a later
    write of its status (a refresh moving its estimate, a warm or a cold pass) keeps saying it."""
    views = {"n0": node_view(node("n0", gpus=8), (GPU,))}
    team, core, gprs = _team_of_two()
    for after in _passes(views, gprs, time.time(), 3, 60,
                         lambda step: PassConfig(core=core, workspaces=team, refresh_queue=step == 2)):
        status = after["ub"]["status"]
        assert status["phase"] == "Queued" and status["reason"] == "WorkspaceQuota", status
        assert "; WorkspaceQuota: workspace team" in status["message"], status["message"]
        assert "2 of 2 devices in use; it needs 2" in status["message"], status["message"]


def test_a_gpr_waiting_for_devices_says_what_it_needs_and_who_holds_them_and_keeps_saying_it() -> None:
    """Issue 35.4: a Queued GPR the pass could not place carries reason InsufficientCapacity and, in
    status.message, what it needs, how many nodes it could use have that much free and who holds the devices
    (before: reason '' and only its position); later writes (a refresh, warm or cold) keep saying it, and a GPR
    of a lower level that would fit but is kept off for the blocked head says BehindHigherPriority."""
    views = {"n0": node_view(node("n0", gpus=8), (GPU,))}
    now = time.time()
    held = gpr("big", namespace="team-b", phase="Running", reservation={"n0": 4}, devices=4, exitDuration="8h")
    held["metadata"].update(uid="ubig", resourceVersion="3", creationTimestamp="2026-11-30T00:00:00Z")
    held["status"].update(admittedAt=rfc3339(now - 60), startedAt=rfc3339(now - 60))
    gprs = {"ubig": held}
    for i, (name, devices, priority) in enumerate((("want", 6, 150), ("small", 3, 50))):
        obj = gpr(name, phase=None, devices=devices, priority=priority, exitDuration="9h")
        obj["metadata"].update(uid=f"u{name}", resourceVersion="7", creationTimestamp=f"2026-11-30T00:00:0{i + 1}Z")
        gprs[f"u{name}"] = obj
    for after in _passes(views, gprs, now, 3, 60, lambda step: PassConfig(refresh_queue=step == 2)):
        status = after["uwant"]["status"]
        assert status["phase"] == "Queued" and status["reason"] == "InsufficientCapacity", status
        assert status["message"].endswith("; InsufficientCapacity: needs 1 node(s) x 6 nvidia.com/gpu; 0 of 1 "
                                          "fitting nodes have 6 free; held by team-b/big (n0)"), status["message"]
        small = after["usmall"]["status"]
        assert small["reason"] == "BehindHigherPriority", small
        assert "behind default/want at priority level medium (101-200)" in small["message"], small["message"]


def test_no_estimate_says_now_for_a_gpr_the_controller_will_not_admit_now() -> None:
    """Issue 35.4 point 2: a GPR its workspace quota holds is estimated to start when its workspace's holder is
    predicted to leave it room (here a's hour, the predictor's prior), not about now (the estimate once said
    now while the quota kept it out, then none was written at all: the estimates issue 35.8 measures were
    never shown); one in backoff is never estimated before its nextRetryTime."""
    views = {"n0": node_view(node("n0", gpus=8), (GPU,))}
    team, core, gprs = _team_of_two()
    now = time.time()
    retry = rfc3339(now + 3600)
    late = gpr("c", namespace="other", phase="Queued", devices=1, requeueOnFailure=True)
    late["metadata"].update(uid="uc", resourceVersion="8", creationTimestamp="2026-11-30T00:00:05Z")
    late["status"].update(reason="Backoff", failures=1, nextRetryTime=retry)
    gprs["uc"] = late
    for after in _passes(views, gprs, now, 2, 1,
                         lambda _step: PassConfig(core=core, workspaces=team, refresh_queue=True)):
        held = after["ub"]["status"]
        assert held["reason"] == "WorkspaceQuota", held
        from scheduler_extender.objects.gpr_codec import parse_time
        when = parse_time(held.get("estimatedStart"))
        assert when is not None and now + 3000 < when < now + 4000, held  # a's predicted end, an hour from now
        assert "estimatedStart" in after["ua"]["status"] or after["ua"]["status"]["phase"] == "Admitted"
        waiting = after["uc"]["status"]
        assert waiting["phase"] == "Queued" and waiting.get("nextRetryTime") == retry, waiting
        if "estimatedStart" in waiting:
            start, retry_at = parse_time(waiting["estimatedStart"]), parse_time(retry)
            assert start is not None and retry_at is not None and start >= retry_at, waiting


def test_an_estimate_is_written_for_a_quota_held_gpr_unless_it_says_about_now_and_never_for_a_capped_one() -> None:
    """What the controller writes of an estimate (``honest``): a GPR its workspace's quota holds keeps the
    projection's estimate when it is a minute or more away, none closer (the projection and the quota can
    disagree while an evicted GPR's devices are still held: "now" would be a promise not kept); a GPR a model
    cap holds gets none (the projection does not model the caps); a backoff moves it to the retry time."""
    from scheduler_extender.controller.status_diff import SOON_S, honest
    from scheduler_extender.core.waittime import Interval

    now = 1_000.0
    later = Interval(now + 600, now + 300, now + 1200)
    assert honest(GPR("q", reason="WorkspaceQuota"), later, now) == later
    assert honest(GPR("q", reason="WorkspaceQuota"), Interval(now + SOON_S - 1, now, now + 90), now) is None
    assert honest(GPR("q", reason="ModelQuota"), later, now) is None
    soon = Interval(now + 5, now, now + 30)
    assert honest(GPR("q", reason="InsufficientCapacity"), soon, now) == soon  # not held by a quota: as projected
    backing = GPR("q", reason="Backoff", not_before=now + 900)
    assert honest(backing, later, now) == Interval(now + 900, now + 900, now + 1200)
    assert honest(GPR("q", reason="WorkspaceQuota", phase=Phase.ADMITTED), later, now) == later  # not queued
