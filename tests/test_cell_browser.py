"""The Cell page in a real browser (Debian's chromium, Playwright), on a head with one member
box (two live apps on loopback, tests.test_cell_membership's rig): reached from the
navigation, the member's card fits a desktop and a phone without sideways scrolling, and an
admin's role change answers in the notice area and the card follows it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.browser_rig import Browser, Page, expect, log_in, shot
from tests.conftest import PASSWORD
from tests.test_cell_membership import Box, add, boxes, join_token  # noqa: F401 - a fixture
from tests.test_console_layout import WIDTHS, fits

pytestmark = pytest.mark.browser


@pytest.fixture(params=sorted(WIDTHS))
def head_tab(request: pytest.FixtureRequest, browser: Browser,
             boxes: tuple[Box, Box]) -> Iterator[tuple[Page, Box, Box]]:  # noqa: F811
    head, member = boxes
    add(head, member, join_token(member))
    width, height = WIDTHS[request.param]
    context = browser.new_context(base_url=head.url, viewport={"width": width, "height": height})
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page, head, member
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def test_the_cell_page_fits_and_an_admin_changes_a_members_role(
        head_tab: tuple[Page, Box, Box]) -> None:
    page, head, member = head_tab
    log_in(page, "alice", PASSWORD)
    expect(page).to_have_url(f"{head.url}/")
    page.get_by_role("navigation", name="main").get_by_role("link", name="Cell").click()
    expect(page).to_have_url(f"{head.url}/cell")
    card = page.locator("section", has=page.get_by_role("heading", name="Member 1"))
    expect(card).to_contain_text(member.url)
    expect(card).to_contain_text("stopped")  # the watch has read the member
    width = page.viewport_size["width"] if page.viewport_size else 0
    assert not fits(page, f"/cell at {width} px")
    shot(page, f"cell-{width}")

    card.get_by_role("button", name="Make it decode…").click()
    notice = page.locator("#cell-notice")
    expect(notice).to_contain_text("Member 1: role decode kept; the engine takes it at its "
                                   "next start.")
    expect(card.locator("dd").nth(1)).to_have_text("decode")  # the card follows its watch
    assert not fits(page, f"/cell with a notice at {width} px")
