"""The portal in a real browser: Debian's chromium driven through chromium-driver (selenium), against the real
REST server with the API-server peer behind it. One browser for the module; each test logs in as the caller it
needs. Screenshots of each page go to $ACCELSTACK_ARTEFACTS/portal (or a pytest tmp dir).

Without chromium and chromium-driver (scripts/system-deps.sh installs them as root) the tests skip with the
reason, and fail under ACCELSTACK_STRICT=1 (CI can install them, so it must run them)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.apiserver_peer import APIServerPeer
from tests.conftest import STRICT
from tests.extender.harness import stack
from tests.portal.cluster import GPRS, seed

T = TypeVar("T")
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WAIT = 10.0


def _missing() -> str:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pip install -e '.[dev]')"
    if not CHROMIUM or not DRIVER:
        return "chromium and chromium-driver are not installed (scripts/system-deps.sh installs them as root)"
    return ""


class Backend:
    """The extender's REST server and the API-server peer on an event loop of their own (selenium blocks)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="portal-backend", daemon=True)
        self.thread.start()
        self.peer = APIServerPeer()
        self.url = ""
        self._stack: Any = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        async def up() -> str:
            await self.peer.start()
            await seed(self.peer)
            self._stack = stack(self.peer)
            _, server = await self._stack.__aenter__()
            return f"http://127.0.0.1:{server.port}"

        self.url = self.run(up())

    def stop(self) -> None:
        async def down() -> None:
            if self._stack is not None:
                await self._stack.__aexit__(None, None, None)
            await self.peer.stop()

        self.run(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def stored(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        async def read() -> dict[str, Any] | None:
            return self.peer.get(resource, namespace, name)

        return self.run(read())


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    missing = _missing()
    if missing:
        if STRICT:
            pytest.fail(f"browser tests cannot run and ACCELSTACK_STRICT=1 forbids skipping: {missing}")
        pytest.skip(missing)
    b = Backend()
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def browser(backend: Backend) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1360,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER or ""))
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("ACCELSTACK_ARTEFACTS")
    path = Path(root) / "portal" if root else tmp_path_factory.mktemp("portal")
    path.mkdir(parents=True, exist_ok=True)
    return path


def until(driver: Any, predicate: Callable[[Any], Any], what: str) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # a page re-rendered while it was read is read again
        return WebDriverWait(driver, WAIT, poll_frequency=0.05,
                             ignored_exceptions=(StaleElementReferenceException,)).until(predicate)
    except TimeoutException:
        raise AssertionError(f"not seen within {WAIT:g}s: {what}; at {driver.current_url}; page: "
                             f"{text(driver, 'main')[:600]!r}") from None


def text(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[0].text if found else ""


def element(driver: Any, css: str) -> Any:
    from selenium.webdriver.common.by import By

    return until(driver, lambda d: (d.find_elements(By.CSS_SELECTOR, css) or [None])[0], css)


def page_done(driver: Any, name: str) -> None:
    until(driver, lambda d: d.execute_script(
        "const m = document.getElementById('main'); return m.dataset.page === arguments[0] "
        "&& m.getAttribute('aria-busy') !== 'true';", name), f"page {name} rendered")


def go(driver: Any, backend: Backend, route: str, name: str) -> None:
    driver.get(f"{backend.url}/ui/#/{route}")
    page_done(driver, name)


def login(driver: Any, backend: Backend, token: str) -> None:
    driver.get(f"{backend.url}/ui/")
    driver.execute_script("sessionStorage.clear();")
    driver.get(f"{backend.url}/ui/#/login")
    page_done(driver, "login")
    element(driver, "#token").send_keys(token)
    element(driver, "#login-submit").click()


def no_console_errors(driver: Any) -> None:
    """No CSP violation, script error or failed load other than the API refusals a test asked for."""
    severe = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"
              and not any(f" {code} " in e["message"] for code in ("(Forbidden)", "401", "403", "404"))
              and "status of 40" not in e["message"]]
    assert not severe, severe


def test_login_inventory_heat_map_and_drill_down(browser: Any, backend: Backend, shots: Path) -> None:
    login(browser, backend, "admin-token")
    page_done(browser, "inventory")
    assert "6 nodes · 36 devices" in text(browser, "#totals")
    assert "signed in as alice" in text(browser, "#who")
    heat = text(browser, "table.heatmap")
    assert "NVIDIA-H100-80GB-HBM3" in heat and "p5.48xlarge" in heat and "10/24" in heat
    browser.save_screenshot(str(shots / "inventory.png"))
    element(browser, "a.cell.sick").click()  # the H100 group with the sick node
    page_done(browser, "inventory")
    until(browser, lambda d: "Node group p5.48xlarge" in text(d, "h1"), "group page")
    assert [t.split("\n")[0] for t in text(browser, "#tiles").split("\n") if t.startswith("p5-")] == [
        "p5-0", "p5-1", "p5-2"]
    browser.save_screenshot(str(shots / "inventory-group.png"))
    element(browser, "a.tile.sick").click()
    page_done(browser, "node")
    until(browser, lambda d: "Node p5-2" in text(d, "h1"), "node page")
    assert "GPUUnhealthy: Xid 79 on GPU 3" in text(browser, "main")
    browser.save_screenshot(str(shots / "node.png"))
    # the token is in this tab's sessionStorage only: no cookie, no localStorage, never in the URL
    assert browser.get_cookies() == []
    assert browser.execute_script("return localStorage.length") == 0
    assert browser.execute_script("return sessionStorage.getItem('accelstack.token')") == "admin-token"
    assert "admin-token" not in browser.current_url
    no_console_errors(browser)


def test_queue_filters_and_a_gprs_detail(browser: Any, backend: Backend, shots: Path) -> None:
    login(browser, backend, "admin-token")
    page_done(browser, "inventory")
    go(browser, backend, "queue", "queue")
    rows = text(browser, "table.queue tbody").split("\n")
    assert [r.split()[1] for r in rows] == ["team-a/finetune", "team-b/batch", "team-b/sweep", "team-a/train-big",
                                            "team-a-dev/exp"]
    assert rows[0].split()[:6] == ["1", "team-a/finetune", "team-a", "Queued", "120", "(medium)"] and "in 15m" in rows[0]
    assert text(browser, "#queue-order").startswith("Queued GPRs start by priority level, strictly: high (201-300)")
    browser.save_screenshot(str(shots / "queue.png"))
    field = element(browser, "#f-workspace")
    field.send_keys("team-b")
    element(browser, "#queue-filters button").click()
    until(browser, lambda d: "workspace=team-b" in d.current_url and len(
        text(d, "table.queue tbody").split("\n")) == 2, "filtered to team-b")
    go(browser, backend, "queue", "queue")
    element(browser, "table.queue tbody a").click()  # finetune
    page_done(browser, "gpr")
    facts = text(browser, "#gpr-facts")
    assert "InsufficientCapacity" in facts and "needs 8 free nvidia.com/gpu on one node" in facts
    assert "Queue position\n1" in facts
    until(browser, lambda d: "position 1; estimated start in 15m" in text(d, "table.events"), "its Events")
    browser.save_screenshot(str(shots / "gpr-detail.png"))
    no_console_errors(browser)


def test_create_a_gpr_from_a_template_with_its_estimate(browser: Any, backend: Backend, shots: Path) -> None:
    from selenium.webdriver.support.ui import Select

    login(browser, backend, "admin-token")
    page_done(browser, "inventory")
    go(browser, backend, "create?namespace=team-a&template=small-gpu", "create")
    until(browser, lambda d: "queue position 3" in text(d, "#estimate"), "the estimate for the template")
    assert Select(element(browser, "#c-template")).first_selected_option.text.startswith("small-gpu")
    assert element(browser, "#c-devicesPerNode").get_attribute("value") == "1"
    assert "in 30m" in text(browser, "#estimate")
    priority = element(browser, "#c-priority")
    priority.clear()
    priority.send_keys("200")
    until(browser, lambda d: "Starts now" in text(d, "#estimate") and "queue position 1" in text(d, "#estimate"),
          "the estimate follows the priority")
    element(browser, "#c-name").send_keys("notebook-1")
    browser.save_screenshot(str(shots / "create-gpr.png"))
    element(browser, "#create-submit").click()
    until(browser, lambda d: "GPR team-a/notebook-1" in text(d, "h1"), "the new GPR's page")
    made = backend.stored(GPRS, "team-a", "notebook-1")
    assert made is not None
    sent = {"resource": "nvidia.com/gpu", "devicesPerNode": 1, "priority": 200, "exitDuration": "2h"}
    assert {k: made["spec"].get(k) for k in sent} == sent  # what the form sent; the CRD's defaults fill the rest
    no_console_errors(browser)


def test_workspaces_and_health_pages(browser: Any, backend: Backend, shots: Path) -> None:
    login(browser, backend, "admin-token")
    page_done(browser, "inventory")
    go(browser, backend, "workspaces", "workspaces")
    card = until(browser, lambda d: text(d, "#ws-team-a"), "the team-a workspace")
    assert "Ready" in card and "team-a (adopted), team-a-dev" in card
    assert "nvidia.com/gpu any 8 2 8 16 63%" in card  # in use + reserved against the quota
    assert "team-a/notebooks small-gpu" in card and "Group team-a member" in card
    browser.save_screenshot(str(shots / "workspaces.png"))
    go(browser, backend, "health", "health")
    assert "2 of 6 nodes have a problem · 9 devices out of service" in text(browser, "#health-summary")
    assert "GPUUnhealthy: Xid 79 on GPU 3 (since 2026-11-30T08:15:00Z)" in text(browser, "table.health")
    browser.save_screenshot(str(shots / "health.png"))
    no_console_errors(browser)


def test_a_caller_without_permission_sees_a_refusal(browser: Any, backend: Backend, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    login(browser, backend, "admin-token")
    page_done(browser, "inventory")
    assert "signed in as alice" in text(browser, "#who")
    login(browser, backend, "forged-token")
    until(browser, lambda d: "the token is not valid" in text(d, "#login-error"), "the login refusal")
    # nobody is signed in now: the header no longer names the last caller, nor offers to log out
    assert text(browser, "#who") == "" and not element(browser, "#logout").is_displayed()
    assert not [e for e in browser.get_log("browser") if "favicon" in e["message"]]  # the icon loads
    login(browser, backend, "carol-token")
    page_done(browser, "inventory")
    assert "Not allowed." in text(browser, ".refusal") and "carol may not list nodes" in text(browser, ".refusal")
    visible = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#nav a") if a.is_displayed()]
    assert visible == []
    browser.save_screenshot(str(shots / "refusal.png"))
    go(browser, backend, "workspaces", "workspaces")
    assert "carol may not list workspaces" in text(browser, ".refusal")

    login(browser, backend, "bob-token")  # may read team-b's GPRs and Events only
    page_done(browser, "inventory")
    go(browser, backend, "queue", "queue")
    assert "Not allowed." in text(browser, ".refusal")
    go(browser, backend, "queue?namespace=team-b", "queue")
    assert [r.split()[1] for r in text(browser, "table.queue tbody").split("\n")] == ["team-b/batch", "team-b/sweep"]
    go(browser, backend, "queue?namespace=team-a", "queue")
    assert "bob may not list gpuprovisioningrequests in namespace team-a" in text(browser, ".refusal")
    no_console_errors(browser)
