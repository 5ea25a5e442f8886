"""What the shipped profile keeps true while kube-scheduler binds the pods itself (the profile names no
``bindVerb``): the extender's filter is then the last word of accelstack on a pod, so what a bind used to check
against the ledger must hold at filter time, for many pods in flight at once."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import GPRS, admitted, bound_gpus, bound_node, gpr, pod, wait_bound, wait_for
from tests.realcluster.stack import Stack

NODE_NS = "accelstack-node"  # privileged per-node agents: the pod webhook and the restricted Pod Security leave it alone


def test_plain_pods_in_flight_together_never_take_a_gprs_reserved_devices(cp: ControlPlane, stack: Stack, ns: str,
                                                                          nodes: Nodes) -> None:
    """A GPR holds 4 of the 8 GPUs of each of three nodes before any of its pods exists; 24 one-GPU pods without a
    GPR arrive at once (in a namespace the webhook leaves alone: elsewhere it gives such pods a GPR or refuses
    them). kube-scheduler counts 8 free GPUs a node and schedules the next pod before the last one's
    Binding is seen: only the extender knows 4 of them are reserved, so exactly 12 may bind (4 a node) however
    many are in flight, and the GPR's own pods then all get their devices."""
    stack.start_scheduler()
    label = {"accelstack.test/pool": ns[:60]}
    names = [nodes.add(f"n{i}", labels=label) for i in range(3)]
    cp.create(GPRS.format(ns=ns), gpr("held", devices=4, nodes=3))
    status = wait_for("the GPR admitted", lambda: admitted(cp, ns, "held"))
    assert {r["node"]: r["devices"] for r in status["reservation"]} == dict.fromkeys(names, 4), status
    plain = [f"{ns[:40]}-plain-{i}" for i in range(24)]
    with contextlib.suppress(ApiCallError):  # the ServiceAccount controller may not be running
        cp.create(f"api/v1/namespaces/{NODE_NS}/serviceaccounts",
                  {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda name: cp.create(f"api/v1/namespaces/{NODE_NS}/pods",
                                                 pod(name, nodeSelector=label)), plain))
        wait_for("12 plain pods bound", lambda: sum(1 for p in plain if bound_node(cp, NODE_NS, p)) >= 12)
        time.sleep(3)  # give a wrong extra bind the time to happen: none may
        on: dict[str, int] = {}
        for name in plain:
            node = bound_node(cp, NODE_NS, name)
            if node:
                on[node] = on.get(node, 0) + 1
        assert sum(on.values()) == 12 and all(n <= 4 for n in on.values()), on
        for i in range(3):
            cp.create(f"api/v1/namespaces/{ns}/pods", pod(f"held-{i}", gpus=4, gpr_name="held"))
        assert {wait_bound(cp, ns, f"held-{i}") for i in range(3)} == set(names)
        for name in names:  # each node's 8: 4 to pods without a GPR, 4 to the GPR's
            assert bound_gpus(cp, name) == 8, name
    finally:
        for name in plain:
            cp.delete(f"api/v1/namespaces/{NODE_NS}/pods/{name}", force=True)

