"""The console in a real browser: Debian's chromium driven by Playwright (sync API).

Covers what only a browser proves: redirects and cookies across a whole flow, the forms as
rendered, htmx swaps and pushed URLs, hx-confirm dialogs. Each test gets its own live server
(the `server` fixture) and a fresh browser context (no shared cookies); the browser process
itself is shared by the module.

The rig (skip rules, chromium flags, the login and navigation helpers) is
`tests/browser_rig.py`, shared by every browser test. With APPLIANCE_SHOTS set, screenshots of
the dashboard and the settings page are written to /tmp/appliance-shots/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy.orm import Session

from appliance import __version__
from appliance.auth.accounts import authenticate
from appliance.auth.tokens import list_tokens
from appliance.db.journal import AuditRecord, add_audit, list_audit
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from tests.browser_rig import (
    Browser,
    BrowserContext,
    Dialog,
    Page,
    expect,
    log_in,
    mark_document,
    same_document,
    shot,
)
from tests.conftest import PASSWORD, LiveServer, add_admin

NEW_PASSWORD = "a new passphrase of my own"
TOKEN_RE = re.compile(r"^apt_[0-9a-f]{8}_[A-Za-z0-9_-]{43}$")


@pytest.fixture
def context(browser: Browser, server: LiveServer) -> Iterator[BrowserContext]:
    """A fresh browser profile (no cookies) pointed at this test's live server."""
    ctx = browser.new_context(base_url=server.base_url, viewport={"width": 1280, "height": 900})
    ctx.set_default_timeout(15_000)
    yield ctx
    ctx.close()


@pytest.fixture
def page(context: BrowserContext) -> Iterator[Page]:
    """A tab that fails the test on any uncaught JavaScript error (htmx included)."""
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    assert not errors, f"JavaScript errors in the page: {errors}"


@pytest.fixture
def alice(runtime: Runtime, page: Page, server: LiveServer) -> Page:
    """The page, logged in as admin `alice` (password already chosen) through the form."""
    add_admin(runtime, "alice", PASSWORD)
    log_in(page, "alice", PASSWORD)
    expect(page).to_have_url(f"{server.base_url}/")
    return page


def audit_entries(runtime: Runtime, *, action: str, outcome: str) -> list[AuditRecord]:
    """The audit log as stored (not as the page shows it), newest first."""
    return runtime.db.call(
        lambda s: list_audit(s, action=action, outcome=outcome, per_page=500)).items


def test_bootstrap_admin_logs_in_changes_password_and_reaches_dashboard(
    runtime: Runtime, page: Page, server: LiveServer
) -> None:
    """The first-login path: login, forced password change, dashboard, both steps audited."""
    add_admin(runtime, "admin", PASSWORD, must_change=True)
    base = server.base_url

    page.goto(base)
    expect(page).to_have_url(f"{base}/login")
    page.get_by_label("Username").fill("admin")
    page.get_by_label("Password", exact=True).fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()

    expect(page).to_have_url(f"{base}/account/password")
    expect(page.get_by_role("heading", name="Change password")).to_be_visible()
    expect(page.locator(".notice")).to_contain_text("one-time or reset password")
    # Anything else is refused until the password is changed.
    page.goto("/audit")
    expect(page).to_have_url(f"{base}/account/password")

    page.get_by_label("Current password").fill(PASSWORD)
    page.get_by_label(re.compile(r"^New password")).fill(NEW_PASSWORD)
    page.get_by_label("Repeat the new password").fill(NEW_PASSWORD)
    page.get_by_role("button", name="Change password").click()

    expect(page).to_have_url(f"{base}/")
    expect(page.get_by_role("heading", name="Dashboard", level=1)).to_be_visible()
    control = page.locator("section.card").filter(
        has=page.get_by_role("heading", name="Control plane"))
    expect(control).to_be_visible()
    expect(control.locator("dd").first).to_have_text(__version__)
    expect(page.locator("header.top .whoami")).to_contain_text("admin")
    shot(page, "dashboard")

    page.get_by_role("navigation", name="main").get_by_role("link", name="Audit").click()
    expect(page).to_have_url(f"{base}/audit")
    rows = page.locator("#audit-rows tbody tr")
    login_row = rows.filter(has_text="Logged in")  # auth.login, in words
    change_row = rows.filter(has_text="Password changed")  # auth.password_change
    expect(login_row).to_have_count(1)
    expect(login_row).to_contain_text("admin")
    expect(login_row.locator("td").nth(5)).to_have_text("ok")
    expect(change_row).to_have_count(1)
    expect(change_row.locator("td").nth(5)).to_have_text("ok")

    changed = runtime.db.call(lambda s: authenticate(s, "admin", NEW_PASSWORD))
    assert changed is not None and not changed.must_change_password


def test_wrong_password_is_refused_and_audited(
    runtime: Runtime, page: Page, context: BrowserContext, server: LiveServer
) -> None:
    """A wrong password shows the error, stays on /login, sets no session, is audited."""
    add_admin(runtime, "alice", PASSWORD)

    log_in(page, "alice", "not the password at all")

    expect(page.get_by_role("alert")).to_have_text("Wrong username or password.")
    expect(page).to_have_url(f"{server.base_url}/login")
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    assert not [c for c in context.cookies() if c["name"] == "appliance_session"]

    failed = audit_entries(runtime, action="auth.login", outcome="failed")
    assert [(a.actor, a.target) for a in failed] == [("alice", "alice")]
    assert not audit_entries(runtime, action="auth.login", outcome="ok")


def test_audit_filter_swaps_rows_with_htmx(runtime: Runtime, alice: Page) -> None:
    """Choosing an outcome refreshes #audit-rows in place and pushes the filtered URL."""
    now = runtime.clock.now()

    def seed(session: Session) -> None:
        for actor, outcome in [("mallory", "failed"), ("bob", "denied"), ("eve", "failed")]:
            add_audit(session, at=now, actor=actor, action="auth.login", outcome=outcome,
                      target=actor)

    runtime.db.call(seed)
    page = alice
    page.goto("/audit")
    rows = page.locator("#audit-rows tbody tr")
    expect(rows).to_have_count(4)  # alice's own login, and the three seeded entries
    mark_document(page)

    with page.expect_response(
        lambda r: "/audit?" in r.url and r.request.headers.get("hx-request") == "true"
    ):
        page.get_by_label("Outcome").select_option("failed")

    expect(page).to_have_url(re.compile(r"/audit\?.*\boutcome=failed\b"))
    expect(rows).to_have_count(2)
    expect(rows.locator("td:nth-child(6)")).to_have_text(["failed", "failed"])
    expect(rows.locator("td:nth-child(2)")).to_have_text(["eve", "mallory"])
    assert same_document(page), "the filter reloaded the whole page instead of swapping rows"
    expect(page.get_by_role("heading", name="Audit log")).to_have_count(1)


def test_htmx_request_after_session_expiry_goes_to_login_and_back(
    runtime: Runtime, clock: FakeClock, alice: Page, server: LiveServer
) -> None:
    """An htmx swap on an expired session sends the whole tab to /login, then back."""
    page = alice
    page.goto("/audit")
    expect(page.locator("#audit-rows tbody tr")).to_have_count(1)
    idle = runtime.config.auth.session_idle_minutes * 60
    clock.advance(idle + 1)

    page.get_by_label("Outcome").select_option("failed")

    expect(page).to_have_url(f"{server.base_url}/login?next=/audit")
    expect(page.locator("#audit-rows")).to_have_count(0)
    page.get_by_label("Username").fill("alice")
    page.get_by_label("Password", exact=True).fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(f"{server.base_url}/audit")
    expect(page.get_by_role("heading", name="Audit log")).to_be_visible()


def test_api_token_created_shown_once_used_and_revoked(
    alice: Page, server: LiveServer
) -> None:
    """Create a token in the console, call the API with it, see it hidden, revoke it."""
    page = alice
    page.goto("/settings")
    tokens = page.locator("#tokens")
    expect(tokens.get_by_text("No tokens yet.")).to_be_visible()
    mark_document(page)

    tokens.get_by_label("Name").fill("ci script")
    tokens.get_by_role("button", name="Create token").click()

    shown = page.locator("#new-token")
    expect(shown).to_have_text(TOKEN_RE)
    token = shown.inner_text()
    prefix = token.split("_")[1]
    assert same_document(page), "creating a token reloaded the page instead of swapping #tokens"
    row = tokens.locator("tbody tr").filter(has_text=prefix)
    expect(row).to_contain_text("ci script")
    expect(row).to_contain_text("active")
    shot(page, "settings-new-token")

    with httpx.Client(base_url=server.base_url, timeout=10) as api:
        bearer = {"Authorization": f"Bearer {token}"}
        me = api.get("/api/v1/me", headers=bearer)
        assert me.status_code == 200, me.text
        assert me.json() == {"username": "alice", "auth": "token", "must_change_password": False,
                             "role": "admin"}

        page.reload()
        expect(row).to_be_visible()
        expect(page.locator("#new-token")).to_have_count(0)
        assert token not in page.content()
        last_used = row.locator("td").nth(4)
        expect(last_used).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$"))
        shot(page, "settings")

        dialogs: list[str] = []

        def accept(dialog: Dialog) -> None:
            dialogs.append(dialog.message)
            dialog.accept()

        page.on("dialog", accept)
        row.get_by_role("button", name="Revoke").click()
        expect(row.locator("td").nth(6)).to_have_text("revoked")
        expect(row.get_by_role("button", name="Revoke")).to_have_count(0)
        assert dialogs == [f"Revoke token {prefix} (ci script)?"]

        refused = api.get("/api/v1/me", headers=bearer)
        assert refused.status_code == 401, refused.text


def test_logout_ends_the_session(alice: Page, context: BrowserContext, server: LiveServer) -> None:
    """The header's Log out ends the session server-side; / then redirects to /login."""
    page = alice
    base = server.base_url
    cookie = next(c["value"] for c in context.cookies() if c["name"] == "appliance_session")

    page.locator("header.top").get_by_role("button", name="Log out").click()
    expect(page).to_have_url(f"{base}/login")

    page.goto("/")
    expect(page).to_have_url(f"{base}/login")
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    # The old cookie is dead on the server too, not merely deleted from the browser.
    with httpx.Client(base_url=base, timeout=10, cookies={"appliance_session": cookie}) as replay:
        response = replay.get("/")
    assert response.status_code == 303
    assert response.headers["location"] == "/login"


@pytest.mark.browser
def test_a_refused_form_shows_its_reason(alice: Page, runtime: Runtime) -> None:
    """A 4xx answer to an htmx form is shown where the form is, not silently dropped."""
    page = alice
    page.goto("/settings")
    tokens = page.locator("#tokens")
    tokens.get_by_label("Name").fill("ok name")
    tokens.get_by_label("Expires in days").fill("-3")
    tokens.get_by_role("button", name="Create token").click()
    expect(tokens.get_by_role("alert")).to_contain_text("whole number of days")
    assert runtime.db.call(list_tokens) == []
