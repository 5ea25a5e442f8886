"""Deboarding a node on the real API server, scheduler and Eviction API (issue 39 point 4): the request on the
AcceleratorNode taints the Node, an Admitted GPR reserved there whose pods have not started is requeued and placed
elsewhere (reason NodeDeboarding), a running GPR's pod is evicted once the grace is over and its GPR requeued (not
Failed), the node ends Deboarded with the DaemonSets' landing labels removed and the taint kept; removing the
request (abort) lifts the taint. Fails on the code before: there was no deboard request, taint or phase."""

from __future__ import annotations

import time
from typing import Any

from scheduler_extender.cli import kubectl_plugin
from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import (
    GPRS,
    account_token,
    admitted,
    bound_node,
    events_for,
    gpr,
    gpr_status,
    pod,
    wait_bound,
    wait_for,
)
from tests.realcluster.stack import Stack
from tests.realcluster.test_accelerator_nodes import (
    AN,
    GFD,
    label_as_device_plugin,
    npd_reports,
    plugin_reports,
    status_of,
    wait_status,
)
from tests.realcluster.test_gpr_control_plane import pods_path, set_running

TAINT = "accelstack.io/deboarding"


def taints(cp: ControlPlane, node: str) -> list[str]:
    return [t["key"] for t in ((cp.get(f"api/v1/nodes/{node}") or {}).get("spec") or {}).get("taints") or []]


def operator_token(cp: ControlPlane, ns: str, allowed: bool) -> str:
    """A real ServiceAccount token; ``allowed``: bound to a ClusterRole that may patch acceleratornodes."""
    if not allowed:
        return account_token(cp, ns, "bystander")
    return account_token(cp, ns, "node-operator", [{"apiGroups": ["accelstack.io"], "resources": ["acceleratornodes"],
                                                    "verbs": ["get", "list", "patch"]}])


def test_a_node_is_deboarded_safely_and_an_abort_lifts_it(cp: ControlPlane, stack: Stack, ns: str,
                                                          nodes: Nodes) -> None:
    stack.start_scheduler()
    plugin = ("--server", stack.url, "--insecure-skip-tls-verify", "--token", operator_token(cp, ns, True))

    def deboard(node: str, *flags: str) -> None:  # `kubectl accelstack node deboard ...`, through the REST API
        assert kubectl_plugin.main([*plugin, "node", "deboard", *flags, node]) == 0

    names = [nodes.add(s, gpus=8) for s in ("a", "b", "c")]
    for n in names:
        label_as_device_plugin(cp, n, GFD)
        npd_reports(cp, n)
        plugin_reports(cp, n, "nvidia.com/gpu", 8, 0)
        wait_status(cp, n, phase="Managed")
    # a running GPR, and an admitted one whose pods have not come yet, on two of the three nodes
    cp.create(pods_path(ns), pod("run-0", gpus=8, gpr_name="run"))
    cp.create(GPRS.format(ns=ns), gpr("run", devices=8))
    running_on = wait_bound(cp, ns, "run-0")
    set_running(cp, ns, "run-0")
    wait_for("run Running", lambda: gpr_status(cp, ns, "run").get("phase") == "Running")
    cp.create(GPRS.format(ns=ns), gpr("adm", devices=8))
    reserved_on = wait_for("adm admitted", lambda: admitted(cp, ns, "adm"))["reservation"][0]["node"]
    assert reserved_on != running_on

    # deboard the admitted GPR's node (a long grace): tainted, its reservation moves to the third node
    assert kubectl_plugin.main([*plugin, "node", "deboard", "--grace", "5x", reserved_on]) == 1  # 400: not a duration
    assert TAINT not in taints(cp, reserved_on)
    deboard(reserved_on, "--grace", "1h")
    wait_for("the deboarding taint", lambda: TAINT in taints(cp, reserved_on))
    third = next(n for n in names if n not in (running_on, reserved_on))
    moved = wait_for("adm reserved on the third node", lambda: (st := admitted(cp, ns, "adm")) and
                     st["reservation"][0]["node"] == third and st)
    assert gpr_status(cp, ns, "adm").get("failures", 0) == 0, moved
    # the Event follows the pass's status write
    wait_for("the NodeDeboarding Event", lambda: [e for e in events_for(cp, ns, "adm")
                                                  if "NodeDeboarding" in e.get("reason", "") + e.get("message", "")],
             timeout=10)
    st = wait_status(cp, reserved_on, phase="Deboarded")  # nothing held devices there
    labels = ((cp.get(f"api/v1/nodes/{reserved_on}") or {}).get("metadata") or {}).get("labels", {})
    assert "accelstack.io/gpu-node" not in labels, st  # the DaemonSets leave
    assert labels.get("nvidia.com/gpu.present") == "true"  # GPU feature discovery's labels are not ours to remove
    assert TAINT in taints(cp, reserved_on)  # the node stays out

    # deboard the running GPR's node with a short grace: its pod is evicted, the GPR requeued (not Failed)
    deboard(running_on, "--grace", "3s")
    wait_for("run-0 evicted", lambda: cp.get(f"{pods_path(ns)}/run-0") is None, timeout=90)
    st_run = wait_for("run requeued", lambda: (s := gpr_status(cp, ns, "run")).get("phase") == "Queued" and s)
    assert st_run.get("reason") == "NodeDeboarding" or "NodeDeboarding" in str(st_run.get("message")), st_run
    wait_status(cp, running_on, phase="Deboarded")

    # abort the first through `kubectl accelstack node deboard --abort` (the REST API, a caller allowed to patch
    # AcceleratorNodes); one who is not is refused and nothing changes
    bystander = ("--server", stack.url, "--insecure-skip-tls-verify", "--token", operator_token(cp, ns, False))
    assert kubectl_plugin.main([*bystander, "node", "deboard", "--abort", reserved_on]) == 1
    assert TAINT in taints(cp, reserved_on)
    deboard(reserved_on, "--abort")
    wait_for("the taint lifted", lambda: TAINT not in taints(cp, reserved_on))
    assert "deboard" not in ((cp.get(f"{AN}/{reserved_on}") or {}).get("spec") or {})
    assert status_of(cp, reserved_on) is not None
    # served by accelstack's plugin still: onboarded again, the landing label back
    wait_for("the landing label back", lambda: ((cp.get(f"api/v1/nodes/{reserved_on}") or {}).get("metadata") or {})
             .get("labels", {}).get("accelstack.io/gpu-node") == "true")
    wait_status(cp, reserved_on, phase="Managed")
    for suffix in ("node-operator",):
        cp.api("DELETE", f"apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{ns}-{suffix}", ok=(200, 404))
        cp.api("DELETE", f"apis/rbac.authorization.k8s.io/v1/clusterroles/{ns}-{suffix}", ok=(200, 404))


def managed_gpu_node(cp: ControlPlane, nodes: Nodes, suffix: str) -> str:
    """A node accelstack's device plugin serves, with NPD reporting: Managed."""
    name = nodes.add(suffix, gpus=8)
    label_as_device_plugin(cp, name, GFD)
    npd_reports(cp, name)
    plugin_reports(cp, name, "nvidia.com/gpu", 8, 0)
    wait_status(cp, name, phase="Managed")
    return name


def test_deboarding_waits_for_a_pdb_that_blocks_and_goes_on_once_it_allows(cp: ControlPlane, stack: Stack, ns: str,
                                                                          nodes: Nodes) -> None:
    """Past the grace, a running GPR's pod is evicted through the Eviction API: a PodDisruptionBudget that allows
    no disruption (as the real disruption controller computes it) keeps it, the GPR says EvictionBlocked and the
    node EvictionPending; once the PDB allows it, the pod goes, the GPR is requeued (NodeDeboarding) and the node
    ends Deboarded."""
    stack.start_scheduler()
    cp.start_controller_manager()  # the disruption controller computes what the PDB allows
    node = managed_gpu_node(cp, nodes, "pdb")
    cp.create(pods_path(ns), pod("guarded-0", gpus=8, gpr_name="guarded", labels={"app": "guarded"}))
    cp.create(GPRS.format(ns=ns), gpr("guarded", devices=8))
    assert wait_bound(cp, ns, "guarded-0") == node
    set_running(cp, ns, "guarded-0")
    wait_for("guarded Running", lambda: gpr_status(cp, ns, "guarded").get("phase") == "Running")
    cp.create(f"apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "guarded"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}})
    pdb = f"apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/guarded"
    wait_for("the disruption controller's verdict: none allowed",
             lambda: (st := (cp.get(pdb) or {}).get("status") or {}).get("observedGeneration") == 1
             and st.get("currentHealthy") == 1 and st.get("disruptionsAllowed") == 0)

    cp.patch(f"{AN}/{node}", {"spec": {"deboard": {"grace": "1s", "requestedAt": "2026-01-01T00:00:00Z"}}})
    st = wait_status(cp, node, phase="Deboarding", reason="EvictionPending")
    assert st["deboard"]["podsLeft"] == 1 and st["deboard"]["pods"] == [f"{ns}/guarded-0"]

    def blocked() -> dict[str, Any] | None:
        conds = {c["type"]: c for c in gpr_status(cp, ns, "guarded").get("conditions") or []}
        c = conds.get("EvictionBlocked")
        return c if c and c.get("status") == "True" else None

    wait_for("EvictionBlocked on the GPR", blocked, timeout=60)
    assert bound_node(cp, ns, "guarded-0") == node  # the PDB held
    assert status_of(cp, node)["phase"] == "Deboarding"  # type: ignore[index]

    cp.patch(pdb, {"spec": {"minAvailable": 0}})  # the PDB allows it now
    wait_for("guarded-0 evicted", lambda: cp.get(f"{pods_path(ns)}/guarded-0") is None, timeout=60)
    st_gpr = wait_for("guarded requeued", lambda: (s := gpr_status(cp, ns, "guarded")).get("phase") == "Queued" and s)
    assert "NodeDeboarding" in (str(st_gpr.get("reason")) + str(st_gpr.get("message"))), st_gpr
    assert st_gpr.get("failures", 0) == 0
    wait_status(cp, node, phase="Deboarded")


def test_a_node_deleted_mid_deboard_drops_out_and_its_gprs_requeue_as_for_a_lost_node(
        cp: ControlPlane, stack: Stack, ns: str, nodes: Nodes) -> None:
    stack.start_scheduler()
    node = managed_gpu_node(cp, nodes, "lost")
    cp.create(pods_path(ns), pod("held-0", gpus=8, gpr_name="held"))
    cp.create(GPRS.format(ns=ns), gpr("held", devices=8))
    assert wait_bound(cp, ns, "held-0") == node
    set_running(cp, ns, "held-0")
    wait_for("held Running", lambda: gpr_status(cp, ns, "held").get("phase") == "Running")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cp.patch(f"{AN}/{node}", {"spec": {"deboard": {"grace": "1h", "requestedAt": now}}})
    wait_status(cp, node, phase="Deboarding", reason="GracePeriod")
    cp.delete(f"api/v1/nodes/{node}")
    wait_for(f"AcceleratorNode {node} gone", lambda: cp.get(f"{AN}/{node}") is None, timeout=60)
    def lost() -> dict[str, Any] | None:
        st = gpr_status(cp, ns, "held")
        return st if st.get("phase") in ("Queued", "Failed") else None

    st = wait_for("held requeued or failed as for a lost node", lost, timeout=60)
    assert "NodeLost" in (str(st.get("reason")) + str(st.get("message"))), st
