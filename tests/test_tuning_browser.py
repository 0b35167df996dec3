"""The Tuning page in a real browser, over real loopback HTTP.

The dev box has K3's `config.json` in its model folder and no engine start yet (the budget is
an estimate, and the page says so). From the page: pick a profile and watch the panel, the
recommendation and the chart change without a reload (and the URL follow); start a custom
profile from a built-in, see the draft previewed while typing, create it; apply its
recommended split in a maintenance window through the confirmation that states the restart's
cost; then find the apply and the scheduled restart on the Audit page. A second test edits a
custom profile with an inline refusal, then deletes it through the browser's confirm dialog.

The browser rig is `tests/browser_rig.py`'s. With APPLIANCE_SHOTS set, screenshots go to
/tmp/appliance-shots/tuning-*.png.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Iterator

import pytest

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.engine.schedule import list_scheduled
from appliance.runtime import Runtime
from tests.browser_rig import Browser, Dialog, Page, admin_on, expect, shot
from tests.conftest import LiveServer
from tests.test_tuning_api import write_k3
from tests.test_weights_ui import audit_of

pytestmark = pytest.mark.browser

# Counts the panel's swaps and records the document, so a reload would show.
WATCH = """
window.__swaps = 0; window.__kept = 'yes';
document.body.addEventListener('htmx:afterSwap', (e) => {
  if (e.detail.target && e.detail.target.id === 'tuning-panel') window.__swaps += 1;
});
"""




@pytest.fixture
def clock() -> SystemClock:
    """Real time (conftest's runtime takes this): the window is a real date in the future."""
    return SystemClock()


@pytest.fixture
def page(browser: Browser, config: Config, server: LiveServer, runtime: Runtime) -> Iterator[Page]:
    """Alice, logged in, on /tuning (reached through the nav)."""
    write_k3(config)
    with admin_on(browser, server, runtime, "Tuning", "/tuning") as tab:
        yield tab


def figure(page: Page, which: str) -> str:
    return page.locator(f"#tuning-{which} .tuning-ratio strong").inner_text()


def test_pick_a_profile_create_one_and_apply_it_in_a_window(
    page: Page, server: LiveServer, runtime: Runtime
) -> None:
    panel = page.locator("#tuning-panel")
    chart = panel.locator("svg.tuning-chart")
    expect(page.get_by_label("Workload profile")).to_have_value("balanced")
    expect(panel.get_by_role("heading", name="Balanced", level=2)).to_be_visible()
    expect(page.locator("#tuning-budget-kind")).to_have_text("estimate")
    expect(panel).to_contain_text("an estimate: no startup measured yet")
    expect(chart).to_be_visible()
    expect(chart.locator("polyline.state-limit")).to_have_count(1)
    expect(chart.locator("polyline.kv-limit")).to_have_count(1)
    expect(chart.locator("circle.balanced")).to_have_count(1)
    expect(page.locator("#tuning-choice")).to_contain_text("No split applied yet")
    balanced_ratio = figure(page, "recommended")
    balanced_desc = chart.locator("desc").text_content()
    shot(page, "tuning-balanced")

    # Pick another profile: the panel, the figures and the chart change, no reload.
    page.evaluate(WATCH)
    page.get_by_label("Workload profile").select_option("long-document")
    expect(panel.get_by_role("heading", name="Long documents", level=2)).to_be_visible()
    expect(page).to_have_url(f"{server.base_url}/tuning?profile=long-document")
    expect(page.locator("#tuning-recommended .tuning-ratio strong")).not_to_have_text(
        balanced_ratio)
    assert float(figure(page, "recommended")) < float(balanced_ratio)  # longer: lower ratio
    expect(panel.locator(".tuning-target")).to_have_text("Target: 4 concurrent requests")
    assert chart.locator("desc").text_content() != balanced_desc
    expect(chart.locator("text", has_text="target 4")).to_have_count(1)
    expect(page.locator("#tuning-summary")).to_contain_text("averaging 538K tokens")
    assert page.evaluate("window.__kept") == "yes" and page.evaluate("window.__swaps") == 1
    shot(page, "tuning-long-document")

    # A custom profile, started from this one: the draft is previewed while typing.
    panel.get_by_role("button", name="Start a new profile from it").click()
    editor = page.locator("#tuning-editor")
    expect(editor.get_by_label("Title")).to_have_value("Long documents (copy)")
    expect(editor.get_by_label("p50")).to_have_value("512K")
    editor.get_by_label("Name").fill("support-bots")
    editor.get_by_label("Title").fill("Support bots")
    editor.get_by_label("Description").fill("Ticket triage: short prompts, many at once.")
    for key, value in (("min", "500"), ("p25", ""), ("p50", "3K"), ("p75", ""), ("p90", "12K"),
                       ("p99", "16K"), ("max", "40K")):
        editor.get_by_label(key, exact=True).fill(value)
    editor.get_by_label("Target concurrency").fill("120")
    expect(panel.locator(".tuning-kind")).to_have_text("unsaved draft")
    expect(panel.get_by_role("heading", name="Support bots", level=2)).to_be_visible()
    expect(panel.locator(".tuning-target")).to_have_text("Target: 120 concurrent requests")
    expect(panel).to_contain_text("save it (below) to apply it")
    draft_ratio = figure(page, "recommended")
    assert float(draft_ratio) > float(balanced_ratio)  # short requests: a higher ratio
    shot(page, "tuning-draft-preview")

    editor.get_by_role("button", name="Create profile").click()
    expect(editor.get_by_role("status")).to_have_text(
        "Profile Support bots (support-bots) created.")
    expect(editor.get_by_role("heading", name="Edit the profile support-bots")).to_be_visible()
    expect(page.get_by_label("Workload profile")).to_have_value("support-bots")
    expect(panel.locator(".tuning-kind")).to_have_text("custom")
    expect(panel.locator("#tuning-recommended .tuning-ratio strong")).to_have_text(draft_ratio)

    # Apply its recommendation in a maintenance window: the confirmation first.
    at = (dt.datetime.now(dt.UTC) + dt.timedelta(days=7)).replace(
        hour=2, minute=0, second=0, microsecond=0)
    apply_form = panel.locator("form.tuning-apply-form")
    expect(apply_form.get_by_label("--mamba-full-memory-ratio")).to_have_value(draft_ratio)
    apply_form.get_by_label("In a maintenance window at").check()
    apply_form.get_by_label("Maintenance window start (UTC)").fill(at.strftime("%Y-%m-%dT%H:%M"))
    apply_form.get_by_role("button", name="Review and apply…").click()
    dialog = panel.get_by_role("alertdialog")
    expect(dialog).to_contain_text(f"Apply ratio {draft_ratio} for Support bots?")
    expect(dialog).to_contain_text(re.compile(r"it fits \d+ concurrent requests"))
    expect(dialog).to_contain_text(f"The engine restarts at {at:%Y-%m-%d %H:%M:%S} UTC")
    expect(dialog).to_contain_text("A cold start of Kimi K3 takes about 90 minutes")
    assert runtime.db.call(list_scheduled) == []  # nothing until confirmed
    shot(page, "tuning-confirm")
    dialog.get_by_role("button", name="Apply and schedule the restart").click()

    result = panel.locator("#tuning-apply-result [role=status]")
    expect(result).to_contain_text(f"Applied ratio {draft_ratio} for the support-bots profile.")
    expect(result).to_contain_text(f"Engine restart scheduled for {at:%Y-%m-%d %H:%M:%S} UTC")
    choice = page.locator("#tuning-choice")
    expect(choice).to_contain_text(
        f"Applied: ratio {draft_ratio} for the support-bots profile, by alice")
    expect(choice).to_contain_text("The engine is stopped: its next start uses this split.")
    expect(choice.locator(".tuning-scheduled")).to_contain_text(
        f"Engine restart scheduled for {at:%Y-%m-%d %H:%M:%S} UTC by alice")
    expect(page.locator("#tuning-profile option:checked")).to_have_text("Support bots (applied)")
    # The current ratio is now the applied one: what the next start launches.
    expect(page.locator("#tuning-current .tuning-ratio strong")).to_have_text(draft_ratio)
    shot(page, "tuning-applied")
    if os.environ.get("APPLIANCE_SHOTS"):  # and as a phone shows it
        page.set_viewport_size({"width": 390, "height": 844})
        shot(page, "tuning-applied-narrow")
        page.set_viewport_size({"width": 1280, "height": 900})

    [scheduled] = runtime.db.call(list_scheduled)
    assert (scheduled.command, scheduled.status, scheduled.run_at) == ("restart", "pending", at)
    assert audit_of(runtime, "tuning.apply") == [
        ("alice", "ok", {"via": "console", "ratio": float(draft_ratio), "pin": None,
                         "restart": "scheduled", "at": at.isoformat()})]

    # The audit page shows it.
    page.get_by_role("navigation", name="main").get_by_role("link", name="Audit").click()
    rows = page.locator("table tbody tr")
    applied = rows.filter(has_text="Memory split applied")  # tuning.apply, in words
    expect(applied).to_have_count(1)
    expect(applied).to_contain_text("support-bots")
    expect(applied.locator("span[title='tuning.apply']")).to_have_count(1)
    expect(rows.filter(has_text="Engine action scheduled")).to_have_count(1)
    expect(rows.filter(has_text="Workload profile created")).to_have_count(1)
    shot(page, "tuning-audit")


def test_edit_with_an_inline_refusal_then_delete_through_the_dialog(
    page: Page, runtime: Runtime
) -> None:
    panel = page.locator("#tuning-panel")
    editor = page.locator("#tuning-editor")
    editor.get_by_label("Name").fill("night-batch")
    editor.get_by_label("Title").fill("Night batch")
    editor.get_by_label("Target concurrency").fill("8")
    editor.get_by_role("button", name="Create profile").click()
    expect(editor.get_by_role("status")).to_contain_text("created")
    expect(page.get_by_label("Workload profile")).to_have_value("night-batch")

    # A percentile below the one before it: refused on its field, what was typed is kept.
    editor.get_by_label("p90", exact=True).fill("1K")
    expect(panel.get_by_role("alert")).to_contain_text("The draft cannot be previewed")
    editor.get_by_role("button", name="Save changes").click()
    alert = editor.get_by_role("alert")
    expect(alert).to_contain_text("lengths.p90: 1024 tokens is below p50")
    expect(editor.get_by_label("p90", exact=True)).to_have_attribute("aria-invalid", "true")
    expect(editor.get_by_label("p90", exact=True)).to_have_value("1K")
    expect(editor.locator("#tuning-ed-p90-error")).to_be_visible()
    shot(page, "tuning-inline-error")
    editor.get_by_label("p90", exact=True).fill("128K")
    editor.get_by_label("Target concurrency").fill("12")
    editor.get_by_role("button", name="Save changes").click()
    expect(editor.get_by_role("status")).to_have_text(
        "Profile Night batch (night-batch) saved.")
    expect(panel.locator(".tuning-target")).to_have_text("Target: 12 concurrent requests")

    dialogs: list[str] = []

    def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    editor.get_by_role("button", name="Delete this profile").click()
    expect(editor.get_by_role("status")).to_have_text("Profile night-batch deleted.")
    assert dialogs == ["Delete the profile night-batch? This cannot be undone."]
    expect(page.locator("#tuning-profile option[value=night-batch]")).to_have_count(0)
    expect(page.get_by_label("Workload profile")).to_have_value("balanced")
    expect(editor.get_by_role("heading", name="New custom profile")).to_be_visible()
    assert [(a, o) for a, o, _ in reversed(audit_of(runtime, "tuning.profile."))] == [
        ("alice", "ok"), ("alice", "denied"), ("alice", "ok"), ("alice", "ok")]
