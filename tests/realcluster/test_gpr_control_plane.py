"""The GPR control plane on the real API server and scheduler: admission webhooks called by the real API server
(real CEL matchConditions, real failurePolicy), exactly the capacity bound when more pods compete than fit,
evictions through the real Eviction API with a real PodDisruptionBudget, two controller replicas handing the
Lease over on SIGTERM and on kill -9, and an API-server restart under running processes."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import (
    GPRS,
    admitted,
    bound_gpus,
    bound_node,
    events_for,
    gpr,
    gpr_status,
    pod,
    pod_obj,
    wait_bound,
    wait_for,
)
from tests.realcluster.stack import SYSTEM_NS, Stack

LEASE = f"apis/coordination.k8s.io/v1/namespaces/{SYSTEM_NS}/leases/accelstack-gpr-controller"


def pods_path(ns: str) -> str:
    return f"api/v1/namespaces/{ns}/pods"


def set_running(cp: ControlPlane, ns: str, name: str) -> None:
    """What the kubelet would report for a started pod (fake nodes have none)."""
    cp.patch(f"{pods_path(ns)}/{name}/status", {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}], "startTime": "2026-01-01T00:00:00Z"}})


def lease_holder(cp: ControlPlane) -> str:
    return str(((cp.get(LEASE) or {}).get("spec") or {}).get("holderIdentity") or "")


def test_more_pods_than_devices_bind_exactly_the_capacity(cp: ControlPlane, stack: Stack, ns: str,
                                                          nodes: Nodes) -> None:
    """12 one-GPU GPRs for one 8-GPU node: 8 bound, 4 queued with a position; no node ever over its devices.
    Freeing two devices lets exactly two more through. kube-scheduler sends every verb on one kept-alive HTTP/1.1
    connection (the shipped profile's filter, one pod at a time; its client offers HTTP/2, which only a profile
    with the bind verb needs, so it is not offered by default)."""
    before = stack.verbs_connections()
    stack.start_scheduler()
    node = nodes.add("only", gpus=8)
    for i in range(12):
        cp.create(pods_path(ns), pod(f"w-{i}", gpr_name=f"g-{i}"))
        cp.create(GPRS.format(ns=ns), gpr(f"g-{i}"))
    wait_for("8 pods bound", lambda: sum(1 for i in range(12) if bound_node(cp, ns, f"w-{i}")) == 8)
    time.sleep(3)  # give a wrong extra bind the time to happen: none may
    assert bound_gpus(cp, node) == 8
    phases = [gpr_status(cp, ns, f"g-{i}").get("phase") for i in range(12)]
    assert phases.count("Queued") == 4, phases
    queued = [gpr_status(cp, ns, f"g-{i}") for i in range(12) if phases[i] == "Queued"]
    assert all(q.get("queuePosition") for q in queued), queued
    done = [i for i in range(12) if bound_node(cp, ns, f"w-{i}")][:2]
    for i in done:
        cp.delete(f"{GPRS.format(ns=ns)}/g-{i}")
        cp.delete(f"{pods_path(ns)}/w-{i}", force=True)
    wait_for("two more bound", lambda: sum(1 for i in range(12) if i not in done and bound_node(cp, ns, f"w-{i}"))
             == 8, timeout=90)
    assert bound_gpus(cp, node) == 8
    after = stack.verbs_connections()
    opened = {k: v - before.get(k, 0.0) for k, v in after.items()}
    # one connection at most (none new when the session's scheduler kept its own), all of them HTTP/1.1
    assert after.get("http/1.1", 0) >= 1 and opened.get("http/1.1", 0) <= 1 and not opened.get("h2"), (before, after)


def test_eviction_for_a_higher_priority_gpr_waits_for_the_pdb(cp: ControlPlane, stack: Stack, ns: str,
                                                             nodes: Nodes) -> None:
    """A preemptible low-priority GPR holds the only node; a high-priority GPR with enableEviction needs it. The
    real Eviction API refuses while a PodDisruptionBudget allows no disruption, as the real disruption controller
    computes it (EvictionBlocked on the victim); once the PDB allows one, the victim's pod goes, the victim is requeued and the high GPR's pod is bound."""
    stack.start_scheduler()
    cp.start_controller_manager()  # the disruption controller computes what the PDB allows
    node = nodes.add("one", gpus=8)
    cp.create(pods_path(ns), pod("low-0", gpus=8, gpr_name="low", labels={"app": "low"}))
    cp.create(GPRS.format(ns=ns), gpr("low", devices=8, priority=10, preemptible=True))
    assert wait_bound(cp, ns, "low-0") == node
    set_running(cp, ns, "low-0")
    cp.create(f"apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "low"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "low"}}}})
    pdb = f"apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/low"
    wait_for("the disruption controller's verdict: none allowed",
             lambda: (st := (cp.get(pdb) or {}).get("status") or {}).get("observedGeneration") == 1
             and st.get("currentHealthy") == 1 and st.get("disruptionsAllowed") == 0)
    cp.create(pods_path(ns), pod("high-0", gpus=8, gpr_name="high"))
    cp.create(GPRS.format(ns=ns), gpr("high", devices=8, priority=250, enableEviction=True))

    def blocked() -> dict[str, Any] | None:
        conds = {c["type"]: c for c in gpr_status(cp, ns, "low").get("conditions") or []}
        c = conds.get("EvictionBlocked")
        return c if c and c.get("status") == "True" else None

    cond = wait_for("EvictionBlocked on the victim", blocked, timeout=60)
    assert "disruption" in cond.get("message", "").lower() or cond.get("reason"), cond
    assert bound_node(cp, ns, "low-0") == node  # still there: the PDB held
    assert not bound_node(cp, ns, "high-0")
    # (maxUnavailable would not do: the disruption controller needs a controller owning the pod to count it)
    cp.patch(pdb, {"spec": {"minAvailable": 0}})
    wait_for("the victim's pod gone", lambda: cp.get(f"{pods_path(ns)}/low-0") is None, timeout=60)
    assert wait_bound(cp, ns, "high-0") == node
    assert gpr_status(cp, ns, "low").get("phase") in ("Queued", "Evicted"), gpr_status(cp, ns, "low")
    assert bound_gpus(cp, node) == 8


def test_gpr_refused_by_the_namespace_limit_through_the_real_admission_chain(cp: ControlPlane, stack: Stack,
                                                                             ns: str) -> None:
    cp.patch(f"api/v1/namespaces/{ns}", {"metadata": {"annotations": {"accelstack.io/priority-range": "1-100"}}})
    with pytest.raises(ApiCallError) as err:
        cp.create(GPRS.format(ns=ns), gpr("too-high", priority=250))
    assert err.value.status in (400, 403, 422), err.value.body
    assert "priority" in err.value.body.get("message", ""), err.value.body
    assert cp.create(GPRS.format(ns=ns), gpr("fine", priority=50))["metadata"]["name"] == "fine"


def test_extender_outage_refuses_accelerator_pods_and_nothing_else(cp: ControlPlane, stack: Stack, ns: str) -> None:
    """failurePolicy Fail with the shipped CEL matchConditions: while the extender is down the API server refuses
    pods that ask for a GPU (or name a GPR) and creates every other pod without calling it."""
    stack.extender.stop()
    try:
        with pytest.raises(ApiCallError) as err:
            cp.create(pods_path(ns), pod("gpu", gpus=1, gpr_name="g"))
        message = err.value.body.get("message", "")
        assert err.value.status == 500 and '"gpr-pods.accelstack.io"' in message, err.value.body
        with pytest.raises(ApiCallError) as err:  # no GPR label: the CEL conditions' entry
            cp.create(pods_path(ns), pod("gpu-alone", gpus=1))
        message = err.value.body.get("message", "")
        assert err.value.status == 500 and '"pods.accelstack.io"' in message, err.value.body
        plain = cp.create(pods_path(ns), pod("plain", gpus=0, scheduler="default-scheduler"))
        assert not plain["spec"].get("schedulingGates")
    finally:
        stack.restart_extender()
    created = cp.create(pods_path(ns), pod("gpu", gpus=1, gpr_name="g"))
    assert [g["name"] for g in created["spec"].get("schedulingGates") or []] == ["accelstack.io/gpr"]


def test_two_controller_replicas_hand_over_on_sigterm_and_on_kill(cp: ControlPlane, stack: Stack, ns: str,
                                                                  nodes: Nodes) -> None:
    """The Lease moves to the standby when the leader stops (released at once on SIGTERM; taken after it expires
    on kill -9), and the new leader admits what arrives next; the stack ends with two healthy replicas."""
    nodes.add("n", gpus=8)
    first = stack.controllers[0]
    wait_for("a leader", lambda: lease_holder(cp))
    second = stack.controller("controller-1").start()
    stack.controllers.append(second)
    leader_name = lease_holder(cp)
    leader, standby = (first, second) if leader_name == first.name else (second, first)
    assert leader_name == leader.name
    # SIGTERM: the leader gives the Lease up on the way out (holderIdentity cleared), the standby takes it
    assert leader.stop() == 0
    wait_for("the standby leads", lambda: lease_holder(cp) == standby.name, timeout=30)
    cp.create(GPRS.format(ns=ns), gpr("after-term"))
    wait_for("admitted by the new leader", lambda: admitted(cp, ns, "after-term"), timeout=30)
    # kill -9 of the new leader: nothing is released; a fresh replica takes over once the lease expires
    replacement = stack.controller("controller-2").start()
    stack.controllers.append(replacement)
    standby.signal(signal.SIGKILL)
    wait_for("the replacement leads", lambda: lease_holder(cp) == replacement.name, timeout=40)
    cp.create(GPRS.format(ns=ns), gpr("after-kill"))
    wait_for("admitted after the kill", lambda: admitted(cp, ns, "after-kill"), timeout=30)
    # two replicas again for the tests that follow
    stack.controllers[:] = [replacement, stack.controller("controller-3").start()]
    phases = [gpr_status(cp, ns, g).get("phase") for g in ("after-term", "after-kill")]
    assert phases == ["Admitted", "Admitted"], phases


def test_api_server_restart_under_running_processes(cp: ControlPlane, stack: Stack, ns: str, nodes: Nodes) -> None:
    """The API server goes away for a few seconds and comes back on the same etcd: the extender and controller
    reconnect their watches, and a GPR created afterwards is admitted and its pod bound through the scheduler."""
    stack.start_scheduler()
    nodes.add("r", gpus=8)
    cp.create(GPRS.format(ns=ns), gpr("before"))
    wait_for("admitted before", lambda: admitted(cp, ns, "before"))
    cp.restart_apiserver(down=3)
    cp.create(pods_path(ns), pod("after-0", gpr_name="after"))
    cp.create(GPRS.format(ns=ns), gpr("after"))
    wait_for("admitted after the restart", lambda: admitted(cp, ns, "after"), timeout=60)
    wait_bound(cp, ns, "after-0")
    # ready again soon: every informer retries its watch at most 4 s apart while not healthy (a 30 s backoff once
    # left /readyz at 503 for up to 30 s after the server was back)
    wait_for("extender ready after the restart", lambda: stack.extender.status() == 200, timeout=20)
    wait_for("the controller's Events after the restart",  # they follow the pass's status write
             lambda: [e for e in events_for(cp, ns, "after") if e.get("reason")], timeout=10)


def test_the_binder_hands_over_on_kill_and_the_next_binds_from_what_the_pods_hold(cp: ControlPlane, stack: Stack,
                                                                                 ns: str, nodes: Nodes) -> None:
    """As shipped (--ledger=memory) one extender replica binds. kill -9 of it: nothing is released; the other
    replica takes the binder Lease once it expires, reads the pods, and binds from what they hold: a pod of a GPR
    whose share the killed binder's bind used up is refused, and the real scheduler binds the next pod through it;
    no node holds more devices than it has."""
    node = nodes.add("k", gpus=8)
    stack.start_scheduler()
    cp.create(GPRS.format(ns=ns), gpr("ga", devices=4))
    cp.create(GPRS.format(ns=ns), gpr("gb", devices=4))
    wait_for("both admitted", lambda: admitted(cp, ns, "ga") and admitted(cp, ns, "gb"))
    cp.create(pods_path(ns), pod("a-0", gpus=4, gpr_name="ga"))
    assert wait_bound(cp, ns, "a-0") == node
    stack.stop_scheduler()  # the next pods wait for the next binder
    a1 = cp.create(pods_path(ns), pod("a-1", gpus=4, gpr_name="ga"))
    cp.create(pods_path(ns), pod("b-0", gpus=4, gpr_name="gb"))
    second, second_verbs = stack.second_extender()
    try:
        time.sleep(1)  # a few of its retry periods: it does not take the Lease while the first holds it
        ctx = cp.ssl_context()
        ctx.load_cert_chain(str(stack.client_cert), str(stack.client_key))
        body = {"PodName": "a-1", "PodNamespace": ns, "PodUID": a1["metadata"]["uid"], "Node": node}
        status, answer = _post(f"{second_verbs}/scheduler/bind", body, ctx)
        assert status == 503 and "not the active binder" in answer["Error"]
        stack.extender.signal(signal.SIGKILL)
        stack.wait_binding(timeout=60, extender=second)  # the Lease expired (15 s), the pods read afresh
        status, answer = _post(f"{second_verbs}/scheduler/bind", body, ctx)
        assert status == 200 and "reservation here is used up" in answer["Error"], answer
        config = stack.scheduler_config()
        config["extenders"][0]["urlPrefix"] = f"{second_verbs}/scheduler"
        stack.start_scheduler(config)
        assert wait_bound(cp, ns, "b-0") == node
        assert bound_gpus(cp, node) == 8 and not pod_obj(cp, ns, "a-1")["spec"].get("nodeName")
    finally:
        stack.stop_scheduler()
        second.stop()  # SIGTERM: the Lease is given up, and the stack's own extender takes it again
        stack.restart_extender()


def _post(url: str, body: dict[str, Any], ctx: Any) -> tuple[int, dict[str, Any]]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=ctx, timeout=10) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())
