"""The workspace planner as a pure function (scheduler_extender/objects/workspaces.py): the cases the API-server tests
do not reach cheaply — a Role of the controller's name that is not its own, a RoleBinding whose roleRef changed,
a terminating namespace, a stray label, the core's quota keys."""

from __future__ import annotations

from typing import Any

from scheduler_extender.objects import workspaces as wsp


def ws(name: str, namespaces: list[str], access: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "generation": 3,
                         "creationTimestamp": "2026-11-30T00:00:00Z"},
            "spec": {"namespaces": namespaces, "access": access or [], **spec}}


def ns(name: str, workspace: str = "", phase: str = "Active", created: str = "") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {wsp.WORKSPACE_LABEL: workspace} if workspace else {}}
    if created:
        meta["annotations"] = {wsp.CREATED_ANNOTATION: created}
    return {"metadata": meta, "status": {"phase": phase}}


ALICE = [{"kind": "User", "name": "alice", "role": "admin"}]


def settle(obs: wsp.Observed, rounds: int = 4) -> wsp.Plan:
    """Apply plans to the observed state as the API server would, until nothing is left to do."""
    namespaces = dict(obs.namespaces)
    managed = dict(obs.managed)
    plan = wsp.plan(obs)
    for _ in range(rounds):
        if not plan.actions:
            return plan
        for a in plan.actions:
            if a.verb == "create-namespace":
                namespaces[a.name] = a.body
            elif a.verb in ("label", "unlabel"):  # a merge patch of labels and annotations
                meta = dict(namespaces[a.name]["metadata"])
                for field, changes in a.body["metadata"].items():
                    merged = dict(meta.get(field) or {})
                    for k, v in changes.items():
                        if v is None:
                            merged.pop(k, None)
                        else:
                            merged[k] = v
                    meta[field] = merged
                namespaces[a.name] = {**namespaces[a.name], "metadata": meta}
            elif a.verb in ("create", "update"):
                managed[a.kind, a.namespace, a.name] = a.body
            elif a.verb == "delete":
                managed.pop((a.kind, a.namespace, a.name), None)
        obs = wsp.Observed(obs.workspaces, namespaces, managed, obs.templates, foreign=obs.foreign)
        plan = wsp.plan(obs)
    raise AssertionError(f"still acting after {rounds} rounds: {plan.actions}")


def test_a_reconciled_workspace_plans_nothing_and_a_stray_label_is_taken_off() -> None:
    obs = wsp.Observed([ws("w", ["a", "b"], ALICE)], {"b": ns("b"), "stray": ns("stray", "w")}, {})
    first = wsp.plan(obs)
    assert ("create-namespace", "a") in {(a.verb, a.name) for a in first.actions}
    assert ("label", "b") in {(a.verb, a.name) for a in first.actions}
    assert ("unlabel", "stray") in {(a.verb, a.name) for a in first.actions}
    assert not [a for a in first.actions if a.verb == "delete"]
    assert settle(obs).actions == []


def test_a_deleted_workspaces_created_by_annotation_is_taken_off_and_the_namespace_stays() -> None:
    """Issue 35.7: the annotation stayed on a namespace after its workspace was deleted (so a workspace of that
    name made later showed the namespace as created, not adopted). Off with the label, the namespace kept;
    a namespace another workspace holds now loses the old creator's annotation, keeps its own label."""
    obs = wsp.Observed([ws("other", ["b"], ALICE)], {"a": ns("a", "w", created="w"), "b": ns("b", "other", created="w"),
                                                     "c": ns("c", "", created="w")}, {})
    plan = wsp.plan(obs)
    patches = {a.name: a.body["metadata"] for a in plan.actions if a.kind == "Namespace"}
    assert patches == {"a": {"labels": {wsp.WORKSPACE_LABEL: None}, "annotations": {wsp.CREATED_ANNOTATION: None}},
                       "b": {"annotations": {wsp.CREATED_ANNOTATION: None}},
                       "c": {"annotations": {wsp.CREATED_ANNOTATION: None}}}
    assert not [a for a in plan.actions if a.verb in ("delete", "create-namespace")]
    assert settle(obs).actions == []
    # its own creator keeps it
    mine = wsp.Observed([ws("w", ["a"], ALICE)], {"a": ns("a", "w", created="w")}, {})
    assert not [a for a in settle(mine).actions if a.kind == "Namespace"]
    assert not [a for a in wsp.plan(mine).actions if a.kind == "Namespace"]


def test_a_role_of_the_controllers_name_that_is_not_its_own_is_left_alone_and_reported() -> None:
    foreign = frozenset({("Role", "a", wsp.role_name("admin"))})
    plan = wsp.plan(wsp.Observed([ws("w", ["a"], ALICE)], {"a": ns("a", "w")}, {}, foreign=foreign))
    assert ("Role", "a", wsp.role_name("admin")) not in {(a.kind, a.namespace, a.name) for a in plan.actions}
    ready = plan.statuses["w"]["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", "NameTaken")
    assert "Role a/accelstack-workspace-admin exists and is not the controller's" in ready["message"]


ALICE_AND_BOB = [{"kind": "User", "name": "alice", "role": "admin"}, {"kind": "User", "name": "bob", "role": "viewer"}]


def managed_objects(workspace: dict[str, Any], namespace: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    """What the controller would hold for ``workspace`` in ``namespace`` once reconciled (with UIDs)."""
    return {(kind, namespace, b["metadata"]["name"]): {**b, "metadata": {**b["metadata"], "uid": f"uid-{kind}-{n}",
                                                                         "resourceVersion": "7"}}
            for n, (kind, b) in enumerate(wsp.desired_objects(wsp.parse_workspace(workspace), namespace,
                                                              wsp.DEFAULT_TEMPLATES, {namespace}))}


def test_no_rolebinding_is_planned_for_a_role_someone_else_owns() -> None:
    """Binding alice to someone else's Role of the admin Role's name would give her whatever that Role grants:
    the admin role is not bound in that namespace (not created, not wanted, not even once the rest settled);
    the viewer role and the other namespace are bound as usual."""
    taken = ("Role", "a", wsp.role_name("admin"))
    obs = wsp.Observed([ws("w", ["a", "b"], ALICE_AND_BOB)], {"a": ns("a", "w"), "b": ns("b", "w")}, {},
                       foreign=frozenset({taken}))
    assert taken not in obs.managed
    plan = wsp.plan(obs)
    created = {(a.kind, a.namespace, a.name) for a in plan.actions if a.verb == "create"}
    admin_binding = ("RoleBinding", "a", wsp.role_name("admin"))
    assert admin_binding not in created and admin_binding not in plan.wanted
    assert taken not in created
    assert {("RoleBinding", "a", wsp.role_name("viewer")), ("RoleBinding", "b", wsp.role_name("admin")),
            ("RoleBinding", "b", wsp.role_name("viewer")), ("Role", "a", wsp.role_name("viewer"))} <= created
    ready = plan.statuses["w"]["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", "NameTaken")
    assert "Role a/accelstack-workspace-admin exists and is not the controller's" in ready["message"]
    settled = settle(obs)
    assert settled.actions == [] and admin_binding not in settled.wanted
    # the controller's own Role of that name (the name taken over): the binding is planned again
    mine = managed_objects(ws("w", ["a"], ALICE), "a")
    again = wsp.plan(wsp.Observed([ws("w", ["a"], ALICE)], {"a": ns("a", "w")},
                                  {taken: mine[taken]}, foreign=frozenset({taken})))
    assert ("create", *admin_binding) in {(a.verb, a.kind, a.namespace, a.name) for a in again.actions}


def test_a_managed_rolebinding_to_a_role_someone_else_owns_is_deleted() -> None:
    """The controller's RoleBinding of a role whose Role name is now someone else's (the controller's Role was
    deleted and another made in its place): deleted, by its UID; the viewer role's binding is kept."""
    w = ws("w", ["a"], ALICE_AND_BOB)
    managed = managed_objects(w, "a")
    taken = ("Role", "a", wsp.role_name("admin"))
    del managed[taken]  # the other Role is not the controller's: the informers (managed-by label) do not see it
    binding = ("RoleBinding", "a", wsp.role_name("admin"))
    uid = managed[binding]["metadata"]["uid"]
    plan = wsp.plan(wsp.Observed([w], {"a": ns("a", "w")}, managed, foreign=frozenset({taken})))
    assert [(a.verb, a.kind, a.namespace, a.name, a.uid) for a in plan.actions] == [("delete", *binding, uid)]
    assert binding not in plan.wanted and ("RoleBinding", "a", wsp.role_name("viewer")) in plan.wanted
    assert plan.statuses["w"]["conditions"][0]["reason"] == "NameTaken"


def test_a_rolebinding_whose_role_reference_changed_is_replaced_not_updated() -> None:
    body = wsp.desired_objects(wsp.parse_workspace(ws("w", ["a"], ALICE)), "a", wsp.DEFAULT_TEMPLATES, {"a"})
    managed = {(kind, "a", b["metadata"]["name"]): {**b, "metadata": {**b["metadata"], "uid": "u1",
                                                                         "resourceVersion": "7"}}
               for kind, b in body}
    key = ("RoleBinding", "a", wsp.role_name("admin"))
    managed[key] = {**managed[key], "roleRef": {**managed[key]["roleRef"], "name": "something-else"}}
    plan = wsp.plan(wsp.Observed([ws("w", ["a"], ALICE)], {"a": ns("a", "w")}, managed))
    assert [(a.verb, a.kind, a.uid) for a in plan.actions] == [("delete", "RoleBinding", "u1")]


def test_nothing_is_created_in_a_terminating_namespace() -> None:
    plan = wsp.plan(wsp.Observed([ws("w", ["a"], ALICE)], {"a": ns("a", "w", phase="Terminating")}, {}))
    assert plan.actions == []
    row = plan.statuses["w"]["namespaces"][0]
    assert (row["ready"], row["message"]) == (False, "the namespace is being deleted")


def test_the_status_keeps_its_transition_time_and_is_not_rewritten_when_unchanged() -> None:
    obs = wsp.Observed([ws("w", ["a"])], {"a": ns("a", "w", created="w")}, {}, now="2026-11-30T10:00:00Z")
    managed = {(k, "a", b["metadata"]["name"]): b for k, b in wsp.desired_objects(
        wsp.parse_workspace(ws("w", ["a"])), "a", wsp.DEFAULT_TEMPLATES, {"a"})}
    obs.managed = managed
    status = wsp.plan(obs).statuses["w"]
    assert status["conditions"][0]["lastTransitionTime"] == "2026-11-30T10:00:00Z"
    assert status["namespaces"] == [{"name": "a", "adopted": False, "ready": True}]
    stored = ws("w", ["a"])
    stored["status"] = status
    later = wsp.Observed([stored], obs.namespaces, managed, now="2026-11-30T11:00:00Z")
    assert wsp.plan(later).statuses == {}


def test_quota_keys_are_per_workspace_and_resource_and_namespaces_outside_keep_their_own() -> None:
    w = ws("w", ["a", "b"], policy={"devices": [{"resource": "nvidia.com/gpu", "max": 3},
                                                {"resource": "nvidia.com/gpu", "model": "H100", "max": 1}]})
    index = wsp.index([wsp.parse_workspace(w)], {})
    assert index.quotas == {"w|nvidia.com/gpu": 3000}
    assert index.model_caps == {"w|nvidia.com/gpu": {"H100": 1000}}  # per model, under the same key
    assert index.key("a", "nvidia.com/gpu") == index.key("b", "nvidia.com/gpu") == "w|nvidia.com/gpu"
    assert index.key("a", "neureality.com/nr1") == "w|neureality.com/nr1"
    assert index.key("elsewhere", "nvidia.com/gpu") == "elsewhere"


def test_the_label_decides_between_two_claimants_then_age() -> None:
    older, newer = wsp.parse_workspace(ws("old", ["x"])), wsp.parse_workspace(ws("new", ["x"]))
    newer = wsp.Workspace(**{**newer.__dict__, "created": "2026-12-01T00:00:00Z"})
    owner, lost = wsp.membership([newer, older], {})
    assert owner == {"x": "old"} and lost == {("new", "x"): "old"}
    owner, lost = wsp.membership([newer, older], {"x": {wsp.WORKSPACE_LABEL: "new"}})
    assert owner == {"x": "new"} and lost == {("old", "x"): "new"}


def test_unusable_role_templates_are_named() -> None:
    rules, errors = wsp.parse_templates({"data": {"admin": "- apiGroups: ['']\n  resources: [pods]\n",
                                                  "member": "{"}})
    assert "admin" not in rules and "member" not in rules and rules["viewer"] == wsp.DEFAULT_TEMPLATES["viewer"]
    assert errors["admin"].startswith(f"ConfigMap {wsp.ROLE_TEMPLATES} key admin[0].verbs: want a list of strings")
    assert errors["member"].startswith(f"ConfigMap {wsp.ROLE_TEMPLATES} key member: not YAML")


def test_the_duration_history_learns_under_the_same_workspace_key_the_core_predicts_with() -> None:
    from scheduler_extender.controller.predictor_store import job_key

    index = wsp.index([wsp.parse_workspace(ws("w", ["a"]))], {})
    obj = {"metadata": {"namespace": "a", "name": "g"}, "spec": {"resource": "neureality.com/nr1"}}
    assert job_key(obj, index.key).workspace == "w|neureality.com/nr1"
    assert job_key(obj).workspace == "a"  # without workspaces: the namespace, as before
