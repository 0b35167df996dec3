"""The dashboard's health part and the Health page in a real browser, over real loopback HTTP.

The server rig is `tests.test_health_api`'s (eight fake GPUs, GPU 3 at 95 °C, a serving
engine, the real monitor) with an hour of samples. Alice logs in and lands on the dashboard:
the overall status is CRITICAL naming the hot GPU, its row is marked, the sparklines are drawn.
On the Health page (through the nav) she runs the checks, mutes the hot GPU's check for 24
hours with a reason — an htmx swap, no reload — and sees it muted and the box no longer
CRITICAL; back on the dashboard it is no longer listed. Then she unmutes it.

The browser rig is `tests/browser_rig.py`'s. With APPLIANCE_SHOTS set, screenshots go to
/tmp/appliance-shots/health-*.png.
"""

# The server rig's fixtures are imported from tests.test_health_api; the tests name them again.
# ruff: noqa: F811

from __future__ import annotations

from collections.abc import Iterator

import pytest

from appliance.runtime import Runtime
from tests.browser_rig import Browser, Page, admin_on, expect, mark_document, same_document, shot
from tests.conftest import LiveServer
from tests.test_health_api import HOT, gpus, runtime, seed_hour  # noqa: F401 - fixtures

pytestmark = pytest.mark.browser
HOT_ID = f"gpu.{HOT}.temperature"


@pytest.fixture
def page(browser: Browser, server: LiveServer, runtime: Runtime) -> Iterator[Page]:
    """Alice, logged in, on /health (reached through the nav), with an hour of samples."""
    seed_hour(runtime)
    with admin_on(browser, server, runtime, "Health", "/health") as tab:
        yield tab


def test_mute_a_check_and_see_it_everywhere(page: Page, server: LiveServer) -> None:
    board = page.locator("#health-board")
    page.get_by_role("button", name="Check now").click()
    expect(board.get_by_role("status")).to_have_text("Every check ran just now.")
    row = board.locator(f'tr[data-check="{HOT_ID}"]')
    expect(row).to_contain_text("CRITICAL")
    expect(row).to_contain_text("95 °C")
    expect(page.locator("#health-overall")).to_have_text("CRITICAL")
    shot(page, "health-page")

    # The dashboard: overall CRITICAL naming the hot GPU, its row marked, sparklines drawn.
    page.get_by_role("navigation", name="main").get_by_role("link", name="Dashboard").click()
    expect(page.locator("#overall-status")).to_have_text("CRITICAL")
    expect(page.locator("#overall-failing")).to_contain_text(f"GPU {HOT} temperature")
    hot = page.locator(f'#gpu-table tr[data-gpu="{HOT}"]')
    expect(hot).to_have_class("level-critical")
    expect(hot.locator("td.level-critical")).to_have_text("95 °C")
    expect(page.locator("#gpu-table tbody tr")).to_have_count(8)
    sparks = page.locator("svg.sparkline")
    expect(sparks).to_have_count(8 * 3 + 2)
    expect(page.locator(f'#gpu-sparks tr[data-gpu="{HOT}"] svg.sparkline').first
           ).to_have_attribute("data-segments", "2")  # the gap in the seeded hour
    expect(page.get_by_role("img", name=f"GPU {HOT} temperature, last hour:", exact=False)
           ).to_be_visible()
    shot(page, "health-dashboard")

    # Mute it from the Health page.
    page.get_by_role("navigation", name="main").get_by_role("link", name="Health").click()
    expect(page).to_have_url(f"{server.base_url}/health")
    mark_document(page)
    row.get_by_text("Mute…").click()
    row.get_by_label("How long").select_option("24h")
    row.get_by_label("Reason").fill("fan swap on Tuesday")
    row.get_by_role("button", name=f"Mute GPU {HOT} temperature").click()
    expect(row).to_have_class("level-critical muted-check")
    expect(row).to_contain_text("Muted until")
    expect(row).to_contain_text("by alice")
    expect(row).to_contain_text("fan swap on Tuesday")
    expect(page.locator("#health-overall")).not_to_have_text("CRITICAL")
    assert same_document(page)  # swapped by htmx, not reloaded
    shot(page, "health-muted")

    page.get_by_role("navigation", name="main").get_by_role("link", name="Dashboard").click()
    expect(page.locator("#overall-status")).not_to_have_text("CRITICAL")
    expect(page.locator(".dashboard-overall")).to_contain_text("1 muted check not counted")

    page.get_by_role("navigation", name="main").get_by_role("link", name="Health").click()
    row.get_by_role("button", name=f"Unmute GPU {HOT} temperature").click()
    expect(row).not_to_contain_text("Muted until")
    expect(page.locator("#health-overall")).to_have_text("CRITICAL")
