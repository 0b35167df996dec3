"""The API keys page in a real browser, over real loopback HTTP.

From the nav: create a key with a limit and see it once — in a read-only field, focused and
selected for copying, with the warning — and its row appear without a reload; reload and the
key is gone for good; edit the row's limits in place; revoke it through the browser's confirm
dialog and see its badge turn; the audit log has all three, `via: console`.

The browser rig is `tests/browser_rig.py`'s. With APPLIANCE_SHOTS set, screenshots go to
/tmp/appliance-shots/keys-*.png.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from appliance.db.journal import list_audit
from appliance.gateway.keys import KEY_RE, KeyLimits, list_keys
from appliance.runtime import Runtime
from tests.browser_rig import Browser, Dialog, Page, admin_on, expect, shot
from tests.conftest import LiveServer, wait_for

pytestmark = pytest.mark.browser


@pytest.fixture
def page(browser: Browser, server: LiveServer, runtime: Runtime) -> Iterator[Page]:
    """Alice, logged in, on /keys (reached through the nav)."""
    with admin_on(browser, server, runtime, "API keys", "/keys") as tab:
        yield tab


def test_create_a_key_see_it_once_edit_its_limits_and_revoke_it(
    page: Page, runtime: Runtime
) -> None:
    expect(page.locator("#keys-table")).to_contain_text("No keys yet")
    page.evaluate("window.__kept = 'yes'")  # gone if the page reloads

    form = page.locator("form[hx-post='/keys']")
    form.get_by_label("Name").fill("support bots")
    form.get_by_label("Owner").fill("Support team")
    form.get_by_label("Requests per minute").fill("60")
    form.get_by_role("button", name="Create key").click()

    new_key = page.get_by_label("New key")
    expect(new_key).to_have_value(re.compile(r"^sk-[0-9a-f]{8}-[A-Za-z0-9_-]{43}$"))
    expect(new_key).to_have_attribute("readonly", "")
    expect(new_key).to_be_focused()  # selected, ready to copy
    # The browser's own autofocus can land a frame before htmx's settle step selects the
    # text, so wait for the selection rather than reading it once.
    # (Polled with evaluate: wait_for_function evaluates a string, which the page's CSP
    # forbids.)
    wait_for(lambda: page.evaluate(
        "(e => e.id === 'new-key' && e.selectionStart === 0"
        " && e.selectionEnd === e.value.length)(document.activeElement)"),
        "the new key to be selected", timeout=10)
    key = new_key.input_value()
    match = KEY_RE.match(key)
    assert match
    prefix = match.group(1)
    status = page.get_by_role("status")
    expect(status).to_contain_text(f"Key {prefix} (support bots) created.")
    expect(status).to_contain_text("it is shown only this once and cannot be recovered")
    row = page.locator(f"#key-{prefix}")
    expect(row).to_contain_text("Support team")
    expect(row.locator(".key-status")).to_have_text("active")
    expect(row).to_contain_text("60 requests/min")
    assert page.evaluate("window.__kept") == "yes"  # no reload: htmx swapped it in
    shot(page, "keys-created")

    # Shown once: after a reload, the key is nowhere on the page.
    page.reload()
    expect(page.locator(f"#key-{prefix}")).to_be_visible()
    expect(page.get_by_label("New key")).to_have_count(0)
    assert key not in page.content()

    # Edit the limits in the row.
    row = page.locator(f"#key-{prefix}")
    row.get_by_role("button", name=f"Edit the limits of key {prefix}").click()
    editor = page.get_by_role("form", name=f"Limits of key {prefix}")
    expect(editor.get_by_label("Requests per minute")).to_have_value("60")
    editor.get_by_label("Max tokens per request").fill("4096")
    editor.get_by_label("Requests per minute").fill("")
    editor.get_by_role("button", name="Save limits").click()
    row = page.locator(f"#key-{prefix}")
    expect(row.locator(".key-limits")).to_contain_text("max_tokens 4,096")
    expect(row.locator(".key-limits")).not_to_contain_text("requests/min")
    expect(row.get_by_role("status")).to_have_text("(saved)")
    assert runtime.db.call(list_keys)[0].limits == KeyLimits(None, None, None, 4096)

    # Revoke, through the confirm dialog.
    dialogs: list[str] = []

    def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    row.get_by_role("button", name=f"Revoke key {prefix}").click()
    expect(page.locator(f"#key-{prefix} .key-status")).to_have_text("revoked")
    assert dialogs == [f"Revoke key {prefix} (support bots)? Its users are refused within a "
                       "second; this cannot be undone."]
    expect(page.locator(f"#key-{prefix}")).to_contain_text("by alice")
    expect(page.get_by_role("button", name=f"Revoke key {prefix}")).to_have_count(0)
    shot(page, "keys-revoked")
    [info] = runtime.db.call(list_keys)
    assert info.revoked_at is not None and info.revoked_by == "alice"
    entries = runtime.db.call(lambda s: list_audit(s, action="keys.")).items
    assert [(a.action, a.actor, a.target, a.detail["via"]) for a in reversed(entries)] == [
        ("keys.create", "alice", prefix, "console"), ("keys.limits", "alice", prefix, "console"),
        ("keys.revoke", "alice", prefix, "console")]
