"""The browser rig every browser test shares: Debian's chromium driven by Playwright (sync API).

Importing it skips the importing test module when /usr/bin/chromium or Playwright is missing,
unless TEST_APPLIANCE_REQUIRE_BROWSER is set (CI sets it), in which case that is a failure.
So a browser test imports Playwright's names from here, not from Playwright, and needs no
checks of its own. The `browser` fixture (one chromium per module) is conftest's, built with
`launch_chromium`. With APPLIANCE_SHOTS set, `shot` writes screenshots to
/tmp/appliance-shots/.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.runtime import Runtime
from tests.conftest import PASSWORD, LiveServer, add_admin

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS_DIR = Path("/tmp/appliance-shots")


def unavailable(reason: str) -> None:
    """Skip the importing module, or fail it when the environment promises a browser."""
    if os.environ.get("TEST_APPLIANCE_REQUIRE_BROWSER"):
        pytest.fail(f"TEST_APPLIANCE_REQUIRE_BROWSER is set but {reason}", pytrace=False)
    pytest.skip(f"browser tests skipped: {reason}", allow_module_level=True)


if not CHROMIUM.exists():
    unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
try:
    from playwright.sync_api import (
        Browser,
        BrowserContext,
        Dialog,
        Page,
        expect,
        sync_playwright,
    )
except ImportError:  # pragma: no cover - depends on the environment
    unavailable("Playwright for Python is not installed (pip install -e '.[dev]')")

__all__ = [
    "CHROMIUM",
    "CHROMIUM_ARGS",
    "Browser",
    "BrowserContext",
    "Dialog",
    "Page",
    "admin_on",
    "expect",
    "launch_chromium",
    "log_in",
    "mark_document",
    "same_document",
    "shot",
    "unavailable",
]

# Upper bound for auto-waiting assertions (argon2 and a loaded CI box can be slow); never a
# sleep: expect() returns as soon as the condition holds.
expect.set_options(timeout=15_000)


@contextlib.contextmanager
def launch_chromium() -> Iterator[Browser]:
    """One headless chromium (contexts keep the tests apart)."""
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def log_in(page: Page, username: str, password: str) -> None:
    """Fill and submit the login form as a person would."""
    page.goto("/login")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password", exact=True).fill(password)
    page.get_by_role("button", name="Log in").click()


@contextlib.contextmanager
def admin_on(browser: Browser, server: LiveServer, runtime: Runtime, link: str,
             path: str) -> Iterator[Page]:
    """Alice, logged in, on `path` reached through the nav's `link`; any uncaught JavaScript
    error fails the test."""
    context = browser.new_context(base_url=server.base_url,
                                  viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    add_admin(runtime, "alice", PASSWORD)
    log_in(tab, "alice", PASSWORD)
    expect(tab).to_have_url(f"{server.base_url}/")
    tab.get_by_role("navigation", name="main").get_by_role("link", name=link).click()
    expect(tab).to_have_url(f"{server.base_url}{path}")
    expect(tab.get_by_role("heading", name=link, level=1)).to_be_visible()
    yield tab
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def shot(page: Page, name: str) -> None:
    """Save a full-page screenshot when APPLIANCE_SHOTS is set (for looking at the layout)."""
    if os.environ.get("APPLIANCE_SHOTS"):
        SHOTS_DIR.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS_DIR / f"{name}.png"), full_page=True)


def mark_document(page: Page) -> None:
    """Tag the current document; `same_document` tells later whether it was replaced."""
    page.evaluate("window.__applianceMark = 'kept'")


def same_document(page: Page) -> bool:
    return bool(page.evaluate("window.__applianceMark === 'kept'"))
