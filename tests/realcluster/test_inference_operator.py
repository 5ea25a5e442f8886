"""The inference operator on the real control plane: ``python -m inference.operator.main`` with the shipped
Deployment's arguments, a real token of its shipped ServiceAccount (so the shipped ClusterRole is what allows or
refuses each call), the real kube-controller-manager (Deployment, ReplicaSet, garbage collector, HPA controllers)
and the shipped admission chain (the ``stack`` fixture's webhooks: the operator's GPRs and its Deployments' pods go
through them).

What it shows: an InferenceEndpoint becomes its children (GPRs, Deployments and their gated pods, Services, PDB,
NetworkPolicy, HPA), each with a controller owner reference, and a status that follows the real GPR controller;
deleting the endpoint (background or foreground) has the real garbage collector remove every child, and the
operator does not bring them back; the HPA it writes is accepted and read by the real HPA controller, and neither
undoes the other's writes; every write is allowed by the shipped RBAC, which refuses what the operator must not do.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from inference.operator import objects as o
from tests.realcluster.controlplane import ControlPlane, Process, free_port
from tests.realcluster.objects import wait_for
from tests.realcluster.shipped import ROOT, pick
from tests.realcluster.stack import SYSTEM_NS, Product, Stack

OPERATOR = "accelstack-inference-operator"
GPUS = 16
IES = "apis/accelstack.io/v1alpha1/namespaces/{ns}/inferenceendpoints"
GATE = "accelstack.io/gpr"
# kind -> list path in a namespace, for each kind of object the operator makes
CHILDREN = {
    "GPUProvisioningRequest": "apis/accelstack.io/v1alpha1/namespaces/{ns}/gpuprovisioningrequests",
    "Deployment": "apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "NetworkPolicy": "apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "HorizontalPodAutoscaler": "apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
}
# what the Deployment controller makes below the operator's Deployments (owned by them, not by the endpoint)
GRANDCHILDREN = {"ReplicaSet": "apis/apps/v1/namespaces/{ns}/replicasets", "Pod": "api/v1/namespaces/{ns}/pods"}


def example_endpoint(namespace: str, name: str = "llama") -> dict[str, Any]:
    """The shipped example (primary pool 1..4 with an HPA on in-flight requests and queue wait, a burst pool), with
    16 GPUs per replica (the CRD's maximum) instead of 1: no fake node of this session has that many, so its GPRs
    wait in the queue (the GPR controller calls them Unschedulable, and such a GPR blocks and evicts no one else's
    in the shared control plane) and the burst pool opens."""
    obj = copy.deepcopy(yaml.safe_load((ROOT / "manifests/examples/inference-endpoint.yaml").read_text()))
    obj["metadata"] = {"name": name, "namespace": namespace}
    obj["spec"]["accelerator"]["count"] = GPUS
    obj["spec"]["burst"]["accelerator"]["count"] = GPUS
    return dict(obj)


# ---- fixtures -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def operator(cp: ControlPlane, stack: Stack, shipped: list[dict[str, Any]]) -> Iterator[Product]:
    """The operator as the shipped Deployment runs it (its args, POD_NAME), under its shipped ServiceAccount, with
    kube-controller-manager running (stopped again afterwards when this module started it, so later modules find
    the control plane as they expect it)."""
    started_kcm = "kube-controller-manager" not in cp.procs
    cp.start_controller_manager()
    dep = pick(shipped, "Deployment", OPERATOR)
    pod_spec = dep["spec"]["template"]["spec"]
    sa = pod_spec["serviceAccountName"]
    namespace = dep["metadata"].get("namespace")
    assert (sa, namespace) == (OPERATOR, SYSTEM_NS), (sa, namespace)
    container = pod_spec["containers"][0]
    port = free_port()
    args = [a for a in container["args"] if not a.startswith("--listen=")]
    args += [f"--listen=127.0.0.1:{port}", "--kubeconfig", str(cp.sa_kubeconfig(namespace, sa))]
    proc = Product(cp, "inference-operator", "inference.operator.main", args,
                   env={"POD_NAME": f"{OPERATOR}-0"}, health=f"http://127.0.0.1:{port}")
    proc.start(ready_timeout=90)
    try:
        yield proc
    finally:
        proc.stop()
        if started_kcm:
            cp.stop_component("kube-controller-manager")




# ---- helpers --------------------------------------------------------------------------------------------------
def items(cp: ControlPlane, path: str, selector: str = "") -> list[dict[str, Any]]:
    query = f"?labelSelector={selector}" if selector else ""
    return list(cp.api("GET", path + query).get("items") or [])


def children(cp: ControlPlane, ns: str) -> dict[str, list[dict[str, Any]]]:
    """Every object of a kind the operator makes, in ``ns``, by kind (whoever made it)."""
    out = {kind: items(cp, path.format(ns=ns)) for kind, path in CHILDREN.items()}
    out["Service"] = [s for s in out["Service"] if s["metadata"]["name"] != "kubernetes"]
    return out


def names(objs: list[dict[str, Any]]) -> set[str]:
    return {o["metadata"]["name"] for o in objs}


def controller_ref(obj: dict[str, Any]) -> dict[str, Any]:
    refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
    assert len(refs) == 1, obj["metadata"]
    return dict(refs[0])


def log_lines(proc: Product) -> list[dict[str, Any]]:
    out = []
    for line in proc.log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            rec = {"msg": line, "unparsed": True}
        if isinstance(rec, dict):
            out.append(rec)
    return out


def assert_nothing_refused(proc: Product, namespace: str) -> None:
    """No call of the operator was refused by RBAC (no 403 but the NamespaceLifecycle plugin's, for an earlier
    test's namespace that is being deleted), and no reconcile of an endpoint in ``namespace`` failed."""
    for rec in log_lines(proc):
        assert not rec.get("unparsed"), rec
        text = json.dumps({k: v for k, v in rec.items() if k != "ts"})
        if re.search(r"\b403\b", text) or "forbidden" in text.lower():
            assert "unable to create new content in namespace" in text and namespace not in text, rec
        if str(rec.get("msg", "")).startswith(("reconcile failed", "reconcile crashed")):
            assert not str(rec.get("endpoint", "")).startswith(f"{namespace}/"), rec


def mine(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The operator's entries in the object's managedFields (what it wrote, and when)."""
    return [m for m in obj["metadata"].get("managedFields") or [] if m["manager"] == OPERATOR]


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


EXPECTED = {"GPUProvisioningRequest": {"llama-primary", "llama-burst"},
            "Deployment": {"llama-primary", "llama-burst"}, "Service": {"llama-primary", "llama-burst"},
            "PodDisruptionBudget": {"llama"}, "NetworkPolicy": {"llama"}, "HorizontalPodAutoscaler": {"llama"}}


def reconciled(cp: ControlPlane, ns: str, name: str = "llama") -> dict[str, Any]:
    """Create the example endpoint and wait until every child is there and the status reports the queued primary
    GPR (so the burst pool is open too); the endpoint as stored."""
    cp.create(IES.format(ns=ns), example_endpoint(ns, name))

    def complete() -> dict[str, list[dict[str, Any]]] | None:
        got = children(cp, ns)
        return got if {k: names(v) for k, v in got.items()} == EXPECTED else None

    wait_for("every child of the endpoint", complete, timeout=90)
    return wait_for("the endpoint's status to follow the queued primary GPR",
                    lambda: (e := cp.get(f"{IES.format(ns=ns)}/{name}")) and
                    ((e.get("status") or {}).get("pools") or {}).get("primary", {}).get("gprPhase") and
                    condition(e, "ScalingLimited").get("reason") == "GPRQueued" and e, timeout=90)


# ---- (1) children with owner references, status, through the admission chain ---------------------------------------
def test_endpoint_becomes_owned_children_and_a_status(cp: ControlPlane, operator: Product, ns: str) -> None:
    ep = reconciled(cp, ns)
    uid = ep["metadata"]["uid"]
    got = children(cp, ns)
    for kind, objs in got.items():
        for obj in objs:
            ref = controller_ref(obj)
            assert (ref["apiVersion"], ref["kind"], ref["name"], ref["uid"], ref.get("blockOwnerDeletion")) == \
                ("accelstack.io/v1alpha1", "InferenceEndpoint", "llama", uid, True), (kind, ref)
            labels = obj["metadata"]["labels"]
            assert labels["app.kubernetes.io/managed-by"] == OPERATOR and \
                labels["accelstack.io/inference-endpoint"] == "llama", (kind, labels)
            # written by the operator's own identity (its field manager), not by the admin
            managers = {m["manager"] for m in obj["metadata"].get("managedFields") or [] if m["operation"] != "Apply"}
            assert OPERATOR in managers, (kind, managers)

    gprs = {g["metadata"]["name"]: g for g in got["GPUProvisioningRequest"]}
    # the GPRs went through the shipped validating webhook and the real GPR controller queues them
    want = {"resource": "nvidia.com/gpu", "devicesPerNode": GPUS, "nodeCount": 1, "priority": 200,
            "preemptible": False}
    assert want.items() <= gprs["llama-primary"]["spec"].items(), gprs["llama-primary"]["spec"]
    assert gprs["llama-burst"]["spec"]["priority"] == 50 and gprs["llama-burst"]["spec"]["preemptible"] is True
    gpr_status = wait_for("the GPR controller's status on the primary GPR", lambda: (
        (cp.get(f"{CHILDREN['GPUProvisioningRequest'].format(ns=ns)}/llama-primary") or {}).get("status")))
    assert (gpr_status["phase"], gpr_status.get("reason")) == ("Queued", "Unschedulable"), gpr_status

    # the status the operator writes (status subresource) from what the real controllers report
    status = ep["status"]
    assert status["url"] == "http://accelstack-gateway.accelstack-system.svc/v1"  # the shipped --gateway-url
    assert status["pools"]["primary"]["desiredReplicas"] == 1 and status["pools"]["primary"]["gprPhase"] == "Queued"
    assert status["pools"]["burst"]["desiredReplicas"] == 1
    assert condition(ep, "Ready")["status"] == "False" and condition(ep, "Ready")["reason"] == "NoReadyReplica"
    assert condition(ep, "Bursting")["status"] == "True"
    assert "llama-primary is Queued" in condition(ep, "ScalingLimited")["message"]

    # the real Deployment controller made pods from the operator's template, and the shipped pod webhook gated
    # them on the pool's GPR (the Deployments' pods wait in the GPR queue like any other workload)
    def two_pods() -> list[dict[str, Any]] | None:
        ps = items(cp, GRANDCHILDREN["Pod"].format(ns=ns), "accelstack.io/inference-endpoint=llama")
        return ps if len(ps) == 2 else None

    # (the autoscaled primary pool's pod is made naming llama-primary-new, no GPR, and the operator points it at the
    # GPR of a free replica slot: here the base GPR, issue 35.6b)
    def on_their_gprs() -> list[dict[str, Any]] | None:
        ps = two_pods() or []
        return ps if ps and all(p["metadata"]["labels"][GATE] == f"llama-{p['metadata']['labels']['accelstack.io/pool']}"
                                for p in ps) else None

    pods = wait_for("a pod per pool, each on its pool's GPR", on_their_gprs)
    for pod in pods:
        pool = pod["metadata"]["labels"]["accelstack.io/pool"]
        assert pod["metadata"]["labels"][GATE] == f"llama-{pool}"
        assert [g["name"] for g in pod["spec"].get("schedulingGates") or []] == [GATE], pod["spec"]
        assert pod["spec"]["schedulerName"] == "accelstack-scheduler"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(GPUS)
        assert controller_ref(pod)["kind"] == "ReplicaSet"

    # the operator recorded events on the endpoint (events: create)
    events = wait_for("the operator's events on the endpoint", lambda: [
        e for e in items(cp, f"api/v1/namespaces/{ns}/events")
        if e["involvedObject"].get("uid") == uid and e.get("reportingComponent") == OPERATOR])
    assert {"GPRQueued", "PrimarySaturated"} <= {e["reason"] for e in events}, events
    assert_nothing_refused(operator, ns)


# ---- (2) the real garbage collector removes the children --------------------------------------------------------
@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_deleting_the_endpoint_has_the_garbage_collector_remove_every_child(
        cp: ControlPlane, operator: Product, ns: str, propagation: str) -> None:
    ep = reconciled(cp, ns)
    wait_for("the Deployment controller's ReplicaSets and pods", lambda: all(
        len(items(cp, path.format(ns=ns), "accelstack.io/inference-endpoint=llama")) == 2
        for path in GRANDCHILDREN.values()))
    created_before = sum(1 for r in log_lines(operator) if r.get("msg") == "created")
    path = f"{IES.format(ns=ns)}/llama"
    cp.api("DELETE", path, {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation,
                            "preconditions": {"uid": ep["metadata"]["uid"]}})
    if propagation == "Foreground":
        # the endpoint stays, marked, until the collector has deleted every child that blocks its deletion
        marked = cp.get(path)
        if marked is not None:
            assert "foregroundDeletion" in marked["metadata"].get("finalizers", []), marked["metadata"]
            assert marked["metadata"].get("deletionTimestamp")

    def all_gone() -> bool:
        left = {k: names(v) for k, v in children(cp, ns).items() if v}
        left |= {k: names(v) for k, p in GRANDCHILDREN.items() if (v := items(cp, p.format(ns=ns)))}
        return not left and cp.get(path) is None

    wait_for("the garbage collector to remove the endpoint's children (and theirs)", all_gone, timeout=120)
    # the operator did not fight the collector: nothing came back, nothing was created for a deleted endpoint
    assert not any(v for v in children(cp, ns).values())
    created_after = sum(1 for r in log_lines(operator) if r.get("msg") == "created")
    assert created_after == created_before, [r for r in log_lines(operator) if r.get("msg") == "created"][-5:]
    assert_nothing_refused(operator, ns)


# ---- (3) the HPA is accepted and read by the real HPA controller; the two do not fight ------------------------------
def test_the_real_hpa_controller_reads_the_operators_hpa_and_neither_undoes_the_other(
        cp: ControlPlane, operator: Product, ns: str) -> None:
    reconciled(cp, ns)
    hpa_path = f"{CHILDREN['HorizontalPodAutoscaler'].format(ns=ns)}/llama"
    hpa = cp.get(hpa_path)
    assert hpa is not None
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-primary"}
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods", "External"]

    # the HPA controller (kube-controller-manager, its own ServiceAccount) writes the status: it found the
    # target's scale, and no custom or external metrics API answers on this cluster
    def active_condition() -> dict[str, Any] | None:
        obj = cp.get(hpa_path)
        c = condition(obj, "ScalingActive")
        return obj if c.get("status") == "False" and condition(obj, "AbleToScale").get("status") == "True" else None

    seen = wait_for("the HPA controller's conditions on the operator's HPA", active_condition, timeout=90)
    active = condition(seen, "ScalingActive")
    # the first metric (Pods: the gateway's in-flight requests per replica) is the one it reports
    assert active["reason"] == "FailedGetPodsMetric" and "accelstack_gateway_replica_inflight" in active["message"] \
        and "custom.metrics.k8s.io" in active["message"], seen["status"]
    assert seen["status"].get("currentReplicas") == 1
    hpa_events = [e for e in items(cp, f"api/v1/namespaces/{ns}/events")
                  if e["involvedObject"].get("kind") == "HorizontalPodAutoscaler"]
    assert any(e.get("source", {}).get("component") == "horizontal-pod-autoscaler" or
               e.get("reportingComponent") == "horizontal-pod-autoscaler" for e in hpa_events), hpa_events
    # issue 37.5: the endpoint says so, with the HPA's reason and the fix, and a Warning event on it
    ep = wait_for("the endpoint's Autoscaling condition", lambda: (e := cp.get(f"{IES.format(ns=ns)}/llama")) and
                  condition(e, "Autoscaling").get("status") == "False" and e, timeout=60)
    auto = condition(ep, "Autoscaling")
    assert auto["reason"] == "FailedGetPodsMetric" and "Prometheus Adapter" in auto["message"] \
        and "manifests/inference/prometheus-adapter.yaml" in auto["message"] \
        and "custom.metrics.k8s.io" in auto["message"], auto
    assert any(e["involvedObject"].get("kind") == "InferenceEndpoint" and e.get("reason") == "FailedGetPodsMetric"
               and e.get("type") == "Warning" for e in items(cp, f"api/v1/namespaces/{ns}/events"))

    # a scale as the autoscaler makes it (the Deployment's scale subresource) is kept by the operator: its next
    # pass reports it as desired and leaves the count alone
    scale = f"apis/apps/v1/namespaces/{ns}/deployments/llama-primary/scale"
    cp.patch(scale, {"spec": {"replicas": 3}})
    ep = wait_for("the operator to report the autoscaler's count", lambda: (e := cp.get(
        f"{IES.format(ns=ns)}/llama")) and (e.get("status") or {}).get("pools", {}).get("primary", {})
        .get("desiredReplicas") == 3 and e)
    assert ep["status"]["pools"]["primary"]["desiredReplicas"] == 3

    # several HPA controller syncs later (it writes the status every 2 s here), the operator has not rewritten
    # the HPA's spec nor the Deployment's count, and the HPA controller has not changed the count either
    before = cp.get(hpa_path)
    assert before is not None
    wait_for("more HPA controller writes", lambda: (h := cp.get(hpa_path)) and
             h["metadata"]["resourceVersion"] != before["metadata"]["resourceVersion"] and h, timeout=60)
    after = cp.get(hpa_path)
    assert after is not None and after["spec"] == before["spec"]
    assert mine(after) == mine(before) and len(mine(after)) == 1, after["metadata"]["managedFields"]
    dep = cp.get(f"{CHILDREN['Deployment'].format(ns=ns)}/llama-primary")
    assert dep is not None and dep["spec"]["replicas"] == 3
    # the burst pool follows the primary's new count; the primary's GPR keeps asking for replicas.min and each
    # replica added gets a GPR of its own (issue 35.6b: a GPR per replica, tests/realcluster/test_endpoint_growth.py);
    # nothing else changed
    updates = [(r.get("kind"), r.get("object")) for r in log_lines(operator)
               if r.get("msg") == "updated" and r.get("endpoint") == f"{ns}/llama"]
    assert set(updates) <= {("Deployment", "llama-burst")}, updates
    gprs = CHILDREN["GPUProvisioningRequest"].format(ns=ns)
    wait_for("a GPR per added replica", lambda: cp.get(f"{gprs}/llama-primary-2") and cp.get(f"{gprs}/llama-primary-3"))
    gpr = cp.get(f"{gprs}/llama-primary")
    assert gpr is not None and gpr["spec"]["nodeCount"] == 1 and gpr["status"].get("phase") != "Admitted"
    assert_nothing_refused(operator, ns)


# ---- (4) the shipped RBAC: enough for every write, and no more -------------------------------------------------
def test_the_shipped_rbac_allows_the_operators_writes_and_refuses_the_rest(
        cp: ControlPlane, operator: Product, ns: str) -> None:
    reconciled(cp, ns)
    assert_nothing_refused(operator, ns)
    lease = cp.get(f"apis/coordination.k8s.io/v1/namespaces/{SYSTEM_NS}/leases/{OPERATOR}")
    assert lease is not None and lease["spec"]["holderIdentity"] == f"{OPERATOR}-0"

    kc = cp.sa_kubeconfig(SYSTEM_NS, OPERATOR)
    allowed = [("create", "deployments.apps", ns, ""), ("update", "horizontalpodautoscalers.autoscaling", ns, ""),
               ("delete", "gpuprovisioningrequests.accelstack.io", ns, ""), ("delete", "pods", ns, ""),
               ("update", "inferenceendpoints.accelstack.io", ns, "status"), ("create", "events", ns, ""),
               ("watch", "nodes", None, "")]
    for verb, resource, namespace, sub in allowed:
        assert cp.can_i(kc, verb, resource, namespace=namespace, subresource=sub), (verb, resource, sub)
    refused = [("get", "secrets", ns, ""), ("list", "secrets", None, ""), ("get", "secrets", SYSTEM_NS, ""),
               ("delete", "nodes", None, ""), ("update", "nodes", None, ""), ("create", "pods", ns, ""),
               ("patch", "deployments.apps", ns, ""), ("deletecollection", "deployments.apps", ns, ""),
               ("update", "inferenceendpoints.accelstack.io", ns, ""),
               ("delete", "inferenceendpoints.accelstack.io", ns, ""),
               ("create", "inferenceendpoints.accelstack.io", ns, ""), ("update", "gprtemplates.accelstack.io", ns, ""),
               ("create", "rolebindings.rbac.authorization.k8s.io", ns, ""), ("create", "serviceaccounts", ns, "token"),
               ("update", "configmaps", SYSTEM_NS, ""), ("create", "pods", ns, "exec"), ("create", "pods", ns, "eviction"),
               ("update", "workspaces.accelstack.io", None, ""), ("impersonate", "serviceaccounts", ns, "")]
    for verb, resource, namespace, sub in refused:
        assert not cp.can_i(kc, verb, resource, namespace=namespace, subresource=sub), (verb, resource, namespace, sub)
    # the Lease: only its own by name
    assert cp.can_i(kc, "update", f"leases.coordination.k8s.io/{OPERATOR}", namespace=SYSTEM_NS)
    assert not cp.can_i(kc, "update", "leases.coordination.k8s.io/accelstack-extender", namespace=SYSTEM_NS)
    assert not cp.can_i(kc, "create", "leases.coordination.k8s.io", namespace=ns)

    # and the server refuses such a call made with the operator's real token, not only can-i
    res = subprocess.run([cp.binary("kubectl"), "--kubeconfig", str(kc), "get", "secrets", "-n", SYSTEM_NS],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "forbidden" in res.stderr.lower(), res.stderr


# ---- (4b) the same under OwnerReferencesPermissionEnforcement -----------------------------------------------------
@contextlib.contextmanager
def apiserver_with(cp: ControlPlane, plugins: str) -> Iterator[str]:
    """A second kube-apiserver on the same etcd (as in an HA control plane), with ``--enable-admission-plugins``
    set to ``plugins``; its URL. Everything else as the fixture's own."""
    args = list(cp.apiserver_args)
    port = free_port()
    args[args.index("--secure-port") + 1] = str(port)
    args[args.index("--enable-admission-plugins") + 1] = plugins
    args[args.index("--cert-dir") + 1] = str(cp.dir / "apiserver-2-certs")
    proc = Process("kube-apiserver-2", args, cp.dir / "kube-apiserver-2.log")
    url = f"https://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            if not proc.alive():
                raise proc.fail("exited")
            try:
                with urllib.request.urlopen(f"{url}/readyz", context=cp.ssl_context(), timeout=5) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False
        wait_for("the second API server", ready, timeout=120, every=0.5)
        yield url
    finally:
        proc.stop()


def test_the_operators_children_are_allowed_where_owner_references_are_enforced(
        cp: ControlPlane, operator: Product, ns: str) -> None:
    """OwnerReferencesPermissionEnforcement (an upstream admission plugin; OpenShift turns it on) lets a client set
    ``blockOwnerDeletion`` on a reference only when it may update the owner's ``finalizers``. The operator sets it
    on every child (so a foreground deletion of the endpoint waits for them): its shipped ClusterRole must carry
    ``inferenceendpoints/finalizers: update`` or every create is refused on such a cluster."""
    ep = reconciled(cp, ns)
    kc = cp.sa_kubeconfig(SYSTEM_NS, OPERATOR)
    assert cp.can_i(kc, "update", "inferenceendpoints.accelstack.io", namespace=ns, subresource="finalizers")
    # exactly what the operator creates, under other names, sent with its token to a server enforcing the plugin
    autoscaler = o.hpa(ep)
    assert autoscaler is not None
    wanted = [o.service(ep, "primary"), o.pdb(ep), o.network_policy(ep, o.OperatorSettings()), autoscaler,
              o.deployment(ep, "primary", 0, o.OperatorSettings()), o.gpr(ep, "primary")]
    with apiserver_with(cp, "NodeRestriction,OwnerReferencesPermissionEnforcement") as url:
        conf = json.loads(kc.read_text())
        conf["clusters"][0]["cluster"]["server"] = url
        kc2 = cp.dir / "operator-on-apiserver-2.kubeconfig"
        kc2.write_text(json.dumps(conf))
        for obj in wanted:
            obj = copy.deepcopy(obj)
            obj["metadata"]["name"] = f"orpe-{obj['metadata']['name']}"
            assert obj["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] is True
            res = subprocess.run([cp.binary("kubectl"), "--kubeconfig", str(kc2), "create", "-f", "-"],
                                 input=json.dumps(obj), capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, (obj["kind"], res.stderr)
        # and the plugin is on: a user who may create Services but not update the endpoint's finalizers is refused
        cp.apply([{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "services-only", "namespace": ns},
                   "rules": [{"apiGroups": [""], "resources": ["services"], "verbs": ["create", "delete"]}]},
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "services-only", "namespace": ns},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "services-only"},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "svc-maker"}]}])
        user = json.loads(cp.user_kubeconfig("svc-maker").read_text())
        user["clusters"][0]["cluster"]["server"] = url
        kc3 = cp.dir / "svc-maker-on-apiserver-2.kubeconfig"
        kc3.write_text(json.dumps(user))
        svc = copy.deepcopy(wanted[0])
        svc["metadata"]["name"] = "orpe-by-user"
        res = subprocess.run([cp.binary("kubectl"), "--kubeconfig", str(kc3), "create", "-f", "-"],
                             input=json.dumps(svc), capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "blockOwnerDeletion" in res.stderr, res.stderr


# ---- (5) an endpoint in a workspace that bounds exitDuration (issue 35.6a) ---------------------------------------
def test_an_endpoint_in_a_workspace_with_max_exit_duration_gets_its_gpr_admitted_by_the_webhook(
        cp: ControlPlane, operator: Product, ns: str) -> None:
    """Before: the shipped GPR webhook refused the operator's GPR (no exitDuration), the endpoint made nothing and
    had no status, only a log line said so. Now the GPR carries the workspace's maxExitDuration and passes."""
    ws = f"ie-{ns}"[:63]
    cp.create("apis/accelstack.io/v1alpha1/workspaces", {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ws},
        "spec": {"namespaces": [ns], "policy": {"maxExitDuration": "2h"}}})
    try:
        wait_for("the namespace to join the workspace", lambda: (
            (cp.get(f"api/v1/namespaces/{ns}") or {}).get("metadata", {}).get("labels", {})
            .get("accelstack.io/workspace") == ws), timeout=60)
        ep = reconciled(cp, ns)
        gpr = cp.get(f"{CHILDREN['GPUProvisioningRequest'].format(ns=ns)}/llama-primary")
        assert gpr is not None and gpr["spec"]["exitDuration"] == "2h", gpr
        assert condition(ep, "Ready")["reason"] == "NoReadyReplica", ep["status"]
    finally:
        cp.api("DELETE", f"apis/accelstack.io/v1alpha1/workspaces/{ws}")
