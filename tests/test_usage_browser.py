"""The Usage page in a real browser, over real loopback HTTP.

The history is `tests.test_usage_api.seed`'s: key "alpha" busy this morning, key "beta" three
days ago. From the nav, the page shows the last 24 hours (alpha, no beta); picking "Last 7
days" swaps the report through htmx without a reload, beta appears, the chart follows and the
URL is pushed. Back in the browser's history restores the 24-hour view.

The browser rig is `tests/browser_rig.py`'s. With APPLIANCE_SHOTS set, screenshots go to
/tmp/appliance-shots/usage-*.png.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from appliance.runtime import Runtime
from tests.browser_rig import Browser, Page, admin_on, expect, mark_document, same_document, shot
from tests.conftest import LiveServer
from tests.test_usage_api import seed

pytestmark = pytest.mark.browser


@pytest.fixture
def page(browser: Browser, server: LiveServer, runtime: Runtime) -> Iterator[Page]:
    """Alice, logged in, on /usage (reached through the nav), with a history recorded."""
    seed(runtime)
    with admin_on(browser, server, runtime, "Usage", "/usage") as tab:
        yield tab


def test_switching_the_range_swaps_the_report(page: Page, server: LiveServer) -> None:
    report = page.locator("#usage-report")
    table = report.locator("#usage-keys tbody")
    chart = report.locator("svg.usage-chart")
    expect(report.get_by_role("heading", name="Last 24 hours · all keys")).to_be_visible()
    expect(table.locator("tr")).to_have_count(2)
    expect(table).to_contain_text("alpha")
    expect(table).not_to_contain_text("beta")
    expect(chart).to_have_attribute("data-buckets", "24")
    expect(report.locator("#usage-requests")).to_have_text("5")
    shot(page, "usage-24h")
    mark_document(page)

    page.get_by_label("Range").select_option("7d")
    expect(report.get_by_role("heading", name="Last 7 days · all keys")).to_be_visible()
    expect(table.locator("tr")).to_have_count(3)
    expect(table.locator("tr").nth(1)).to_contain_text("beta")
    expect(chart).to_have_attribute("data-buckets", "7")
    expect(report.locator("#usage-requests")).to_have_text("6")
    expect(page).to_have_url(f"{server.base_url}/usage?range=7d")
    expect(report.get_by_role("link", name="Daily totals")).to_have_attribute(
        "href", "/api/v1/usage/export.csv?granularity=day&range=7d")
    assert same_document(page)  # swapped by htmx, not reloaded
    shot(page, "usage-7d")

    page.go_back()
    expect(page).to_have_url(f"{server.base_url}/usage")
    expect(report.get_by_role("heading", name="Last 24 hours · all keys")).to_be_visible()
    expect(table).not_to_contain_text("beta")
