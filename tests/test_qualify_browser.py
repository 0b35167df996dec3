"""During a qualification every place that states admission says the gateway refuses every
user, why and until when (issue 23: the Dashboard and the Usage page said "admits up to the
engine's max_running_requests" while every request got a 503).

In a real browser over a live daemon and the engine emulator (a real process): the
qualification is started from its page through the confirmation, then every page of the
nav is walked while it runs; each admission line (Dashboard, Usage) and the Qualification
page's progress state the refusal, its reason and its end, and no page states admission
otherwise. `/api/v1/engine` (`admits_requests`, `admission`) and `appliance doctor`'s
engine check say the same meanwhile. The run is then cancelled from the page and the
Dashboard's line goes back to stating the limit. Waits are on what the page shows.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from appliance.engine.cli import describe_status
from appliance.health.doctor import run_doctor
from appliance.health.model import Level
from appliance.testing.fake_gpus import FakeGpus
from tests.browser_rig import Browser, Dialog, Page, admin_on, expect, shot
from tests.conftest import LiveServer
from tests.test_engine_api import engine_server, wait_until

pytestmark = pytest.mark.browser

REFUSAL = re.compile(r"refusing every user until about \d\d:\d\d:\d\d UTC: a qualification "
                     r"is running")
NAV = ("Dashboard", "Weights", "Engine", "Tuning", "Qualification", "Health", "Cell",
       "API keys", "Usage", "Audit", "Events", "Settings")
STATES_ADMISSION = {"/": "#admission-line", "/usage": "#admission-line",
                    "/qualify": "#qualify-status [role=status]"}


@pytest.fixture
def ready_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    with engine_server(tmp_path, monkeypatch) as live:
        yield live


@pytest.fixture
def page(browser: Browser, ready_box: LiveServer) -> Iterator[Page]:
    with admin_on(browser, ready_box, ready_box.runtime, "Qualification", "/qualify") as tab:
        yield tab


def start_engine(page: Page) -> None:
    started = page.request.post("/api/v1/engine/start", data={},
                                headers={"X-CSRF-Token": csrf_of(page)})
    assert started.status == 202, started.text()


def csrf_of(page: Page) -> str:
    token = page.evaluate("JSON.parse(document.body.getAttribute('hx-headers'))"
                          "['X-CSRF-Token']")
    return str(token)


def test_every_place_that_states_admission_states_the_refusal_during_a_qualification(
        ready_box: LiveServer, page: Page) -> None:
    runtime = ready_box.runtime
    start_engine(page)
    wait_ready(page)
    page.reload()

    # Start it from the page: the first press shows what it does, the second runs it. Long
    # answers (1,000 tokens at 10 ms) keep it running through the whole walk.
    form = page.locator("form").filter(has=page.get_by_label("Rounds per step"))
    form.get_by_label("Rounds per step").fill("3")
    form.get_by_label(re.compile("^Users at once, per step")).fill("1,2,4")
    form.get_by_role("button", name="Run a qualification…").click()
    confirm = page.get_by_role("button", name="Refuse users and qualify now")
    expect(confirm).to_be_visible()
    confirm.click()
    running = page.locator("#qualify-status [role=status]")
    expect(running).to_contain_text("A qualification is running")
    expect(running).to_contain_text(re.compile(r"The gateway refuses every user until it "
                                               r"ends, about \d{4}-\d\d-\d\d \d\d:\d\d"))

    nav = page.get_by_role("navigation", name="main")
    for link in NAV:
        nav.get_by_role("link", name=link, exact=True).click()
        expect(page.get_by_role("heading", level=1)).to_be_visible()
        path = page.evaluate("location.pathname")
        where = STATES_ADMISSION.get(path)
        if path in ("/", "/usage"):
            line = page.locator(where or "")
            expect(line).to_contain_text(REFUSAL)
            expect(line).to_have_attribute("data-admitting", "no")
            expect(line.get_by_role("link", name="See the qualification →")).to_be_visible()
        elif where is not None:
            expect(page.locator(where)).to_contain_text("refuses every user")
            # the ledger's row of the running one says so, not a lone "."
            expect(page.get_by_role("row").filter(has_text="running")).to_contain_text(
                re.compile(r"Still running: \d of 3 steps measured"))
        else:  # a page that states no admission must not state a stale one
            assert page.locator("#admission-line").count() == 0, path
        shot(page, f"qualifying-{path.strip('/') or 'dashboard'}")

    engine = page.request.get("/api/v1/engine/").json()
    assert engine["state"] == "ready" and engine["admits_requests"] is False
    assert engine["admission"]["admitting"] is False
    assert REFUSAL.search(engine["admission"]["words"]) and engine["admission"]["refusing_until"]
    assert REFUSAL.search(describe_status(engine))  # `appliance engine status` says it too
    with ThreadPoolExecutor(1) as pool:  # Playwright's loop runs in this thread
        report = pool.submit(asyncio.run, run_doctor(runtime.config, gpus=FakeGpus())).result()
    (check,) = [r for r in report.results if r.id == "engine.state"]
    assert check.level is Level.WARN and REFUSAL.search(check.summary), check

    # Cancelled from its page: the refusal ends everywhere.
    page.get_by_role("navigation", name="main").get_by_role("link", name="Qualification").click()
    page.once("dialog", accept)
    page.get_by_role("button", name="Cancel the qualification").click()
    expect(page.locator("#qualify-status [role=status]")).to_have_count(0, timeout=60_000)
    page.get_by_role("navigation", name="main").get_by_role("link", name="Dashboard").click()
    line = page.locator("#admission-line")
    expect(line).to_have_attribute("data-admitting", "yes")
    expect(line).not_to_contain_text("refusing")
    expect(line).to_contain_text(re.compile(r"admitting up to \d+ at a time"))
    assert page.request.get("/api/v1/engine/").json()["admits_requests"] is True


def accept(dialog: Dialog) -> None:
    dialog.accept()


def wait_ready(page: Page) -> None:
    """Until the engine is READY, asked through the page's own session."""
    wait_until(lambda: page.request.get("/api/v1/engine/").json()["state"] == "ready",
               "the engine to be READY")
