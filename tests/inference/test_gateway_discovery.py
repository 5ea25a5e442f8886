"""The gateway discovering endpoints, replicas and keys from the API server (the API-server peer), end to end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from inference.gateway.kube_source import FIELD_MANAGER, KubeSource
from inference.gateway.server import Gateway, Settings
from kubeapi.client import connected
from tests.apiserver_peer import APIServerPeer
from tests.inference.harness import KEY_A, KEY_B, RunningGateway, endpoint, eventually, key_secret, slices
from tests.inference.test_gateway_openai import client

IE = "apis/accelstack.io/v1alpha1/inferenceendpoints"
EPS = "apis/discovery.k8s.io/v1/endpointslices"
SECRETS = "api/v1/secrets"


@pytest.fixture
async def apiserver() -> AsyncIterator[APIServerPeer]:
    peer = APIServerPeer()
    await peer.start()
    yield peer
    await peer.stop()


async def test_routes_follow_the_api_server(apiserver: APIServerPeer, make_peers: Any) -> None:
    first, second = await make_peers(2)
    await apiserver.put_object(IE, endpoint("llm", models=["m"]))
    for obj in slices("llm", [first.url]):
        await apiserver.put_object(EPS, obj)
    await apiserver.put_object(SECRETS, key_secret("app", "team-a", KEY_A))
    await apiserver.put_object(SECRETS, {"metadata": {"name": "unrelated", "namespace": "team-a"},
                                         "data": {"key": "eA=="}})  # not labelled: never read as a key
    running = RunningGateway(Settings(request_timeout=5))
    await running.start()
    gateway: Gateway = running.gateway
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        source = KubeSource(gateway, kube, debounce=0.01)
        task = asyncio.create_task(source.run())
        try:
            await eventually(lambda: "m" in gateway.routes and gateway.synced, what="routes from the API server")
            answer = await client(running.url).embeddings.create(model="m", input="x")
            assert answer.data and first.completed == 1

            # a rollout: the slice now lists the second replica only
            moved = slices("llm", [second.url])[0]
            moved["metadata"]["name"] = "llm-primary-0"
            await apiserver.put_object(EPS, moved, "MODIFIED")
            await eventually(lambda: list(gateway.routes["m"].core.replicas) == [second.url], what="slice update")
            await client(running.url).embeddings.create(model="m", input="x")
            assert second.completed == 1

            # a new key appears; access widened to team-b
            await apiserver.put_object(SECRETS, key_secret("app", "team-b", KEY_B))
            widened = endpoint("llm", models=["m"], access={"namespaces": ["team-b"]})
            await apiserver.put_object(IE, widened, "MODIFIED")
            await eventually(lambda: "team-b" in gateway.routes["m"].access.namespaces, what="access update")
            await client(running.url, KEY_B).embeddings.create(model="m", input="x")

            # the endpoint is deleted: its model is gone
            await apiserver.delete_object(IE, "team-a", "llm")
            await eventually(lambda: "m" not in gateway.routes, what="model removed")
            with pytest.raises(openai.NotFoundError):
                await client(running.url).embeddings.create(model="m", input="x")

            # the key's Secret is deleted: the key no longer works
            await apiserver.delete_object(SECRETS, "team-b", "app")
            await eventually(lambda: len(gateway.keys) == 1, what="key removed")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await running.stop()
    selectors = [q for _m, q in apiserver.requests if "secrets" in q]
    assert selectors and all("labelSelector=accelstack.io/api-key%3Dtrue" in q for q in selectors)
    from tests.inference.test_inference_manifests import allowed, request_verb, rules_of

    for method, path in apiserver.requests:  # Secrets: the role bound in the key namespaces (rbac.yaml)
        group, resource, verb = request_verb(method, path)
        rules = rules_of("accelstack-gateway-api-keys" if resource == "secrets" else "accelstack-gateway")
        assert allowed(rules, group, resource, verb), f"{method} {path}: {verb} on {group or 'core'}/{resource}"


async def test_service_account_tokens_by_token_review(apiserver: APIServerPeer, make_peers: Any) -> None:
    (replica,) = await make_peers(1)
    await apiserver.put_object(IE, endpoint("llm", models=["m"], access={"serviceAccounts": ["team-b/chat"]}))
    for obj in slices("llm", [replica.url]):
        await apiserver.put_object(EPS, obj)
    apiserver.tokens = {  # JWT-shaped, as service-account tokens are (only those are reviewed)
        "hdr.token-of-chat.sig": {"username": "system:serviceaccount:team-b:chat", "uid": "u1"},
        "hdr.token-of-other.sig": {"username": "system:serviceaccount:team-b:other", "uid": "u2"},
        "hdr.token-of-a-pod-in-team-a.sig": {"username": "system:serviceaccount:team-a:default", "uid": "u3"},
        "hdr.token-of-a-person.sig": {"username": "alice@example.com", "uid": "u4"},
    }
    running = RunningGateway(Settings(request_timeout=5))
    await running.start()
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        source = KubeSource(running.gateway, kube, debounce=0.01)
        task = asyncio.create_task(source.run())
        try:
            await eventually(lambda: "m" in running.gateway.routes, what="routes")
            for _ in range(3):
                await client(running.url, "hdr.token-of-chat.sig").embeddings.create(model="m", input="x")  # listed
            await client(running.url, "hdr.token-of-a-pod-in-team-a.sig").embeddings.create(model="m", input="x")  # own ns
            with pytest.raises(openai.PermissionDeniedError):
                await client(running.url, "hdr.token-of-other.sig").embeddings.create(model="m", input="x")
            for token in ("hdr.token-of-a-person.sig", "not-a-token-at-all"):
                with pytest.raises(openai.AuthenticationError):
                    await client(running.url, token).embeddings.create(model="m", input="x")
            reviews = [q for m, q in apiserver.requests if "tokenreviews" in q]
            # one per distinct JWT-shaped token (the answers are cached); "not-a-token-at-all" is refused unreviewed
            assert len(reviews) == 4
            with pytest.raises(openai.AuthenticationError):
                await client(running.url, "hdr.token-of-a-person.sig").embeddings.create(model="m", input="x")
            assert len([q for m, q in apiserver.requests if "tokenreviews" in q]) == 4
            assert replica.completed == 4 and "Authorization" not in replica.last_headers
            from tests.inference.test_inference_manifests import allowed, request_verb, rules_of

            for method, path in apiserver.requests:
                asked = request_verb(method, path)
                role = "accelstack-gateway-api-keys" if asked[1] == "secrets" else "accelstack-gateway"
                assert allowed(rules_of(role), *asked), (method, path)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await running.stop()


async def test_gateway_process_on_the_api_server(apiserver: APIServerPeer, make_peers: Any, tmp_path: Any) -> None:
    import os
    import signal
    import sys

    import aiohttp

    from tests.inference.test_gateway_process import free_port

    (replica,) = await make_peers(1)
    await apiserver.put_object(IE, endpoint("llm", models=["m"]))
    for obj in slices("llm", [replica.url]):
        await apiserver.put_object(EPS, obj)
    await apiserver.put_object(SECRETS, key_secret("app", "team-a", KEY_A))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: peer, cluster: {{server: "{apiserver.url}"}}}}]
users: [{{name: test, user: {{}}}}]
contexts: [{{name: peer, context: {{cluster: peer, user: test}}}}]
current-context: peer
""")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inference.gateway.main", "--kubeconfig", str(kubeconfig), "--listen",
        f"127.0.0.1:{port}", "--drain-seconds", "0", "--log-level", "debug", stderr=asyncio.subprocess.PIPE,
        env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                try:
                    async with s.get(url + "/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            deadline = asyncio.get_running_loop().time() + 20
            while not await ready():
                assert asyncio.get_running_loop().time() < deadline, "gateway never ready"
                await asyncio.sleep(0.05)
        answer = await client(url).embeddings.create(model="m", input="x")
        assert answer.data and replica.completed == 1
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0
    assert proc.stderr is not None
    log = (await proc.stderr.read()).decode()
    assert "discovery synced" in log and KEY_A not in log and "Traceback" not in log


async def test_namespaced_informers_keep_each_namespace_apart(apiserver: APIServerPeer, make_peers: Any) -> None:
    """--namespaces: one informer per namespace and kind; a relist of one namespace keeps the others' objects."""
    (replica,) = await make_peers(1)
    await apiserver.put_object(IE, endpoint("a", "team-a", models=["ma"]))
    await apiserver.put_object(IE, endpoint("b", "team-b", models=["mb"]))
    await apiserver.put_object(IE, endpoint("c", "team-c", models=["mc"]))  # not watched
    for obj in slices("a", [replica.url], namespace="team-a") + slices("b", [replica.url], namespace="team-b"):
        await apiserver.put_object(EPS, obj)
    running = RunningGateway(Settings())
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        source = KubeSource(running.gateway, kube, namespaces=["team-a", "team-b"], debounce=0.01)
        assert len(source.informers) == 6
        task = asyncio.create_task(source.run())
        try:
            await eventually(lambda: set(running.gateway.routes) == {"ma", "mb"}, what="two namespaces")
            source.endpoints.sync([], "team-a")  # a relist of team-a that finds nothing
            assert {k[0] for k in source.endpoints.objects} == {"team-b"}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert all("/namespaces/team-" in q for _, q in apiserver.requests)


async def test_api_keys_are_read_only_in_the_key_namespaces(apiserver: APIServerPeer, make_peers: Any) -> None:
    """--key-namespaces (issue 36.7): Secrets are listed and watched only there, labelled ones only (the account
    holds Secrets rights nowhere else); a labelled key in another namespace is never asked for and never works,
    while endpoints and slices are still watched in every namespace."""
    (replica,) = await make_peers(1)
    await apiserver.put_object(IE, endpoint("llm", "team-a", models=["m"],
                                            access={"apiKeys": ["keys/central"], "namespaces": ["team-a"]}))
    for obj in slices("llm", [replica.url], namespace="team-a"):
        await apiserver.put_object(EPS, obj)
    await apiserver.put_object(SECRETS, key_secret("central", "keys", KEY_A))
    await apiserver.put_object(SECRETS, key_secret("app", "team-a", KEY_B))  # outside the key namespaces
    running = RunningGateway(Settings(request_timeout=5))
    await running.start()
    async with connected(apiserver.url, field_manager=FIELD_MANAGER) as kube:
        source = KubeSource(running.gateway, kube, key_namespaces=["keys"], debounce=0.01)
        task = asyncio.create_task(source.run())
        try:
            await eventually(lambda: "m" in running.gateway.routes and running.gateway.synced, what="routes")
            assert (await client(running.url, KEY_A).embeddings.create(model="m", input="x")).data
            with pytest.raises(openai.AuthenticationError):
                await client(running.url, KEY_B).embeddings.create(model="m", input="x")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await running.stop()
    secret_queries = [q for _, q in apiserver.requests if "/secrets" in q]
    assert secret_queries and all(q.startswith("/api/v1/namespaces/keys/secrets") and "labelSelector=" in q
                                  for q in secret_queries), secret_queries
    assert any(q.startswith("/apis/accelstack.io/v1alpha1/inferenceendpoints") for _, q in apiserver.requests)


def test_a_replica_listed_twice_is_kept_once_per_endpoint_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37.6: an address twice within one endpoint is one replica (one log line); the same address under
    two endpoints stays a replica of both (before: the second endpoint lost it, nothing said)."""
    from inference.gateway.sources import apply_objects

    shared = "http://10.0.0.1:8000"
    own = slices("a", [shared, "http://10.0.0.2:8000"])
    again = slices("a", [shared])[0]
    again["metadata"]["name"] = "a-primary-2"  # a third slice listing the first address again
    objects = [*own, again, slices("b", [shared])[0]]
    endpoints = [endpoint("a", models=["m"]), endpoint("b", models=["n"])]
    gateway = Gateway(Settings())
    with caplog.at_level("INFO", logger="accelstack.gateway"):
        apply_objects(gateway, endpoints, objects, [])
        apply_objects(gateway, endpoints, objects, [])  # a rebuild: nothing new to say
    assert list(gateway.routes["m"].core.replicas) == [shared, "http://10.0.0.2:8000"]
    assert list(gateway.routes["n"].core.replicas) == [shared]
    notes = [r.note for r in caplog.records if hasattr(r, "note")]
    assert notes == [f"replica {shared} is listed 2 times for endpoint team-a/a; kept once",
                     f"replica {shared} serves endpoints team-a/a, team-a/b; kept in each"]
    assert gateway.metrics.config_errors._value.get() == 0  # noted, not a misconfiguration
