"""Issue 35.5 on the real API server: a workspace member (a ServiceAccount with a real bound token, named in the
Workspace's access) reads its own cluster-scoped Workspace through the REST API and the kubectl plugin, though
its RBAC (namespaced roles) denies ``get workspaces``; a caller in the same namespace who is not a member is
refused. Fails on the code before: the member's GET was 403 (``may not get workspaces``)."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from typing import Any

from scheduler_extender.cli.kubectl_plugin import Client
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import GPRS, gpr, gpr_status, wait_for
from tests.realcluster.stack import Stack
from tests.realcluster.test_workspaces import WS, wait_ready


def rest(stack: Stack, cp: ControlPlane, path: str, token: str) -> tuple[int, Any]:
    request = urllib.request.Request(stack.url + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30, context=cp.ssl_context()) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_a_member_reads_its_workspace_through_the_rest_api_and_the_plugin(cp: ControlPlane, stack: Stack,
                                                                          ns: str) -> None:
    for sa in ("bot", "stranger"):
        cp.create(f"api/v1/namespaces/{ns}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                             "metadata": {"name": sa}})
    cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ns},
                   "spec": {"namespaces": [ns], "access": [{"kind": "ServiceAccount", "name": "bot",
                                                            "role": "member"}],
                            "policy": {"devices": [{"resource": "nvidia.com/gpu", "max": 8}]}}})
    try:
        wait_ready(cp, ns)
        member, stranger = cp.token(ns, "bot"), cp.token(ns, "stranger")
        status, got = rest(stack, cp, f"/api/v1/workspaces/{ns}", member)
        assert status == 200 and got["metadata"]["name"] == ns, got
        status, listed = rest(stack, cp, "/api/v1/workspaces", member)
        assert status == 200 and [w["metadata"]["name"] for w in listed["items"]] == [ns], listed
        status, me = rest(stack, cp, "/api/v1/whoami", member)
        assert me["allowed"]["workspaces"] and me["createGPRIn"] == [ns], me
        usage = Client(stack.url, member, cp.ssl_context()).get(f"/api/v1/workspaces/{ns}")
        assert usage["metadata"]["name"] == ns  # what `kubectl accelstack workspace usage NS` reads
        for path in (f"/api/v1/workspaces/{ns}", "/api/v1/workspaces"):
            status, body = rest(stack, cp, path, stranger)
            assert status == 403 and "may not" in body["error"], body
    finally:
        cp.api("DELETE", f"{WS}/{ns}", ok=(200, 202, 404))


def test_a_member_reads_why_the_queue_is_in_its_order(cp: ControlPlane, stack: Stack, ns: str) -> None:
    """Issue 35.4 (the queue view explains ordering), on the real API server: a member's queue through the REST API
    names each waiting GPR's priority level and says how the queue is ordered (level strictly, then smaller
    predicted work first, ageing, backfill). Before: a bare position and priority number, nothing about the rule."""
    cp.create(f"api/v1/namespaces/{ns}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                         "metadata": {"name": "bot"}})
    cp.create(WS, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace", "metadata": {"name": ns},
                   "spec": {"namespaces": [ns], "access": [{"kind": "ServiceAccount", "name": "bot",
                                                            "role": "member"}]}})
    try:
        wait_ready(cp, ns)
        # no node has this many devices: both wait, and the controller writes why
        for name, priority in (("urgent", 250), ("whenever", 50)):
            cp.create(GPRS.format(ns=ns), gpr(name, devices=64, priority=priority))
        def reason(name: str) -> str | None:
            return gpr_status(cp, ns, name).get("reason")

        for name in ("urgent", "whenever"):
            wait_for(f"{name} queued with a reason", functools.partial(reason, name))
        member = cp.token(ns, "bot")
        status, q = rest(stack, cp, f"/api/v1/queue?namespace={ns}", member)
        assert status == 200, q
        levels = {r["name"]: (r["phase"], r["level"]) for r in q["items"]}
        assert levels == {"urgent": ("Queued", "high"), "whenever": ("Queued", "low")}, q
        assert q["order"].startswith("Queued GPRs start by priority level, strictly: high (201-300), then medium"), q
        assert "smaller predicted work first" in q["order"] and "backfill" in q["order"]
    finally:
        cp.api("DELETE", f"{WS}/{ns}", ok=(200, 202, 404))
