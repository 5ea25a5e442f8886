"""The admission path as a cluster runs it: the API server (the peer) calls the extender's ``/mutate-pods`` for a
pod, the extender creates the pod's GPR at the API server, and the API server calls the extender's
``/validate-gprs`` on that create before storing it (``manifests/extender/webhooks.yaml`` registers both). The
webhook thus waits on a request that needs the same process to answer another: under a burst of pod creations
every pod must still be admitted, each GPR made once and judged once, and what the GPR webhook refuses must
come back to the user as the API server's error."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s

from kubeapi import KubeClient
from kubeapi.resources import WORKSPACES
from scheduler_extender.admission.webhook import (
    AUTO_LABEL,
    PRIORITY_RANGE_ANNOTATION,
    KubeLookup,
    Webhook,
    add_webhook_routes,
)
from scheduler_extender.objects.kube import Kube, NotFound
from tests.apiserver_peer import APIServerPeer, json_patch
from tests.apiserver_peer.admission import ValidatingWebhook
from tests.extender.harness import stack

GPRS = "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"
JOBS = "apis/batch/v1/jobs"


def a_pod(name: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "team"}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


async def create_pod(http: aiohttp.ClientSession, peer: APIServerPeer, mutate: str, pod: dict[str, Any],
                     timeout: int = 5) -> str:
    """What the API server does with a pod CREATE: call the mutating webhook (timeoutSeconds 5, told to the
    webhook as ``?timeout=5s``), apply its patch, store. '' when stored, else why not."""
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": pod["metadata"]["name"], "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "team",
        "operation": "CREATE", "userInfo": {"username": "alice"}, "object": pod, "dryRun": False}}
    try:
        async with http.post(mutate, json=review, params={"timeout": f"{timeout}s"},
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            answer = (await r.json())["response"]
    except TimeoutError:
        return "failed calling webhook: context deadline exceeded"
    if not answer.get("allowed"):
        return f"refused: {answer.get('status')}"
    if answer.get("patch"):
        pod = json_patch(pod, json.loads(base64.b64decode(answer["patch"])))
    async with http.post(f"{peer.url}/api/v1/namespaces/team/pods", json=pod) as r:
        return "" if r.status == 201 else f"{r.status}: {await r.text()}"


async def team(peer: APIServerPeer) -> None:
    await peer.put_object("api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team", "annotations": {
            "accelstack.io/default-template": "one", PRIORITY_RANGE_ANNOTATION: "1-200"}}})
    await peer.put_object("apis/accelstack.io/v1alpha1/gprtemplates", {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate", "metadata": {"name": "one", "namespace": "team"},
        "spec": {"devicesPerNode": 1, "priority": 50, "exitDuration": "4h"}})


@contextlib.asynccontextmanager
async def webhook_stack(peer: APIServerPeer) -> AsyncIterator[str]:
    """An extender serving the admission webhooks (auto-GPR on) with its own client to the peer; its base URL."""
    api = k8s.ApiClient(k8s.Configuration(host=peer.url))
    handler = Webhook(KubeLookup(Kube(KubeClient(api, field_manager="accelstack-extender"))), auto_gpr=True)
    try:
        async with stack(peer, extra_routes=lambda app: add_webhook_routes(app, handler)) as (_, server):
            yield f"http://127.0.0.1:{server.port}"
    finally:
        await api.close()


async def test_a_burst_of_pods_makes_each_gpr_once_through_the_api_servers_gpr_webhook() -> None:
    peer = APIServerPeer()
    await peer.start()
    await team(peer)
    job = await peer.put_object(JOBS, {"apiVersion": "batch/v1", "kind": "Job",
                                       "metadata": {"name": "train", "namespace": "team"}, "spec": {}})
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": job["metadata"]["uid"],
             "controller": True}
    try:
        async with webhook_stack(peer) as base, aiohttp.ClientSession() as http:
            hook = ValidatingWebhook("gprs.accelstack.io", f"{base}/validate-gprs",
                                     frozenset({"gpuprovisioningrequests"}))
            peer.admission.validating.append(hook)
            pods = [a_pod(f"solo-{i}") for i in range(30)] + [a_pod(f"train-{i}", owner) for i in range(10)]
            outcomes = await asyncio.gather(*(create_pod(http, peer, f"{base}/mutate-pods", p) for p in pods))
            assert outcomes == [""] * len(pods)
            made = {name for (res, _, name) in peer.objects if res == GPRS}
            assert made == {f"solo-{i}" for i in range(30)} | {"train"}
            assert all(peer.get(GPRS, "team", n)["metadata"]["labels"][AUTO_LABEL] == "true"  # type: ignore[index]
                       for n in made)
            stored = [p for (res, _, _), p in peer.objects.items() if res == "api/v1/pods"]
            assert len(stored) == 40
            assert {p["metadata"]["labels"]["accelstack.io/gpr"] for p in stored} == made
            assert all(p["spec"]["schedulingGates"] == [{"name": "accelstack.io/gpr"}] for p in stored)
            assert hook.calls >= 31 and hook.failures == []  # every create judged (racing ones for "train" too)
            # what the GPR webhook refuses reaches the user as the API server's error, and nothing is stored
            body = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
                    "metadata": {"name": "greedy", "namespace": "team"},
                    "spec": {"devicesPerNode": 1, "priority": 250, "exitDuration": "4h"}}
            async with http.post(f"{peer.url}/apis/accelstack.io/v1alpha1/namespaces/team/gpuprovisioningrequests",
                                 json=body) as r:
                status = await r.json()
                assert r.status == 403, status["message"]
            assert status["message"].startswith('admission webhook "gprs.accelstack.io" denied the request: ')
            assert "spec.priority: 250 is outside 1-200" in status["message"]
            assert peer.get(GPRS, "team", "greedy") is None
            # a spec change through the API is judged too (UPDATE, with the old object)
            async with http.patch(f"{peer.url}/apis/accelstack.io/v1alpha1/namespaces/team/gpuprovisioningrequests/"
                                  "solo-0", json={"spec": {"priority": 250}},
                                  headers={"Content-Type": "application/merge-patch+json"}) as r:
                assert r.status == 403, await r.text()
            assert peer.get(GPRS, "team", "solo-0")["spec"]["priority"] == 50  # type: ignore[index]
    finally:
        await peer.stop()


async def test_gpr_creates_leave_connections_for_the_gpr_webhook_they_make_the_api_server_call() -> None:
    """Each auto-GPR create waits for the API server, which waits for this process's ``/validate-gprs``, whose
    lookups take a connection of the same client pool. With every connection held by a create, each webhook
    answer waited for a connection that only the webhook's timeout freed: a whole window of pod creations
    refused at once (the e2e bench's one window of 200 client timeouts, when the cached namespace expired
    mid-burst). Creates now take at most half the pool. Such a wait ends only at the webhook's timeout, which the
    API server's peer records as a failure: no failure, no wait (no wall-clock bound that a loaded machine
    breaks)."""
    peer = APIServerPeer()
    await peer.start()
    await team(peer)
    configuration = k8s.Configuration(host=peer.url)
    configuration.connection_pool_maxsize = 6
    api = k8s.ApiClient(configuration)
    # nothing kept: every lookup of the GPR webhook is an API call, as when the cached namespace expires
    lookup = KubeLookup(Kube(KubeClient(api, field_manager="accelstack-extender")), ttl=0.0, max_stale=0.0)
    handler = Webhook(lookup, auto_gpr=True)
    try:
        async with stack(peer, extra_routes=lambda app: add_webhook_routes(app, handler)) as (_, server), \
                aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{server.port}"
            hook = ValidatingWebhook("gprs.accelstack.io", f"{base}/validate-gprs",
                                     frozenset({"gpuprovisioningrequests"}), timeout=2.0)
            peer.admission.validating.append(hook)
            outcomes = await asyncio.gather(*(create_pod(http, peer, f"{base}/mutate-pods", a_pod(f"solo-{i}"))
                                              for i in range(40)))
            assert hook.failures == []  # no GPR create waited out the webhook's timeout
            assert outcomes == [""] * 40
            assert len([1 for (res, _, _) in peer.objects if res == GPRS]) == 40
    finally:
        await api.close()
        await peer.stop()


async def test_every_write_our_own_webhooks_judge_takes_at_most_half_the_pool() -> None:
    """GPR creates (auto-GPR, REST API) and the REST API's creates and replaces of workspaces, templates and
    bindings each wait for this process's webhooks: at most half the client's connections are theirs, and a
    read made meanwhile does not wait behind them (it reaches the API server before any write is answered: by
    order, not by a wall-clock bound a loaded machine breaks)."""
    peer = APIServerPeer()
    await peer.start()
    configuration = k8s.Configuration(host=peer.url)
    configuration.connection_pool_maxsize = 6
    api = k8s.ApiClient(configuration)
    kube = Kube(KubeClient(api, field_manager="accelstack-extender"))
    try:
        peer.inject("POST", None, delay=0.6)  # every create answered late, as while a webhook judges it
        gpr = {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
               "spec": {"devicesPerNode": 1, "priority": 1, "exitDuration": "1h"}}
        writes = [kube.create_gpr("team", {**gpr, "metadata": {"name": f"g{i}", "namespace": "team"}})
                  for i in range(6)]
        writes += [kube.create_object(WORKSPACES, None, {"apiVersion": "accelstack.io/v1alpha1", "kind": "Workspace",
                                                         "metadata": {"name": f"w{i}"}, "spec": {}})
                   for i in range(6)]
        started = time.monotonic()
        done = asyncio.gather(*writes)
        await asyncio.sleep(0.1)  # the first writes hold their connections
        with contextlib.suppress(NotFound):
            await kube.get_gpr("team", "nope")
        await done
        posts = peer.calls("POST")
        assert len(posts) == 12
        overlap = max(sum(1 for r in posts if r.started <= p.started < (r.finished or float("inf"))) for p in posts)
        assert overlap <= 3, overlap  # half of 6
        (read,) = peer.calls("GET", "gpuprovisioningrequests")
        # not behind a write: had the writes taken every connection, the read would start only once one was answered
        assert read.started < min(p.finished or float("inf") for p in posts)
        assert time.monotonic() - started >= 4 * 0.6 - 0.05  # 12 writes, 3 at a time
    finally:
        await peer.stop()


async def test_a_pod_whose_gpr_cannot_be_made_in_time_is_refused_with_a_reason_before_the_deadline() -> None:
    """The API server tells the webhook its deadline (``?timeout=2s``). When the pod's GPR create hangs at the API
    server, the webhook answers before that deadline with a refusal that says why, instead of leaving the API
    server to give up ("context deadline exceeded", the bare error users saw under load); the GPR that may have
    landed meanwhile is an orphan the controller deletes. Without a deadline from the API server nothing
    changes: a lookup's own failure is still refused as unreadable."""
    from scheduler_extender.admission.webhook import answer_within

    assert [answer_within(t) for t in ("5s", "2s", "1s", "10s")] == [4.0, 1.0, 0.5, 9.0]
    assert [answer_within(t) for t in (None, "", "0s", "soon", "-3s")] == [None] * 5
    peer = APIServerPeer()
    await peer.start()
    await team(peer)
    try:
        async with webhook_stack(peer) as base, aiohttp.ClientSession() as http:
            with peer.inject("POST", "gpuprovisioningrequests", hang=True):
                started = time.monotonic()
                outcome = await create_pod(http, peer, f"{base}/mutate-pods", a_pod("late"), timeout=2)
                took = time.monotonic() - started
            assert "could not finish within the webhook's timeout (2s)" in outcome, outcome
            assert "ServiceUnavailable" in outcome and took > 0.9, took  # at its own 1 s (before 2 s: the outcome)
            assert peer.get("api/v1/pods", "team", "late") is None
            text = await (await http.get(f"{base}/metrics")).text()
            assert 'accelstack_webhook_request_seconds_count{endpoint="mutate-pods",outcome="deadline"} 1.0' in text
            # the next pod, with the API server answering again, is admitted as ever
            assert await create_pod(http, peer, f"{base}/mutate-pods", a_pod("fine"), timeout=2) == ""
    finally:
        await peer.stop()
