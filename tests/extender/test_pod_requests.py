"""A pod's effective device request is what kube-scheduler and the kubelet's device manager count
(``resource.PodRequests`` in k8s.io/component-helpers, KEP-753 for native sidecars): app containers and native
sidecars (init containers with ``restartPolicy: Always``) add up, a plain init container needs its own devices
beside the sidecars started before it, and the pod needs the largest of those. Counting a sidecar's devices as
an init container's (the maximum) under-counts a pod, and the ledger would then hand the same devices to
another pod."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_extender.extender import wire
from scheduler_extender.extender.verbs import ask_of, filter_nodes
from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import GPU, NR1, ClusterView
from scheduler_extender.objects.resources import host_allocatable, host_requests, pod_requests
from tests.extender.harness import node

MANAGED = (GPU, NR1)


def c(name: str, gpus: int = 0, *, sidecar: bool = False, limits_only: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": "x"}
    if gpus:
        container["resources"] = {"limits": {GPU: str(gpus)}} if limits_only else \
            {"requests": {GPU: str(gpus)}, "limits": {GPU: str(gpus)}}
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


CASES = [
    # (containers, initContainers, effective nvidia.com/gpu)
    ([c("app", 2)], [], 2),
    ([c("a", 1), c("b", 2)], [], 3),
    ([c("app", 1)], [c("init", 4)], 4),  # a plain init container: the larger of the two
    ([c("app", 4)], [c("init", 1)], 4),
    ([c("app", 1)], [c("proxy", 1, sidecar=True)], 2),  # a sidecar runs beside the app: they add up
    ([c("app", 1)], [c("proxy", 1, sidecar=True), c("init", 2)], 3),  # init runs beside the proxy: 1 + 2
    ([c("app", 1)], [c("init", 2), c("proxy", 1, sidecar=True)], 2),  # init ran before the proxy started
    ([c("app", 0)], [c("s1", 1, sidecar=True), c("s2", 2, sidecar=True), c("init", 1)], 4),
    ([c("app", 1)], [c("s1", 1, sidecar=True), c("init", 5), c("s2", 1, sidecar=True)], 6),
    ([c("app", 1, limits_only=True)], [c("proxy", 2, sidecar=True, limits_only=True)], 3),
    ([], [c("proxy", 1, sidecar=True)], 1),
    ([c("app")], [c("init")], 0),
]


@pytest.mark.parametrize(("containers", "inits", "expected"), CASES)
def test_effective_request_as_the_scheduler_counts_it(containers: list[dict[str, Any]],
                                                        inits: list[dict[str, Any]], expected: int) -> None:
    spec = {"containers": containers, "initContainers": inits}
    assert pod_requests(spec, MANAGED).get(GPU, 0) == expected
    # the extender's wire structs (filter, prioritize, bind bodies) count the same
    decoded = msgspec.json.decode(msgspec.json.encode({"spec": spec}), type=wire.Pod)
    assert pod_requests(decoded.spec, MANAGED).get(GPU, 0) == expected


def held_at_peak(containers: list[tuple[int, bool]], inits: list[tuple[int, bool]]) -> int:
    """The most devices the pod holds at once, walking its life: each init container in turn runs beside the
    sidecars already started (a plain one then exits and gives its devices back), then the app containers run
    beside every sidecar."""
    sidecars = peak = 0
    for gpus, is_sidecar in inits:
        if is_sidecar:
            sidecars += gpus
            peak = max(peak, sidecars)
        else:
            peak = max(peak, sidecars + gpus)
    return max(peak, sidecars + sum(gpus for gpus, _ in containers))


shape = st.tuples(st.integers(0, 4), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.just(False)), max_size=3), st.lists(shape, max_size=5))
def test_effective_request_is_the_peak_of_the_pods_life(containers: list[tuple[int, bool]],
                                                         inits: list[tuple[int, bool]]) -> None:
    spec = {"containers": [c(f"a{i}", g) for i, (g, _) in enumerate(containers)],
            "initContainers": [c(f"i{i}", g, sidecar=s) for i, (g, s) in enumerate(inits)]}
    assert pod_requests(spec, MANAGED).get(GPU, 0) == held_at_peak(containers, inits)


def test_filter_keeps_a_pod_with_a_gpu_sidecar_off_a_node_with_one_gpu_free() -> None:
    """7 of 8 GPUs held: a pod whose app and sidecar take one GPU each needs two, so the node cannot take it."""
    view = ClusterView()
    obj = node("n1", gpus=8)
    entries = {"p0": ledger.Entry("p0", "default/p0", {GPU: 7}, "", 1.0)}
    obj["metadata"]["annotations"] = {ledger.LEDGER_ANNOTATION: ledger.render(entries)}
    view.on_node("ADDED", obj)
    view.on_node("ADDED", node("n2", gpus=8))
    body = {"metadata": {"name": "p", "namespace": "default", "uid": "u-p"},
            "spec": {"containers": [c("app", 1)], "initContainers": [c("proxy", 1, sidecar=True)]}}
    pod = msgspec.json.decode(msgspec.json.encode(body), type=wire.Pod)
    ask = ask_of(view, pod)
    assert ask.requests == {GPU: 2}
    out = filter_nodes(view, ask, ["n1", "n2"])
    assert out.passed == ["n2"]
    assert "n1" in out.failed or "n1" in out.unresolvable


def cpu_mem(container: dict[str, Any]) -> dict[str, Any]:
    """The same container asking for its devices' count in CPU cores and in GiB of memory instead."""
    out = dict(container)
    res = container.get("resources")
    if res:
        out["resources"] = {kind: {"cpu": v[GPU], "memory": f"{v[GPU]}Gi"} for kind, v in res.items()}
    return out


@pytest.mark.parametrize(("containers", "inits", "expected"), CASES)
def test_host_cpu_and_memory_add_up_by_the_same_rule(containers: list[dict[str, Any]],
                                                      inits: list[dict[str, Any]], expected: int) -> None:
    """kube-scheduler's NodeResourcesFit counts CPU and memory by the rule it counts devices by."""
    spec = {"containers": [cpu_mem(x) for x in containers], "initContainers": [cpu_mem(x) for x in inits]}
    assert host_requests(spec) == (expected * 1000, expected * 1024)


def test_host_requests_round_up_and_add_overhead_and_take_pod_level_resources() -> None:
    spec: dict[str, Any] = {"containers": [{"name": "a", "resources": {"requests": {"cpu": "0.0001", "memory": "1"}}},
                                           {"name": "b", "resources": {"limits": {"cpu": "250m", "memory": "1.5Mi"}}}]}
    assert host_requests(spec) == (1 + 250, 1 + 2)  # a millicore and a MiB each at least, rounded up
    spec["overhead"] = {"cpu": "100m", "memory": "64Mi"}  # RuntimeClass overhead comes on top
    assert host_requests(spec) == (351, 67)
    spec["resources"] = {"requests": {"cpu": "4"}}  # pod-level resources win where they are set
    assert host_requests(spec) == (4100, 67)


@pytest.mark.parametrize("spec", [
    {}, {"containers": None}, {"containers": "x"}, {"containers": [1, None, "x"]},
    {"containers": [{"resources": {"requests": {"cpu": "lots", "memory": []}}}]},
    {"containers": [{"resources": {"requests": ["cpu"]}}]}, {"containers": [{"resources": "x"}]},
    {"overhead": "x", "resources": 3, "initContainers": {"a": 1}},
])
def test_malformed_host_requests_count_as_none(spec: dict[str, Any]) -> None:
    assert host_requests(spec) == (0, 0)


def test_node_allocatable_cpu_and_memory_round_down() -> None:
    assert host_allocatable({"cpu": "31500m", "memory": "1025Ki", GPU: "8"}) == (31500, 1)
    assert host_allocatable({"cpu": "7.9999"}) == (7999, 1 << 40)  # no memory stated: not a limit
    assert host_allocatable({GPU: "8"}) is None
    assert host_allocatable(None) is None


def bound(name: str, node_name: str, cpu: str, *, gpus: int = 0, phase: str = "Running") -> dict[str, Any]:
    res = {"requests": {"cpu": cpu, "memory": "1Gi", **({GPU: str(gpus)} if gpus else {})}}
    return {"metadata": {"name": name, "namespace": "default", "uid": name},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": res}]},
            "status": {"phase": phase}}


def test_the_view_sums_the_cpu_and_memory_of_every_live_pod_bound_to_each_node() -> None:
    """Pods that ask for no managed resource count too (kube-scheduler counts them); a pod that ended or was
    deleted gives its share back; a relist builds the same sums."""
    view = ClusterView(MANAGED)
    view.on_pod("ADDED", bound("web", "n1", "2"))  # no device: not in view.pods, but on the node
    view.on_pod("ADDED", bound("train", "n1", "500m", gpus=1))
    view.on_pod("ADDED", bound("pending", "", "8"))  # not bound: nowhere yet
    assert "web" not in view.pods and view.host_used == {"n1": (2500, 2048)}
    view.on_pod("MODIFIED", bound("pending", "n2", "8"))
    view.on_pod("MODIFIED", bound("web", "n1", "2", phase="Succeeded"))
    assert view.host_used == {"n1": (500, 1024), "n2": (8000, 1024)}
    view.on_pod("DELETED", bound("pending", "n2", "8"))
    assert view.host_used == {"n1": (500, 1024)}
    fresh = ClusterView(MANAGED)
    fresh.sync_pods([bound("web", "n1", "2", phase="Succeeded"), bound("train", "n1", "500m", gpus=1)])
    assert fresh.host_used == view.host_used and fresh.host_of == view.host_of


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10**15), st.sampled_from(["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "Ti",
                                                                     "e3", ".5", ".0001m"]), st.booleans())
def test_the_plain_quantity_forms_read_as_the_general_parser_reads_them(n: int, suffix: str, as_int: bool) -> None:
    """CPU and memory amounts are read at every pod event: the plain forms skip Decimal, with the same result."""
    import math
    from decimal import Decimal

    from scheduler_extender.objects.resources import MIB, _cpu_milli, _memory_mib, parse_quantity

    value: Any = n if as_int and not suffix else f"{n}{suffix}"
    q = parse_quantity(value)
    assert _cpu_milli(value) == math.ceil(q * 1000)
    assert _memory_mib(value) == math.ceil(q / Decimal(MIB))
