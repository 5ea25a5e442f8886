"""The REST API's authentication under abuse (issue 36.4): TokenReviews sent to the API server are counted.

- many different bogus tokens from one address cost at most the failure burst in TokenReviews, then 429 with a
  Retry-After (each unknown token cost one TokenReview: 20,000 bogus keys were 20,000 reviews);
- one token, bogus or valid, asked about again and again is reviewed once (a cache of both outcomes);
- a valid token is never held back by its address's failure limit;
- the wait-time limiter keys on the authenticated user: the same token spelt with different spacing shares one
  bucket (it was keyed on the raw header: 60 spellings, 60 answers);
- the review cache is bounded.
"""

from __future__ import annotations

import time

import aiohttp

from scheduler_extender.api.app import RateLimiter
from scheduler_extender.api.auth import Authorizer
from tests.apiserver_peer import APIServerPeer
from tests.extender.test_http_robustness import process


def reviews(peer: APIServerPeer) -> int:
    return sum(1 for method, path in peer.requests if method == "POST" and "tokenreviews" in path)


async def test_bogus_tokens_from_one_address_cost_at_most_the_failure_burst_in_token_reviews() -> None:
    async with process() as (peer, server), aiohttp.ClientSession() as http:
        assert server.rest.authorizer is not None
        burst = server.rest.authorizer.fail_burst
        before = reviews(peer)
        statuses: list[int] = []
        started = time.monotonic()
        for i in range(200):
            async with http.get(f"http://127.0.0.1:{server.port}/api/v1/gprs",
                                headers={"Authorization": f"Bearer bogus-{i}"}) as r:
                statuses.append(r.status)
                if r.status == 429:
                    assert int(r.headers["Retry-After"]) >= 1
                    assert "too many failed authentications" in (await r.json())["error"]
        sent = reviews(peer) - before
        # the bucket refills at fail_rate a second while the loop runs: the burst and what refilled, never 200
        refilled = server.rest.authorizer.fail_rate * (time.monotonic() - started)
        assert burst <= sent <= burst + refilled + 1, (sent, refilled)
        assert statuses[:burst] == [401] * burst and statuses.count(429) >= 200 - sent
        # a known valid token from the same address still gets in
        async with http.get(f"http://127.0.0.1:{server.port}/api/v1/gprs",
                            headers={"Authorization": "Bearer admin-token"}) as r:
            assert r.status == 429  # not known yet: it would cost a TokenReview
        server.rest.authorizer._failures = type(server.rest.authorizer._failures)(16)  # a fresh address's view
        async with http.get(f"http://127.0.0.1:{server.port}/api/v1/gprs",
                            headers={"Authorization": "Bearer admin-token"}) as r:
            assert r.status == 200
        # known now: the exhausted address does not stop it
        for i in range(30):
            async with http.get(f"http://127.0.0.1:{server.port}/api/v1/gprs",
                                headers={"Authorization": f"Bearer more-bogus-{i}"}) as r:
                pass
        async with http.get(f"http://127.0.0.1:{server.port}/api/v1/gprs",
                            headers={"Authorization": "Bearer admin-token"}) as r:
            assert r.status == 200


async def test_one_token_asked_about_again_and_again_is_reviewed_once() -> None:
    async with process() as (peer, server), aiohttp.ClientSession() as http:
        for token, expected in (("same-bogus", 401), ("admin-token", 200)):
            before = reviews(peer)
            for _ in range(50):
                async with http.get(f"http://127.0.0.1:{server.port}/api/v1/gprs",
                                    headers={"Authorization": f"Bearer {token}"}) as r:
                    assert r.status == expected
            assert reviews(peer) - before == 1, token


async def test_waittime_limit_keys_on_the_authenticated_user_not_the_raw_header() -> None:
    async with process() as (_, server), aiohttp.ClientSession() as http:
        server.rest.limiter = RateLimiter(rate=0.001, burst=3)
        body = {"namespace": "team-a", "spec": {"devicesPerNode": 1}}
        answers = []
        for i in range(60):
            spelling = "Bearer" + " " * (1 + i) + "admin-token" + " " * (i % 3)
            async with http.post(f"http://127.0.0.1:{server.port}/api/v1/waittime", json=body,
                                 headers={"Authorization": spelling}) as r:
                answers.append(r.status)
        assert answers.count(200) == 3 and answers.count(429) == 57, answers


async def test_the_review_cache_is_bounded() -> None:
    class Kube:
        async def token_review(self, token: str) -> dict[str, object]:
            return {"authenticated": token.startswith("good"), "user": {"username": token}}

    auth = Authorizer(Kube(), max_entries=8, fail_burst=1000)  # type: ignore[arg-type]
    for i in range(100):
        await auth.authenticate(f"Bearer good-{i}", client="10.0.0.1")
        await auth.authenticate(f"Bearer bad-{i}", client="10.0.0.1")
    assert len(auth._users) == 8 and auth.reviews == 200
    # the most recent are the ones kept: asking again costs nothing
    await auth.authenticate("Bearer bad-99", client="10.0.0.1")
    assert auth.reviews == 200
