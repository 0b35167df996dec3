"""The Weights page in a real browser, pulling from the fake Hub over real loopback HTTP.

The fake Hub (`appliance.testing.fake_hub`) serves a generated six-shard checkpoint with a
rate fault, so a pull takes a few seconds: from the page, click Pull, watch the total bar
and the file rows move (the card polls itself every second during a job), see every file
verified and the page say the weights are ready for the engine; then a full verification
with re-hash, started and finished from the page. A second test types a bad endpoint (the
refusal shows inline and nothing changes: no job, no request to the Hub), then pulls for real
and cancels through the confirmation dialog.

The browser rig is `tests/browser_rig.py`'s. With APPLIANCE_SHOTS set, screenshots go to
/tmp/appliance-shots/weights-*.png. Every wait is bounded (at most 60 s).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.journal import list_audit
from appliance.runtime import Runtime
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.fake_hub import FakeHub
from tests.browser_rig import Browser, Dialog, Page, admin_on, expect, shot
from tests.conftest import LiveServer, make_config

pytestmark = pytest.mark.browser

REPO_ID = "moonshotai/Kimi-K3"
SHARDS = 6
SHARD_BYTES = 1 << 20
PULL_RATE = 150_000  # bytes/s per connection: each shard takes ~7 s, and so does the pull
CANCEL_RATE = 100_000  # slow enough that the pull is surely still running when cancelled
LONG = 60_000  # ms: the longest single wait
# Records the total bar's value and the activity each time the card is swapped.
WATCH = """
window.__totals = []; window.__activities = [];
const record = () => {
  const bar = document.getElementById('weights-total');
  const card = document.getElementById('weights-status');
  if (bar) {
    const v = parseFloat(bar.getAttribute('value'));
    if (window.__totals[window.__totals.length - 1] !== v) window.__totals.push(v);
  }
  const a = card ? card.dataset.activity : '';
  if (a && window.__activities[window.__activities.length - 1] !== a) window.__activities.push(a);
};
record();
new MutationObserver(record).observe(document.querySelector('main'),
                                     {childList: true, subtree: true, attributes: true});
"""




@pytest.fixture
def checkpoint(tmp_path: Path) -> list[Path]:
    return write_checkpoint(tmp_path / "checkpoint", shards=SHARDS, shard_bytes=SHARD_BYTES)


@pytest.fixture
def hub(tmp_path: Path, checkpoint: list[Path]) -> Iterator[FakeHub]:
    with FakeHub({REPO_ID: tmp_path / "checkpoint"}, faults=[f"rate:{PULL_RATE}"]) as running:
        yield running


@pytest.fixture
def clock() -> SystemClock:
    """Real time (conftest's runtime takes this): the page shows when files were proven."""
    return SystemClock()


@pytest.fixture
def config(tmp_path: Path, hub: FakeHub) -> Config:
    """conftest's dev config (engine.model is the repo served) pulling from the fake Hub."""
    config = make_config(tmp_path / "appliance", APPLIANCE_WEIGHTS_ENDPOINT=hub.url,
                         APPLIANCE_WEIGHTS_RESERVE_GIB="0")
    assert config.engine.model == REPO_ID
    return config


@pytest.fixture
def page(browser: Browser, server: LiveServer, runtime: Runtime) -> Iterator[Page]:
    """Alice, logged in, on /weights (reached through the nav)."""
    with admin_on(browser, server, runtime, "Weights", "/weights") as tab:
        yield tab


def audit_trail(runtime: Runtime, action: str) -> list[tuple[str, str, dict[str, object]]]:
    entries = runtime.db.call(lambda s: list_audit(s, action=action)).items
    return [(a.actor, a.outcome, a.detail) for a in reversed(entries)]  # oldest first


def test_pull_watch_progress_to_ready_then_verify_full(
    page: Page, runtime: Runtime, hub: FakeHub, checkpoint: list[Path]
) -> None:
    status = page.locator("#weights-status")
    readiness = page.locator("#weights-readiness")
    rows = page.locator("#weights-files tbody tr")
    expect(status).to_have_attribute("data-activity", "idle")
    expect(readiness).to_contain_text("Not ready for the engine: no manifest yet.")
    expect(page.locator("#weights-files")).to_contain_text("No files yet")
    # The pull form carries the configured defaults.
    expect(page.get_by_label("Repository")).to_have_value(REPO_ID)
    expect(page.get_by_label("Revision")).to_have_value("main")
    expect(page.get_by_label("Endpoint")).to_have_value(hub.url)
    shot(page, "weights-empty")

    page.evaluate(WATCH)
    page.get_by_role("button", name="Pull", exact=True).click()
    expect(page.locator("#weights-pull-result [role=status]")).to_have_text(
        f"Pull of {REPO_ID}@main from {hub.url} started.")

    # Downloading: the card polls every second; rows are moving, the total bar fills.
    expect(status).to_have_attribute("data-activity", "downloading", timeout=LONG)
    expect(status).to_have_attribute("hx-trigger", "every 1s")
    expect(rows.first).to_have_attribute("data-state", re.compile("downloading|verifying"))
    expect(rows.first.locator(".badge")).to_have_text(re.compile("downloading|verifying"))
    expect(status.get_by_role("button", name="Cancel")).to_be_visible()
    # Decimal units throughout, as the Hub shows file sizes.
    figures = re.compile(r"\d+% · [\d.]+ (B|kB|MB|GB) of [\d.]+ MB · (< )?[\d.]+ [MG]B/s · "
                         r"about [\d a-z]+ left")  # the ETA in words: "about 5 seconds left"
    expect(status.locator(".figures")).to_contain_text(figures, timeout=LONG)
    # A shard's own bar moves while it downloads, with its rate beside it.
    moving = rows.filter(has=page.locator("progress:not([value='0.0'])")).filter(
        has=page.locator(".badge", has_text="downloading"))
    expect(moving.first).to_be_visible(timeout=LONG)
    expect(moving.first.locator("td").nth(4)).to_have_text(re.compile(r"[\d.]+ MB/s"))
    expect(status.locator(".counts")).to_contain_text(re.compile(r"downloading \d+"))
    commit = hub.commit(REPO_ID)
    expect(status.locator("dd").first).to_have_text(f"{REPO_ID}@{commit[:12]}")
    shot(page, "weights-downloading")

    # Done: every file verified, ready for the engine, the card back to a slow poll.
    expect(readiness).to_contain_text(
        re.compile(r"^\s*\S?\s*Ready for the engine: fully verified \d{4}-\d\d-\d\d "
                   r"[\d:]+ UTC, quick check passed \d{4}-"), timeout=LONG)
    expect(rows).to_have_count(len(checkpoint))
    expect(rows.locator(".badge")).to_have_text(["verified"] * len(checkpoint))
    expect(rows.locator("progress[value='100.0']")).to_have_count(len(checkpoint))
    expect(status).to_have_attribute("data-activity", "idle")
    expect(status).to_have_attribute("hx-trigger", "every 5s")
    expect(status.locator(".activity-message")).to_contain_text(
        f"all {len(checkpoint)} files verified")
    expect(status.get_by_role("button", name="Cancel")).to_have_count(0)
    expect(status.get_by_role("link", name="Download manifest (JSON)")).to_have_attribute(
        "href", "/api/v1/weights/manifest")
    expect(page.locator("#weights-total")).to_have_attribute("value", "100.00")

    totals: list[float] = page.evaluate("window.__totals")
    activities: list[str] = page.evaluate("window.__activities")
    moving = [v for v in totals if 0 < v < 100]
    assert len(set(moving)) >= 2, f"the total bar never moved: {totals}"
    assert totals == sorted(totals), f"the total bar went backwards: {totals}"
    assert totals[-1] == 100, totals
    assert "downloading" in activities and activities[-1] == "idle", activities
    shot(page, "weights-ready")

    # A full verification that hashes everything again, from the page.
    verify = page.locator("section").filter(
        has=page.get_by_role("heading", name="Verify", exact=True))
    verify.get_by_label("Re-hash unchanged files").check()
    verify.get_by_role("button", name="Verify full").click()
    expect(page.locator("#weights-verify-result [role=status]")).to_have_text(
        "Full verification started, re-hashing every file.")
    expect(status.locator(".activity-message")).to_contain_text(
        f"All {len(checkpoint)} files match the manifest ({len(checkpoint)} hashed at",
        timeout=LONG)
    expect(status).to_have_attribute("data-activity", "idle")
    expect(readiness).to_contain_text("Ready for the engine: fully verified", timeout=LONG)
    expect(rows.locator(".badge")).to_have_text(["verified"] * len(checkpoint))
    verify.get_by_role("button", name="Verify quick").click()
    expect(page.locator("#weights-verify-result [role=status]")).to_contain_text(
        f"Quick check passed: {len(checkpoint)} files and {SHARDS} shard headers checked")
    shot(page, "weights-verified")
    if os.environ.get("APPLIANCE_SHOTS"):  # and as a phone shows it
        page.set_viewport_size({"width": 390, "height": 844})
        shot(page, "weights-verified-narrow")

    assert audit_trail(runtime, "weights.pull") == [
        ("alice", "ok", {"via": "console", "revision": "main", "endpoint": hub.url})]
    assert audit_trail(runtime, "weights.verify") == [
        ("alice", "ok", {"via": "console", "rehash": True}),
        ("alice", "ok", {"via": "console", "ok": True})]


def test_bad_endpoint_is_refused_inline_then_a_pull_is_cancelled(
    page: Page, runtime: Runtime, hub: FakeHub
) -> None:
    status = page.locator("#weights-status")
    endpoint = page.get_by_label("Endpoint")
    pull_result = page.locator("#weights-pull-result")
    endpoint.fill("ftp://x")
    page.get_by_role("button", name="Pull", exact=True).click()
    alert = pull_result.get_by_role("alert")
    expect(alert).to_contain_text(
        "Endpoint 'ftp://x' is not an http(s) URL of a Hub-compatible endpoint")
    expect(alert).to_contain_text("What to do: fix endpoint, or clear the field")
    expect(endpoint).to_have_value("ftp://x")  # what was typed is kept, to be corrected
    # Nothing changed, and stays so across the next poll: no job, no manifest, no request.
    with page.expect_response(lambda r: r.url.endswith("/weights/status"), timeout=10_000):
        pass
    expect(status).to_have_attribute("data-activity", "idle")
    expect(page.locator("#weights-readiness")).to_contain_text("no manifest yet")
    expect(page.locator("#weights-files")).to_contain_text("No files yet")
    assert runtime.weights._task is None
    assert hub.requests() == []
    shot(page, "weights-bad-endpoint")

    # Corrected, on a slow link: the pull starts; cancel it through the dialog.
    hub.set_faults([f"rate:{CANCEL_RATE}"])
    endpoint.fill(hub.url)
    page.get_by_role("button", name="Pull", exact=True).click()
    expect(pull_result.get_by_role("status")).to_contain_text("started")
    expect(pull_result.get_by_role("alert")).to_have_count(0)
    expect(status).to_have_attribute("data-activity", "downloading", timeout=LONG)
    dialogs: list[str] = []

    def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    status.get_by_role("button", name="Cancel").click()
    expect(status).to_have_attribute("data-activity", "idle")
    expect(status.locator(".activity-message")).to_contain_text(
        "Pull cancelled by alice; partial files are kept")
    assert len(dialogs) == 1 and dialogs[0].startswith("Cancel the weights job"), dialogs
    expect(page.locator("#weights-readiness")).to_contain_text(
        re.compile(r"Not ready for the engine: \d+ of \d+ files are not verified yet"))
    expect(page.locator("#weights-files tbody tr:not([data-state=verified])")).not_to_have_count(
        0)
    shot(page, "weights-cancelled")
    assert [(a, o) for a, o, _ in audit_trail(runtime, "weights.pull")] == [
        ("alice", "denied"), ("alice", "ok")]
    assert audit_trail(runtime, "weights.cancel") == [("alice", "ok", {"via": "console"})]
