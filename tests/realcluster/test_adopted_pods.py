"""A GPR made for a pod that already runs (onboarding adopts such pods; or a pod created with ``nodeName``) is
placed where the pod runs, on the real API server: two nodes, the pod on the one best fit would not choose. Before,
the GPR was admitted on the other node and said "running on" it while its pod held devices elsewhere (counted
twice: reserved there, used here)."""

from __future__ import annotations

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import GPRS, gpr, gpr_status, pod, wait_for
from tests.realcluster.stack import Stack
from tests.realcluster.test_gpr_control_plane import pods_path, set_running

OUTSIDE = "kube-system"  # no pod webhook there: pods that ran before accelstack, as on a brownfield node


def test_a_gpr_for_a_running_pod_is_placed_where_the_pod_runs(cp: ControlPlane, stack: Stack, ns: str,
                                                              nodes: Nodes) -> None:
    try:
        cp.create(f"api/v1/namespaces/{OUTSIDE}/serviceaccounts", {"metadata": {"name": "default"}})
    except ApiCallError as exc:
        if exc.status != 409:
            raise
    tight, roomy = nodes.add("tight", gpus=8), nodes.add("roomy", gpus=8)
    filler, held, name = f"{ns}-filler"[:63], f"{ns}-held"[:63], f"{ns}-adopted"[:63]
    try:
        cp.create(pods_path(OUTSIDE), pod(filler, gpus=4, scheduler="default-scheduler", nodeName=tight))
        cp.create(pods_path(OUTSIDE), pod(held, gpus=2, scheduler="default-scheduler", nodeName=roomy))
        set_running(cp, OUTSIDE, held)
        cp.patch(f"{pods_path(OUTSIDE)}/{held}", {"metadata": {"labels": {"accelstack.io/gpr": name}}})
        cp.create(GPRS.format(ns=OUTSIDE), gpr(name, devices=2))

        def running() -> dict[str, object] | None:
            st = gpr_status(cp, OUTSIDE, name)
            return st if st.get("phase") == "Running" else None

        st = wait_for("the adopted GPR Running", running)
        assert st["reservation"] == [{"devices": 2, "node": roomy}], st  # best fit alone would take `tight`
        assert roomy in str(st.get("message")), st
    finally:
        for p in (filler, held):
            cp.api("DELETE", f"{pods_path(OUTSIDE)}/{p}", {"gracePeriodSeconds": 0}, ok=(200, 202, 404))
        cp.api("DELETE", f"{GPRS.format(ns=OUTSIDE)}/{name}", ok=(200, 202, 404))
