"""Every console page fits a desktop (1440 px) and a phone (390 px) without sideways scrolling.

The server rig is `tests.test_health_api`'s (eight fake GPUs, one hot, a serving engine, the
real monitor) with an hour of samples, every check run, and rows on the events, audit and
keys pages, so the tables are as wide as real ones. Alice logs in once per width and walks
every page; on each, `document.documentElement.scrollWidth` must not exceed the window's
width: a wide table scrolls inside its own box (`.scroll`, `.card`), never the page. On each
page, at both widths, nothing that carries a verdict or an action (a badge, an element marked
`data-verdict`, a table's buttons, links, inputs and summaries) lies past the window's edge,
so none is cut off inside a scrolled card (on a phone a table's rows stack), and every link
of the main navigation is in view (on a phone it wraps onto more rows). The tuning chart fits
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
from tests.test_qualify_ledger import record_done
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

# What an operator must see without sideways scrolling: verdicts and actions. A horizontal
# position does not depend on the vertical scroll, but each element is scrolled into view
# vertically (never sideways) as a person would, before its box is read.
CUT = """() => {
  const inner = window.innerWidth;
  const marked = '[data-verdict], main .badge, main table button, main table a[href], '
    + 'main table input:not([type=hidden]), main table select, main table summary';
  const name = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '')
    + ' "' + (el.textContent || el.value || '').trim().replace(/\\s+/g, ' ').slice(0, 30) + '"';
  const cut = [];
  for (const el of document.querySelectorAll(marked)) {
    let box = el.getBoundingClientRect();
    if (box.width === 0 && box.height === 0) continue;  // folded away (a closed details)
    window.scrollTo(window.scrollX, window.scrollY + box.top - 40);
    box = el.getBoundingClientRect();
    if (box.left < -1 || box.right > inner + 1)
      cut.push(`${name(el)} at ${Math.round(box.left)}..${Math.round(box.right)} px`);
  }
  window.scrollTo(0, 0);
  const nav = [...document.querySelectorAll('nav[aria-label=main] a')];
  const unreachable = nav.filter(a => {
    const box = a.getBoundingClientRect();
    return box.width === 0 || box.left < -1 || box.right > inner + 1;
  }).map(a => a.textContent.trim());
  return {cut: cut.slice(0, 8), links: nav.length, unreachable};
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
    missing: list[str] = []  # e.g. /favicon.ico, asked by the browser on every page
    page.on("response", lambda answer: answer.status == 404 and missing.append(answer.url))
    yield page
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"
    assert not missing, f"answered 404: {missing}"


def fits(page: Page, label: str) -> list[str]:
    """[] when the page is no wider than its window, else one line saying what sticks out."""
    found = page.evaluate(OVERFLOW)
    if found["scroll"] <= found["inner"]:
        return []
    return [f"{label}: the page is {found['scroll']} px wide in a {found['inner']} px window; "
            f"outermost elements past the edge: {found['wide']}"]


def in_view(page: Page, label: str) -> list[str]:
    """[] when every verdict and action and every main navigation link is within the window."""
    found = page.evaluate(CUT)
    problems = [f"{label}: cut off past the window's edge: {found['cut']}"] if found["cut"] else []
    if found["links"] != 12 or found["unreachable"]:
        problems.append(f"{label}: {found['links']} navigation links, out of view: "
                        f"{found['unreachable']}")
    return problems


@pytest.fixture
def qualified(seeded: Runtime) -> str:
    """A finished qualification's page: its step table has ten columns."""
    record = record_done(seeded.db, "f1b31ec6ffdf" + "0" * 52)
    return f"/qualify/{record.id}"


# Health's "What it found" wrapped to a word a line on a phone (a 52rem table squeezed).
FOUND_WIDTH = """() => Math.min(10000, ...[...document.querySelectorAll(
  'table.health-checks td:nth-child(3)')].map(td => td.getBoundingClientRect().width)
  .filter(w => w > 0))"""


# At 1440 px the step table's last columns (failures, KV and state peaks) were past its box.
STEPS_FIT = """() => [...document.querySelectorAll('table.qualify-steps')]
  .filter(t => t.scrollWidth > t.parentElement.clientWidth + 1)
  .map(t => `${t.scrollWidth} px in ${t.parentElement.clientWidth} px`)"""


def test_every_page_fits_its_window(tab: Page, server: LiveServer, qualified: str) -> None:
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
    icon = tab.evaluate("document.querySelector('link[rel=icon]').href")
    answer = tab.request.get(icon)
    assert answer.status == 200 and answer.headers["content-type"].startswith("image/svg")
    for path in (*PAGES, qualified):
        tab.goto(path)
        expect(tab.locator("main h1").first).to_be_visible()
        tab.wait_for_load_state("networkidle")
        problems += fits(tab, f"{path} at {width} px") + in_view(tab, f"{path} at {width} px")
        narrow = tab.evaluate(FOUND_WIDTH)
        if narrow < min(width * 0.5, 300):
            problems.append(f"{path} at {width} px: a check's findings are {narrow} px wide "
                            "(a word a line)")
        if width >= 1440 and (cut := tab.evaluate(STEPS_FIT)):
            problems.append(f"{path} at {width} px: the step table is cut: {cut}")
        shot(tab, f"layout-{width}{path.replace('/', '-') or '-dashboard'}")
    assert not problems, "\n".join(problems)


def test_every_navigation_link_is_in_view_and_works(tab: Page, server: LiveServer) -> None:
    log_in(tab, "alice", PASSWORD)
    expect(tab).to_have_url(f"{server.base_url}/")
    nav = tab.get_by_role("navigation", name="main")
    links = nav.get_by_role("link")
    expect(links).to_have_count(12)
    for i in range(12):
        expect(links.nth(i)).to_be_in_viewport()
    nav.get_by_role("link", name="Settings").click()  # the last link, no sideways scroll
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
