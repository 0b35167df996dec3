"""The create-key form in a real browser: blank again after a key is made, its values kept
after a refusal, and a Copy button that puts the new key on the clipboard.

The form kept the last key's name, owner and limits after creating it (the next key started
as a copy of the last), and the key shown once could only be copied by selecting it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from appliance.runtime import Runtime
from tests.browser_rig import Browser, Page, admin_on, expect
from tests.conftest import LiveServer

pytestmark = pytest.mark.browser


@pytest.fixture
def page(browser: Browser, server: LiveServer, runtime: Runtime) -> Iterator[Page]:
    with admin_on(browser, server, runtime, "API keys", "/keys") as tab:
        tab.context.grant_permissions(["clipboard-read", "clipboard-write"],
                                      origin=server.base_url)
        yield tab


def test_the_form_starts_blank_after_a_key_and_the_key_copies(page: Page) -> None:
    form = page.locator("form[hx-post='/keys']")
    form.get_by_label("Name").fill("support bots")
    form.get_by_label("Requests per minute").fill("not a number")
    form.get_by_role("button", name="Create key").click()
    expect(page.locator("#keys-create-result").get_by_role("alert")).to_be_visible()
    expect(form.get_by_label("Name")).to_have_value("support bots")  # a refusal keeps them
    expect(form.get_by_label("Requests per minute")).to_have_value("not a number")

    form.get_by_label("Requests per minute").fill("60")
    form.get_by_label("Owner").fill("Support team")
    form.get_by_role("button", name="Create key").click()
    new_key = page.get_by_label("New key")
    expect(new_key).to_have_value(re.compile(r"^sk-[0-9a-f]{8}-"))
    for field in ("Name", "Owner", "Requests per minute"):
        expect(form.get_by_label(field)).to_have_value("")

    copy = page.locator("#keys-new button[data-copy]")
    expect(copy).to_have_text("Copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == new_key.input_value()
