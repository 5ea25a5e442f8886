"""API keys from Secrets, the access map, rate limits and the route table from EndpointSlices (pure)."""

from __future__ import annotations

import base64

import pytest

from inference.access import (
    Access,
    Caller,
    TokenBucket,
    admits,
    bearer_token,
    caller_from_secret,
    caller_from_user,
    digest,
    key_table,
)
from inference.discovery import replicas_of, route_table
from inference.names import POOL_BURST
from tests.inference.harness import KEY_A, endpoint, key_secret, slices


def test_key_table_hashes_tokens_and_reads_annotations() -> None:
    table, errors = key_table([key_secret("app", "team-a", KEY_A, rate=5, burst=10, workspace="research"),
                               {"metadata": {"name": "other", "namespace": "x"}, "data": {}}])  # not labelled
    assert errors == []
    assert list(table) == [digest(KEY_A)]
    assert table[digest(KEY_A)] == Caller("team-a/app", "team-a", "research", 5.0, 10.0)
    assert KEY_A not in repr(table)


@pytest.mark.parametrize(("data", "message"), [
    ({}, "data.key is missing"),
    ({"key": "!!!not base64"}, "not base64"),
    ({"key": base64.b64encode(b"short").decode()}, "at least 16 characters"),
])
def test_malformed_key_secrets_are_named_not_echoed(data: dict[str, str], message: str) -> None:
    secret = key_secret("bad", "team-a", KEY_A)
    secret["data"] = data
    table, errors = key_table([secret])
    assert table == {}
    assert len(errors) == 1 and errors[0].startswith("Secret team-a/bad: ") and message in errors[0]


def test_bad_rate_annotation_named() -> None:
    secret = key_secret("bad", "team-a", KEY_A)
    secret["metadata"]["annotations"]["accelstack.io/rate-limit"] = "fast"
    with pytest.raises(ValueError, match=r"Secret team-a/bad: annotation accelstack.io/rate-limit: not a number"):
        caller_from_secret(secret)


def test_admits() -> None:
    access = Access.from_spec("team-a", {"namespaces": ["team-c"], "workspaces": ["research"],
                                         "apiKeys": ["partner", "team-z/ci"]})
    assert admits(access, Caller("team-a/x", "team-a", "team-a"))[0]  # own namespace
    assert admits(access, Caller("team-c/x", "team-c", "team-c"))[0]
    assert admits(access, Caller("team-q/x", "team-q", "research"))[0]
    assert admits(access, Caller("team-z/ci", "team-z", "team-z"))[0]  # the key itself is listed
    assert access.api_keys == {"team-a/partner", "team-z/ci"}  # a bare name is in the endpoint namespace
    ok, why = admits(access, Caller("team-b/app", "team-b", "team-b"))
    assert not ok and "team-b" in why
    assert admits(Access.from_spec("team-a", {"namespaces": ["*"]}), Caller("x/y", "x", "x"))[0]


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer ") is None


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=2, burst=2)
    assert bucket.take(0.0) == 0 and bucket.take(0.0) == 0
    assert bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.5) == 0  # refilled one token in 0.5 s
    assert TokenBucket(rate=0, burst=0).take(0.0) == 0  # unlimited


def test_replicas_from_slices() -> None:
    eps = slices("llm", ["http://10.0.0.1:8000"])[0]
    eps["endpoints"] += [
        {"addresses": ["10.0.0.2"], "conditions": {}},  # ready absent: counts as ready
        {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
        {"addresses": ["10.0.0.4"], "conditions": {"ready": True, "terminating": True}},
        {"addresses": [], "conditions": {"ready": True}},
    ]
    v6 = slices("llm", ["http://10.0.0.9:8000"], pool=POOL_BURST)[0]
    v6["endpoints"][0]["addresses"] = ["fd00::5"]
    unlabelled = slices("llm", ["http://10.0.0.8:8000"])[0]
    del unlabelled["metadata"]["labels"]["accelstack.io/inference-endpoint"]
    found = replicas_of([eps, v6, unlabelled])
    urls = [(r.url, r.pool) for r in found["team-a/llm"]]
    assert urls == [("http://10.0.0.1:8000", "primary"), ("http://10.0.0.2:8000", "primary"),
                    ("http://[fd00::5]:8000", "burst")]
    assert found["team-a/llm"][0].pod == "llm-primary-0" and found["team-a/llm"][0].node == "node-1"


def test_route_table_and_model_conflicts() -> None:
    older = endpoint("a", models=["m", "n"], created="2026-01-01T00:00:00Z", max_inflight=8)
    newer = endpoint("b", namespace="team-b", models=["m"], created="2026-02-01T00:00:00Z")
    table, problems = route_table([newer, older], slices("a", ["http://10.0.0.1:8000"]))
    assert table["m"].endpoint == "team-a/a" and table["m"].max_inflight == 8
    assert [r.url for r in table["n"].replicas] == ["http://10.0.0.1:8000"]
    assert problems == ["model 'm' of team-b/b is already served by team-a/a; ignored"]
    older["metadata"]["deletionTimestamp"] = "2026-03-01T00:00:00Z"
    table, _ = route_table([newer, older], [])
    assert table["m"].endpoint == "team-b/b" and table["m"].replicas == ()


def test_service_account_callers() -> None:
    chat = caller_from_user({"username": "system:serviceaccount:team-b:chat"})
    assert chat == Caller("team-b/chat", "team-b", "team-b", kind="serviceaccount")
    assert caller_from_user({"username": "alice"}) is None
    assert caller_from_user({"username": "system:serviceaccount:broken"}) is None
    assert caller_from_user(None) is None
    access = Access.from_spec("team-a", {"serviceAccounts": ["team-b/chat"], "apiKeys": ["team-b/other"]})
    assert admits(access, chat)[0]
    # a key Secret and a service account of the same name are different callers
    assert not admits(access, Caller("team-b/chat", "team-b", "team-b", kind="apikey"))[0]
    assert not admits(access, Caller("team-b/other", "team-b", "team-b", kind="serviceaccount"))[0]
