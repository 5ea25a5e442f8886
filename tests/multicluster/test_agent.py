"""The member agent's hub token: renewed past two thirds of its life through TokenRequest on its own
ServiceAccount, used at once and stored in the member Secret; a refused renewal keeps the old token. Its status
loop: woken once by a change, never spinning on one it does not send, and paced while the hub refuses."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

import scheduler_extender.multicluster.agent as agent_module
from kubeapi import ApiError, Forbidden, Resource
from kubeapi.metrics import api_metrics
from kubeapi.passes import wait_first
from scheduler_extender.multicluster.agent import MemberAgent, token_times
from scheduler_extender.multicluster.clusters import summarize_node


class Configuration:
    def __init__(self) -> None:
        self.api_key: dict[str, str] = {"BearerToken": "old"}
        self.api_key_prefix: dict[str, str] = {}


class FakeClient:
    """Records calls; answers TokenRequest and the Secret as the API server would (or refuses)."""

    def __init__(self, refuse: bool = False) -> None:
        self.configuration, self.refuse, self.calls = Configuration(), refuse, []  # type: ignore[var-annotated]
        self.metrics = api_metrics()  # what the agent's informers count with
        self.secret = {"metadata": {"name": "accelstack-hub-kubeconfig", "resourceVersion": "7"}, "data": {
            "kubeconfig": base64.b64encode(yaml.safe_dump({"users": [{"name": "u", "user": {"token": "old"}}]})
                                           .encode()).decode()}}

    async def create(self, res: Resource, body: dict[str, Any], namespace: str | None = None, **kw: Any) -> Any:
        self.calls.append(("create", res.plural, namespace, kw, body))
        if self.refuse:
            raise Forbidden(403, "Forbidden", "no")
        return {"status": {"token": "new-token"}}

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> Any:
        return self.secret

    async def replace(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None) -> Any:
        self.calls.append(("replace", res.plural, namespace, name, body))
        self.secret = body
        return body


def agent(hub: FakeClient, member: FakeClient, now: list[float]) -> MemberAgent:
    return MemberAgent(member, hub, "member-a", resources=("nvidia.com/gpu",),  # type: ignore[arg-type]
                       hub_namespace="accelstack-member-member-a", secret_namespace="accelstack-system",
                       token=(1000.0, 1000.0 + 3600), wall=lambda: now[0])


async def test_the_token_is_renewed_past_two_thirds_of_its_life() -> None:
    hub, member, now = FakeClient(), FakeClient(), [1000.0 + 2399]
    a = agent(hub, member, now)
    await a.maybe_renew_token()
    assert hub.calls == []  # 2399 s of 3600: not yet
    now[0] = 1000.0 + 2401
    await a.maybe_renew_token()
    (verb, plural, namespace, kw, body), = hub.calls
    assert (verb, plural, namespace, kw) == ("create", "serviceaccounts", "accelstack-member-member-a",
                                             {"subresource": "token", "name": "member-agent"})
    assert body["spec"] == {"expirationSeconds": 3600}
    assert hub.configuration.api_key == {"BearerToken": "new-token"}  # used from the next call on
    stored = yaml.safe_load(base64.b64decode(member.secret["data"]["kubeconfig"]))
    assert stored["users"][0]["user"]["token"] == "new-token"
    assert member.secret["metadata"]["resourceVersion"] == "7"  # a conditional update of what was read
    await a.maybe_renew_token()
    assert len(hub.calls) == 1  # the new token is young


async def test_a_refused_renewal_keeps_the_token() -> None:
    hub, member, now = FakeClient(refuse=True), FakeClient(), [1000.0 + 3000]
    a = agent(hub, member, now)
    await a.maybe_renew_token()
    assert hub.configuration.api_key == {"BearerToken": "old"} and member.calls == []


def test_token_times_read_the_jwt_claims(tmp_path: Path) -> None:
    def part(d: str) -> str:
        return base64.urlsafe_b64encode(d.encode()).decode().rstrip("=")

    claims = '{"iat": 100, "exp": 700}'
    jwt = f"{part('{}')}.{part(claims)}.sig"
    path = tmp_path / "kc"
    path.write_text(yaml.safe_dump({"current-context": "c", "contexts": [{"name": "c", "context": {"user": "u"}}],
                                    "users": [{"name": "u", "user": {"token": jwt}}]}))
    assert token_times(str(path)) == (100.0, 700.0)
    path.write_text("users: []")
    assert token_times(str(path)) is None


class Hub(FakeClient):
    """The hub's Cluster status subresource: every patch recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.patches: list[dict[str, Any]] = []
        self.down = False

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    **kw: Any) -> Any:
        self.patches.append(body)
        if self.down:
            raise ApiError(503, "ServiceUnavailable", "the hub is down")
        return body


async def test_a_change_the_hub_is_not_sent_wakes_the_loop_once_not_until_the_heartbeat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A member event that changes nothing the hub is sent (a finished GPR, a node's unrelated field), a change
    inside ``min_gap`` of the last write, and any event while an informer is not healthy (nothing can be written
    then): each used to leave ``changed`` set, so the loop ran flat out, a summary of every node and GPR a turn,
    until the next heartbeat (up to 10 s of a core each time; 9,539 turns in 0.3 s here)."""
    hub, member = Hub(), FakeClient()
    a = MemberAgent(member, hub, "member-a", resources=("nvidia.com/gpu",),  # type: ignore[arg-type]
                    heartbeat=30.0, min_gap=1.0)
    for informer in a.informers:
        informer.synced.set()
        informer.healthy = True
    turns = [0]

    async def counted(*args: Any) -> None:
        turns[0] += 1
        await wait_first(*args)

    monkeypatch.setattr(agent_module, "wait_first", counted)

    async def settle(seconds: float) -> int:
        before = turns[0]
        await asyncio.sleep(seconds)
        return turns[0] - before

    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    try:
        while not hub.patches:  # the first status
            await asyncio.sleep(0.01)
        await settle(0.05)
        a.changed.set()  # as _put does for a change the summary does not show
        assert await settle(0.3) <= 2
        assert len(hub.patches) == 1  # nothing new to send
        node = summarize_node({"metadata": {"name": "n1"}, "status": {
            "capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"}}}, a.resources)
        assert node is not None
        a.nodes["n1"] = node
        a.changed.set()  # a change the hub is sent, inside min_gap of the first write: sent once the gap is over
        assert await settle(0.9) <= 3
        assert len(hub.patches) == 2 and hub.patches[1]["status"]["devices"]["gpuAllocatable"] == 8
        a.informers[0].healthy = False  # a member API-server outage
        a.changed.set()
        assert await settle(0.3) <= 2
        assert len(hub.patches) == 2
        a.informers[0].healthy = True
        hub.down = True  # the hub refuses: tried again after the retry gap, however many member events come
        a.heartbeat = 0.3  # the next try is due now (a heartbeat); the gap while the hub refuses: min(heartbeat, 2 s)
        for _ in range(10):
            a.changed.set()
            await asyncio.sleep(0.05)
        assert 2 < len(hub.patches) <= 5, len(hub.patches)
    finally:
        stop.set()
        await task
