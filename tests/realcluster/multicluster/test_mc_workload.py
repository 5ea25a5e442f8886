"""A hub GPR's workload (``spec.workload``, issue 40.3) on the shared three-plane world (``mc_world``): refused on the
hub by the CRD's own rules (the hub runs no webhook) in one line per object; created in member-a's namespace by
the member's agent once member-a admits the GPR, as that namespace's ServiceAccount ``accelstack-workload`` (the
agent itself may create none of it: ``kubectl auth can-i`` with its real token), labelled and owned so the pod is
the GPR's pod to member-a's own webhook; made again when deleted; deleted with the hub GPR; and, where member-a's
RBAC does not let that account create a Pod, ``WorkloadRefused`` on the hub GPR with the API server's line.

Names: namespaces ``wl-ok`` and ``wl-deny`` on the hub and member-a (left there: tests share the world and no
namespace controller runs), the Role ``wl-runner`` (deleted at the end)."""

from __future__ import annotations

import pytest

from tests.realcluster.controlplane import ApiCallError
from tests.realcluster.mc_world import (
    HUB_NS,
    SYSTEM,
    World,
    condition,
    hub_gpr,
    member_gpr,
    namespace,
    ready_with,
)
from tests.realcluster.objects import GPRS, gpr, wait_for

pytestmark = pytest.mark.realcluster

RUNNER = "accelstack-workload"
RBAC = "apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"


def pod_manifest(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "wl"}},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                "name": "main", "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}}]}}


JOB = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "wl-job"}, "spec": {"template": {
    "metadata": {"labels": {"app": "wl"}},
    "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}}}
CONFIG = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "wl-cfg"}, "data": {"epochs": "3"}}


def workload_condition(w: World, ns: str, name: str, reason: str) -> dict[str, object] | None:
    c = condition(hub_gpr(w, ns, name), "WorkloadCreated")
    return c if c.get("reason") == reason else None


def gone_or_going(cp: object, path: str) -> bool:
    obj = cp.get(path)  # type: ignore[attr-defined]
    return obj is None or bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def test_a_hub_gprs_workload_runs_in_its_member_as_the_namespaces_account_and_goes_with_it(mc_world: World) -> None:
    w = mc_world
    a = w.members["member-a"]
    wait_for("member-a Ready with 16 GPUs", lambda: ready_with(w.hub, "member-a", 16), timeout=90)
    for ns in ("wl-ok", "wl-deny"):
        namespace(w.hub, ns)
        namespace(a.cp, ns)

    # ---- the agent cannot create these kinds itself; it may act as the one workload account only ---------------
    agent_kc = a.cp.sa_kubeconfig(SYSTEM, "accelstack-member-agent")
    for kind in ("deployments.apps", "jobs.batch", "pods", "configmaps", "statefulsets.apps", "services"):
        assert not a.cp.can_i(agent_kc, "create", kind, namespace="wl-ok"), kind
    assert a.cp.can_i(agent_kc, "impersonate", f"serviceaccounts/{RUNNER}", namespace="wl-ok")
    assert not a.cp.can_i(agent_kc, "impersonate", "serviceaccounts/default", namespace="wl-ok")
    assert not a.cp.can_i(agent_kc, "impersonate", "users")
    assert not a.cp.can_i(agent_kc, "impersonate", "groups")

    # ---- on the hub: a kind outside the allow-list is refused at admission, one line per object ----------------
    bad = gpr("wl-bad", clusterName="member-a", workload={"objects": [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "rb"}}]})
    with pytest.raises(ApiCallError) as refused:
        w.hub.create(HUB_NS.format(ns="wl-ok"), bad)
    assert refused.value.status == 422
    message = str(refused.value.body.get("message"))
    assert "spec.workload.objects[0]: Invalid value: v1 Secret is not allowed in a workload (allowed: v1 Pod, " \
           "Service, ConfigMap; batch/v1 Job; apps/v1 Deployment, StatefulSet)" in message, message
    assert "spec.workload.objects[1]: Invalid value: rbac.authorization.k8s.io/v1 RoleBinding is not allowed" in message
    assert hub_gpr(w, "wl-ok", "wl-bad") == {}

    # member-a's admin lets wl-ok's workload account create pods and configmaps there (and nothing in wl-deny)
    a.cp.create(RBAC.format(ns="wl-ok") + "/roles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "wl-runner"},
        "rules": [{"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": ["get", "create", "delete"]},
                  {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "create", "delete"]}]})
    a.cp.create(RBAC.format(ns="wl-ok") + "/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "wl-runner"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "wl-runner"},
        "subjects": [{"kind": "ServiceAccount", "name": RUNNER, "namespace": "wl-ok"}]})
    try:
        # ---- created once member-a admits the GPR, as the account, labelled and owned ----------------------------
        w.hub.create(HUB_NS.format(ns="wl-ok"), gpr("wl-train", clusterName="member-a", models=["A100"], workload={
            "objects": [pod_manifest("wl-pod"), CONFIG, JOB]}))
        created = wait_for("WorkloadCreated on the hub GPR", lambda: workload_condition(w, "wl-ok", "wl-train",
                                                                                          "Created"), timeout=60)
        assert created["status"] == "True"
        assert created["message"] == ("3 of 3 object(s) in wl-ok as "
                                      "system:serviceaccount:wl-ok:accelstack-workload"), created
        copy = member_gpr(a, "wl-ok", "wl-train")
        assert copy["status"]["phase"] in ("Admitted", "Running") and "workload" not in copy["spec"]
        pod = a.cp.get("api/v1/namespaces/wl-ok/pods/wl-pod") or {}
        cfg = a.cp.get("api/v1/namespaces/wl-ok/configmaps/wl-cfg") or {}
        job = a.cp.get("apis/batch/v1/namespaces/wl-ok/jobs/wl-job") or {}
        # the Job's pods (a job controller would make them) carry the GPR's label too
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert (labels["accelstack.io/gpr"], labels["app"]) == ("wl-train", "wl"), labels
        for obj in (pod, cfg, job):
            meta = obj["metadata"]
            assert meta["labels"]["accelstack.io/gpr"] == "wl-train"
            assert [(o["kind"], o["name"], o["uid"]) for o in meta["ownerReferences"]] == [
                ("GPUProvisioningRequest", "wl-train", copy["metadata"]["uid"])]
        assert cfg["data"] == {"epochs": "3"}
        # member-a's own webhook took the pod as the GPR's pod: pinned to the node the GPR reserved
        nodes = [r["node"] for r in copy["status"]["reservation"]]
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"] == [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                                "values": nodes}]}], (terms, nodes)

        # ---- level-triggered: deleted, made again (the GPR touched, so the agent looks now, not at its resync) ---
        a.cp.delete("api/v1/namespaces/wl-ok/configmaps/wl-cfg")
        a.cp.patch(f"{GPRS.format(ns='wl-ok')}/wl-train", {"metadata": {"annotations": {"wl-test/touch": "1"}}})
        wait_for("wl-cfg made again", lambda: a.cp.get("api/v1/namespaces/wl-ok/configmaps/wl-cfg"), timeout=60)

        # ---- refused: wl-deny's account may create nothing on member-a -----------------------------------------
        w.hub.create(HUB_NS.format(ns="wl-deny"), gpr("wl-denied", clusterName="member-a", models=["A100"],
                                                      workload={"objects": [pod_manifest("wl-pod")]}))
        denied = wait_for("WorkloadRefused on the hub GPR", lambda: workload_condition(
            w, "wl-deny", "wl-denied", "WorkloadRefused"), timeout=60)
        text = str(denied["message"])
        assert denied["status"] == "False" and "\n" not in text
        assert text.startswith("Pod/wl-pod in wl-deny as system:serviceaccount:wl-deny:accelstack-workload: "), text
        assert "forbidden" in text and text.endswith("(0 of 1 object(s) there)"), text
        assert a.cp.get("api/v1/namespaces/wl-deny/pods/wl-pod") is None
        assert (hub_gpr(w, "wl-deny", "wl-denied").get("status") or {}).get("phase") in ("Admitted", "Running")

        # ---- deleted with the hub GPR (the agent deletes them: no garbage collector runs here) --------------------
        w.clean(("wl-ok", "wl-train"), ("wl-deny", "wl-denied"))
        wait_for("wl-cfg deleted with its GPR", lambda: a.cp.get("api/v1/namespaces/wl-ok/configmaps/wl-cfg") is None,
                 timeout=60)
        wait_for("wl-job deleted with its GPR", lambda: a.cp.get("apis/batch/v1/namespaces/wl-ok/jobs/wl-job") is None,
                 timeout=60)
        wait_for("wl-pod deleted with its GPR", lambda: gone_or_going(a.cp, "api/v1/namespaces/wl-ok/pods/wl-pod"),
                 timeout=60)
    finally:
        for ns, name in (("wl-ok", "wl-train"), ("wl-deny", "wl-denied")):
            if hub_gpr(w, ns, name):
                w.clean((ns, name))
        a.cp.delete("api/v1/namespaces/wl-ok/pods/wl-pod", force=True)
        a.cp.delete("apis/batch/v1/namespaces/wl-ok/jobs/wl-job")
        for kind in ("rolebindings", "roles"):
            a.cp.delete(RBAC.format(ns="wl-ok") + f"/{kind}/wl-runner")
