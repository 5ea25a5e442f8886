"""The controller learns how long work runs from finished GPRs, estimates queued GPRs' starts from it (with a
P10-P90 range in status), and keeps what it learned in a ConfigMap: a restarted controller estimates as well
as the old one after the finished GPRs are gone (issue #12)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from scheduler_extender.controller.predictor_store import (
    CONFIGMAP,
    DATA_KEY,
    PredictorStore,
    job_key,
    workload_of,
)
from scheduler_extender.core.predictor import DurationPredictor
from scheduler_extender.objects import gpr_codec as gr
from tests.apiserver_peer import APIServerPeer
from tests.extender.harness import gpr, pod, stack, wait_until
from tests.extender.test_controller import FAST, GPRS, seed_nodes, status

CONFIGMAPS = "api/v1/configmaps"
HOUR = 3600.0


def _finished(name: str, now: float, ran_s: float) -> dict[str, Any]:
    obj = gpr(name, phase="Complete", devices=4, exitDuration="10h")
    obj["metadata"]["labels"] = {"accelstack.io/template": "train"}
    obj["status"].update({"admittedAt": gr.rfc3339(now - ran_s - 60), "finishedAt": gr.rfc3339(now - 60),
                          "reason": "Succeeded"})
    return obj


def _estimate_wait(peer: APIServerPeer, name: str, now: float) -> float | None:
    st = status(peer, name)
    when = gr.parse_time(st.get("estimatedStart"))
    return None if when is None else when - now


async def test_wait_estimates_use_learned_durations_and_survive_a_restart() -> None:
    peer = APIServerPeer()
    await peer.start()
    await seed_nodes(peer)  # n0, n1: 4 GPUs each
    now = time.time()
    for i in range(6):  # "train" GPRs ask for 10 h and finish within the hour
        await peer.put_object(GPRS, _finished(f"done{i}", now, 0.9 * HOUR))
    for i, node_name in enumerate(("n0", "n1")):  # both nodes are busy with "train" GPRs admitted 10 min ago
        holder = gpr(f"run{i}", phase="Running", reservation={node_name: 4}, devices=4, exitDuration="10h")
        holder["metadata"]["labels"] = {"accelstack.io/template": "train"}
        holder["status"].update({"admittedAt": gr.rfc3339(now - 600), "startedAt": gr.rfc3339(now - 590)})
        await peer.put_object(GPRS, holder)
        await peer.put_object("api/v1/pods", pod(f"run{i}-0", 4, gpr=f"run{i}", node_name=node_name,
                                                 phase="Running"))
    nxt = gpr("next", phase=None, devices=4, exitDuration="10h")
    nxt["metadata"]["labels"] = {"accelstack.io/template": "train"}
    await peer.put_object(GPRS, nxt)
    async with stack(peer, **FAST):
        await wait_until(lambda: _estimate_wait(peer, "next", now) is not None)
        wait = _estimate_wait(peer, "next", now)
        assert wait is not None and wait < 1.5 * HOUR  # from history: the holders end within the hour, not at 10 h
        rng = status(peer, "next")["estimatedStartRange"]
        assert gr.parse_time(rng["earliest"]) <= gr.parse_time(status(peer, "next")["estimatedStart"])  # type: ignore[operator]
        assert gr.parse_time(rng["latest"]) >= gr.parse_time(status(peer, "next")["estimatedStart"])  # type: ignore[operator]
    saved = peer.get(CONFIGMAPS, "accelstack-system", CONFIGMAP)
    assert saved is not None and DATA_KEY in saved["data"]
    for i in range(6):  # finished GPRs are cleaned up: only the ConfigMap remembers how long "train" runs
        await peer.delete_object(GPRS, "default", f"done{i}")
    later = gpr("later", phase=None, devices=4, exitDuration="10h")
    later["metadata"]["labels"] = {"accelstack.io/template": "train"}
    await peer.put_object(GPRS, later)
    async with stack(peer, **FAST):  # a restarted (or new) leader
        await wait_until(lambda: _estimate_wait(peer, "later", now) is not None)
        wait = _estimate_wait(peer, "later", now)
        # both holders are predicted to end within the hour and "next" takes one node: "later" gets the other;
        # without the history both would hold to their 10 h bound
        assert wait is not None and wait < 1.5 * HOUR
    await peer.stop()


def test_store_learns_each_finished_gpr_once_and_round_trips() -> None:
    now = 1_000_000.0
    store = PredictorStore()
    objs = {f"uid{i}": dict(_finished(f"done{i}", now, 1800), metadata={
        "name": f"done{i}", "namespace": "default", "uid": f"uid{i}", "labels": {"accelstack.io/template": "train"}})
        for i in range(6)}
    assert store.learn(objs) == 6 and store.learn(objs) == 0  # once each
    key = job_key(next(iter(objs.values())))
    assert key.template == "train" and key.workspace == "default"
    assert store.predictor.predict(key, 36_000).mean == pytest.approx(1800, rel=0.15)
    # a queued GPR's first projection is kept until it is admitted, then calibrates the estimates
    store.note_projections({"q1": (now + 100, 600.0, 50)}, now)
    store.note_projections({"q1": (now + 900, 600.0, 50)}, now + 10)  # only the first counts
    assert store.first["q1"] == (now, 100.0, "low")
    data = store.to_data()
    again = PredictorStore()
    again.load_data(data)
    assert again.predictor.predict(key, 36_000) == store.predictor.predict(key, 36_000)
    assert again.learned == store.learned and again.first == store.first
    # objects that are gone are forgotten; an admitted one feeds the calibration
    queued = {"q1": {"metadata": {"namespace": "default"}, "spec": {}, "status": {"admittedAt": gr.rfc3339(now + 300)}}}
    again.learn(queued)
    assert again.first == {} and again.learned == set()
    for bad in ({}, {DATA_KEY: "not json"}, {DATA_KEY: orjson.dumps({"version": 7}).decode()}):
        with pytest.raises(ValueError, match=CONFIGMAP):
            PredictorStore().load_data(bad)


def test_store_stays_within_a_configmap() -> None:
    store = PredictorStore(DurationPredictor(max_keys=50_000))
    for i in range(30_000):
        store.predictor.observe(job_key({"metadata": {"namespace": f"ns{i}"}, "spec": {}}), 100.0 + i)
    assert len(store.to_data()[DATA_KEY]) <= 900_000


def test_workload_names_lose_generated_suffixes() -> None:
    def owned(kind: str, name: str) -> dict[str, Any]:
        return {"metadata": {"ownerReferences": [{"kind": kind, "name": name}]}}

    assert workload_of(owned("Job", "train-resnet-28514")) == "Job/train-resnet"
    assert workload_of(owned("ReplicaSet", "serve-7d9f8c6b5d")) == "ReplicaSet/serve"
    assert workload_of({"metadata": {"labels": {"accelstack.io/workload": "nightly"}}}) == "nightly"
    assert workload_of({"metadata": {}}) == ""
