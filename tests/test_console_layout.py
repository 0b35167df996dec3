"""Every console page fits a desktop (1440 px) and a phone (390 px) without sideways scrolling.

The server rig is `tests.test_health_api`'s (eight fake GPUs, one hot, a serving engine, the
real monitor) with an hour of samples, every check run, and rows on the events, audit and
keys pages, so the tables are as wide as real ones. Alice logs in once per width and walks
every page; on each, `document.documentElement.scrollWidth` must not exceed the window's
width: a wide table scrolls inside its own box (`.scroll`, `.card`), never the page. On a phone
the main navigation stays one row that scrolls inside the header, and the tuning chart fits
its card with the recommended marker in view.

No screenshots are written into the repository (APPLIANCE_SHOTS writes them to /tmp).
"""

# The server rig's fixtures are imported from tests.test_health_api; the tests name them again.
# ruff: noqa: F811

from __future__ import annotations

from collections.abc import Iterator

import pytest

from appliance.runtime import Runtime
from tests.browser_rig import Browser, Page, expect, log_in, shot
from tests.conftest import PASSWORD, LiveServer, add_admin
from tests.test_health_api import gpus, runtime, seed_hour  # noqa: F401 - fixtures
from tests.test_tuning_api import write_k3
from tests.test_units_of_measure import seed_rows

pytestmark = pytest.mark.browser

PAGES = ("/", "/engine", "/weights", "/tuning", "/qualify", "/usage", "/keys", "/health",
         "/cell", "/events", "/audit", "/settings", "/account/password")
WIDTHS = {"desktop": (1440, 900), "phone": (390, 844)}

OVERFLOW = """() => {
  const edge = window.innerWidth + 1;
  const past = el => el.getBoundingClientRect().right > edge;
  // The outermost elements past the window's edge: where a fix belongs.
  const wide = [...document.querySelectorAll('body *')]
    .filter(el => past(el) && !past(el.parentElement))
    .slice(0, 5).map(el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '')
                      + (el.className && typeof el.className === 'string'
                         ? '.' + el.className.trim().replace(/ +/g, '.') : ''));
  return {scroll: document.documentElement.scrollWidth, inner: window.innerWidth, wide};
}"""


@pytest.fixture
def seeded(runtime: Runtime, server: LiveServer) -> Runtime:
    seed_hour(runtime)
    seed_rows(runtime)
    write_k3(runtime.config)  # the Tuning page has its chart
    add_admin(runtime, "alice", PASSWORD)
    return runtime


@pytest.fixture(params=sorted(WIDTHS))
def tab(request: pytest.FixtureRequest, browser: Browser, server: LiveServer,
        seeded: Runtime) -> Iterator[Page]:
    width, height = WIDTHS[request.param]
    context = browser.new_context(base_url=server.base_url,
                                  viewport={"width": width, "height": height})
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def fits(page: Page, label: str) -> list[str]:
    """[] when the page is no wider than its window, else one line saying what sticks out."""
    found = page.evaluate(OVERFLOW)
    if found["scroll"] <= found["inner"]:
        return []
    return [f"{label}: the page is {found['scroll']} px wide in a {found['inner']} px window; "
            f"outermost elements past the edge: {found['wide']}"]


def test_every_page_fits_its_window(tab: Page, server: LiveServer) -> None:
    width = tab.viewport_size["width"] if tab.viewport_size else 0
    tab.goto("/login")
    login = fits(tab, f"/login at {width} px")
    log_in(tab, "alice", PASSWORD)
    expect(tab).to_have_url(f"{server.base_url}/")
    tab.goto("/health")  # every check once, so the dashboard's GPU table is full
    tab.get_by_role("button", name="Check now").click()
    expect(tab.locator("#health-board").get_by_role("status")).to_have_text(
        "Every check ran just now.")
    problems = login
    for path in PAGES:
        tab.goto(path)
        expect(tab.locator("main h1").first).to_be_visible()
        tab.wait_for_load_state("networkidle")
        problems += fits(tab, f"{path} at {width} px")
        shot(tab, f"layout-{width}{path.replace('/', '-') or '-dashboard'}")
    assert not problems, "\n".join(problems)


def test_on_a_phone_the_navigation_is_one_row(tab: Page, server: LiveServer) -> None:
    log_in(tab, "alice", PASSWORD)
    expect(tab).to_have_url(f"{server.base_url}/")
    nav = tab.get_by_role("navigation", name="main")
    links = nav.get_by_role("link")
    expect(links).to_have_count(12)
    tops = {round(box["y"]) for box in (links.nth(i).bounding_box() for i in range(12)) if box}
    assert len(tops) == 1, f"the navigation wraps onto {len(tops)} rows"
    nav.get_by_role("link", name="Settings").click()  # the last link is reachable
    expect(tab).to_have_url(f"{server.base_url}/settings")


def test_the_tuning_chart_fits_with_the_recommended_marker_in_view(tab: Page) -> None:
    log_in(tab, "alice", PASSWORD)
    tab.goto("/tuning")
    chart = tab.locator(".tuning-figure-chart svg").first
    expect(chart).to_be_visible()
    box = chart.bounding_box()
    viewport = tab.viewport_size
    assert box is not None and viewport is not None
    assert box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"] + 1, (box, viewport)
    mark = chart.locator("line.recommended").bounding_box()
    assert mark is not None and box["x"] <= mark["x"] <= box["x"] + box["width"]
    assert 0 <= mark["x"] <= viewport["width"], (mark, viewport)
