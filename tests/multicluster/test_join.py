"""What cluster join creates (the scoping of the member's hub identity, the member's read-only agent) and the
command's one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from scheduler_extender.cli.kubectl_plugin import main
from scheduler_extender.multicluster.join import (
    api_server_spec,
    hub_items,
    member_items,
    member_objects,
    plan_lines,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_hub_identity_may_touch_its_own_cluster_only() -> None:
    items = {(i.resource.kind, i.name): i for i in hub_items("member-a", {"region": "eu-west"})}
    role = items[("ClusterRole", "accelstack-member-member-a")].body
    assert role is not None
    assert role["rules"] == [{"apiGroups": ["accelstack.io"], "resources": ["clusters", "clusters/status"],
                              "verbs": ["get", "update", "patch"], "resourceNames": ["member-a"]}]
    ns_role = items[("Role", "accelstack-member-agent")]
    assert ns_role.namespace == "accelstack-member-member-a"
    assert ns_role.body is not None and ns_role.body["rules"] == [
        {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"],
         "resourceNames": ["member-agent"]},
        {"apiGroups": ["accelstack.io"], "resources": ["gpuprovisioningrequests"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["accelstack.io"], "resources": ["gpuprovisioningrequests/status"], "verbs": ["patch"]},
        # the Workspace carriers in its own hub namespace: read them, patch the verdict in (never create or delete)
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "patch"]},
        # the answers to workspace kubeconfig requests: created, never read back
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    # the hub's own account writes in this namespace only: dispatches, carriers and requests, and the answers
    hub_role = items[("Role", "accelstack-hub")]
    assert hub_role.namespace == "accelstack-member-member-a" and hub_role.body is not None
    assert hub_role.body["rules"] == [
        {"apiGroups": ["accelstack.io"], "resources": ["gpuprovisioningrequests"], "verbs": ["create", "delete"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "delete"]}]
    binding = items[("RoleBinding", "accelstack-hub")].body
    assert binding is not None and binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "accelstack-hub", "namespace": "accelstack-system"}]
    cluster = items[("Cluster", "member-a")].body
    assert cluster is not None and cluster["spec"] == {"labels": {"region": "eu-west"}}
    # where the member is reached (for workspace kubeconfigs): its URL and CA, never a credential
    located = {(i.resource.kind, i.name): i for i in hub_items("member-a", {}, api_server_spec(
        "https://a.example:6443", b"PEM"))}[("Cluster", "member-a")].body
    assert located is not None and located["spec"]["apiServer"] == {"url": "https://a.example:6443",
                                                                    "caBundle": "UEVN"}
    # every object carries join's label (leave deletes only those), the token is issued, never stored on the hub
    assert all(i.body["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "accelstack-cluster-join"
               for i in items.values() if i.body is not None)
    assert [i.line() for i in hub_items("member-a", {})][-1] == \
        "hub: ServiceAccount member-agent/token in accelstack-member-member-a"


def test_the_member_agent_reads_and_writes_only_gprs_and_workspaces() -> None:
    rules = next(o for o in member_objects() if o["kind"] == "ClusterRole")["rules"]
    assert {res for r in rules for res in r["resources"]} == {"nodes", "acceleratornodes", "gpuprovisioningrequests",
                                                              "workspaces", "serviceaccounts",
                                                              "serviceaccounts/token"}
    writes = [r for r in rules if set(r["verbs"]) - {"get", "list", "watch"}]
    assert writes == [{"apiGroups": ["accelstack.io"], "resources": ["gpuprovisioningrequests"],
                       "verbs": ["create", "delete"]},  # the hub's GPRs: no status, no update, no nodes
                      {"apiGroups": ["accelstack.io"], "resources": ["workspaces"],  # no status, no namespaces
                       "verbs": ["get", "list", "watch", "create", "update", "delete"]},
                      # a hub GPR's workload, made as one named account of its namespace: never as the agent
                      {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["impersonate"],
                       "resourceNames": ["accelstack-workload"]},
                      # workspace kubeconfigs: tokens for the three role accounts only (never default, kube-system)
                      {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"],
                       "resourceNames": ["accelstack-workspace-admin", "accelstack-workspace-member",
                                         "accelstack-workspace-viewer"]}]
    role = next(o for o in member_objects() if o["kind"] == "Role")
    assert role["rules"][0]["resourceNames"] == ["accelstack-hub-kubeconfig"]
    assert member_items()[0].line() == "member: Secret accelstack-hub-kubeconfig in accelstack-system"


def test_manifests_member_is_what_join_creates() -> None:
    shipped = [d for d in yaml.safe_load_all((ROOT / "manifests/member/agent.yaml").read_text()) if d]
    assert json.dumps(shipped, sort_keys=True) == json.dumps(member_objects(), sort_keys=True)


def test_dry_run_prints_every_object_and_creates_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["cluster", "join", "member-a", "--hub-kubeconfig", "/nonexistent", "--label", "region=eu",
                 "--dry-run"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out == [f"{line}: would be created" for line in plan_lines("member-a", {"region": "eu"})]
    assert len(out) == 17


@pytest.mark.parametrize(("argv", "message"), [
    (["cluster", "join", "Member_A", "--hub-kubeconfig", "x"], "cluster name 'Member_A': want a DNS label"),
    (["cluster", "join", "a", "--hub-kubeconfig", "x", "--label", "region"], "label 'region': want key=value"),
    (["cluster", "join", "a", "--hub-kubeconfig", "x", "--token-expiry", "5m"], "--token-expiry: at least 10m"),
    (["cluster", "join", "a", "--hub-kubeconfig", "x", "--token-expiry", "soon"], "--token-expiry:"),
    (["cluster", "join", "a", "--hub-kubeconfig", "/nonexistent/hub"], "--hub-kubeconfig: no such file"),
    (["cluster", "leave", "a", "--hub-kubeconfig", "/nonexistent/hub"], "--hub-kubeconfig: no such file"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_an_unreachable_hub_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
              "users": [{"name": "u", "user": {"token": "t"}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    assert main(["cluster", "join", "a", "--hub-kubeconfig", str(path), "--kubeconfig", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing created, nothing said to be
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "hub: cannot reach the API server https://127.0.0.1:9" in lines[0], lines
