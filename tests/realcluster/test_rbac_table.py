"""Least privilege of every shipped ServiceAccount, on the real API server with the shipped manifests installed.

The table is the one in docs/security.md ("What each account can and cannot do"), parsed here, so the docs and
the test cannot drift: each "can" entry must answer yes and each "cannot" entry no to ``kubectl auth can-i
VERB RESOURCE --as=system:serviceaccount:NS:SA``. ``can-i`` asks RBAC only; the extender's Roles, RoleBindings
and ServiceAccounts (cluster-wide in RBAC, the namespaces of workspaces are made at run time) are narrowed by
the shipped ValidatingAdmissionPolicies, so the second half makes the writes with the account's real token: in
``kube-system``, in a namespace of no workspace, another's object in a workspace namespace, and the namespace
labels, all refused with the policy's message; its own objects in a workspace namespace allowed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.realcluster.controlplane import ApiCallError, ControlPlane
from tests.realcluster.objects import wait_for
from tests.realcluster.shipped import ROOT
from tests.realcluster.stack import Stack

EXTENDER_NS, EXTENDER_SA = "accelstack-system", "accelstack-extender"
RBAC = "apis/rbac.authorization.k8s.io/v1"
WS = "apis/accelstack.io/v1alpha1/workspaces"
WS_LABEL, MANAGED = "accelstack.io/workspace", {"app.kubernetes.io/managed-by": "accelstack-workspace-controller"}
POLICIES = ("accelstack-workspace-controller-scope", "accelstack-workspace-controller-namespaces",
            "accelstack-device-plugin-labels")
ONLY_WORKSPACE_NS = "the workspace controller may write Roles, RoleBindings and ServiceAccounts only in a workspace's"
ONLY_ITS_OWN = "the workspace controller may only change or delete objects it made"
ONLY_THE_LABEL = "the workspace controller may only change a namespace's accelstack.io/workspace label"
NEVER_SYSTEM = "can never be a workspace namespace"
ENTRY = re.compile(r"^(?P<verbs>[a-z,]+) (?P<res>[a-z0-9.\-]+)(?:/(?P<sub>[a-z]+))?(?: named (?P<name>[a-z0-9.\-]+))?"
                   r"(?: in (?P<ns>[a-z0-9,\-]+))?$")


def doc_table() -> dict[str, tuple[list[str], list[str]]]:
    """``{"NS/SA": (can entries, cannot entries)}`` from docs/security.md."""
    text = (ROOT / "docs/security.md").read_text()
    section = text.split("### What each account can and cannot do", 1)[1].split("\n### ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        account = cells[0].strip("`")
        out[account] = tuple([e.strip().strip("`") for e in cell.split(";") if e.strip()] for cell in cells[1:])
    return out  # type: ignore[return-value]


def questions(entry: str) -> list[tuple[str, str, str, str | None]]:
    """(verb, resource[/name], subresource, namespace or None for all) for one table entry."""
    m = ENTRY.match(entry)
    assert m, f"docs/security.md: cannot read the entry {entry!r}"
    res = m["res"] + (f"/{m['name']}" if m["name"] else "")
    namespaces: list[str | None] = list(m["ns"].split(",")) if m["ns"] else [None]
    return [(v, res, m["sub"] or "", n) for v in m["verbs"].split(",") for n in namespaces]


def can_i(cp: ControlPlane, account: str, verb: str, resource: str, sub: str, namespace: str | None) -> bool:
    ns, sa = account.split("/")
    args = ["auth", "can-i", verb, resource, f"--as=system:serviceaccount:{ns}:{sa}"]
    args += [f"--subresource={sub}"] if sub else []
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    out = cp.kubectl(*args, check=False).strip().splitlines()
    return bool(out) and out[0].strip() == "yes"


def shipped_accounts(objects: list[dict[str, Any]]) -> set[str]:
    return {f"{o['metadata']['namespace']}/{o['metadata']['name']}" for o in objects
            if o.get("kind") == "ServiceAccount"}


# ---- the table ------------------------------------------------------------------------------------------------
def test_every_shipped_account_has_a_row(shipped: list[dict[str, Any]]) -> None:
    assert set(doc_table()) == shipped_accounts(shipped)


def test_every_account_can_and_cannot_exactly_what_the_table_says(cp: ControlPlane,
                                                                  shipped: list[dict[str, Any]]) -> None:
    asks = [(account, want, q) for account, (can, cannot) in sorted(doc_table().items())
            for want, entries in ((True, can), (False, cannot)) for entry in entries for q in questions(entry)]
    # each question is its own kubectl process (about 0.15 s, mostly its start): four at a time, the same answers
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda a: can_i(cp, a[0], *a[2]), asks))
    wrong = []
    for (account, want, (verb, res, sub, namespace)), got in zip(asks, answers, strict=True):
        if got != want:
            where = f" -n {namespace}" if namespace else " (all namespaces)"
            wrong.append(f"{account}: {verb} {res}{'/' + sub if sub else ''}{where}: want {'yes' if want else 'no'}")
    assert len(asks) > 150
    assert not wrong, "\n".join(wrong)


def test_the_policies_type_check(cp: ControlPlane, shipped: list[dict[str, Any]]) -> None:
    """A CEL expression the API server cannot type-check is a warning on the policy, not an error: every
    request would then fail (failurePolicy Fail). None of the shipped policies has one."""
    for name in POLICIES:
        obj = cp.get(f"apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}")
        assert obj, name
        warnings = ((obj.get("status") or {}).get("typeChecking") or {}).get("expressionWarnings")
        assert not warnings, (name, warnings)


# ---- what admission narrows: the extender's account, with its real token ------------------------------------
@pytest.fixture(scope="module")
def extender(cp: ControlPlane, shipped: list[dict[str, Any]]) -> Path:
    """The extender's real token, once the API server enforces the policies it has just been given (they are
    loaded asynchronously): a server-side dry run of a Role in kube-system is refused."""
    kc = cp.sa_kubeconfig(EXTENDER_NS, EXTENDER_SA)
    probe = role("accelstack-workspace-probe", "kube-system", {**MANAGED, WS_LABEL: "probe"})
    wait_for("the workspace controller's policy enforced",
             lambda: ONLY_WORKSPACE_NS in write(cp, kc, "create", probe, "--dry-run=server")[1], timeout=60,
             every=0.5)
    return kc


def write(cp: ControlPlane, kubeconfig: Path, verb: str, obj: dict[str, Any] | None = None,
          *args: str) -> tuple[bool, str]:
    """``kubectl VERB -f -`` (or ``kubectl VERB ARGS``) as ``kubeconfig``: (succeeded, what kubectl said)."""
    cmd = [verb, *args] if obj is None else [verb, "-f", "-", *args]
    try:
        out = cp.kubectl(*cmd, kubeconfig=kubeconfig, stdin=None if obj is None else json.dumps(obj))
        return True, out
    except subprocess.CalledProcessError as exc:
        return False, f"{exc.stdout}{exc.stderr}"


def role(name: str, ns: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]}


def relabelled(cp: ControlPlane, path: str, labels: dict[str, str]) -> dict[str, Any]:
    """The object at ``path`` with ``labels`` added, for a ``kubectl replace`` (the controller updates, it does
    not patch)."""
    obj = cp.get(path)
    assert obj, path
    obj["metadata"]["labels"] = {**(obj["metadata"].get("labels") or {}), **labels}
    return obj


def sa(name: str, ns: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns,
                                                                       "labels": labels}}


def test_the_extender_writes_no_rbac_outside_workspace_namespaces(cp: ControlPlane, extender: Path,
                                                                  ns: str) -> None:
    """Its own labels for a workspace, outside a workspace namespace: refused (kube-system, a plain namespace);
    the bindings it could make there are refused the same way; nothing in kube-system it may change or delete."""
    mine = {**MANAGED, WS_LABEL: "team"}
    for where in ("kube-system", ns):
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "accelstack-workspace-admin", "namespace": where, "labels": mine},
                   # to a role whose rules it holds everywhere (its own), so RBAC's escalation check (which runs
                   # before admission) lets it through and the policy is what refuses it. ("view" would not do: the
                   # controller manager's aggregation adds rules to it that the extender lacks.)
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "accelstack-workspace-controller"},
                   "subjects": [{"kind": "User", "name": "mallory", "apiGroup": "rbac.authorization.k8s.io"}]}
        objs: list[dict[str, Any]] = [role("accelstack-workspace-admin", where, mine), sa("ci", where, mine), binding]
        for obj in objs:
            ok, said = write(cp, extender, "create", obj)
            assert not ok and ONLY_WORKSPACE_NS in said, (where, obj["kind"], said)
            assert cp.get(f"{RBAC if obj['kind'] != 'ServiceAccount' else 'api/v1'}/namespaces/{where}/"
                          f"{obj['kind'].lower()}s/{obj['metadata']['name']}") is None
    # objects in kube-system it did not make (of rights it holds, so RBAC alone would let it): never deleted,
    # never taken over
    cp.create("api/v1/namespaces/kube-system/serviceaccounts", sa(f"{ns}-keep", "kube-system", {}))
    cp.create(f"{RBAC}/namespaces/kube-system/roles", role(f"{ns}-keep", "kube-system", {}))
    try:
        for args in (("serviceaccount", f"{ns}-keep", "-n", "kube-system"),
                     ("role", f"{ns}-keep", "-n", "kube-system")):
            ok, said = write(cp, extender, "delete", None, *args)
            assert not ok and ONLY_ITS_OWN in said, (args, said)
        ok, said = write(cp, extender, "replace", relabelled(cp, f"{RBAC}/namespaces/kube-system/roles/{ns}-keep",
                                                             mine))
        assert not ok and ONLY_ITS_OWN in said, said
        assert cp.get(f"api/v1/namespaces/kube-system/serviceaccounts/{ns}-keep")
        assert not (cp.get(f"{RBAC}/namespaces/kube-system/roles/{ns}-keep") or {})["metadata"].get("labels")
    finally:
        cp.delete(f"api/v1/namespaces/kube-system/serviceaccounts/{ns}-keep")
        cp.delete(f"{RBAC}/namespaces/kube-system/roles/{ns}-keep")
    # and kube-system (or default, or accelstack's own namespace) never becomes a workspace namespace
    for name in ("kube-system", "default", EXTENDER_NS):
        ok, said = write(cp, extender, "label", None, "namespace", name, f"{WS_LABEL}=team")
        assert not ok and NEVER_SYSTEM in said, (name, said)
        assert WS_LABEL not in ((cp.get(f"api/v1/namespaces/{name}") or {})["metadata"].get("labels") or {})


def test_the_extender_writes_its_own_objects_in_a_workspace_namespace_only(cp: ControlPlane, stack: Stack,
                                                                           extender: Path, ns: str) -> None:
    """A workspace's namespace (the running controller labels it and makes its objects): the controller's own
    objects for that workspace may be made, changed and deleted; without its labels, for another workspace, or
    someone else's Role there: refused; on the namespace, only the workspace label. The writes are server-side
    dry runs (admission runs, nothing is stored), so the running controller's own work is left alone."""
    ws = f"{ns}-ws"
    cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ws},
                   "spec": {"namespaces": [ns], "access": [{"kind": "User", "name": f"u-{ns}", "role": "viewer"}]}})
    dry = "--dry-run=server"
    try:
        viewer = f"{RBAC}/namespaces/{ns}/roles/accelstack-workspace-viewer"
        wait_for("the workspace's Role", lambda: cp.get(viewer), timeout=60)
        for extra in (("team=x",), ("--overwrite", f"{WS_LABEL}={ns}-other")):
            ok, said = write(cp, extender, "label", None, "namespace", ns, *extra, dry)
            assert ok == (extra[0] == "--overwrite") and (ok or ONLY_THE_LABEL in said), (extra, said)
        ok, said = write(cp, extender, "annotate", None, "namespace", ns, "note=x", dry)
        assert not ok and ONLY_THE_LABEL in said, said
        mine = {**MANAGED, WS_LABEL: ws}
        for obj in (role("accelstack-workspace-extra", ns, mine), sa("ci", ns, mine)):
            ok, said = write(cp, extender, "create", obj, dry)
            assert ok, said
        ok, said = write(cp, extender, "replace", relabelled(cp, viewer, {"x": "y"}), dry)
        assert ok, said
        ok, said = write(cp, extender, "delete", None, "role", "accelstack-workspace-viewer", "-n", ns, dry)
        assert ok, said
        for obj in (role("unlabelled", ns, {}), role("other-workspace", ns, {**MANAGED, WS_LABEL: f"{ns}-other"}),
                    sa("bare", ns, {WS_LABEL: ws})):
            ok, said = write(cp, extender, "create", obj, dry)
            assert not ok and ONLY_WORKSPACE_NS in said, (obj["metadata"]["name"], said)
        # someone else's Role in the workspace namespace: not the controller's to change or delete
        cp.create(f"{RBAC}/namespaces/{ns}/roles", role("theirs", ns, {}))
        ok, said = write(cp, extender, "replace", relabelled(cp, f"{RBAC}/namespaces/{ns}/roles/theirs", mine), dry)
        assert not ok and ONLY_ITS_OWN in said, said
        ok, said = write(cp, extender, "delete", None, "role", "theirs", "-n", ns, dry)
        assert not ok and ONLY_ITS_OWN in said, said
    finally:
        with contextlib.suppress(ApiCallError):
            cp.delete(f"{WS}/{ws}")
