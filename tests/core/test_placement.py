"""Placement policies: exact small cases, the fragmentation measure against a plain reference, and
no over-allocation under random request streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_extender.core.eviction import Candidate, plan_eviction
from scheduler_extender.core.inventory import Inventory, NodeSpec
from scheduler_extender.core.placement import (
    FGD,
    POLICIES,
    BestFit,
    RandomFit,
    Request,
    Shape,
    TypicalShapes,
    feasible_nodes,
    fits,
    make_policy,
)


def _inv(*devs: int, model: str = "A", cpu: int = 64000) -> Inventory:
    return Inventory([NodeSpec(f"n{i}", d, model=model, cpu_milli=cpu, memory_mib=1 << 20) for i, d in enumerate(devs)])


def test_bestfit_prefers_the_fuller_node_and_the_fullest_fitting_device() -> None:
    inv = _inv(4, 4)
    inv.allocate("a", BestFit().place(inv, Request(count=1, milli=700)))  # type: ignore[arg-type]
    p = BestFit().place(inv, Request(count=1, milli=300))
    assert p is not None
    first = inv.allocations["a"].assignments[0]
    assert p.assignments[0].node == first.node and p.assignments[0].devices == first.devices


def test_whole_device_request_needs_wholly_free_devices() -> None:
    inv = _inv(2)
    inv.allocate("a", BestFit().place(inv, Request(count=1, milli=100)))  # type: ignore[arg-type]
    assert BestFit().place(inv, Request(count=2)) is None
    assert BestFit().place(inv, Request(count=1)) is not None


def test_models_and_resource_filter() -> None:
    inv = Inventory([NodeSpec("t4", 2, model="T4"), NodeSpec("a100", 2, model="A100")])
    p = BestFit().place(inv, Request(count=1, models=frozenset({"A100"})))
    assert p is not None and inv.names[p.assignments[0].node] == "a100"
    assert BestFit().place(inv, Request(count=1, resource="neureality.com/nr1")) is None
    assert BestFit().place(inv, Request(count=1, models=frozenset({"H100"}))) is None


@pytest.mark.parametrize("name", POLICIES)
def test_a_request_kept_to_some_nodes_is_placed_on_those_only(name: str) -> None:
    """Request.nodes (where the GPR's pods can run): every policy keeps to it, on whole and fractional devices
    and across nodes; names of nodes not in the inventory are ignored; a set too small does not fit."""
    inv = _inv(8, 8, 8, 8)
    policy = make_policy(name)
    for req in (Request(count=2, nodes=frozenset({"n2"})), Request(count=1, milli=250, nodes=frozenset({"n3"})),
                Request(count=8, node_count=2, nodes=frozenset({"n1", "n3", "gone"}))):
        p = policy.place(inv, req)
        assert p is not None
        assert {inv.names[a.node] for a in p.assignments} <= set(req.nodes or ())
        assert fits(inv, req)
    assert policy.place(inv, Request(count=8, node_count=2, nodes=frozenset({"n0", "gone"}))) is None
    assert policy.place(inv, Request(count=1, nodes=frozenset())) is None
    assert not fits(inv, Request(count=1, nodes=frozenset()))


def test_eviction_frees_room_only_on_the_nodes_a_request_may_use() -> None:
    inv = _inv(4, 4)
    inv.allocate("low0", BestFit().place(inv, Request(count=4, nodes=frozenset({"n0"}))))  # type: ignore[arg-type]
    inv.allocate("low1", BestFit().place(inv, Request(count=4, nodes=frozenset({"n1"}))))  # type: ignore[arg-type]
    cands = [Candidate("low0", 10, True, 0.0, 4000), Candidate("low1", 10, True, 1.0, 4000)]
    # low0 is the cheaper victim, but the request may use n1 only
    assert plan_eviction(inv, Request(count=4, nodes=frozenset({"n1"})), 100, cands) == ["low1"]
    assert plan_eviction(inv, Request(count=4), 100, cands) == ["low0"]


def test_unhealthy_devices_take_no_work() -> None:
    inv = _inv(2)
    inv.set_health("n0", 0, False)
    p = BestFit().place(inv, Request(count=1))
    assert p is not None and p.assignments[0].devices == (1,)
    assert BestFit().place(inv, Request(count=2)) is None


def test_multi_node_request_uses_distinct_nodes() -> None:
    inv = _inv(8, 8, 8)
    p = make_policy("bestfit").place(inv, Request(count=8, node_count=2))
    assert p is not None and len(set(p.nodes())) == 2


def _ref_frag(shapes: TypicalShapes, free: list[int], cpu: int, model: str) -> float:
    total = sum(max(f, 0) for f in free)
    out = 0.0
    for s, w in zip(shapes.shapes, shapes.weight, strict=True):
        fits = (
            s.count > 0
            and (not s.models or model in s.models)
            and cpu >= s.cpu_milli
            and sum(1 for f in free if f >= s.milli) >= s.count
        )
        out += w * (sum(f for f in free if 0 <= f < s.milli) if fits else total)
    return out


def test_frag_matches_reference() -> None:
    shapes = TypicalShapes.from_requests(
        [Shape(4000, 1, 500)] * 5 + [Shape(8000, 1, 1000)] * 3 + [Shape(1000, 0, 0)] * 2
        + [Shape(16000, 2, 1000, frozenset({"B"}))] * 2,
        ["A", "B"],
        coverage=1.0,
    )
    rng = np.random.default_rng(3)
    avail = rng.integers(-1, 1001, size=(40, 4)).astype(np.int32)
    cpu = rng.integers(0, 20000, size=40)
    model = rng.integers(0, 2, size=40).astype(np.int32)
    got = shapes.frag(avail, cpu, model)
    want = [_ref_frag(shapes, list(avail[i]), int(cpu[i]), "AB"[model[i]]) for i in range(40)]
    assert np.allclose(got, want)


def test_fgd_avoids_breaking_a_whole_device() -> None:
    # node 0 has a device with 500 free; node 1 is empty. A 500-milli request should fill the fragment.
    inv = _inv(1, 1)
    inv.allocate("a", BestFit().place(inv, Request(count=1, milli=500)))  # type: ignore[arg-type]
    shapes = TypicalShapes.from_requests([Shape(0, 1, 1000)] * 5 + [Shape(0, 1, 500)] * 5, inv.models)
    p = FGD(shapes).place(inv, Request(count=1, milli=500))
    assert p is not None and p.assignments[0].node == inv.allocations["a"].assignments[0].node


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([100, 250, 500, 1000]), st.integers(1, 2), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(["bestfit", "fgd", "random"]),
)
def test_no_over_allocation_under_any_request_stream(reqs: list[tuple[int, int, int, bool]], name: str) -> None:
    inv = Inventory([NodeSpec(f"n{i}", d, model="AB"[i % 2], cpu_milli=8000) for i, d in enumerate([1, 2, 4, 8])], tie_seed=1)
    shapes = TypicalShapes.from_requests([Shape(1000, 1, 500), Shape(2000, 2, 1000)], inv.models)
    policy = make_policy(name, shapes, seed=2)
    for i, (count, milli, nodes, release) in enumerate(reqs):
        milli = milli if count == 1 else 1000
        req = Request(count=count, milli=milli if count else 0, node_count=nodes, cpu_milli=1000)
        p = policy.place(inv, req)
        if p is not None:
            assert len(p.assignments) == nodes
            inv.allocate(f"r{i}", p)  # raises on any over-allocation
        if release and inv.allocations:
            inv.release(sorted(inv.allocations)[0])
        inv.check()


def test_random_fit_is_seeded() -> None:
    a = [RandomFit(7).place(_inv(1, 1, 1, 1), Request(count=1)) for _ in range(2)]
    assert a[0] == a[1]


def test_fgd_follows_a_changed_model_list() -> None:
    inv = Inventory([NodeSpec("a", 2, model="A")])
    shapes = TypicalShapes.from_requests([Shape(0, 1, 500, frozenset({"B"})), Shape(0, 1, 1000)], inv.models)
    fgd = FGD(shapes)
    assert fgd.place(inv, Request(count=1, milli=500)) is not None
    inv2, lost = inv.rebuild([NodeSpec("b", 2, model="B"), NodeSpec("a", 2, model="A")])
    assert lost == [] and inv2.models == ["A", "B"]
    p = fgd.place(inv2, Request(count=1, milli=500, models=frozenset({"B"})))
    assert p is not None and inv2.names[p.assignments[0].node] == "b"
    assert list(fgd.shapes.models) == ["A", "B"]


def test_fgd_without_history_uses_generic_shapes() -> None:
    inv = _inv(8, 8)
    pol = make_policy("fgd")
    inv.allocate("a", pol.place(inv, Request(count=1, milli=500)))  # type: ignore[arg-type]
    p = pol.place(inv, Request(count=1, milli=500))
    assert p is not None  # the second half goes on the same device, keeping the other node whole
    assert p.assignments[0].node == inv.allocations["a"].assignments[0].node
    assert p.assignments[0].devices == inv.allocations["a"].assignments[0].devices


def test_host_withheld_from_a_copy_shrinks_its_capacity_and_leaves_the_original_alone() -> None:
    """Work outside any placement (pods running on the node) takes CPU and memory out of a pass's copy; over-
    committed work leaves nothing free; the invariants still hold and the nodes' stamps move (cached scores go)."""
    base = Inventory([NodeSpec("a", 8, cpu_milli=32_000, memory_mib=1024), NodeSpec("b", 8, cpu_milli=32_000,
                                                                                    memory_mib=1024)])
    inv = base.copy()
    stamps = inv.stamp.copy()
    inv.withhold_host(np.array([1, 0]), np.array([40_000, 2_000]), np.array([10, -5]))
    assert inv.cpu_free.tolist() == [30_000, 0] and inv.mem_free.tolist() == [1024, 1014]
    assert (inv.stamp > stamps).all()
    inv.check()
    assert base.cpu_free.tolist() == [32_000, 32_000] and base.cpu_cap.tolist() == [32_000, 32_000]
    base.check()
    ok, _ = feasible_nodes(inv, Request(count=1, cpu_milli=1))
    assert ok.tolist() == [True, False]


def test_host_owned_by_an_allocation_goes_and_comes_back_with_it() -> None:
    """A holder's pods' CPU taken with its allocation: released with it (an eviction plan's scratch copy sees it
    free), taken again when that very placement is put back, not when the owner is placed anew elsewhere."""
    from scheduler_extender.core.inventory import NodeAssignment, Placement

    inv = Inventory([NodeSpec("a", 4, cpu_milli=8_000, memory_mib=100), NodeSpec("b", 4, cpu_milli=8_000,
                                                                                 memory_mib=100)])
    held = Placement((NodeAssignment(0, (0, 1), 1000),))
    inv.allocate("low", held)
    inv.own_host({"low": ((0, 6_000, 50),), "nobody": ((1, 1_000, 1),)})  # one that holds nothing: ignored
    assert inv.cpu_free.tolist() == [2_000, 8_000] and inv.mem_free.tolist() == [50, 100]
    inv.check()
    scratch = inv.copy()
    scratch.release("low")
    assert scratch.cpu_free.tolist() == [8_000, 8_000]
    scratch.check()
    assert inv.cpu_free.tolist() == [2_000, 8_000]  # the original is untouched
    scratch.allocate("low", held)  # put back as it was
    assert scratch.cpu_free.tolist() == [2_000, 8_000]
    scratch.check()
    scratch.release("low")
    scratch.allocate("low", Placement((NodeAssignment(1, (0,), 1000),)))  # placed anew elsewhere
    assert scratch.cpu_free.tolist() == [8_000, 8_000]
    scratch.check()
    assert not fits(scratch, Request(count=1, cpu_milli=9_000))
    # a share larger than what is free is clamped
    over = Inventory([NodeSpec("a", 4, cpu_milli=1_000)])
    over.allocate("x", Placement((NodeAssignment(0, (0,), 1000),)))
    over.own_host({"x": ((0, 5_000, 0),)})
    assert over.cpu_free.tolist() == [0]
    over.check()
