"""The API-server peer misbehaves the way a kube-apiserver does, on demand, and speaks the protocol parts the
client layer relies on: faults, pagination, bookmarks, watch timeouts, managedFields, preconditions,
finalizers, generation, dry runs, leases and the request log. Plain aiohttp and kubernetes_asyncio clients."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from tests.apiserver_peer import PROXY_502_HTML, APIServerPeer

GPRS = "apis/accelstack.io/v1alpha1/gpuprovisioningrequests"
GPR_URL = "/apis/accelstack.io/v1alpha1/namespaces/ml/gpuprovisioningrequests"
LEASES = "apis/coordination.k8s.io/v1/leases"


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {}, "status": {}}


def gpr(name: str, priority: int = 100) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": name, "namespace": "ml"}, "spec": {"devicesPerNode": 1, "priority": priority}}


@pytest.fixture
async def peer() -> AsyncIterator[APIServerPeer]:
    p = APIServerPeer()
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
async def api(peer: APIServerPeer) -> AsyncIterator[client.ApiClient]:
    api_client = client.ApiClient(client.Configuration(host=peer.url))
    yield api_client
    await api_client.close()


async def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


async def read_events(response: aiohttp.ClientResponse, timeout: float) -> list[dict[str, Any]]:
    """Watch events until the stream ends or ``timeout`` passes."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = await asyncio.wait_for(response.content.readline(), left)
        except TimeoutError:
            break
        if not line:
            break
        events.append(json.loads(line))
    return events


# -- faults ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("code", "reason"), [(403, "Forbidden"), (404, "NotFound"), (409, "Conflict"),
                                              (410, "Expired"), (422, "Invalid"), (429, "TooManyRequests"),
                                              (500, "InternalError"), (502, "InternalError"),
                                              (503, "ServiceUnavailable"), (504, "Timeout")])
async def test_error_status_has_the_real_reason_and_ends_after_times(
        peer: APIServerPeer, http: aiohttp.ClientSession, code: int, reason: str) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    fault = peer.inject("GET", "nodes", verb="list", status=code, times=2)
    for _ in range(2):
        async with http.get(f"{peer.url}/api/v1/nodes") as r:
            body = await r.json()
            assert r.status == code and r.content_type == "application/json"
            assert body["kind"] == "Status" and body["reason"] == reason and body["code"] == code
            assert body["message"] and "Retry-After" not in r.headers
    assert fault.hits == 2 and not fault.active and not peer.faults
    async with http.get(f"{peer.url}/api/v1/nodes") as r:
        assert r.status == 200 and [o["metadata"]["name"] for o in (await r.json())["items"]] == ["a"]
    assert [rec.status for rec in peer.calls("GET", "nodes")] == [code, code, 200]


async def test_forbidden_message_names_the_verb_and_scope(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    peer.inject("GET", "gpuprovisioningrequests", watch=False, status=403)
    async with http.get(f"{peer.url}{GPR_URL}") as r:
        body = await r.json()
    assert body["message"] == ('gpuprovisioningrequests.accelstack.io is forbidden: User "system:serviceaccount:'
                               'accelstack:test" cannot list resource "gpuprovisioningrequests" in API group '
                               '"accelstack.io" in the namespace "ml"')


@pytest.mark.parametrize("code", [429, 503])
async def test_retry_after_header_and_details(peer: APIServerPeer, http: aiohttp.ClientSession, code: int) -> None:
    peer.inject(resource="pods", status=code, retry_after=3)
    async with http.get(f"{peer.url}/api/v1/pods") as r:
        body = await r.json()
        assert r.status == code and r.headers["Retry-After"] == "3"
        assert body["details"]["retryAfterSeconds"] == 3


async def test_proxy_html_502_is_not_json(peer: APIServerPeer, api: client.ApiClient) -> None:
    peer.inject("GET", "nodes", body=PROXY_502_HTML, times=1)
    with pytest.raises(ApiException) as exc:
        await client.CoreV1Api(api).list_node()
    raw = exc.value.body or b""
    assert exc.value.status == 502 and exc.value.headers is not None
    assert "text/html" in exc.value.headers["Content-Type"]
    assert (raw if isinstance(raw, bytes) else raw.encode()).startswith(b"<html>")
    assert (await client.CoreV1Api(api).list_node()).items == []


async def test_matching_by_namespace_name_subresource_and_order(peer: APIServerPeer,
                                                                http: aiohttp.ClientSession) -> None:
    await peer.put_object(GPRS, gpr("a"))
    await peer.put_object(GPRS, gpr("b"))
    first = peer.inject("PATCH", "gpuprovisioningrequests", namespace="ml", name="a", subresource="status",
                        status=409)
    peer.inject("PATCH", GPRS, status=500)  # later: only what the first did not take
    headers = {"Content-Type": "application/merge-patch+json"}
    patch = json.dumps({"status": {"phase": "Queued"}})
    async with http.patch(f"{peer.url}{GPR_URL}/a/status", data=patch, headers=headers) as r:
        assert r.status == 409
    async with http.patch(f"{peer.url}{GPR_URL}/b/status", data=patch, headers=headers) as r:
        assert r.status == 500
    first.remove()
    async with http.patch(f"{peer.url}{GPR_URL}/a", data=patch, headers=headers) as r:
        assert r.status == 500
    peer.clear_faults()
    async with http.patch(f"{peer.url}{GPR_URL}/a/status", data=patch, headers=headers) as r:
        assert r.status == 200 and (await r.json())["status"]["phase"] == "Queued"
    with peer.inject(resource="gpuprovisioningrequests", name="", status=503) as f:  # collections only
        async with http.get(f"{peer.url}{GPR_URL}/a") as r:
            assert r.status == 200
        async with http.get(f"{peer.url}{GPR_URL}") as r:
            assert r.status == 503
    assert f.hits == 1 and not f.active


async def test_watch_false_spares_watches_and_when_predicate(peer: APIServerPeer,
                                                             http: aiohttp.ClientSession) -> None:
    peer.inject("GET", "nodes", watch=False, status=500, when=lambda req: "labelSelector" in req.query)
    async with http.get(f"{peer.url}/api/v1/nodes?labelSelector=x%3Dy") as r:
        assert r.status == 500
    async with http.get(f"{peer.url}/api/v1/nodes") as r:
        assert r.status == 200
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&labelSelector=x%3Dy&timeoutSeconds=1") as r:
        assert r.status == 200


async def test_respond_hook_and_delay(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    from aiohttp import web

    seen: list[str] = []

    def respond(request: web.Request) -> web.Response | None:
        seen.append(request.path)
        return web.json_response({"custom": True}, status=418) if len(seen) == 1 else None

    peer.inject("GET", "nodes", respond=respond, times=2)
    async with http.get(f"{peer.url}/api/v1/nodes") as r:
        assert r.status == 418
    async with http.get(f"{peer.url}/api/v1/nodes") as r:  # None: answered normally
        assert r.status == 200
    peer.inject("GET", "nodes", delay=0.3, times=1)
    started = time.monotonic()
    async with http.get(f"{peer.url}/api/v1/nodes") as r:
        assert r.status == 200
    assert time.monotonic() - started >= 0.3


async def test_hang_never_answers_until_the_client_leaves(peer: APIServerPeer, api: client.ApiClient) -> None:
    fault = peer.inject("PUT", "leases", hang=True)
    lease: Any = await peer.put_lease("kube-system", "accelstack", "other", skew=-1)
    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        await client.CoordinationV1Api(api).replace_namespaced_lease("accelstack", "kube-system", lease,
                                                                      _request_timeout=0.3)
    await wait_until(lambda: peer.calls("PUT", "leases")[0].status == 499, timeout=3)
    stored = peer.get(LEASES, "kube-system", "accelstack")
    assert fault.hits == 1 and stored is not None and stored["spec"]["holderIdentity"] == "other"


async def test_a_write_that_lands_is_made_though_the_client_sees_it_fail(peer: APIServerPeer,
                                                                         api: client.ApiClient) -> None:
    # the answer says 500, yet the write is stored (etcd committed, the answer was lost)
    peer.inject("PUT", "leases", status=500, lands=True, times=1)
    lease: Any = await peer.put_lease("kube-system", "accelstack", "other", skew=-1)
    lease["spec"]["holderIdentity"] = "me"
    with pytest.raises(client.ApiException) as failed:
        await client.CoordinationV1Api(api).replace_namespaced_lease("accelstack", "kube-system", lease)
    assert failed.value.status == 500
    stored = peer.get(LEASES, "kube-system", "accelstack")
    assert stored is not None and stored["spec"]["holderIdentity"] == "me"
    # no answer at all; the write is made once the client has gone, after it looked again and saw nothing
    fault = peer.inject("PUT", "leases", hang=True, lands=True, times=1)
    lease = dict(stored, spec={**stored["spec"], "holderIdentity": "late"})
    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        await client.CoordinationV1Api(api).replace_namespaced_lease("accelstack", "kube-system", lease,
                                                                      _request_timeout=0.3)
    seen = peer.get(LEASES, "kube-system", "accelstack")
    assert seen is not None and seen["spec"]["holderIdentity"] == "me"
    await wait_until(lambda: (peer.get(LEASES, "kube-system", "accelstack") or {}).get("spec", {}).get(
        "holderIdentity") == "late", timeout=3)
    assert fault.hits == 1


async def test_half_open_watch_sends_headers_then_silence(peer: APIServerPeer,
                                                          http: aiohttp.ClientSession) -> None:
    peer.inject("GET", "nodes", half_open=True, times=1)
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&timeoutSeconds=1") as r:
        assert r.status == 200
        await peer.put_object("api/v1/nodes", node("a"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.content.readline(), 1.5)  # past its timeoutSeconds: still open, silent
        assert peer.calls(watch=True)[0].status is None  # still being answered
    await wait_until(lambda: peer.calls(watch=True)[0].status == 200, timeout=3)  # ends when the client goes


async def test_watch_error_events_and_close(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    for code, reason in ((410, "Expired"), (500, "InternalError")):
        peer.inject("GET", "nodes", watch_error=code, times=1)
        async with http.get(f"{peer.url}/api/v1/nodes?watch=true&resourceVersion=0") as r:
            events = await read_events(r, 2)
        assert r.status == 200 and [e["type"] for e in events] == ["ERROR"]
        assert events[0]["object"]["code"] == code and events[0]["object"]["reason"] == reason
    peer.inject("GET", "nodes", close=True, times=1)
    started = time.monotonic()
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&timeoutSeconds=30") as r:
        assert r.status == 200 and await read_events(r, 5) == []
    assert time.monotonic() - started < 2


async def test_watch_fault_after_a_normal_stretch(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    peer.inject("GET", "nodes", watch_error=410, after=0.4, times=1)
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&resourceVersion={peer.revision}") as r:
        await asyncio.sleep(0.1)
        await peer.put_object("api/v1/nodes", node("a"))
        events = await read_events(r, 3)
    assert [e["type"] for e in events] == ["ADDED", "ERROR"] and events[1]["object"]["code"] == 410


async def test_kubernetes_asyncio_watch_sees_410_as_api_exception(peer: APIServerPeer,
                                                                  api: client.ApiClient) -> None:
    peer.inject("GET", "nodes", watch_error=410, times=1)
    w = watch.Watch()
    with pytest.raises(ApiException) as exc:
        async for _ in w.stream(client.CoreV1Api(api).list_node, resource_version="1", timeout_seconds=2):
            pass
    await w.close()
    assert exc.value.status == 410


def test_a_fault_does_one_thing() -> None:
    peer = APIServerPeer()
    with pytest.raises(ValueError, match="one thing"):
        peer.inject(status=500, hang=True)
    with pytest.raises(ValueError, match="needs an action"):
        peer.inject("GET")
    with pytest.raises(ValueError, match="watch faults"):
        peer.inject(watch=False, half_open=True)
    with pytest.raises(ValueError, match="verb"):
        peer.inject(verb="fetch", status=500)
    with pytest.raises(ValueError, match="lands"):
        peer.inject("GET", "pods", status=500, lands=True)
    with pytest.raises(ValueError, match="lands"):
        peer.inject("POST", "pods", delay=1, lands=True)
    assert not peer.faults


# -- lists -------------------------------------------------------------------------------------------------
async def test_pagination_is_one_snapshot_and_tokens_expire(peer: APIServerPeer, api: client.ApiClient) -> None:
    for i in range(25):
        await peer.put_object("api/v1/nodes", node(f"n{i:02d}"))
    core = client.CoreV1Api(api)
    page = await core.list_node(limit=10)
    names = [n.metadata.name for n in page.items]
    assert len(names) == 10 and page.metadata.remaining_item_count == 15 and page.metadata._continue
    rv = page.metadata.resource_version
    await peer.put_object("api/v1/nodes", node("n00a"))  # after the snapshot: not in this list
    while page.metadata._continue:
        page = await core.list_node(limit=10, _continue=page.metadata._continue)
        assert page.metadata.resource_version == rv
        names += [n.metadata.name for n in page.items]
    assert names == [f"n{i:02d}" for i in range(25)] and page.metadata.remaining_item_count is None
    first = await core.list_node(limit=10)
    assert len(first.items) == 10 and first.metadata.remaining_item_count == 16
    peer.compact()
    with pytest.raises(ApiException) as exc:
        await core.list_node(limit=10, _continue=first.metadata._continue)
    assert exc.value.status == 410 and json.loads(exc.value.body)["reason"] == "Expired"
    again = await core.list_node(limit=20)
    peer.expire_continue_tokens()
    with pytest.raises(ApiException) as exc:
        await core.list_node(limit=20, _continue=again.metadata._continue)
    assert exc.value.status == 410
    with pytest.raises(ApiException) as exc:
        await core.list_node(limit=20, _continue="not-a-token")
    assert exc.value.status == 400


async def test_list_resource_version_semantics(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    await peer.put_object("api/v1/nodes", node("b"))
    base = f"{peer.url}/api/v1/nodes"
    for query in ("", "?resourceVersion=0", "?resourceVersion=1", "?resourceVersion=2&resourceVersionMatch=Exact"):
        async with http.get(base + query) as r:
            body = await r.json()
            assert r.status == 200 and len(body["items"]) == 2 and body["metadata"]["resourceVersion"] == "2"
            assert body["kind"] == "NodeList"
    async with http.get(base + "?resourceVersion=1&resourceVersionMatch=Exact") as r:
        assert r.status == 410 and (await r.json())["reason"] == "Expired"
    async with http.get(base + "?resourceVersionMatch=NotOlderThan") as r:
        assert r.status == 422
    peer.too_large_rv_wait = 0.2
    async with http.get(base + "?resourceVersion=9") as r:
        body = await r.json()
        assert r.status == 504 and body["reason"] == "Timeout" and "Too large resource version" in body["message"]
    waiting = asyncio.create_task(http.get(base + "?resourceVersion=3"))
    peer.too_large_rv_wait = 3
    await asyncio.sleep(0.05)
    await peer.put_object("api/v1/nodes", node("c"))
    r = await waiting
    assert r.status == 200 and len((await r.json())["items"]) == 3
    r.release()


async def test_field_selector(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    for name, node_name in (("p1", "n1"), ("p2", "n2")):
        await peer.put_object("api/v1/pods", {"metadata": {"name": name, "namespace": "ml"},
                                              "spec": {"nodeName": node_name}})
    async with http.get(f"{peer.url}/api/v1/pods?fieldSelector=spec.nodeName%3Dn2") as r:
        assert [p["metadata"]["name"] for p in (await r.json())["items"]] == ["p2"]
    async with http.get(f"{peer.url}/api/v1/pods?fieldSelector=spec.nodeName!%3Dn2") as r:
        assert [p["metadata"]["name"] for p in (await r.json())["items"]] == ["p1"]


# -- watches -----------------------------------------------------------------------------------------------
async def test_bookmarks_only_when_asked(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    peer.bookmark_interval = 0.1
    await peer.put_object("api/v1/nodes", node("a"))
    rv = peer.revision
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&resourceVersion={rv}&allowWatchBookmarks=true") as r:
        events = await read_events(r, 0.45)
    assert len(events) >= 3 and {e["type"] for e in events} == {"BOOKMARK"}
    assert events[0]["object"] == {"kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)}}
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&resourceVersion={rv}") as r:
        assert await read_events(r, 0.35) == []


async def test_watch_timeout_seconds_and_initial_events(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    started = time.monotonic()
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&timeoutSeconds=1") as r:
        events = await read_events(r, 5)  # rv unset: the current objects first, then the server closes at 1 s
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a")]
    assert 0.9 <= time.monotonic() - started < 3


async def test_watch_from_compacted_version_is_410(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    await peer.put_object("api/v1/nodes", node("a"))
    await peer.put_object("api/v1/nodes", node("b"))
    peer.compact()  # at revision 2: a watch from 1 cannot be served
    await peer.put_object("api/v1/nodes", node("c"))
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&resourceVersion=1") as r:
        events = await read_events(r, 2)
    assert [e["type"] for e in events] == ["ERROR"] and events[0]["object"]["reason"] == "Expired"


# -- writes ------------------------------------------------------------------------------------------------
async def test_managed_fields_name_the_writer(peer: APIServerPeer, api: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api)
    args = ("accelstack.io", "v1alpha1", "ml", "gpuprovisioningrequests")
    created = await custom.create_namespaced_custom_object(*args, gpr("a"), field_manager="accelstack-controller")
    entry = created["metadata"]["managedFields"][0]
    assert (entry["manager"], entry["operation"]) == ("accelstack-controller", "Update")
    assert "f:spec" in entry["fieldsV1"] and entry["time"]
    merge: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
    await custom.patch_namespaced_custom_object_status(*args, "a", {"status": {"phase": "Queued"}}, **merge)
    stored = peer.get(GPRS, "ml", "a")
    assert stored is not None
    managers = {(e["manager"], e["operation"], e.get("subresource", "")) for e in stored["metadata"]["managedFields"]}
    assert managers == {("accelstack-controller", "Update", ""), ("OpenAPI-Generator", "Update", "status")}


async def test_generation_follows_spec_only(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    headers = {"Content-Type": "application/merge-patch+json"}
    async with http.post(f"{peer.url}{GPR_URL}", json={**gpr("a"), "status": {"phase": "Admitted"}}) as r:
        created = await r.json()
    assert created["metadata"]["generation"] == 1 and "status" not in created  # status dropped on create

    async def patch(path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with http.patch(f"{peer.url}{GPR_URL}/{path}", data=json.dumps(body), headers=headers) as r:
            assert r.status == 200
            result: dict[str, Any] = await r.json()
            return result

    assert (await patch("a/status", {"status": {"phase": "Queued"}}))["metadata"]["generation"] == 1
    assert (await patch("a", {"metadata": {"labels": {"x": "y"}}}))["metadata"]["generation"] == 1
    changed = await patch("a", {"spec": {"priority": 300}, "status": {"phase": "Admitted"}})
    assert changed["metadata"]["generation"] == 2 and changed["status"] == {"phase": "Queued"}  # main: no status
    only_status = await patch("a/status", {"spec": {"priority": 1}, "status": {"phase": "Failed"}})
    assert only_status["spec"]["priority"] == 300 and only_status["status"]["phase"] == "Failed"


async def test_dry_run(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{peer.url}{GPR_URL}?dryRun=All", json=gpr("a")) as r:
        assert r.status == 201 and (await r.json())["metadata"]["name"] == "a"
    assert peer.get(GPRS, "ml", "a") is None and peer.revision == 0
    async with http.post(f"{peer.url}{GPR_URL}?dryRun=Maybe", json=gpr("a")) as r:
        assert r.status == 422 and (await r.json())["reason"] == "Invalid"
    await peer.put_object(GPRS, gpr("b"))
    async with http.delete(f"{peer.url}{GPR_URL}/b?dryRun=All") as r:
        assert r.status == 200
    assert peer.get(GPRS, "ml", "b") is not None


async def test_body_must_name_what_the_url_names(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    await peer.put_object(GPRS, gpr("a"))
    async with http.put(f"{peer.url}{GPR_URL}/a", json=gpr("other")) as r:
        body = await r.json()
        assert r.status == 400 and body["reason"] == "BadRequest" and "does not match the name" in body["message"]
    async with http.post(f"{peer.url}{GPR_URL}", json={**gpr("b"), "metadata": {"name": "b", "namespace": "x"}}) as r:
        assert r.status == 400 and "namespace" in (await r.json())["message"]
    async with http.post(f"{peer.url}{GPR_URL}", json={"spec": {}}) as r:
        assert r.status == 422 and (await r.json())["reason"] == "Invalid"
    async with http.post(f"{peer.url}{GPR_URL}", data=b"{not json") as r:
        assert r.status == 400 and (await r.json())["kind"] == "Status"


async def test_delete_preconditions(peer: APIServerPeer, api: client.ApiClient) -> None:
    stored = await peer.put_object("api/v1/nodes", node("a"))
    core = client.CoreV1Api(api)
    for pre in ({"uid": "someone-else"}, {"resource_version": "999"}):
        with pytest.raises(ApiException) as exc:
            await core.delete_node("a", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(**pre)))
        assert exc.value.status == 409 and "Precondition failed" in json.loads(exc.value.body or b"{}")["message"]
    pre = {"uid": stored["metadata"]["uid"], "resource_version": stored["metadata"]["resourceVersion"]}
    await core.delete_node("a", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(**pre)))
    assert peer.get("api/v1/nodes", "", "a") is None


async def test_finalizers_hold_deletion(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    obj = gpr("a")
    obj["metadata"]["finalizers"] = ["accelstack.io/cleanup"]
    await peer.put_object(GPRS, obj)
    rv = peer.revision
    async with http.delete(f"{peer.url}{GPR_URL}/a") as r:
        assert r.status == 200 and (await r.json())["metadata"]["deletionTimestamp"]
    headers = {"Content-Type": "application/merge-patch+json"}
    add = json.dumps({"metadata": {"finalizers": ["accelstack.io/cleanup", "other"]}})
    async with http.patch(f"{peer.url}{GPR_URL}/a", data=add, headers=headers) as r:
        assert r.status == 422
    async with http.patch(f"{peer.url}{GPR_URL}/a", data=json.dumps({"metadata": {"finalizers": None}}),
                          headers=headers) as r:
        assert r.status == 200
    assert peer.get(GPRS, "ml", "a") is None
    async with http.get(f"{peer.url}{GPR_URL}?watch=true&resourceVersion={rv}&timeoutSeconds=1") as r:
        events = await read_events(r, 3)
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED", "DELETED"]


async def test_server_side_apply(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    headers = {"Content-Type": "application/apply-patch+yaml"}
    body = json.dumps(gpr("a"))
    async with http.patch(f"{peer.url}{GPR_URL}/a", data=body, headers=headers) as r:
        assert r.status == 422  # apply needs a fieldManager
    async with http.patch(f"{peer.url}{GPR_URL}/a?fieldManager=ctl", data=body, headers=headers) as r:
        assert r.status == 201
    async with http.patch(f"{peer.url}{GPR_URL}/a?fieldManager=ctl", data="spec:\n  priority: 5\n",
                          headers=headers) as r:
        result = await r.json()
        assert r.status == 200 and result["spec"]["priority"] == 5 and result["metadata"]["generation"] == 2
    assert result["metadata"]["managedFields"][-1]["operation"] == "Apply"


# -- leases ------------------------------------------------------------------------------------------------
async def test_lease_of_another_holder_with_a_skewed_clock(peer: APIServerPeer, api: client.ApiClient) -> None:
    coord = client.CoordinationV1Api(api)
    await peer.put_lease("kube-system", "accelstack-extender", "replica-b", skew=+30)
    lease = await coord.read_namespaced_lease("accelstack-extender", "kube-system")
    assert lease.spec.holder_identity == "replica-b"
    ahead = lease.spec.renew_time - dt.datetime.now(dt.UTC)
    assert dt.timedelta(seconds=25) < ahead < dt.timedelta(seconds=35)
    stale = await coord.read_namespaced_lease("accelstack-extender", "kube-system")
    lease.spec.holder_identity = "replica-a"
    await coord.replace_namespaced_lease("accelstack-extender", "kube-system", lease)
    stale.spec.holder_identity = "replica-c"
    with pytest.raises(ApiException) as exc:
        await coord.replace_namespaced_lease("accelstack-extender", "kube-system", stale)
    assert exc.value.status == 409
    created = await coord.create_namespaced_lease("kube-system", client.V1Lease(
        metadata=client.V1ObjectMeta(name="new"), spec=client.V1LeaseSpec(holder_identity="x")))
    assert created.metadata.resource_version


# -- request log -------------------------------------------------------------------------------------------
async def test_request_log_counts_and_rates(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    start = peer.mark()
    peer.inject("GET", "gpuprovisioningrequests", watch=False, status=404)
    for _ in range(20):
        async with http.get(f"{peer.url}{GPR_URL}") as r:
            assert r.status == 404
    async with http.get(f"{peer.url}/api/v1/nodes?watch=true&timeoutSeconds=1") as r:
        await read_events(r, 2)
    assert peer.count("GET", "gpuprovisioningrequests", verb="list", status=404, since=start) == 20
    assert peer.count(watch=True) == 1 and peer.count(watch=False) == 20
    assert peer.max_rate(resource="gpuprovisioningrequests", window=1.0) >= 10
    assert peer.rate(resource="nodes", window=60) == pytest.approx(1 / 60)
    record = peer.calls(verb="list")[0]
    assert (record.namespace, record.plural, record.fault is not None) == ("ml", "gpuprovisioningrequests", True)
    assert record.finished is not None and record.finished >= record.started
    assert len(peer.requests) == 21  # the older (method, path) log still has every request


async def test_kubernetes_asyncio_watch_gets_bookmarks_and_http_errors(peer: APIServerPeer,
                                                                       api: client.ApiClient) -> None:
    peer.bookmark_interval = 0.1
    await peer.put_object("api/v1/nodes", node("a"))
    w = watch.Watch()
    seen: list[tuple[str, str]] = []
    async for event in w.stream(client.CoreV1Api(api).list_node, resource_version=str(peer.revision),
                                allow_watch_bookmarks=True, timeout_seconds=1):
        seen.append((event["type"], event["object"]["metadata"]["resourceVersion"]))  # bookmarks stay dicts
        if len(seen) == 2:
            break
    await w.close()
    assert seen == [("BOOKMARK", "1"), ("BOOKMARK", "1")]
    peer.inject("GET", "nodes", watch=True, status=403)
    w = watch.Watch()
    with pytest.raises(ApiException) as exc:
        async for _ in w.stream(client.CoreV1Api(api).list_node, resource_version="1", timeout_seconds=1):
            pass
    await w.close()
    assert exc.value.status == 403


async def test_selective_watch_shows_objects_entering_and_leaving(peer: APIServerPeer,
                                                                  http: aiohttp.ClientSession) -> None:
    await peer.put_object("api/v1/pods", {"metadata": {"name": "p", "namespace": "ml", "labels": {"gpr": "a"}}})
    rv = peer.revision
    url = f"{peer.url}/api/v1/pods?watch=true&labelSelector=gpr%3Da&timeoutSeconds=1&resourceVersion={rv}"
    async with http.get(url) as r:
        for labels in ({"gpr": "b"}, {"gpr": "a"}, {"gpr": "a", "x": "y"}):
            obj = peer.get("api/v1/pods", "ml", "p")
            assert obj is not None
            await peer.put_object("api/v1/pods", {**obj, "metadata": {**obj["metadata"], "labels": labels}},
                                  "MODIFIED")
        await peer.delete_object("api/v1/pods", "ml", "p")
        events = await read_events(r, 3)
    assert [e["type"] for e in events] == ["DELETED", "ADDED", "MODIFIED", "DELETED"]


async def webhook_server(judge: Any) -> tuple[Any, str]:
    """An admission webhook on a port of its own: (its runner, to clean up; its URL)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/validate", judge)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/validate"  # type: ignore[union-attr]


async def test_validating_webhooks_judge_creates_and_updates_as_the_api_server_calls_them(
        peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    """CREATE and UPDATE of the named resource (not /status) go to the webhook with an AdmissionReview; a
    refusal is the API server's Status; a webhook that hangs fails the write closed (Fail) or not (Ignore)."""
    from aiohttp import web

    from tests.apiserver_peer.admission import ValidatingWebhook

    seen: list[dict[str, Any]] = []
    hang = asyncio.Event()

    async def judge(request: web.Request) -> web.Response:
        req = (await request.json())["request"]
        seen.append(req)
        if req["object"]["metadata"]["name"] == "slow":
            await hang.wait()
        allowed = req["object"]["spec"]["priority"] <= 250  # the CRD allows up to 300: this webhook is stricter
        answer: dict[str, Any] = {"uid": req["uid"], "allowed": allowed}
        if not allowed:
            answer["status"] = {"code": 422, "reason": "Invalid", "message": "spec.priority: at most 250"}
        return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                  "response": answer})

    runner, url = await webhook_server(judge)
    hook = ValidatingWebhook("gprs.example.io", url, frozenset({"gpuprovisioningrequests"}), timeout=0.5)
    peer.admission.validating.append(hook)
    try:
        async with http.post(peer.url + GPR_URL, json=gpr("ok")) as r:
            assert r.status == 201
        req = seen[-1]
        assert (req["operation"], req["kind"]["kind"], req["resource"]["resource"], req["namespace"], req["name"],
                req["oldObject"], req["userInfo"]["username"]) == (
            "CREATE", "GPUProvisioningRequest", "gpuprovisioningrequests", "ml", "ok", None, "system:anonymous")
        async with http.post(peer.url + GPR_URL, json=gpr("greedy", priority=280)) as r:
            body = await r.json()
            assert r.status == 422, body
        assert body["reason"] == "Invalid"
        assert body["message"] == 'admission webhook "gprs.example.io" denied the request: spec.priority: at most 250'
        assert peer.get(GPRS, "ml", "greedy") is None
        # an update: judged with the old object beside it; refused, nothing changes
        async with http.patch(f"{peer.url}{GPR_URL}/ok", json={"spec": {"priority": 280}},
                              headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status == 422
        assert seen[-1]["operation"] == "UPDATE" and seen[-1]["oldObject"]["spec"]["priority"] == 100
        assert peer.get(GPRS, "ml", "ok")["spec"]["priority"] == 100  # type: ignore[index]
        async with http.patch(f"{peer.url}{GPR_URL}/ok", json={"spec": {"priority": 200}},
                              headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status == 200
        assert peer.get(GPRS, "ml", "ok")["spec"]["priority"] == 200  # type: ignore[index]
        calls = hook.calls
        async with http.put(f"{peer.url}{GPR_URL}/ok/status",  # a status write is not judged
                            json={**peer.get(GPRS, "ml", "ok"), "status": {"phase": "Queued"}}) as r:  # type: ignore[dict-item]
            assert r.status == 200
        assert hook.calls == calls
        # a webhook that does not answer within timeoutSeconds: 500 under Fail, nothing stored
        async with http.post(peer.url + GPR_URL, json=gpr("slow")) as r:
            body = await r.json()
            assert r.status == 500, body
        assert body["reason"] == "InternalError" and 'failed calling webhook "gprs.example.io"' in body["message"]
        assert "context deadline exceeded" in body["message"] and peer.get(GPRS, "ml", "slow") is None
        hook.failure_policy = "Ignore"  # ... and let through under Ignore
        async with http.post(peer.url + GPR_URL, json=gpr("slow")) as r:
            assert r.status == 201
        assert hook.failures == ["context deadline exceeded"] * 2
    finally:
        hang.set()
        await runner.cleanup()


async def test_an_update_whose_object_changed_while_a_webhook_judged_it_is_made_on_the_new_object(
        peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    """A merge patch without a resourceVersion is applied to what is stored when it is written, as the API
    server's update loop does: a status write that lands while the webhook judges the patch is kept."""
    from aiohttp import web

    from tests.apiserver_peer.admission import ValidatingWebhook

    await peer.put_object(GPRS, gpr("g"))
    first = asyncio.Event()

    async def judge(request: web.Request) -> web.Response:
        req = (await request.json())["request"]
        if not first.is_set():
            first.set()
            stored = peer.get(GPRS, "ml", "g")
            assert stored is not None
            await peer.put_object(GPRS, {**stored, "status": {"phase": "Admitted"}}, "MODIFIED")
        return web.json_response({"response": {"uid": req["uid"], "allowed": True}})

    runner, url = await webhook_server(judge)
    peer.admission.validating.append(ValidatingWebhook("v.example.io", url, frozenset({"gpuprovisioningrequests"})))
    try:
        async with http.patch(f"{peer.url}{GPR_URL}/g", json={"metadata": {"labels": {"team": "a"}}},
                              headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status == 200
        stored = peer.get(GPRS, "ml", "g")
        assert stored is not None
        assert stored["metadata"]["labels"] == {"team": "a"} and stored["status"] == {"phase": "Admitted"}
    finally:
        await runner.cleanup()


# ---- pod validation: what a real API server refuses ----------------------------------------------------------
def _pod(name: str, affinity: dict[str, Any] | None = None, gated: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "x"}]}
    if gated:
        spec["schedulingGates"] = [{"name": "accelstack.io/gpr"}]
    if affinity is not None:
        spec["affinity"] = affinity
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml"}, "spec": spec}


def _terms(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


BY_NAME = {"key": "metadata.name", "operator": "In"}
ZONE = {"key": "zone", "operator": "In", "values": ["a"]}
POD_URL = "/api/v1/namespaces/ml/pods"
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


async def test_a_node_field_selector_takes_exactly_one_value(peer: APIServerPeer,
                                                             http: aiohttp.ClientSession) -> None:
    two = _pod("two", _terms({"matchFields": [{**BY_NAME, "values": ["n1", "n2"]}]}))
    async with http.post(peer.url + POD_URL, json=two) as r:
        body = await r.json()
        assert r.status == 422 and body["reason"] == "Invalid"
        assert body["message"] == (
            'Pod "two" is invalid: spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.'
            "nodeSelectorTerms[0].matchFields[0].values: Required value: must be only one value when `operator` "
            "is 'In' or 'NotIn' for node field selector")
    label = _pod("label", _terms({"matchFields": [{"key": "metadata.labels", "operator": "In", "values": ["x"]}]}))
    async with http.post(peer.url + POD_URL, json=label) as r:
        assert r.status == 422 and "not a valid field selector key" in (await r.json())["message"]
    per_node = _pod("ok", _terms({"matchFields": [{**BY_NAME, "values": ["n1"]}]},
                                 {"matchFields": [{**BY_NAME, "values": ["n2"]}]}))
    async with http.post(peer.url + POD_URL, json=per_node) as r:
        assert r.status == 201
    # and on update: the same rule
    patch = [{"op": "replace", "path": "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/"
              "nodeSelectorTerms/0/matchFields/0/values", "value": ["n1", "n3"]}]
    async with http.patch(peer.url + POD_URL + "/ok", data=json.dumps(patch), headers=JSON_PATCH) as r:
        assert r.status == 422


async def test_a_gated_pods_node_affinity_may_only_be_narrowed(peer: APIServerPeer,
                                                               http: aiohttp.ClientSession) -> None:
    """KEP-3838: with no required term anything may be set; with terms, each keeps its requirements (new ones
    appended) and no term is added or removed; once ungated, the affinity is fixed."""
    base = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms"
    await peer.put_object("api/v1/pods", _pod("free"))
    await peer.put_object("api/v1/pods", _pod("own", _terms({"matchExpressions": [ZONE]})))

    async def patch(name: str, ops: list[dict[str, Any]]) -> tuple[int, str]:
        async with http.patch(peer.url + POD_URL + "/" + name, data=json.dumps(ops), headers=JSON_PATCH) as r:
            return r.status, (await r.json()).get("message", "")

    # no affinity: any terms may be set, a term per node included
    assert (await patch("free", [{"op": "add", "path": "/spec/affinity", "value": _terms(
        {"matchFields": [{**BY_NAME, "values": ["n1"]}]}, {"matchFields": [{**BY_NAME, "values": ["n2"]}]})}]))[0] == 200
    # the user's term: a requirement appended is a narrowing
    hostname = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["h1", "h2"]}
    code, _ = await patch("own", [{"op": "add", "path": base + "/0/matchExpressions/-", "value": hostname}])
    assert code == 200
    # a term added widens (terms are ORed): refused
    code, message = await patch("own", [{"op": "add", "path": base + "/-", "value": {"matchExpressions": [ZONE]}}])
    assert code == 422 and "no additions/deletions to non-empty NodeSelectorTerms list are allowed" in message
    # a requirement removed or changed: refused
    code, message = await patch("own", [{"op": "remove", "path": base + "/0/matchExpressions/0"}])
    assert code == 422 and "only additions are allowed" in message
    # a gate added: refused; the gate removed: fine; then the affinity is fixed
    code, message = await patch("own", [{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": "x"}}])
    assert code == 422 and "only deletion is allowed" in message
    assert (await patch("own", [{"op": "replace", "path": "/spec/schedulingGates", "value": []}]))[0] == 200
    code, message = await patch("own", [{"op": "add", "path": base + "/0/matchExpressions/-",
                                         "value": {"key": "rack", "operator": "Exists"}}])
    assert code == 422 and "pod updates may not change fields" in message
    # images, tolerations added, labels: fine at any time
    ok: list[dict[str, Any]] = [{"op": "replace", "path": "/spec/containers/0/image", "value": "y"},
          {"op": "add", "path": "/spec/tolerations", "value": [{"key": "k", "operator": "Exists"}]},
          {"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}]
    assert (await patch("own", ok))[0] == 200


async def test_a_bound_pod_is_deleted_gracefully_and_an_unbound_one_at_once(peer: APIServerPeer,
                                                                            http: aiohttp.ClientSession) -> None:
    peer.pod_grace = 0.3
    bound = _pod("bound", gated=False)
    bound["spec"]["nodeName"] = "n1"
    bound["status"] = {"phase": "Running"}
    await peer.put_object("api/v1/pods", bound)
    await peer.put_object("api/v1/pods", _pod("loose", gated=False))
    async with http.delete(peer.url + POD_URL + "/bound") as r:
        body = await r.json()
        assert r.status == 200 and body["metadata"]["deletionTimestamp"]
        assert body["metadata"]["deletionGracePeriodSeconds"] == 30  # the pod's terminationGracePeriodSeconds
    stored = peer.get("api/v1/pods", "ml", "bound")
    assert stored is not None and stored["metadata"]["deletionTimestamp"]  # still there: its kubelet stops it
    async with http.delete(peer.url + POD_URL + "/bound") as r:  # deleted again: still the same
        assert r.status == 200
    async with http.delete(peer.url + POD_URL + "/loose") as r:
        assert r.status == 200
    assert peer.get("api/v1/pods", "ml", "loose") is None  # never bound: gone at once
    await wait_until(lambda: peer.get("api/v1/pods", "ml", "bound") is None, timeout=3)
    kinds = [kind for _, res, kind, obj in peer.events if res == "api/v1/pods" and obj["metadata"]["name"] == "bound"]
    assert kinds == ["ADDED", "MODIFIED", "DELETED"]


async def test_an_eviction_is_a_graceful_deletion(peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    peer.pod_grace = 0.2
    bound = _pod("victim", gated=False)
    bound["spec"]["nodeName"] = "n1"
    await peer.put_object("api/v1/pods", bound)
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "victim", "namespace": "ml"}}
    async with http.post(peer.url + POD_URL + "/victim/eviction", json=eviction) as r:
        assert r.status == 201
    stored = peer.get("api/v1/pods", "ml", "victim")
    assert stored is not None and stored["metadata"]["deletionTimestamp"]
    await wait_until(lambda: peer.get("api/v1/pods", "ml", "victim") is None, timeout=3)


async def test_a_binding_of_a_gated_or_deleting_pod_is_refused(peer: APIServerPeer,
                                                               http: aiohttp.ClientSession) -> None:
    await peer.put_object("api/v1/pods", _pod("gated"))
    deleting = _pod("deleting", gated=False)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    await peer.put_object("api/v1/pods", deleting)
    for name, words in (("gated", "has non-empty .spec.schedulingGates"),
                        ("deleting", "is being deleted, cannot be assigned to a host")):
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": "ml"},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}
        async with http.post(peer.url + POD_URL + f"/{name}/binding", json=binding) as r:
            body = await r.json()
            assert r.status == 500 and body["reason"] == "InternalError" and words in body["message"]
        stored = peer.get("api/v1/pods", "ml", name)
        assert stored is not None and not stored["spec"].get("nodeName")


async def test_built_in_objects_the_controllers_write_are_checked_against_the_kubernetes_schema(
        peer: APIServerPeer, http: aiohttp.ClientSession) -> None:
    deployment: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "cg", "namespace": "ml"},
                  "spec": {"selector": {"matchLabels": {"app": "cg"}}, "template": {
                      "metadata": {"labels": {"app": "cg"}},
                      "spec": {"containers": [{"name": "c", "image": "x", "ports": [{"containerPort": "http"}]}]}}}}
    url = peer.url + "/apis/apps/v1/namespaces/ml/deployments"
    async with http.post(url, json=deployment) as r:  # a port number given as a name: the schema refuses it
        body = await r.json()
        assert r.status == 422 and body["reason"] == "Invalid" and "containerPort" in body["message"], body
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 8000}]
    deployment["spec"]["replica"] = 2  # a typo: strict decoding refuses unknown fields
    async with http.post(url, json=deployment) as r:
        assert r.status == 422 and "replica" in (await r.json())["message"]
    del deployment["spec"]["replica"]
    async with http.post(url, json=deployment) as r:
        assert r.status == 201
    async with http.patch(url + "/cg", json={"spec": {"replicas": "two"}},
                          headers={"Content-Type": "application/merge-patch+json"}) as r:
        assert r.status == 422
    assert peer.get("apis/apps/v1/deployments", "ml", "cg")["spec"].get("replicas") is None  # type: ignore[index]
