"""Issue 36.2 on the real control plane: the extender's verbs answer only kube-scheduler's client certificate.

An anonymous ``POST /scheduler/bind`` (no certificate, a certificate of another name, or the main port) binds
nothing; the real kube-scheduler with the shipped profile's ``tlsConfig`` (certFile/keyFile) binds a GPR's pod
through the verbs listener; and even a caller holding the scheduler's certificate cannot have a pod that is not
accelstack's bound."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import GPRS, admitted, gpr, pod, pod_obj, wait_bound, wait_for
from tests.realcluster.stack import Stack


def post(url: str, body: dict[str, Any], ctx: ssl.SSLContext) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            status, raw = int(r.status), r.read()
    except urllib.error.HTTPError as exc:
        status, raw = int(exc.code), exc.read()
    try:
        return status, dict(json.loads(raw))
    except ValueError:
        return status, {"text": raw.decode(errors="replace")}


def plain_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"schedulerName": "nobody", "containers": [
                {"name": "c", "image": "pause", "resources": {"requests": {"cpu": "100m"}}}]}}


def test_anonymous_bind_is_refused_and_the_real_scheduler_binds_through_mtls(cp: ControlPlane, stack: Stack,
                                                                             ns: str, nodes: Nodes) -> None:
    node = nodes.add("a", gpus=8)
    victim = cp.create(f"api/v1/namespaces/{ns}/pods", plain_pod("plain"))
    body = {"PodName": "plain", "PodNamespace": ns, "PodUID": victim["metadata"]["uid"], "Node": node}
    anonymous = cp.ssl_context()
    # the main port (webhooks, REST API) no longer serves the verbs
    assert post(f"{stack.url}/scheduler/bind", body, anonymous)[0] == 404
    # the verbs' port: no client certificate, no TLS session
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        post(f"{stack.verbs_url}/scheduler/bind", body, anonymous)
    # a certificate of the same CA with another name: 403
    crt, key = cp.pki.issue("someone", "/CN=someone-else", client=True)
    other = cp.ssl_context()
    other.load_cert_chain(str(crt), str(key))
    status, answer = post(f"{stack.verbs_url}/scheduler/bind", body, other)
    assert status == 403 and "not allowed" in answer["Error"]
    # the scheduler's own certificate, for a pod that is not accelstack's: refused with the reason
    scheduler = cp.ssl_context()
    scheduler.load_cert_chain(str(stack.client_cert), str(stack.client_key))
    status, answer = post(f"{stack.verbs_url}/scheduler/bind", body, scheduler)
    assert status == 200 and "not the accelstack extender's to bind" in answer["Error"]
    assert not pod_obj(cp, ns, "plain")["spec"].get("nodeName")
    # the real kube-scheduler with the shipped profile (client certificate in tlsConfig) binds a GPR's pod
    stack.start_scheduler()
    cp.create(GPRS.format(ns=ns), gpr("sec", devices=1, nodes=1))
    wait_for("the GPR admitted", lambda: admitted(cp, ns, "sec"))
    cp.create(f"api/v1/namespaces/{ns}/pods", pod("sec-0", gpus=1, gpr_name="sec"))
    assert wait_bound(cp, ns, "sec-0") == node
    assert not pod_obj(cp, ns, "plain")["spec"].get("nodeName")
