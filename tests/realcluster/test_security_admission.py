"""Workspace admission on the real API server: who may adopt an existing namespace, and a foreign Role of a
reserved name never reached through the workspace.

The shipped webhook configuration sends every Workspace write to the extender under test; the person writing it
is a real client-certificate user whose rights are plain RBAC objects. A user whose only right is to create
Workspaces cannot adopt an existing namespace and make herself its admin (she would gain pod and log reads she
does not hold there); once she holds those rights in it, she can (docs/security.md, "Who may make a Workspace").
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any

from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import wait_for
from tests.realcluster.stack import Stack
from tests.realcluster.test_workspaces import ADMIN, RBAC, WS, granted, wait_ready

A = "accelstack.io"


def as_user(cp: ControlPlane, kubeconfig: Path, obj: dict[str, Any]) -> tuple[bool, str]:
    try:
        return True, cp.kubectl("create", "-f", "-", kubeconfig=kubeconfig, stdin=json.dumps(obj))
    except subprocess.CalledProcessError as exc:
        return False, f"{exc.stdout}{exc.stderr}"


def cluster_grant(cp: ControlPlane, name: str, user: str, rules: list[dict[str, Any]]) -> None:
    cp.apply([{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
               "rules": rules},
              {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}])


def test_workspace_verbs_alone_do_not_adopt_a_namespace(cp: ControlPlane, stack: Stack, ns: str) -> None:
    user, ws_name = f"dana-{ns}", f"{ns}-ws"
    cluster_grant(cp, f"{ns}-ws-only", user, [{"apiGroups": [A], "resources": ["workspaces"],
                                              "verbs": ["get", "list", "create", "update", "delete"]}])
    kc = cp.user_kubeconfig(user)
    wait_for("the user's workspace right", lambda: cp.can_i(kc, "create", "workspaces.accelstack.io"), timeout=30)
    ws = {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ws_name},
          "spec": {"namespaces": [ns], "access": [{"kind": "User", "name": user, "role": "admin"}]}}
    try:
        ok, said = as_user(cp, kc, ws)
        assert not ok and f"spec.namespaces: {ns} exists and would be adopted" in said and user in said, said
        assert cp.get(f"{WS}/{ws_name}") is None
        assert not {g for g in granted(cp, kc, ns) if g[0] != A}  # her workspace verbs only
        # holding, in that namespace, what the admin role grants: the same request is admitted
        cp.apply([{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "dana-admin", "namespace": ns},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "accelstack-workspace-controller"},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}])
        wait_for("the user's rights in the namespace", lambda: cp.can_i(kc, "get", "pods", namespace=ns,
                                                                         subresource="log"), timeout=30)
        ok, said = as_user(cp, kc, ws)
        assert ok, said
        wait_ready(cp, ws_name)
        assert granted(cp, kc, ns) >= ADMIN
    finally:
        with contextlib.suppress(ApiCallError):
            cp.delete(f"{WS}/{ws_name}")
        cp.delete(f"{RBAC}/clusterrolebindings/{ns}-ws-only")
        cp.delete(f"{RBAC}/clusterroles/{ns}-ws-only")


def test_a_foreign_role_of_a_reserved_name_never_reaches_the_members(cp: ControlPlane, stack: Stack,
                                                                     ns: str) -> None:
    """Someone else's Role named as the member template, in an adopted namespace: reported (NameTaken), never
    bound; when its owner later adds Secrets to it, the workspace's member still reads no Secret there."""
    ws_name, member = f"{ns}-ws", f"m-{ns}"
    theirs: dict[str, Any] = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                              "metadata": {"name": "accelstack-workspace-member", "namespace": ns},
                              "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]}
    cp.create(f"{RBAC}/namespaces/{ns}/roles", theirs)
    cp.create(f"api/v1/namespaces/{ns}/secrets", {"apiVersion": "v1", "kind": "Secret",
                                                  "metadata": {"name": "db"}, "stringData": {"password": "x"}})
    cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ws_name},
                   "spec": {"namespaces": [ns], "access": [{"kind": "User", "name": member, "role": "member"}]}})
    try:
        cond = wait_ready(cp, ws_name, "False", "NameTaken")
        assert f"Role {ns}/accelstack-workspace-member exists and is not the controller's" in cond["message"]
        theirs["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]})
        cp.api("PUT", f"{RBAC}/namespaces/{ns}/roles/accelstack-workspace-member", theirs)
        cp.patch(f"{WS}/{ws_name}", {"spec": {"access": [{"kind": "User", "name": member, "role": "member"},
                                                         {"kind": "User", "name": f"{member}-2", "role": "member"}]}})
        wait_ready(cp, ws_name, "False", "NameTaken")
        kc = cp.user_kubeconfig(member)
        assert cp.get(f"{RBAC}/namespaces/{ns}/rolebindings/accelstack-workspace-member") is None
        for verb in ("get", "list"):
            assert not cp.can_i(kc, verb, "secrets", namespace=ns)
        out = cp.kubectl("get", "secret", "db", "-n", ns, kubeconfig=kc, check=False)
        assert "forbidden" in out.lower(), out
    finally:
        with contextlib.suppress(ApiCallError):
            cp.delete(f"{WS}/{ws_name}")
