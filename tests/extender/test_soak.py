"""Soak: 100,000 pod and GPR events through the controller's informer handlers and passes, with churn (GPRs
created, admitted, run, finished and deleted; names reused; pods created, bound, ended and deleted), keep memory
flat: what the controller remembers is bounded by what exists now, not by what happened (issue #10, point 9)."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from scheduler_extender.controller.gpr_controller import GPRController
from scheduler_extender.controller.gpr_pass import plan_pass
from scheduler_extender.controller.pass_types import PassConfig
from scheduler_extender.objects.cluster import ClusterView
from tests.extender.harness import gpr, node, pod

# longer soaks: ACCELSTACK_SOAK_EVENTS=300000 python -m pytest -q -s tests/extender/test_soak.py
EVENTS = int(os.environ.get("ACCELSTACK_SOAK_EVENTS", "100000"))


class Cluster:
    """A cluster in memory that evolves like a busy one; every change is an informer event."""

    def __init__(self, controller: GPRController, view: ClusterView) -> None:
        self.controller, self.view = controller, view
        self.revision = 0
        self.gprs: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.events = 0
        self.serial = 0

    def _rv(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        self.events += 1
        return obj

    def gpr_event(self, kind: str, obj: dict[str, Any]) -> None:
        self.controller.on_gpr(kind, self._rv(obj))

    def pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        self.view.on_pod(kind, self._rv(obj))

    def step(self) -> None:
        self.serial += 1
        name = f"job-{self.serial % 300}"  # names are reused once the old object is gone
        if name in self.gprs:
            obj = self.gprs.pop(name)
            for p in [p for p in self.pods.values() if p["metadata"]["labels"].get("accelstack.io/gpr") == name]:
                done = {**p, "status": {"phase": "Succeeded"}}
                self.pod_event("MODIFIED", done)
                self.pod_event("DELETED", done)
                del self.pods[p["metadata"]["name"]]
            self.gpr_event("DELETED", obj)
            web = self.pods.pop(f"web-{name}")
            self.pod_event("MODIFIED", {**web, "status": {"phase": "Succeeded"}})
            self.pod_event("DELETED", web)
            return
        obj = gpr(name, phase=None, devices=1)
        obj["metadata"]["uid"] = f"uid-{self.serial}"
        self.gprs[name] = obj
        self.gpr_event("ADDED", obj)
        p = pod(f"{name}-0", 1, gpr=name, uid=f"pod-{self.serial}", gated=True)
        p["spec"]["containers"][0]["resources"]["requests"].update(cpu="100m", memory="256Mi")
        self.pods[p["metadata"]["name"]] = p
        # beside it, a pod that asks for no device (its CPU and memory count on its node all the same)
        web = pod(f"web-{name}", 0, uid=f"web-{self.serial}", node_name=f"n{self.serial % 20}", phase="Running")
        web["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "200m", "memory": "128Mi"}}
        self.pods[web["metadata"]["name"]] = web
        self.pod_event("ADDED", web)
        self.pod_event("ADDED", p)
        running = {**p, "spec": {**p["spec"], "nodeName": f"n{self.serial % 20}", "schedulingGates": []},
                   "status": {"phase": "Running"}}
        self.pods[p["metadata"]["name"]] = running
        self.pod_event("MODIFIED", running)

    def apply(self, writes: list[Any]) -> None:
        """The API server stores the pass's status writes; the informer brings them back."""
        for w in writes:
            obj = next((o for o in self.gprs.values() if o["metadata"]["uid"] == w.uid), None)
            if obj is not None:
                obj["status"] = w.status
                self.gpr_event("MODIFIED", obj)


def test_memory_stays_flat_over_100000_events() -> None:
    view = ClusterView(("nvidia.com/gpu",))
    view.sync_nodes([node(f"n{i}", gpus=8) for i in range(20)])
    controller = GPRController(kube=None, view=view)  # type: ignore[arg-type]  # passes only: no API calls
    cluster = Cluster(controller, view)
    cfg = PassConfig(refresh_queue=False, refresh_on_change=False)

    def run_until(events: int) -> None:
        # names cycle every 600 steps (300 created, then those 300 deleted): every sample is taken at the same
        # point of the cycle (all 300 alive), so what exists is the same at each
        while cluster.events < events or cluster.serial % 600 != 300:
            for _ in range(150):
                cluster.step()
            snap = controller.snapshot()
            cluster.apply(plan_pass(snap, cfg, controller.cache).writes)

    def rss() -> int:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    started = time.perf_counter()
    run_until(20_000)  # warm up: the steady-state working set exists
    gc.collect()
    tracked = len(gc.get_objects())  # before the RSS base: the list it builds must not count as growth
    base = rss()
    samples = []
    for target in range(40_000, EVENTS + 1, 20_000):
        run_until(target)
        gc.collect()
        samples.append(rss() - base)
    elapsed = time.perf_counter() - started
    grown = len(gc.get_objects()) - tracked
    print(f"soak: {cluster.events:,} events in {elapsed:.1f} s; RSS growth after warm-up, every 20,000 events "
          f"(bytes): {samples}; objects the collector tracks: {tracked:,} after warm-up, {grown:+,} at the end")
    assert cluster.events >= EVENTS
    # bounded by what exists (<= 300 GPRs and their pods), not by the 100,000 events that happened
    assert max(samples) < 8_000_000, samples
    assert grown < 1_000, grown  # RSS moves with the allocator; a leak of Python objects shows here
    assert len(controller.objects) <= 300 and len(controller.cache.specs) <= 300
    assert len(controller.cache.decoded) <= 300 and len(view.pods) <= 300
    assert len(view.host_of) <= 600  # every live bound pod, accelstack's or not, and no more
    live = ClusterView(("nvidia.com/gpu",))
    live.sync_pods(list(cluster.pods.values()))
    assert view.host_used == live.host_used  # the sums kept event by event are those a relist makes
