"""The hub's verdict on a Cluster is written only over the very object it was judged from: a heartbeat the member's
agent wrote after the hub's informer copy (right after the hub's own API server came back, its watch can deliver
the Clusters' events seconds late) makes the write a 409, and the next pass judges the fresh object; no false
``Lost`` is written, so nothing a Lost member's GPRs would go through (moving them) starts."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from kubeapi import Conflict, NotFound, Resource
from kubeapi.metrics import api_metrics
from scheduler_extender.multicluster.clusters import micro_time
from scheduler_extender.multicluster.hub import HubController

NOW = 1_000_000.0


class Server:
    """The Clusters as the API server holds them: a merge patch of ``status``, with ``metadata.resourceVersion``
    in the body as a precondition (409 when it is not the current one), as kube-apiserver applies it."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj, self.patches = obj, list[dict[str, Any]]()
        self.metrics = api_metrics()  # what the controller's informer counts with

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    **kw: Any) -> Any:
        want = (body.get("metadata") or {}).get("resourceVersion")
        if want is not None and want != self.obj["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "the object has been modified")
        self.patches.append(body)
        self.obj["status"] = {**self.obj["status"], **body["status"]}
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.obj)


def cluster(rv: str, beat: float, observed: float) -> dict[str, Any]:
    """A Ready member whose agent's last heartbeat is ``beat`` (its clock), seen by the hub at ``observed``."""
    return {"metadata": {"name": "member-a", "resourceVersion": rv}, "status": {
        "lastHeartbeatTime": micro_time(beat), "observedHeartbeat": micro_time(observed - 1),
        "observedHeartbeatTime": micro_time(observed),
        "conditions": [{"type": "Ready", "status": "True", "reason": "HeartbeatSeen", "message": "",
                        "lastTransitionTime": micro_time(observed).split(".")[0] + "Z"},
                       {"type": "Lost", "status": "False", "reason": "HeartbeatSeen", "message": "",
                        "lastTransitionTime": micro_time(observed).split(".")[0] + "Z"}]}}


async def test_a_verdict_judged_from_a_stale_copy_is_not_written_and_the_fresh_object_is_judged_next() -> None:
    # what the hub's informer holds: the heartbeat it last saw and recorded, 10 s ago (lost after 4 s)
    stale = cluster("7", NOW - 10, NOW - 10)
    stale["status"]["observedHeartbeat"] = stale["status"]["lastHeartbeatTime"]
    # the API server: the agent has written a new heartbeat since (resourceVersion 8)
    fresh = copy.deepcopy(stale)
    fresh["metadata"]["resourceVersion"] = "8"
    fresh["status"]["lastHeartbeatTime"] = micro_time(NOW - 0.2)
    server = Server(copy.deepcopy(fresh))
    hub = HubController(server, lost_after=4.0, wall=lambda: NOW)  # type: ignore[arg-type]
    hub.informer.healthy = True
    hub.heard_since = NOW - 30  # the view has been live for a while, as far as the hub knows
    hub.clusters = {"member-a": copy.deepcopy(stale)}

    await hub.pass_once()  # judges the stale copy Lost; the write is refused, so nothing false is recorded
    assert server.patches == [] and hub.writes == 0
    assert next(c for c in server.obj["status"]["conditions"] if c["type"] == "Ready")["status"] == "True"

    hub._on_cluster("MODIFIED", copy.deepcopy(server.obj))  # the informer's event for the fresh object
    await hub.pass_once()
    assert hub.writes == 1
    status = server.obj["status"]
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "True"
    assert status["observedHeartbeat"] == fresh["status"]["lastHeartbeatTime"]  # the new beat, seen now
    assert server.patches[0]["metadata"] == {"resourceVersion": "8"}


class LeavesWhileWritten(Server):
    """The member leaves (``cluster leave`` deletes its Cluster) while the hub's status write is in flight: the
    write lands first, the informer's DELETED event reaches the hub before the write's answer does."""

    def __init__(self, obj: dict[str, Any], hub: list[HubController]) -> None:
        super().__init__(obj)
        self.hub = hub

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    **kw: Any) -> Any:
        answer = await super().patch(res, name, body, namespace, **kw)
        self.hub[0]._on_cluster("DELETED", copy.deepcopy(self.obj))
        return answer


async def test_a_member_that_left_while_its_status_was_written_is_not_brought_back() -> None:
    """The write's answer must not put the deleted Cluster back in the hub's view: nothing would ever remove it
    again, and the hub would keep the member Ready and its GPRs placed there (a real-cluster test saw a left
    member's GPR never move)."""
    hub_box: list[HubController] = []
    beat = cluster("7", NOW - 0.2, NOW - 1)
    server = LeavesWhileWritten(copy.deepcopy(beat), hub_box)
    hub = HubController(server, lost_after=4.0, wall=lambda: NOW)  # type: ignore[arg-type]
    hub_box.append(hub)
    hub.informer.healthy = True
    hub.heard_since = NOW - 30
    hub.clusters = {"member-a": copy.deepcopy(beat)}
    await hub.pass_once()  # a new heartbeat seen: written, and meanwhile the Cluster is deleted
    assert len(server.patches) == 1
    assert hub.clusters == {}


class Gone(Server):
    """The API server no longer has the Cluster (its deletion's event has not reached the hub)."""

    async def patch(self, res: Resource, name: str, body: dict[str, Any], namespace: str | None = None,
                    **kw: Any) -> Any:
        raise NotFound(404, "NotFound", f'clusters.accelstack.io "{name}" not found')


async def test_a_cluster_the_api_server_no_longer_has_leaves_the_view_at_the_next_verdict() -> None:
    """Whatever the watch has delivered: a member whose Cluster is gone is dropped when the write of its verdict
    is answered 404, so the dispatcher sees it left (and moves what had not started there)."""
    beat = cluster("7", NOW - 10, NOW - 10)  # silent for 10 s: judged Lost, a write is due
    beat["status"]["observedHeartbeat"] = beat["status"]["lastHeartbeatTime"]
    hub = HubController(Gone(copy.deepcopy(beat)), lost_after=4.0, wall=lambda: NOW)  # type: ignore[arg-type]
    hub.informer.healthy = True
    hub.heard_since = NOW - 30
    hub.clusters = {"member-a": copy.deepcopy(beat)}
    seen = asyncio.Event()
    hub.listeners.append(seen)
    await hub.pass_once()
    assert hub.clusters == {} and seen.is_set() and hub.writes == 0
