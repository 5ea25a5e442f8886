"""A hub GPR's workload (scheduler_extender/multicluster/workload.py, follow.py): the agent's own check of the
manifests (one line per problem), what it creates (the GPR's namespace, label, owner, pod template label), the
decision (nothing before the member admits the GPR, never an object that is not the GPR's), and the follower
against fake API servers: created as the namespace's workload account once admitted, made again when deleted,
a refusal shown on the dispatch in one line, deleted with the GPR."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from kubeapi import AlreadyExists, ApiError, Conflict, Forbidden, NotFound, Resource
from kubeapi.metrics import api_metrics
from kubeapi.resources import GPRS
from scheduler_extender.multicluster.follow import DispatchFollower
from scheduler_extender.multicluster.placement import ORIGIN_NAME, ORIGIN_NAMESPACE, ORIGIN_UID
from scheduler_extender.multicluster.workload import (
    CONDITION,
    GPR_LABEL,
    OBJECTS,
    desired,
    ours,
    problems,
    refs_annotation,
    runner,
    step,
    to_delete,
    with_condition,
)

NOW = 1_796_018_400.0
NS = "wl-team"
JOB: dict[str, Any] = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "labels": {"app": "t"}},
       "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}}
CM = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"k": "v"}}
WORKLOAD = {"objects": [JOB, CM]}


def gpr(phase: str = "", uid: str = "uid-g") -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": "g", "namespace": NS, "uid": uid, "resourceVersion": "1",
                         "annotations": {OBJECTS: refs_annotation(WORKLOAD)}},
            "status": {"phase": phase} if phase else {}}


# ---- the check ------------------------------------------------------------------------------------------------
def test_a_good_workload_has_no_problem() -> None:
    assert problems(WORKLOAD, NS) == []
    assert problems({"objects": [{**CM, "metadata": {"name": "cfg", "namespace": NS}}]}, NS) == []


def test_each_problem_is_one_line_naming_the_object() -> None:
    bad = {"objects": [
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "d"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "x-"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "other"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "r"}},
        "not a manifest"]}
    out = problems(bad, NS)
    assert out == [
        "spec.workload.objects[0]: apps/v1 DaemonSet is not allowed in a workload (allowed: v1 Pod, Service, "
        "ConfigMap; batch/v1 Job; apps/v1 Deployment, StatefulSet)",
        "spec.workload.objects[1]: metadata.name is required (generateName is not: the agent finds its objects by "
        "name)",
        "spec.workload.objects[2]: metadata.namespace 'other' is not the GPR's namespace 'wl-team'",
        "spec.workload.objects[3]: a second ConfigMap named 'c'",
        "spec.workload.objects[4]: rbac.authorization.k8s.io/v1 RoleBinding is not allowed in a workload (allowed: "
        "v1 Pod, Service, ConfigMap; batch/v1 Job; apps/v1 Deployment, StatefulSet)",
        "spec.workload.objects[5]: must be a manifest (an object), got str"]
    assert all("\n" not in line for line in out)


def test_the_caps() -> None:
    many = {"objects": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"c{i}"}} for i in range(33)]}
    assert problems(many, NS) == ["spec.workload.objects: at most 32 objects, got 33"]
    big = {"objects": [{**CM, "data": {"k": "x" * 300_000}}]}
    assert problems(big, NS) == ["spec.workload.objects: at most 256 KiB in all, got 293 KiB"]
    assert problems({"objects": []}, NS) == ["spec.workload.objects: must be a non-empty list of manifests"]
    assert problems("x", NS) == ["spec.workload: must be an object, got str"]


# ---- what is created -------------------------------------------------------------------------------------------
def test_objects_go_to_the_gprs_namespace_labelled_and_owned() -> None:
    job, cm = desired(gpr("Admitted"), {"objects": [{**JOB, "status": {"active": 1}, "metadata": {
        **JOB["metadata"], "namespace": NS, "uid": "forged", "resourceVersion": "9"}}, CM]})
    assert job["metadata"] == {"name": "train", "namespace": NS, "labels": {"app": "t", GPR_LABEL: "g"},
                               "ownerReferences": [{"apiVersion": "accelstack.io/v1alpha1",
                                                    "kind": "GPUProvisioningRequest", "name": "g", "uid": "uid-g"}]}
    assert "status" not in job
    assert job["spec"]["template"]["metadata"]["labels"] == {GPR_LABEL: "g"}  # its pods are the GPR's pods
    assert cm["metadata"]["labels"] == {GPR_LABEL: "g"} and cm["data"] == {"k": "v"}
    assert JOB["metadata"] == {"name": "train", "labels": {"app": "t"}}  # the hub's manifest is not changed
    assert ours(job, gpr()) and not ours(job, gpr(uid="uid-other"))
    assert not ours({"metadata": {"labels": {GPR_LABEL: "g"}}}, gpr())  # the label alone is not enough


# ---- the decision ---------------------------------------------------------------------------------------------
def test_nothing_is_created_before_the_member_admits_the_gpr() -> None:
    for phase in ("", "Queued"):
        s = step(gpr(phase), WORKLOAD, {})
        assert s.create == [] and (s.status, s.reason) == ("False", "WaitingForAdmission")
    for phase in ("Admitted", "Running"):
        s = step(gpr(phase), WORKLOAD, {})
        assert [o["metadata"]["name"] for o in s.create] == ["train", "cfg"]
        assert (s.status, s.reason) == ("True", "Created")
    for phase in ("Complete", "Failed", "Cancelled"):
        s = step(gpr(phase), WORKLOAD, {})
        assert s.create == [] and s.status == ""  # finished: the hub keeps what it last showed


def test_only_what_is_missing_is_created_and_a_stranger_is_never_touched() -> None:
    g = gpr("Running")
    job = desired(g, WORKLOAD)[0]
    s = step(g, WORKLOAD, {("batch/v1", "Job", "train"): job, ("v1", "ConfigMap", "cfg"): None})
    assert [o["kind"] for o in s.create] == ["ConfigMap"]
    stranger = {"metadata": {"name": "cfg", "labels": {}}}
    s = step(g, WORKLOAD, {("v1", "ConfigMap", "cfg"): stranger})
    assert s.create == [] and s.reason == "NameTaken" and "ConfigMap/cfg" in s.message
    bad = step(g, {"objects": [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}]}, {})
    assert bad.create == [] and bad.reason == "WorkloadInvalid" and "v1 Secret is not allowed" in bad.message


def test_only_the_gprs_own_objects_are_deleted_with_it() -> None:
    g = gpr("Running")
    job, _cm = desired(g, WORKLOAD)
    job["metadata"]["uid"] = "uid-job"
    assert to_delete(g, {("batch/v1", "Job", "train"): job, ("v1", "ConfigMap", "cfg"): {
        "metadata": {"name": "cfg", "uid": "uid-cm"}}}) == [(("batch/v1", "Job", "train"), "uid-job")]
    assert to_delete(g, {}) == []
    assert to_delete({"metadata": {"annotations": {OBJECTS: "not json"}}}, {}) == []


def test_the_condition_keeps_its_time_and_a_finished_gpr_keeps_what_it_showed() -> None:
    current = {"conditions": [{"type": CONDITION, "status": "True", "reason": "Created", "message": "m",
                               "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    out = with_condition({"phase": "Running", "conditions": None}, current, ("True", "Created", "m2"), "later")
    assert out["conditions"] == [{"type": CONDITION, "status": "True", "reason": "Created", "message": "m2",
                                  "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    kept = with_condition({"phase": "Complete", "conditions": None}, current, None, "later")
    assert kept["conditions"] == current["conditions"]


# ---- the follower against fake API servers --------------------------------------------------------------------
class Fake:
    """Objects by (plural, namespace, name); a user not in ``may_write`` is refused creates and deletes (403)."""

    def __init__(self, may_write: set[str] | None = None) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str, str, str]] = []  # verb, user, plural, namespace, name
        self.may_write = may_write
        self.delete_options: list[Any] = []
        self.fail_creates: ApiError | None = None  # every create of a workload object answers this
        self.metrics = api_metrics()
        self.impersonate = ""
        self.rv = 1

    def impersonating(self, user: str) -> Fake:
        other = copy.copy(self)
        other.impersonate = user
        return other

    def _check(self, verb: str, res: Resource, ns: str, name: str) -> None:
        self.calls.append((verb, self.impersonate, res.plural, ns, name))
        if verb != "get" and self.may_write is not None and self.impersonate not in self.may_write:
            raise Forbidden(403, "Forbidden", f'{res.plural} "{name}" is forbidden: User "{self.impersonate}" '
                            f'cannot {verb} resource "{res.plural}"\nin API group "" in the namespace "{ns}"')

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> Any:
        self._check("get", res, str(namespace), name)
        obj = self.objects.get((res.plural, str(namespace), name))
        if obj is None:
            raise NotFound(404, "NotFound", name)
        return copy.deepcopy(obj)

    async def create(self, res: Resource, body: dict[str, Any], namespace: str | None = None) -> Any:
        key = (res.plural, str(namespace), body["metadata"]["name"])
        self._check("create", res, key[1], key[2])
        if self.fail_creates is not None and res.plural != GPRS.plural:
            raise self.fail_creates
        if key in self.objects:
            raise AlreadyExists(409, "AlreadyExists", "exists")
        obj = copy.deepcopy(body)
        self.rv += 1
        obj["metadata"].update(namespace=namespace, uid=f"uid-{key[2]}", resourceVersion=str(self.rv))
        self.objects[key] = obj
        return copy.deepcopy(obj)

    async def delete(self, res: Resource, name: str, namespace: str | None = None, *, uid: str | None = None) -> Any:
        key = (res.plural, str(namespace), name)
        self._check("delete", res, key[1], name)
        if key not in self.objects:
            raise NotFound(404, "NotFound", name)
        del self.objects[key]
        return {}

    async def request(self, method: str, path: str, *, body: Any = None, retry: bool | None = None,
                      resource: str = "") -> Any:
        """Only the DELETE with options the agent sends for a workload object: .../namespaces/NS/PLURAL/NAME."""
        assert method == "DELETE"
        *_, ns, plural, name = path.split("/")
        assert plural == resource
        self.delete_options.append(body)
        uid = (body.get("preconditions") or {}).get("uid")
        if uid and (self.objects.get((plural, ns, name)) or {}).get("metadata", {}).get("uid") not in (None, uid):
            raise Conflict(409, "Conflict", "uid precondition")
        return await self.delete(Resource("", "v1", plural, ""), name, ns)

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    subresource: str | None = None) -> Any:
        obj = self.objects[(res.plural, str(namespace), name)]
        status = obj.setdefault("status", {})
        for k, v in body["status"].items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        return copy.deepcopy(obj)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def world(may_write: set[str] | None = None, workload: Any = WORKLOAD) -> tuple[Fake, Fake, DispatchFollower, Clock]:
    member, hub, clock = Fake(may_write), Fake(), Clock()
    dispatch = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
                "metadata": {"name": f"{NS}.g", "namespace": "accelstack-member-a",
                             "labels": {ORIGIN_NAMESPACE: NS, ORIGIN_NAME: "g", ORIGIN_UID: "hub-uid"}},
                "spec": {"clusterName": "a", "workload": workload}}
    hub.objects[(GPRS.plural, "accelstack-member-a", f"{NS}.g")] = dispatch
    f = DispatchFollower(member, hub, "accelstack-member-a", resync=30.0, wall=lambda: NOW,  # type: ignore[arg-type]
                         monotonic=clock)
    f.dispatches = {f"{NS}.g": copy.deepcopy(dispatch)}
    f.hub_informer.synced.set()
    f.hub_informer.healthy = True
    return member, hub, f, clock


def set_phase(member: Fake, f: DispatchFollower, phase: str) -> None:
    obj = member.objects[(GPRS.plural, NS, "g")]
    obj["status"] = {"phase": phase}
    member.rv += 1
    obj["metadata"]["resourceVersion"] = str(member.rv)
    f.mine[(NS, "g")] = copy.deepcopy(obj)


def condition_of(hub: Fake) -> dict[str, Any]:
    status = hub.objects[(GPRS.plural, "accelstack-member-a", f"{NS}.g")].get("status") or {}
    return next(c for c in status.get("conditions") or () if c["type"] == CONDITION)


def made(member: Fake) -> list[tuple[str, str]]:
    return sorted((k[0], k[2]) for k in member.objects if k[0] != GPRS.plural)


def test_the_follower_creates_the_workload_once_admitted_as_the_workload_account() -> None:
    async def go() -> None:
        member, hub, f, clock = world()
        await f.pass_once()
        copy_ = member.objects[(GPRS.plural, NS, "g")]
        assert "workload" not in copy_["spec"] and "clusterName" not in copy_["spec"]  # the member refuses both
        assert json.loads(copy_["metadata"]["annotations"][OBJECTS]) == [["batch/v1", "Job", "train"],
                                                                         ["v1", "ConfigMap", "cfg"]]
        assert made(member) == []  # not admitted yet
        assert condition_of(hub)["reason"] == "WaitingForAdmission"

        set_phase(member, f, "Admitted")
        await f.pass_once()
        assert made(member) == [("configmaps", "cfg"), ("jobs", "train")]
        writes = [c for c in member.calls if c[0] == "create" and c[2] != GPRS.plural]
        assert {c[1] for c in writes} == {runner(NS)} == {f"system:serviceaccount:{NS}:accelstack-workload"}
        job = member.objects[("jobs", NS, "train")]
        assert job["metadata"]["labels"][GPR_LABEL] == "g"
        assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-g"
        c = condition_of(hub)
        assert (c["status"], c["reason"]) == ("True", "Created") and "2 of 2" in c["message"]

        # level-triggered: an object deleted is made again (at the next look: the GPR changed, or the resync)
        del member.objects[("jobs", NS, "train")]
        await f.pass_once()
        assert ("jobs", "train") not in made(member)  # same GPR version, within the resync: not looked at
        clock.t += 31
        await f.pass_once()
        assert ("jobs", "train") in made(member)

        # the dispatch goes: the objects (its own only) then the GPR are deleted
        member.objects[("configmaps", NS, "other")] = {"metadata": {"name": "other", "labels": {GPR_LABEL: "g"}}}
        f.dispatches.clear()
        await f.pass_once()
        assert made(member) == [("configmaps", "other")]
        assert (GPRS.plural, NS, "g") not in member.objects
        deletes = [c for c in member.calls if c[0] == "delete"]
        assert [c[2] for c in deletes] == ["jobs", "configmaps", GPRS.plural]
        assert deletes[-1][1] == ""  # the GPR as the agent itself; its objects as the workload account
        assert {c[1] for c in deletes[:2]} == {runner(NS)}
        # Background, with the object's UID: a Job's default (orphan) would leave it to a garbage collector
        assert member.delete_options == [{"apiVersion": "v1", "kind": "DeleteOptions",
                                          "propagationPolicy": "Background", "preconditions": {"uid": u}}
                                         for u in ("uid-train", "uid-cfg")]

    asyncio.run(go())


def test_a_refusal_is_one_line_on_the_dispatch_and_nothing_crashes() -> None:
    async def go() -> None:
        member, hub, f, _ = world(may_write={""})  # the agent may write its GPRs; the workload account nothing
        await f.pass_once()
        set_phase(member, f, "Admitted")
        await f.pass_once()
        assert made(member) == []
        c = condition_of(hub)
        assert (c["status"], c["reason"]) == ("False", "WorkloadRefused")
        assert "\n" not in c["message"] and c["message"].startswith(f"Job/train in {NS} as {runner(NS)}: ")
        assert 'cannot create resource "jobs"' in c["message"] and c["message"].endswith("(0 of 2 object(s) there)")
        # the hub GPR shows the member's phase all the same
        assert hub.objects[(GPRS.plural, "accelstack-member-a", f"{NS}.g")]["status"]["phase"] == "Admitted"

    asyncio.run(go())


@pytest.mark.parametrize("workload", [
    {"objects": [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}]},
    {"objects": [{**CM, "metadata": {"name": "cfg", "namespace": "kube-system"}}]}])
def test_an_invalid_workload_is_a_condition_and_nothing_is_created(workload: Any) -> None:
    async def go() -> None:
        member, hub, f, _ = world(workload=workload)
        await f.pass_once()
        set_phase(member, f, "Running")
        await f.pass_once()
        assert made(member) == []
        assert not [c for c in member.calls if c[2] != GPRS.plural]  # not even a look
        assert condition_of(hub)["reason"] == "WorkloadInvalid"

    asyncio.run(go())


def test_a_gpr_without_a_workload_gets_no_condition() -> None:
    async def go() -> None:
        member, hub, f, _ = world(workload=None)
        dispatch = f.dispatches[f"{NS}.g"]
        dispatch["spec"].pop("workload")
        await f.pass_once()
        set_phase(member, f, "Admitted")
        await f.pass_once()
        status = hub.objects[(GPRS.plural, "accelstack-member-a", f"{NS}.g")]["status"]
        assert not [c for c in status.get("conditions") or () if c["type"] == CONDITION]
        assert OBJECTS not in member.objects[(GPRS.plural, NS, "g")]["metadata"]["annotations"]

    asyncio.run(go())


def test_a_manifest_the_member_finds_invalid_is_a_condition_and_a_busy_member_is_tried_again() -> None:
    async def go() -> None:
        member, hub, f, _ = world()
        await f.pass_once()
        member.fail_creates = ApiError(503, "ServiceUnavailable", "etcd leader changed")
        set_phase(member, f, "Admitted")
        await f.pass_once()
        # not a verdict: the status still flows, the condition stays what it was, and the next pass tries again
        dispatch = hub.objects[(GPRS.plural, "accelstack-member-a", f"{NS}.g")]
        assert dispatch["status"]["phase"] == "Admitted"
        assert condition_of(hub)["reason"] == "WaitingForAdmission"
        member.fail_creates = ApiError(422, "Invalid", 'Job.batch "train" is invalid: spec.template.spec.containers:\n'
                                       "Required value")
        await f.pass_once()
        c = condition_of(hub)
        assert (c["status"], c["reason"]) == ("False", "WorkloadInvalid")
        assert c["message"] == (f"Job/train in {NS} as {runner(NS)}: Job.batch \"train\" is invalid: "
                                "spec.template.spec.containers: Required value (0 of 2 object(s) there)")
        member.fail_creates = None
        set_phase(member, f, "Running")
        await f.pass_once()
        assert made(member) == [("configmaps", "cfg"), ("jobs", "train")]
        assert condition_of(hub)["reason"] == "Created"

    asyncio.run(go())
