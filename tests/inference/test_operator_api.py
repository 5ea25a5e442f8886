"""The CG operator against the API-server peer (REST + watch): owned objects created, updated and deleted,
status and events written, a replica on an unhealthy node replaced, access reaching the NetworkPolicy, bad
specs refused, a queued GPR making the endpoint burst, and a restart that changes nothing."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from inference.operator.controller import FIELD_MANAGER, Operator
from kubeapi.client import connected
from tests.apiserver_peer import APIServerPeer
from tests.extender.test_crds import admit
from tests.inference.harness import eventually
from tests.inference.test_operator_decide import EXAMPLE

IE = "apis/accelstack.io/v1alpha1/inferenceendpoints"
DEP = "apis/apps/v1/deployments"
SVC = "api/v1/services"
GPR = "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"
PDB = "apis/policy/v1/poddisruptionbudgets"
NP = "apis/networking.k8s.io/v1/networkpolicies"
HPA = "apis/autoscaling/v2/horizontalpodautoscalers"
PODS = "api/v1/pods"
NODES = "api/v1/nodes"
EVENTS = "api/v1/events"


def endpoint() -> dict[str, Any]:
    stored, errors = admit("inferenceendpoints", yaml.safe_load(EXAMPLE.read_text()))
    assert errors == []
    stored["metadata"]["generation"] = 1
    return stored


class Running:
    def __init__(self, apiserver: APIServerPeer, operator: Operator) -> None:
        self.apiserver, self.operator = apiserver, operator
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.operator.run_informers(self.stop)),
                      asyncio.create_task(self.operator.run_workers(self.stop))]

    async def close(self) -> None:
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def apiserver() -> AsyncIterator[APIServerPeer]:
    peer = APIServerPeer()
    await peer.start()
    yield peer
    await peer.stop()


@pytest.fixture
async def operator(apiserver: APIServerPeer) -> AsyncIterator[Running]:
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        running = Running(apiserver, Operator(kube, resync=60))
        yield running
        await running.close()


def get(apiserver: APIServerPeer, resource: str, name: str, namespace: str = "team-a") -> dict[str, Any] | None:
    return apiserver.get(resource, namespace, name)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def events(apiserver: APIServerPeer, reason: str) -> list[dict[str, Any]]:
    return [o for (r, _, _), o in apiserver.objects.items() if r == EVENTS and o.get("reason") == reason]


async def test_endpoint_becomes_its_objects_and_follows_updates(apiserver: APIServerPeer, operator: Running) -> None:
    created = await apiserver.put_object(IE, endpoint())
    uid = created["metadata"]["uid"]
    operator.start()
    names = [(DEP, "llama-primary"), (DEP, "llama-burst"), (SVC, "llama-primary"), (SVC, "llama-burst"),
             (GPR, "llama-primary"), (PDB, "llama"), (NP, "llama"), (HPA, "llama")]
    await eventually(lambda: all(get(apiserver, r, n) for r, n in names), what="owned objects created")
    for resource, name in names:
        obj = get(apiserver, resource, name)
        assert obj is not None and obj["metadata"]["ownerReferences"][0]["uid"] == uid, (resource, name)
    assert get(apiserver, GPR, "llama-burst") is None  # the burst GPR exists only while bursting
    await eventually(lambda: condition(get(apiserver, IE, "llama"), "Ready").get("reason") == "NoReadyReplica",
                     what="status written")
    status = get(apiserver, IE, "llama")["status"]  # type: ignore[index]
    assert status["observedGeneration"] == 1 and status["url"].endswith("/v1")

    # the Deployment controller reports ready replicas: the endpoint is Ready
    dep = copy.deepcopy(get(apiserver, DEP, "llama-primary"))
    assert dep is not None
    dep["status"] = {"replicas": 1, "readyReplicas": 1}
    await apiserver.put_object(DEP, dep, "MODIFIED")
    await eventually(lambda: condition(get(apiserver, IE, "llama"), "Ready").get("status") == "True",
                     what="Ready once a replica is")

    # an update: new image, access widened, burst pool removed
    ep = copy.deepcopy(get(apiserver, IE, "llama"))
    assert ep is not None
    ep["metadata"]["generation"] = 2
    ep["spec"]["template"]["image"] = "registry.example.com/team-a/vllm-openai:0.7.0"
    ep["spec"]["access"]["namespaces"] = ["team-b", "team-c"]
    del ep["spec"]["burst"]
    await apiserver.put_object(IE, ep, "MODIFIED")

    def updated() -> bool:
        d = get(apiserver, DEP, "llama-primary")
        n = get(apiserver, NP, "llama")
        return bool(d and n and d["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.7.0")
                    and any(p.get("namespaceSelector", {}).get("matchExpressions", [{}])[0].get("values")
                            == ["team-b", "team-c"] for p in n["spec"]["ingress"][0]["from"]))

    await eventually(updated, what="Deployment and NetworkPolicy updated")
    await eventually(lambda: get(apiserver, DEP, "llama-burst") is None and get(apiserver, SVC, "llama-burst") is None,
                     what="burst objects deleted")
    await eventually(lambda: get(apiserver, IE, "llama")["status"]["observedGeneration"] == 2,  # type: ignore[index]
                     what="observedGeneration follows")
    assert get(apiserver, DEP, "llama-primary")["spec"]["replicas"] == 1  # type: ignore[index]


async def test_autoscaler_owns_the_replica_count(apiserver: APIServerPeer, operator: Running) -> None:
    await apiserver.put_object(IE, endpoint())
    operator.start()
    await eventually(lambda: get(apiserver, DEP, "llama-primary") is not None, what="Deployment")
    dep = copy.deepcopy(get(apiserver, DEP, "llama-primary"))
    assert dep is not None
    dep["spec"]["replicas"] = 3  # the HPA scaled it
    await apiserver.put_object(DEP, dep, "MODIFIED")
    writes_before = len([m for m, q in apiserver.requests if m == "PUT" and "/deployments/" in q])
    await eventually(lambda: condition(get(apiserver, IE, "llama"), "Degraded").get("message", "").startswith(
        "0 of 3"), what="status sees 3 desired")
    assert get(apiserver, DEP, "llama-primary")["spec"]["replicas"] == 3  # type: ignore[index]
    assert len([m for m, q in apiserver.requests if m == "PUT" and "/deployments/" in q]) == writes_before


async def test_replica_on_unhealthy_node_is_replaced(apiserver: APIServerPeer, operator: Running) -> None:
    await apiserver.put_object(IE, endpoint())
    await apiserver.put_object(NODES, {"metadata": {"name": "gpu-1"}, "status": {"conditions": [
        {"type": "GPUUnhealthy", "status": "False"}]}})
    await apiserver.put_object(PODS, {"metadata": {"name": "llama-primary-abc", "namespace": "team-a",
                                                   "labels": {"accelstack.io/inference-endpoint": "llama",
                                                              "accelstack.io/pool": "primary"}},
                                      "spec": {"nodeName": "gpu-1", "containers": []}, "status": {"phase": "Running"}})
    operator.start()
    await eventually(lambda: get(apiserver, DEP, "llama-primary") is not None, what="reconciled")
    assert get(apiserver, PODS, "llama-primary-abc") is not None  # healthy node: left alone
    await apiserver.put_object(NODES, {"metadata": {"name": "gpu-1"}, "status": {"conditions": [
        {"type": "GPUUnhealthy", "status": "True", "reason": "XID", "message": "XID 79 on GPU 0"}]}}, "MODIFIED")
    await eventually(lambda: get(apiserver, PODS, "llama-primary-abc") is None, what="replica deleted")
    await eventually(lambda: bool(events(apiserver, "ReplicaReplaced")), what="event")
    (event,) = events(apiserver, "ReplicaReplaced")
    assert event["type"] == "Warning" and "XID 79" in event["message"]
    assert event["involvedObject"]["kind"] == "InferenceEndpoint" and event["involvedObject"]["name"] == "llama"


async def test_bad_spec_is_refused_with_a_reason(apiserver: APIServerPeer, operator: Running) -> None:
    bad = endpoint()
    bad["spec"]["template"].pop("image")  # written without the CRD's validation
    await apiserver.put_object(IE, bad)
    operator.start()
    await eventually(lambda: condition(get(apiserver, IE, "llama"), "Ready").get("reason") == "InvalidSpec",
                     what="InvalidSpec")
    assert "spec.template.image is required" in condition(get(apiserver, IE, "llama"), "Ready")["message"]
    assert not [k for k in apiserver.objects if k[0] in (DEP, SVC, GPR, HPA)]
    await eventually(lambda: bool(events(apiserver, "InvalidSpec")), what="warning event")


async def test_queued_gpr_shows_scaling_limited_and_bursts(apiserver: APIServerPeer, operator: Running) -> None:
    await apiserver.put_object(IE, endpoint())
    operator.start()
    await eventually(lambda: get(apiserver, GPR, "llama-primary") is not None, what="GPR created")
    g = copy.deepcopy(get(apiserver, GPR, "llama-primary"))
    assert g is not None
    g["status"] = {"phase": "Queued", "queuePosition": 3, "estimatedStart": "2026-11-30T13:00:00Z"}
    await apiserver.put_object(GPR, g, "MODIFIED")
    await eventually(lambda: (get(apiserver, DEP, "llama-burst") or {}).get("spec", {}).get("replicas") == 1,
                     what="burst pool scaled up")
    await eventually(lambda: get(apiserver, GPR, "llama-burst") is not None, what="burst GPR created")
    await eventually(lambda: condition(get(apiserver, IE, "llama"), "Bursting").get("status") == "True",
                     what="Bursting")
    ep = get(apiserver, IE, "llama")
    limited = condition(ep, "ScalingLimited")
    assert limited["status"] == "True" and "position 3" in limited["message"]
    assert ep is not None and ep["status"]["estimatedStart"] == "2026-11-30T13:00:00Z"


async def test_restart_changes_nothing(apiserver: APIServerPeer, operator: Running) -> None:
    await apiserver.put_object(IE, endpoint())
    operator.start()
    await eventually(lambda: condition(get(apiserver, IE, "llama"), "Ready").get("reason") == "NoReadyReplica",
                     what="first operator done")
    await operator.close()
    writes = len([m for m, _ in apiserver.requests if m in ("POST", "PUT", "PATCH", "DELETE")])
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        second = Running(apiserver, Operator(kube, resync=60))
        second.start()
        try:
            await eventually(lambda: second.operator.synced() and not second.operator._queue, what="second synced")
            await eventually(lambda: second.operator.reconciles.labels("ok")._value.get() >= 1, what="reconciled")
        finally:
            await second.close()
    assert len([m for m, _ in apiserver.requests if m in ("POST", "PUT", "PATCH", "DELETE")]) == writes


async def test_operator_process_leads_reconciles_and_releases_on_sigterm(apiserver: APIServerPeer,
                                                                        tmp_path: Any) -> None:
    import os
    import signal
    import sys

    from tests.inference.test_gateway_process import free_port

    await apiserver.put_object(IE, endpoint())
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: peer, cluster: {{server: "{apiserver.url}"}}}}]
users: [{{name: test, user: {{}}}}]
contexts: [{{name: peer, context: {{cluster: peer, user: test}}}}]
current-context: peer
""")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inference.operator.main", "--kubeconfig", str(kubeconfig), "--listen",
        f"127.0.0.1:{port}", "--lease-seconds", "3", "--log-format", "text",
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "POD_NAME": "operator-0"})
    try:
        await eventually(lambda: get(apiserver, DEP, "llama-primary") is not None, timeout=20,
                         what="the process reconciled the endpoint")
        # its listener has every accelstack listener's bounds: no version banner, a fixed answer to malformed
        # HTTP that quotes nothing of the request
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = (await reader.read()).split(b"\r\n\r\n")[0].lower()
        writer.close()
        assert head.startswith(b"http/1.1 200") and b"server: accelstack" in head and b"python" not in head, head
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\nAuthorization: Bearer s3cret-token\x7f\n\n")
        answer = await reader.read()
        writer.close()
        assert answer.split(b" ")[1] == b"400" and b"s3cret" not in answer, answer
        lease = apiserver.get("apis/coordination.k8s.io/v1/leases", "accelstack-system",
                              "accelstack-inference-operator")
        assert lease is not None and lease["spec"]["holderIdentity"] == "operator-0"
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0
    lease = apiserver.get("apis/coordination.k8s.io/v1/leases", "accelstack-system", "accelstack-inference-operator")
    assert lease is not None and lease["spec"]["holderIdentity"] == ""  # released: a peer takes over at once


async def test_every_request_is_allowed_by_the_shipped_rbac(apiserver: APIServerPeer, operator: Running) -> None:
    from tests.inference.test_inference_manifests import allowed, request_verb, rules_of

    await apiserver.put_object(IE, endpoint())
    await apiserver.put_object(NODES, {"metadata": {"name": "gpu-1"}, "spec": {"taints": [
        {"key": "accelstack.io/unhealthy", "effect": "NoSchedule"}]}})
    await apiserver.put_object(PODS, {"metadata": {"name": "llama-primary-x", "namespace": "team-a",
                                                   "labels": {"accelstack.io/inference-endpoint": "llama"}},
                                      "spec": {"nodeName": "gpu-1", "containers": []}})
    operator.start()
    await eventually(lambda: get(apiserver, PODS, "llama-primary-x") is None, what="pod replaced")
    ep = copy.deepcopy(get(apiserver, IE, "llama"))
    assert ep is not None
    del ep["spec"]["burst"]
    ep["spec"]["template"]["image"] = "other:1"
    await apiserver.put_object(IE, ep, "MODIFIED")
    await eventually(lambda: get(apiserver, DEP, "llama-burst") is None, what="burst deleted")
    rules = rules_of("accelstack-inference-operator")
    verbs = set()
    for method, path in apiserver.requests:
        group, resource, verb = request_verb(method, path)
        if resource == "leases":
            continue
        assert allowed(rules, group, resource, verb), f"{method} {path}: {verb} on {group or 'core'}/{resource}"
        verbs.add(verb)
    assert verbs >= {"list", "watch", "create", "update", "delete"}


async def test_a_scale_that_lands_after_the_plan_is_not_undone(apiserver: APIServerPeer) -> None:
    """The plan saw 1 replica; the HPA scaled to 3 before the write: the write keeps 3."""
    await apiserver.put_object(IE, endpoint())
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        op = Operator(kube, resync=60)
        stop = asyncio.Event()
        informers = asyncio.create_task(op.run_informers(stop))
        try:
            await eventually(op.synced, what="informers synced")
            await op.reconcile(("team-a", "llama"))
            await eventually(lambda: ("team-a", "llama-primary") in op.owned["Deployment"].objects, what="seen")
            endpoint_obj = copy.deepcopy(op.endpoints.objects[("team-a", "llama")])
            stale = op.observe(endpoint_obj)  # what a pass saw before the HPA acted
            dep = copy.deepcopy(get(apiserver, DEP, "llama-primary"))
            assert dep is not None
            dep["spec"]["replicas"] = 3
            dep["spec"]["template"]["spec"]["containers"][0]["image"] = "changed-by-hand:1"  # forces a write
            await apiserver.put_object(DEP, dep, "MODIFIED")
            await eventually(lambda: op.owned["Deployment"].objects[("team-a", "llama-primary")]["spec"][
                "replicas"] == 3, what="informer saw the scale")
            from inference.operator.decide import plan

            result = plan(endpoint_obj, stale, op.settings, "2026-11-30T12:00:00Z")
            (desired,) = [o for o in result.apply if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(
                "primary")]
            assert desired["spec"]["replicas"] == 1  # the stale plan
            await op._apply(endpoint_obj, desired)
            stored = get(apiserver, DEP, "llama-primary")
            assert stored is not None and stored["spec"]["replicas"] == 3
            assert stored["spec"]["template"]["spec"]["containers"][0]["image"].startswith("registry.example.com")
        finally:
            stop.set()
            informers.cancel()
            await asyncio.gather(informers, return_exceptions=True)


async def test_an_object_it_does_not_own_is_left_alone(apiserver: APIServerPeer, operator: Running) -> None:
    await apiserver.put_object(SVC, {"metadata": {"name": "llama-primary", "namespace": "team-a",
                                                  "labels": {"app.kubernetes.io/managed-by":
                                                             "accelstack-inference-operator"}},
                                     "spec": {"ports": [{"port": 1}]}})
    await apiserver.put_object(IE, endpoint())
    operator.start()
    await eventually(lambda: bool(events(apiserver, "ObjectNotOwned")), what="event")
    await eventually(lambda: get(apiserver, DEP, "llama-primary") is not None, what="the rest reconciled")
    assert get(apiserver, SVC, "llama-primary")["spec"] == {"ports": [{"port": 1}]}  # type: ignore[index]
    operator.operator.enqueue(("team-a", "llama"))
    await eventually(lambda: operator.operator.reconciles.labels("ok")._value.get() >= 2, what="second pass")
    assert len(events(apiserver, "ObjectNotOwned")) == 1


def test_own_writes_never_replace_something_newer_in_the_store() -> None:
    from inference.operator.controller import Store

    changed: list[Any] = []
    store = Store(changed.append)

    def obj(rv: str, note: str) -> dict[str, Any]:
        return {"metadata": {"namespace": "a", "name": "x", "resourceVersion": rv}, "note": note}

    store.event("ADDED", obj("1", "v1"))
    store.event("MODIFIED", obj("3", "v2 from the watch"))  # arrived while our write based on v1 was in flight
    store.record_write(obj("1", "v1"), obj("2", "our write"))
    assert store.objects[("a", "x")]["note"] == "v2 from the watch"
    store.record_write(obj("3", "v2"), obj("4", "our next write"))
    assert store.objects[("a", "x")]["note"] == "our next write"
    store.record_write(None, obj("5", "a create racing the watch"))  # the key exists: the watch's copy stays
    assert store.objects[("a", "x")]["note"] == "our next write"


WS = "apis/accelstack.io/v1alpha1/workspaces"
WEBHOOK_NO = ('admission webhook "gprs.accelstack.io" denied the request: spec.exitDuration: required in workspace '
              'team, at most 2h0m0s (spec.policy.maxExitDuration)')


async def test_a_refused_gpr_is_a_ready_false_condition_and_an_event(apiserver: APIServerPeer,
                                                                     operator: Running) -> None:
    """Issue 35.6: a refusal (here the GPR webhook's) was a log line only; the endpoint had no status at all."""
    fault = apiserver.inject("POST", "gpuprovisioningrequests", status=403, reason="Forbidden", message=WEBHOOK_NO)
    await apiserver.put_object(IE, endpoint())
    operator.start()
    await eventually(lambda: condition(get(apiserver, IE, "llama"), "Ready").get("reason") == "Refused",
                     what="Ready=False Refused")
    ready = condition(get(apiserver, IE, "llama"), "Ready")
    assert ready["status"] == "False"
    assert ready["message"].startswith("GPUProvisioningRequest team-a/llama-primary refused: admission webhook")
    assert "spec.exitDuration: required in workspace team" in ready["message"]
    # nothing is made behind a refused GPR: no Deployment whose pods would wait for a GPR that does not exist
    assert get(apiserver, DEP, "llama-primary") is None
    await eventually(lambda: bool(events(apiserver, "Refused")), what="warning event")
    fault.remove()


async def test_a_gpr_in_a_workspace_with_max_exit_duration_carries_it(apiserver: APIServerPeer,
                                                                        operator: Running) -> None:
    """Issue 35.6: the operator's GPR had no exitDuration, so a workspace's webhook refused it."""
    await apiserver.put_object(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
                                    "metadata": {"name": "team"},
                                    "spec": {"namespaces": ["team-a"], "policy": {"maxExitDuration": "2h"}}})
    await apiserver.put_object(IE, endpoint())
    operator.start()
    await eventually(lambda: get(apiserver, GPR, "llama-primary") is not None, what="GPR created")
    g = get(apiserver, GPR, "llama-primary")
    assert g is not None and g["spec"]["exitDuration"] == "2h"
    # when it reaches it (the GPR completes), a new GPR takes its place: the service outlives any one GPR
    done = copy.deepcopy(g)
    done["status"] = {"phase": "Complete", "reason": "ExitDurationReached"}
    await apiserver.put_object(GPR, done, "MODIFIED")
    await eventually(lambda: (x := get(apiserver, GPR, "llama-primary")) is not None and
                     x["metadata"]["uid"] != g["metadata"]["uid"], what="a new GPR")
    await eventually(lambda: bool(events(apiserver, "GPRRenewed")), what="renewal event")


def gated(name: str, gpr: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team-a", "creationTimestamp": f"2026-11-30T11:00:0{name[-1]}Z",
                         "labels": {"accelstack.io/inference-endpoint": "llama", "accelstack.io/pool": "primary",
                                    "accelstack.io/gpr": gpr}},
            "spec": {"schedulingGates": [{"name": "accelstack.io/gpr"}], "containers": []}}


async def base_gpr_running(apiserver: APIServerPeer, pod_name: str) -> None:
    """The endpoint's base GPR Running, with one replica pod past its gate on gpu-1."""
    base = copy.deepcopy(get(apiserver, GPR, "llama-primary"))
    assert base is not None
    base["status"] = {"phase": "Running"}
    await apiserver.put_object(GPR, base, "MODIFIED")
    running = gated(pod_name, "llama-primary")
    running["spec"] = {"nodeName": "gpu-1", "containers": []}
    await apiserver.put_object(PODS, running)


async def test_the_autoscalers_replicas_get_a_gpr_each_and_gated_pods_are_pointed_at_them(
        apiserver: APIServerPeer, operator: Running) -> None:
    """Issue 35.6b: the HPA scales 1 -> 3 with the base GPR running; GPRs llama-primary-2 and -3 are made and the
    two new pods (at the gate, naming llama-primary-new) are patched to name them, with a deletion cost; a pod whose
    gate was lifted meanwhile is not moved (the JSON patch's test fails and the next pass sees it)."""
    await apiserver.put_object(IE, endpoint())
    operator.start()
    await eventually(lambda: get(apiserver, GPR, "llama-primary") is not None, what="GPR created")
    await base_gpr_running(apiserver, "run-0")
    await eventually(lambda: get(apiserver, DEP, "llama-primary") is not None, what="Deployment")
    dep = copy.deepcopy(get(apiserver, DEP, "llama-primary"))
    assert dep is not None
    dep["spec"]["replicas"] = 3  # the HPA scaled it
    await apiserver.put_object(DEP, dep, "MODIFIED")
    await eventually(lambda: get(apiserver, GPR, "llama-primary-3") is not None, what="a GPR per added replica")
    for k in (2, 3):
        grown = get(apiserver, GPR, f"llama-primary-{k}")
        assert grown is not None and grown["spec"]["nodeCount"] == 1
    for pod in (gated("new-1", "llama-primary-new"), gated("new-2", "llama-primary-new")):
        await apiserver.put_object(PODS, pod)

    def labels() -> list[str]:
        return sorted((get(apiserver, PODS, n) or {})["metadata"]["labels"]["accelstack.io/gpr"]
                      for n in ("new-1", "new-2"))

    await eventually(lambda: "llama-primary-new" not in labels(), what="pods pointed at the replica GPRs")
    assert labels() == ["llama-primary-2", "llama-primary-3"]
    costs = sorted((get(apiserver, PODS, n) or {})["metadata"]["annotations"][
        "controller.kubernetes.io/pod-deletion-cost"] for n in ("new-1", "new-2"))
    assert costs == ["-2", "-3"]
    assert (get(apiserver, GPR, "llama-primary") or {})["spec"]["nodeCount"] == 1  # the running part untouched
    assert get(apiserver, PODS, "run-0")["metadata"]["labels"]["accelstack.io/gpr"] == "llama-primary"  # type: ignore[index]
    # a pod past its gate is never moved, even to a GPR that could take it sooner
    other = gated("new-3", "llama-primary-new")
    other["spec"] = {"schedulingGates": [], "containers": []}
    await apiserver.put_object(PODS, other)
    await asyncio.sleep(0.3)
    assert get(apiserver, PODS, "new-3")["metadata"]["labels"]["accelstack.io/gpr"] == "llama-primary-new"  # type: ignore[index]


async def test_a_pass_from_a_stale_pod_view_does_not_give_a_slot_to_a_second_pod(apiserver: APIServerPeer) -> None:
    """Two passes a few milliseconds apart: the first points new-1 at replica slot llama-primary-2; the second plans
    from a pod informer that has not shown that patch yet, with an older pod new-0 arrived meanwhile. Without the
    operator remembering its own assignment, the second pass gave llama-primary-2 to new-0 as well (found on the real
    cluster: one slot's GPR on two pods). Now new-0 gets the other slot."""
    await apiserver.put_object(IE, endpoint())
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        op = Operator(kube, resync=60)
        stop = asyncio.Event()
        informers = asyncio.create_task(op.run_informers(stop))
        key = ("team-a", "llama")
        try:
            await eventually(op.synced, what="informers synced")
            await op.reconcile(key)
            await eventually(lambda: ("team-a", "llama-primary") in op.owned["GPUProvisioningRequest"].objects,
                             what="base GPR seen")
            await base_gpr_running(apiserver, "run-9")
            await op.reconcile(key)
            await eventually(lambda: ("team-a", "llama-primary") in op.owned["Deployment"].objects, what="Deployment")
            dep = copy.deepcopy(get(apiserver, DEP, "llama-primary"))
            assert dep is not None
            dep["spec"]["replicas"] = 3  # the HPA scaled it
            await apiserver.put_object(DEP, dep, "MODIFIED")
            await eventually(lambda: op.owned["Deployment"].objects[("team-a", "llama-primary")]["spec"][
                "replicas"] == 3, what="informer saw the scale")
            await op.reconcile(key)
            await eventually(lambda: all(("team-a", f"llama-primary-{k}") in op.owned["GPUProvisioningRequest"].objects
                                         for k in (2, 3)), what="slot GPRs seen")
            await apiserver.put_object(PODS, gated("new-1", "llama-primary-new"))
            await eventually(lambda: ("team-a", "new-1") in op.pods.objects, what="new-1 seen")
            stale = copy.deepcopy(op.pods.objects[("team-a", "new-1")])
            await op.reconcile(key)
            assert (get(apiserver, PODS, "new-1") or {})["metadata"]["labels"]["accelstack.io/gpr"] == "llama-primary-2"
            await eventually(lambda: op.pods.objects[("team-a", "new-1")]["metadata"]["labels"][
                "accelstack.io/gpr"] == "llama-primary-2", what="the watch brought the patch")
            op.pods.objects[("team-a", "new-1")] = stale  # as the store stood when the next pass ran on the cluster
            await apiserver.put_object(PODS, gated("new-0", "llama-primary-new"))  # older: planned first
            await eventually(lambda: ("team-a", "new-0") in op.pods.objects, what="new-0 seen")
            await op.reconcile(key)
            labels = {n: (get(apiserver, PODS, n) or {})["metadata"]["labels"]["accelstack.io/gpr"]
                      for n in ("new-0", "new-1")}
            assert labels == {"new-0": "llama-primary-3", "new-1": "llama-primary-2"}
            # once the informer shows the assignment the memory of it ends, and the plan reads the pod as it is
            current = apiserver.get(PODS, "team-a", "new-1")
            assert current is not None
            op.pods.objects[("team-a", "new-1")] = copy.deepcopy(current)
            op.observe(op.endpoints.objects[key])
            assert ("team-a", "new-1") not in op._assigned
        finally:
            stop.set()
            informers.cancel()
            await asyncio.gather(informers, return_exceptions=True)
