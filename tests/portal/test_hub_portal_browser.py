"""The portal as a hub serves it (issue 40.4), in a real browser: the same static files, the inventory grouped
cluster → model → node group with each member's state, the queue with a cluster column, and only the pages a hub
answers in the menu. The hub API runs with the views over fixed Cluster/GPR/Workspace objects
(tests/multicluster/test_view.py) and a fake TokenReview/SubjectAccessReview; skipped like the other browser tests
without chromium."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.hub import HubAPI
from service.http_listener import serve_app
from tests.conftest import STRICT
from tests.multicluster.test_view import FakeKube, Source
from tests.portal import test_portal_browser as pb
from tests.portal.test_portal_browser import element, no_console_errors, page_done, text, until

browser = pb.browser  # the module's one browser, against this module's backend


class HubBackend:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hub-portal", daemon=True)
        self.thread.start()
        self.url = ""
        self.runner: web.AppRunner | None = None

    def start(self) -> None:
        async def up() -> str:
            app = web.Application()
            app.add_routes(HubAPI(Source(), Authorizer(FakeKube())).routes())  # type: ignore[arg-type]
            self.runner, port = await serve_app(app, "127.0.0.1", 0)
            return f"http://127.0.0.1:{port}"

        self.url = asyncio.run_coroutine_threadsafe(up(), self.loop).result(30)

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def backend() -> Iterator[HubBackend]:
    missing = pb._missing()
    if missing:
        if STRICT:
            pytest.fail(f"browser tests cannot run and ACCELSTACK_STRICT=1 forbids skipping: {missing}")
        pytest.skip(missing)
    b = HubBackend()
    b.start()
    try:
        yield b
    finally:
        b.stop()


def rows(driver: Any, css: str) -> list[list[str]]:
    from selenium.webdriver.common.by import By

    return [[td.text for td in tr.find_elements(By.CSS_SELECTOR, "td")]
            for tr in driver.find_elements(By.CSS_SELECTOR, css + " tbody tr")]


def test_a_hub_portal_groups_by_cluster_and_shows_the_cluster_in_the_queue(browser: Any, backend: HubBackend
                                                                          ) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{backend.url}/ui/")
    browser.execute_script("sessionStorage.clear();")
    browser.get(f"{backend.url}/ui/#/login")
    page_done(browser, "login")
    element(browser, "#token").send_keys("admin-token")
    element(browser, "#login-submit").click()
    page_done(browser, "inventory")
    shown = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#nav a") if a.is_displayed()]
    assert shown == ["Inventory", "Queue"]
    assert text(browser, "h1") == "Inventory of every cluster"
    assert text(browser, "#totals").startswith("2 clusters · 32 devices")
    table = rows(browser, "table.hub-inventory")
    assert [(r[0], r[1], r[2].split("\n")[0]) for r in table] == [
        ("member-a", "Ready", "A100"), ("", "", "H100"), ("member-b", "Lost", "A100"), ("", "", "H100")]
    assert table[1][3] == "(not reported)" and table[1][4] == "3/8"

    browser.get(f"{backend.url}/ui/#/queue")
    page_done(browser, "queue")
    assert [r[:4] for r in rows(browser, "table.queue")] == [
        ["(not placed)", "—", "team-b/huge", "Queued"], ["member-a", "1", "team-a/train", "Queued"],
        ["member-b", "—", "team-a/serve", "Running"]]
    element(browser, "#f-cluster").send_keys("member-b")
    element(browser, "#queue-filters button").click()
    until(browser, lambda d: [r[2] for r in rows(d, "table.queue")] == ["team-a/serve"], "only member-b's GPR")
    no_console_errors(browser)
