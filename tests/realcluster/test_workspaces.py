"""The workspace controller against the real API server's RBAC, escalation checks included.

The controller runs in the stack's controller process under the shipped ``accelstack-extender`` ServiceAccount,
which the shipped ClusterRole ``accelstack-workspace-controller`` gives no RBAC ``escalate`` or ``bind``: the API
server lets it create a Role (and bind it) only when it holds every permission the Role grants. Workspaces are
created as the admin from ``manifests/examples/workspace.yaml`` (names made unique per test); what the docs
(docs/workspaces.md) promise is checked on the real server: namespaces created or adopted and labelled, Roles,
RoleBindings and ServiceAccounts from the role templates, the rights each member gets (SelfSubjectRulesReview and
``kubectl auth can-i`` as that member, and one real write), a role template that grants more than the controller
holds refused with 403 and shown on the Workspace, and what deleting a workspace removes and never removes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import GPRS, gpr, wait_for
from tests.realcluster.shipped import ROOT
from tests.realcluster.stack import SYSTEM_NS, Stack

WS = "apis/accelstack.io/v1alpha1/workspaces"
RBAC = "apis/rbac.authorization.k8s.io/v1"
MANAGED = "app.kubernetes.io/managed-by=accelstack-workspace-controller"
WS_LABEL = "accelstack.io/workspace"
CREATED = "accelstack.io/created-by-workspace"
TEMPLATES = "accelstack-workspace-roles"
CONTROLLER = f"system:serviceaccount:{SYSTEM_NS}:accelstack-extender"

# What docs/workspaces.md promises each role, as (API group, resource, verb) triples ("patch" goes with update).
READ = ("get", "list", "watch")
WRITE = ("create", "update", "patch", "delete")
A = "accelstack.io"


def _grants(*rules: tuple[str, tuple[str, ...], tuple[str, ...]]) -> frozenset[tuple[str, str, str]]:
    return frozenset((g, r, v) for g, resources, verbs in rules for r in resources for v in verbs)


VIEWER = _grants((A, ("gpuprovisioningrequests", "gprtemplates", "gprtemplatebindings"), READ),
                 ("", ("pods", "events"), READ))
MEMBER = VIEWER | _grants((A, ("gpuprovisioningrequests",), WRITE), ("", ("pods/log",), ("get",)))
ADMIN = MEMBER | _grants((A, ("gprtemplates", "gprtemplatebindings"), WRITE))
PROMISED = {"viewer": VIEWER, "member": MEMBER, "admin": ADMIN}
# what every authenticated identity may do anywhere (system:basic-user and friends): not the workspace's doing
BASELINE_GROUPS = {"authorization.k8s.io", "authentication.k8s.io"}


# ---- helpers --------------------------------------------------------------------------------------------------
def example_workspace(name: str, namespaces: list[str], monitoring: str) -> dict[str, Any]:
    """The shipped example Workspace, renamed for this test: its namespaces, the example's ``monitoring`` and its
    default template's namespace replaced."""
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests/examples/workspace.yaml").read_text()) if d]
    ws = next(d for d in docs if d["kind"] == "Workspace")
    ws["metadata"]["name"] = name
    ws["spec"]["namespaces"] = namespaces
    for rule in ws["spec"]["access"]:
        if rule.get("namespace") == "monitoring":
            rule["namespace"] = monitoring
    ws["spec"]["defaultTemplate"]["namespace"] = namespaces[0]
    return dict(ws)


def example_role_templates() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests/examples/workspace.yaml").read_text()) if d]
    return dict(next(d for d in docs if d["kind"] == "ConfigMap"))


def ready(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    """The Workspace's Ready condition once the status describes the current generation."""
    obj = cp.get(f"{WS}/{name}") or {}
    status = obj.get("status") or {}
    if status.get("observedGeneration") != obj.get("metadata", {}).get("generation"):
        return None
    return next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), None)


def wait_ready(cp: ControlPlane, name: str, status: str = "True", reason: str = "Reconciled",
               timeout: float = 60) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        cond = ready(cp, name)
        return cond if cond and cond["status"] == status and cond["reason"] == reason else None
    try:
        return wait_for(f"workspace {name} Ready={status} ({reason})", probe, timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nstatus: {json.dumps((cp.get(f'{WS}/{name}') or {}).get('status'))}") from None


def managed(cp: ControlPlane, ws: str) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of every object carrying the controller's label for workspace ``ws``."""
    sel = f"{MANAGED},{WS_LABEL}={ws}"
    out = set()
    for kind, path in (("Role", "apis/rbac.authorization.k8s.io/v1/roles"),
                       ("RoleBinding", "apis/rbac.authorization.k8s.io/v1/rolebindings"),
                       ("ServiceAccount", "api/v1/serviceaccounts")):
        for o in cp.api("GET", f"{path}?labelSelector={sel}").get("items") or ():
            out.add((kind, o["metadata"]["namespace"], o["metadata"]["name"]))
    return out


def wanted_objects(namespaces: list[str], created_sa: list[str]) -> set[tuple[str, str, str]]:
    """What the example workspace wants per namespace: a Role per role, a RoleBinding per role with subjects (all
    three have some), ServiceAccount ``ci`` where it is the controller's to create."""
    out = {(k, ns, f"accelstack-workspace-{r}") for ns in namespaces for k in ("Role", "RoleBinding")
           for r in ("admin", "member", "viewer")}
    return out | {("ServiceAccount", ns, "ci") for ns in created_sa}


def granted(cp: ControlPlane, kubeconfig: Path, namespace: str) -> frozenset[tuple[str, str, str]]:
    """What the identity of ``kubeconfig`` may do in ``namespace`` (SelfSubjectRulesReview, as that identity),
    without the self-reviews every authenticated identity may create."""
    review = json.loads(cp.kubectl("create", "--raw", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
                                   "-f", "-", kubeconfig=kubeconfig, stdin=json.dumps({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
        "spec": {"namespace": namespace}})))
    status = review["status"]
    assert not status.get("incomplete"), status
    out = set()
    for rule in status.get("resourceRules") or ():
        assert not rule.get("resourceNames"), rule
        for g in rule.get("apiGroups") or ():
            if g in BASELINE_GROUPS:
                continue
            for r in rule.get("resources") or ():
                for v in rule.get("verbs") or ():
                    out.add((g, r, v))
    return frozenset(out)


def rules_of(cp: ControlPlane, ns: str, role: str) -> list[dict[str, Any]]:
    obj = cp.get(f"apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/accelstack-workspace-{role}") or {}
    return list(obj.get("rules") or [])


def namespace(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.get(f"api/v1/namespaces/{name}") or {}


def delete_namespaces(cp: ControlPlane, *names: str) -> None:
    for n in names:
        cp.delete(f"api/v1/namespaces/{n}")


@pytest.fixture
def role_templates(cp: ControlPlane, stack: Stack) -> Iterator[None]:
    """The test writes the role templates ConfigMap (cluster-wide in effect: every workspace's Roles follow it);
    what was there before is put back, and the controller given the resync to apply it."""
    path = f"api/v1/namespaces/{SYSTEM_NS}/configmaps/{TEMPLATES}"
    before = cp.get(path)
    yield
    cp.delete(path)
    if before is not None:
        before["metadata"] = {k: v for k, v in before["metadata"].items()
                              if k in ("name", "namespace", "labels", "annotations")}
        cp.create(f"api/v1/namespaces/{SYSTEM_NS}/configmaps", before)


def put_templates(cp: ControlPlane, data: dict[str, str]) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": TEMPLATES, "namespace": SYSTEM_NS},
            "data": data}
    cp.apply(body)
    if (cp.get(f"api/v1/namespaces/{SYSTEM_NS}/configmaps/{TEMPLATES}") or {}).get("data") != data:
        cp.api("PUT", f"api/v1/namespaces/{SYSTEM_NS}/configmaps/{TEMPLATES}", body)


# ---- tests ----------------------------------------------------------------------------------------------------
def test_the_controller_holds_what_the_templates_grant_and_no_escalate_or_bind(cp: ControlPlane,
                                                                                 stack: Stack) -> None:
    kc = stack.kubeconfig
    who = json.loads(cp.kubectl("auth", "whoami", "-o", "json", kubeconfig=kc))["status"]["userInfo"]["username"]
    assert who == CONTROLLER
    # the widest built-in template, held in every namespace (a ClusterRole), so it may create the Roles
    assert granted(cp, kc, "default") >= ADMIN and granted(cp, kc, "kube-public") >= ADMIN
    assert cp.can_i(kc, "delete", "gpuprovisioningrequests.accelstack.io")  # cluster-wide, not per namespace
    assert cp.can_i(kc, "get", "pods", subresource="log")
    for verb, resource in (("escalate", "roles.rbac.authorization.k8s.io"), ("bind", "roles.rbac.authorization.k8s.io"),
                           ("escalate", "clusterroles.rbac.authorization.k8s.io"), ("delete", "namespaces"),
                           ("get", "secrets"), ("create", "pods")):
        assert not cp.can_i(kc, verb, resource), (verb, resource)


def test_a_workspace_creates_adopts_and_grants_exactly_what_the_docs_promise(cp: ControlPlane, stack: Stack,
                                                                             ns: str) -> None:
    adopted, created, mon = ns, f"{ns}-dev", f"{ns}-mon"
    assert cp.get(f"api/v1/namespaces/{created}") is None
    cp.create("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": mon}})
    cp.create(f"api/v1/namespaces/{mon}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                          "metadata": {"name": "grafana"}})
    # a ServiceAccount the access rules name that exists already: used as it is, never the controller's
    cp.create(f"api/v1/namespaces/{adopted}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                              "metadata": {"name": "ci", "labels": {"mine": "yes"}}})
    ws_name = ns
    try:
        ws = cp.create(WS, example_workspace(ws_name, [adopted, created], mon))
        cond = wait_ready(cp, ws_name)
        assert cond["message"] == "2 namespaces, 4 access rules in place", cond
        status = (cp.get(f"{WS}/{ws_name}") or {})["status"]
        assert [(n["name"], n["adopted"], n["ready"]) for n in status["namespaces"]] == \
            [(adopted, True, True), (created, False, True)], status
        assert {m["name"]: m["role"] for m in status["members"]} == {
            "alice@example.com": "admin", "vision-researchers": "member", "ci": "member", "grafana": "viewer"}

        # namespaces: one created (label and annotation), one adopted (label only)
        new, old = namespace(cp, created)["metadata"], namespace(cp, adopted)["metadata"]
        assert new["labels"][WS_LABEL] == ws_name and new["annotations"][CREATED] == ws_name, new
        assert old["labels"][WS_LABEL] == ws_name and CREATED not in (old.get("annotations") or {}), old

        # RBAC objects from the built-in templates, created under the controller's own token
        assert managed(cp, ws_name) == wanted_objects([adopted, created], [created])
        uid = ws["metadata"]["uid"]
        for n in (adopted, created):
            for role in ("admin", "member", "viewer"):
                path = f"apis/rbac.authorization.k8s.io/v1/namespaces/{n}/roles/accelstack-workspace-{role}"
                obj = cp.get(path) or {}
                assert [(o["kind"], o["name"], o["uid"]) for o in obj["metadata"]["ownerReferences"]] == \
                    [("Workspace", ws_name, uid)]
                assert _grants(*[(g, tuple(r["resources"]), tuple(r["verbs"]))
                                 for r in obj["rules"] for g in r["apiGroups"]]) == PROMISED[role], (n, role)
            binding = cp.get(f"{RBAC}/namespaces/{n}/rolebindings/accelstack-workspace-member") or {}
            assert sorted((s["kind"], s["name"], s.get("namespace", "")) for s in binding["subjects"]) == \
                [("Group", "vision-researchers", ""), ("ServiceAccount", "ci", n)]
            viewer = cp.get(f"{RBAC}/namespaces/{n}/rolebindings/accelstack-workspace-viewer") or {}
            assert [(s["kind"], s["name"], s.get("namespace")) for s in viewer["subjects"]] == \
                [("ServiceAccount", "grafana", mon)]
        sa = cp.get(f"api/v1/namespaces/{adopted}/serviceaccounts/ci") or {}
        assert sa["metadata"]["labels"] == {"mine": "yes"}  # left as it was
        assert (cp.get(f"api/v1/namespaces/{mon}/serviceaccounts/grafana") or {})["metadata"].get("labels") is None
        assert not [k for k in managed(cp, ws_name) if k[1] == mon]  # outside the workspace: bound only

        # each member gets exactly the promised rights in every namespace of the workspace, nothing elsewhere
        alice = cp.user_kubeconfig("alice@example.com")
        researcher = cp.user_kubeconfig(f"bob-{ns}", groups=("vision-researchers",))
        grafana = cp.sa_kubeconfig(mon, "grafana")
        ci_created = cp.sa_kubeconfig(created, "ci")
        stranger = cp.user_kubeconfig(f"eve-{ns}", groups=("other-team",))
        for n in (adopted, created):
            assert granted(cp, alice, n) == ADMIN, n
            assert granted(cp, researcher, n) == MEMBER, n
            assert granted(cp, grafana, n) == VIEWER, n
            assert granted(cp, stranger, n) == frozenset(), n
        assert granted(cp, ci_created, created) == MEMBER
        assert granted(cp, ci_created, adopted) == frozenset()  # the rule binds each namespace's own "ci"
        for who in (alice, researcher, grafana, ci_created):
            assert granted(cp, who, mon) == frozenset() and granted(cp, who, "default") == frozenset()
        # the same through the authorizer's access check (kubectl auth can-i), spot checks per role
        gprs = "gpuprovisioningrequests.accelstack.io"
        assert cp.can_i(researcher, "create", gprs, namespace=created)
        assert cp.can_i(researcher, "get", "pods", namespace=adopted, subresource="log")
        assert not cp.can_i(researcher, "create", "gprtemplates.accelstack.io", namespace=created)
        assert not cp.can_i(researcher, "create", "pods", namespace=created)
        assert not cp.can_i(researcher, "get", "secrets", namespace=created)
        assert not cp.can_i(researcher, "create", gprs, namespace=mon)
        assert not cp.can_i(researcher, "create", gprs)  # not cluster-wide
        assert cp.can_i(alice, "create", "gprtemplatebindings.accelstack.io", namespace=adopted)
        assert not cp.can_i(alice, "create", "rolebindings.rbac.authorization.k8s.io", namespace=adopted)
        assert cp.can_i(grafana, "list", gprs, namespace=created)
        assert not cp.can_i(grafana, "create", gprs, namespace=created)
        # and one real write each way, through the real webhooks
        body = json.dumps(gpr("smoke", devices=1, priority=100, exitDuration="1h", idleTimeout="30m"))
        out = cp.kubectl("create", "-n", created, "-f", "-", kubeconfig=researcher, stdin=body)
        assert "created" in out
        out = cp.kubectl("create", "-n", mon, "-f", "-", kubeconfig=researcher, stdin=body, check=False)
        assert "Forbidden" in out and "cannot create resource" in out, out
        cp.delete(f"{GPRS.format(ns=created)}/smoke")

        # the workspace webhook: a namespace belongs to one workspace; system namespaces to none
        with pytest.raises(ApiCallError) as err:
            cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
                           "metadata": {"name": f"{ws_name}-2"}, "spec": {"namespaces": [created]}})
        assert f"{created} already belongs to workspace {ws_name}" in err.value.body["message"], err.value.body
        with pytest.raises(ApiCallError) as err:
            cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
                           "metadata": {"name": f"{ws_name}-3"}, "spec": {"namespaces": ["kube-system"]}})
        assert "kube-system is a system namespace" in err.value.body["message"], err.value.body
    finally:
        cp.delete(f"{WS}/{ws_name}")
        wait_for("the workspace's objects removed", lambda: not managed(cp, ws_name), timeout=60)
        delete_namespaces(cp, created, mon)


def test_a_template_granting_more_than_the_controller_holds_is_refused_and_shown(
        cp: ControlPlane, stack: Stack, ns: str, role_templates: None) -> None:
    ws_name = ns
    # a valid template that grants less: followed (and allowed: the controller holds more than it grants)
    put_templates(cp, {"member": "- {apiGroups: [accelstack.io], resources: [gpuprovisioningrequests], "
                                 "verbs: [get, list]}\n"})
    try:
        cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ws_name},
                       "spec": {"namespaces": [ns], "access": [{"kind": "Group", "name": f"g-{ns}", "role": "member"},
                                                               {"kind": "User", "name": f"v-{ns}", "role": "viewer"}]}})
        wait_ready(cp, ws_name)
        assert rules_of(cp, ns, "member") == [{"apiGroups": ["accelstack.io"], "resources": ["gpuprovisioningrequests"],
                                               "verbs": ["get", "list"]}]
        member = cp.user_kubeconfig(f"m-{ns}", groups=(f"g-{ns}",))
        assert granted(cp, member, ns) == _grants((A, ("gpuprovisioningrequests",), ("get", "list")))

        # a template granting what the controller does not hold (secrets): the real escalation check says 403
        put_templates(cp, {"member": "- {apiGroups: [''], resources: [secrets], verbs: [get]}\n"})
        cond = wait_ready(cp, ws_name, "False", "Forbidden")
        msg = cond["message"]
        assert f"update Role {ns}/accelstack-workspace-member: 403" in msg, msg
        assert "attempting to grant RBAC permissions not currently held" in msg and "secrets" in msg, msg
        assert CONTROLLER in msg, msg
        # nothing was granted: the Role keeps its last rules, the member cannot read secrets
        assert rules_of(cp, ns, "member")[0]["resources"] == ["gpuprovisioningrequests"]
        assert not cp.can_i(member, "get", "secrets", namespace=ns)
        assert rules_of(cp, ns, "viewer") and granted(cp, cp.user_kubeconfig(f"v-{ns}"), ns) == VIEWER  # unaffected

        # a template that is not a rule list: RoleTemplateInvalid, the role's Roles left as they were
        put_templates(cp, {"member": "verbs: [get]\n"})
        cond = wait_ready(cp, ws_name, "False", "RoleTemplateInvalid")
        assert f"ConfigMap {TEMPLATES} key member" in cond["message"], cond

        # the example's templates (viewer spelled out, the others built in): back to Ready, built-in member rules
        example = example_role_templates()
        assert example["metadata"] == {"name": TEMPLATES, "namespace": SYSTEM_NS}
        put_templates(cp, example["data"])
        wait_ready(cp, ws_name)
        assert granted(cp, member, ns) == MEMBER
    finally:
        cp.delete(f"{WS}/{ws_name}")
        wait_for("the workspace's objects removed", lambda: not managed(cp, ws_name), timeout=60)


def test_deleting_a_workspace_removes_what_it_created_and_never_a_namespace(cp: ControlPlane, stack: Stack,
                                                                           ns: str) -> None:
    ws_name, created = ns, f"{ns}-new"
    # a Role of a name the controller wants, made by someone else: left alone and reported (NameTaken). It grants
    # what the controller holds (so the API server would let the controller bind it) but the viewer template
    # does not: writing GPRs
    theirs = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
              "metadata": {"name": "accelstack-workspace-viewer"},
              "rules": [{"apiGroups": ["accelstack.io"], "resources": ["gpuprovisioningrequests"],
                         "verbs": ["create", "delete"]}]}
    cp.create(f"apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", theirs)
    cp.create(f"api/v1/namespaces/{ns}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                         "metadata": {"name": "bot"}})
    cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ws_name},
                   "spec": {"namespaces": [ns, created],
                            "access": [{"kind": "ServiceAccount", "name": "bot", "role": "member"},
                                       {"kind": "User", "name": f"u-{ns}", "role": "viewer"}]}})
    try:
        cond = wait_ready(cp, ws_name, "False", "NameTaken")
        assert f"Role {ns}/accelstack-workspace-viewer exists and is not the controller's" in cond["message"]
        mine = {(k, n, name) for n in (ns, created) for k, name in (
            ("Role", "accelstack-workspace-admin"), ("Role", "accelstack-workspace-member"),
            ("RoleBinding", "accelstack-workspace-member"))}
        mine |= {("Role", created, "accelstack-workspace-viewer"), ("RoleBinding", created, "accelstack-workspace-viewer"),
                 ("ServiceAccount", created, "bot")}
        try:
            wait_for("the workspace's objects", lambda: managed(cp, ws_name) == mine or None, timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: want {sorted(mine)}, have {sorted(managed(cp, ws_name))}") from None
        assert (cp.get(f"apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/accelstack-workspace-viewer")
                or {})["rules"] == theirs["rules"]
        # the viewers are not bound to that Role (it is not the viewer template): no rights there, the template's
        # rights in the other namespace
        assert cp.get(f"apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/accelstack-workspace-viewer") \
            is None
        viewer = cp.user_kubeconfig(f"u-{ns}")
        assert granted(cp, viewer, ns) == frozenset() and granted(cp, viewer, created) == VIEWER
        assert not cp.can_i(viewer, "create", "gpuprovisioningrequests.accelstack.io", namespace=ns)

        # once that Role is gone, the name is the controller's: the viewer template and its binding follow
        # (level-triggered: nothing remembers the old owner)
        cp.delete(f"{RBAC}/namespaces/{ns}/roles/accelstack-workspace-viewer")
        wait_ready(cp, ws_name)
        assert managed(cp, ws_name) == mine | {("Role", ns, "accelstack-workspace-viewer"),
                                               ("RoleBinding", ns, "accelstack-workspace-viewer")}
        assert granted(cp, viewer, ns) == VIEWER

        # dropping a namespace: its objects go, its label goes, the namespace stays
        cp.patch(f"{WS}/{ws_name}", {"spec": {"namespaces": [ns]}})
        wait_for("the dropped namespace's objects removed",
                 lambda: not [k for k in managed(cp, ws_name) if k[1] == created], timeout=60)
        wait_for("the dropped namespace's label off",
                 lambda: WS_LABEL not in (namespace(cp, created)["metadata"].get("labels") or {}), timeout=60)
        assert not namespace(cp, created)["metadata"].get("deletionTimestamp")

        # deleting the workspace: everything it made goes; the namespaces and the ServiceAccount that existed
        # before stay
        cp.delete(f"{WS}/{ws_name}")
        wait_for("the workspace's objects removed", lambda: not managed(cp, ws_name), timeout=60)
        wait_for("the label off", lambda: WS_LABEL not in (namespace(cp, ns)["metadata"].get("labels") or {}),
                 timeout=60)
        for n in (ns, created):
            meta = namespace(cp, n)["metadata"]
            assert meta and not meta.get("deletionTimestamp"), meta
        assert cp.get(f"api/v1/namespaces/{ns}/serviceaccounts/bot")
        assert cp.get(f"api/v1/namespaces/{created}/serviceaccounts/bot") is None  # that one was the controller's
        for n in (ns, created):
            assert not cp.api("GET", f"apis/rbac.authorization.k8s.io/v1/namespaces/{n}/rolebindings").get("items")
    finally:
        with contextlib.suppress(ApiCallError):
            cp.delete(f"{WS}/{ws_name}")
        delete_namespaces(cp, created)
