"""The Engine page in a real browser, driving the engine emulator as a real process.

Start from the page, watch the state move through the load (progress bar) to READY, see the
memory table with its KV capacity line, the flags with their origins, the run, and the live
log filling through server-sent events; stop through the confirmation dialog, which states
the cost of the next start.

The browser rig is `tests/browser_rig.py`'s. With APPLIANCE_SHOTS set, screenshots of /engine
while loading and when ready are written to /tmp/appliance-shots/. The engine's process group
is killed on teardown in every case.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.db.journal import list_audit
from tests.browser_rig import Browser, Dialog, Page, admin_on, expect, shot
from tests.conftest import LiveServer
from tests.test_engine_api import engine_server

pytestmark = pytest.mark.browser

LOAD_SECONDS = "8"  # long enough that a 2 s status poll sees the load, short for a test
READY_TIMEOUT = 90_000  # ms: a loaded 2-core CI box
# Records every state label the status card shows, in order (the card is swapped every 2 s).
WATCH_STATES = """
window.__states = [];
const record = () => {
  const el = document.querySelector('#engine-status .state');
  const text = el ? el.textContent.trim() : '';
  if (text && window.__states[window.__states.length - 1] !== text) window.__states.push(text);
};
record();
new MutationObserver(record).observe(document.getElementById('engine-status'),
                                     {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture
def engine_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    with engine_server(tmp_path, monkeypatch, load_seconds=LOAD_SECONDS) as live:
        yield live


@pytest.fixture
def page(browser: Browser, engine_box: LiveServer) -> Iterator[Page]:
    """Alice, logged in, on /engine (reached through the nav). Its context is closed before
    the server goes down, and the EventSource with it."""
    with admin_on(browser, engine_box, engine_box.runtime, "Engine", "/engine") as tab:
        yield tab


def test_start_watch_load_to_ready_then_stop_with_confirmation(
    engine_box: LiveServer, page: Page
) -> None:
    runtime = engine_box.runtime

    status = page.locator("#engine-status")
    state = status.locator(".state")
    expect(state).to_have_text(re.compile("^stopped$", re.I))
    expect(status.get_by_role("button", name="Start")).to_be_visible()
    expect(status.get_by_role("button", name="Stop")).to_have_count(0)

    # The launch command: argv, and every flag with its origin.
    launch = page.locator("section.card").filter(
        has=page.get_by_role("heading", name="Launch command"))
    expect(launch.locator(".argv")).to_contain_text(" serve --model-path ")
    flag_rows = launch.locator("tbody tr")
    spec = runtime.supervisor.current_spec()
    expect(flag_rows).to_have_count(len(spec.args))
    model_row = flag_rows.filter(has_text="--model-path")
    expect(model_row.locator("td").nth(2)).to_have_text("default")
    expect(launch.locator("tbody td:nth-child(3)")).to_have_text(
        [a.origin.value for a in spec.args])

    runs = page.locator("#engine-runs tbody tr")
    expect(runs).to_have_count(1)
    expect(runs).to_have_text(re.compile("No runs yet"))
    log_box = page.locator("#engine-log")
    expect(log_box).to_have_text("")  # nothing logged yet: what comes next comes as events

    page.evaluate(WATCH_STATES)
    status.get_by_role("button", name="Start").click()

    # Loading: the state, the progress bar and its figures.
    expect(state).to_have_text(re.compile("^loading weights$", re.I), timeout=READY_TIMEOUT)
    bar = status.locator("progress")
    expect(bar).to_be_visible()
    expect(status).to_contain_text(re.compile(r"\d+%\s+·\s+(about|[\d.]+ \w?i?B of)"))
    expect(status.get_by_role("button", name="Stop")).to_be_visible()
    shot(page, "engine-loading")
    # A start from a stale page is refused (409): the card shows why instead of nothing.
    page.evaluate("htmx.ajax('POST', '/engine/start', '#engine-status')")
    expect(status.get_by_role("alert")).to_contain_text(
        re.compile(r"^Cannot start the engine: the engine is already "))
    expect(status.get_by_role("alert")).to_contain_text("What to do: wait for the current")

    expect(state).to_have_text(re.compile("^ready$", re.I), timeout=READY_TIMEOUT)
    expect(bar).to_have_count(0)
    seen = [s.lower() for s in page.evaluate("window.__states")]
    assert seen[0] == "stopped" and seen[-1] == "ready", seen
    assert "loading weights" in seen, seen
    start_order = ["preflight", "launching", "loading weights", "allocating",
                   "capturing graphs", "warming", "ready"]
    shown = [s for s in seen[1:]]
    assert all(s in start_order for s in shown), seen
    assert shown == sorted(shown, key=start_order.index), f"the state went backwards: {seen}"

    # The memory table: a row per rank and the KV capacity across the DCP group.
    memory = page.locator("section.card").filter(
        has=page.get_by_role("heading", name="Memory per rank"))
    tp_size, dcp = runtime.config.engine.tp_size, runtime.config.engine.dcp_size
    expect(memory.locator("tbody tr")).to_have_count(tp_size)
    expect(memory.locator("tbody tr").first.locator("td").first).to_have_text("TP0")
    expect(memory.locator("tbody tr").first).to_contain_text(
        re.compile(r"GiB = [\d.]+[KM]? tokens"))
    capacity = memory.get_by_text(re.compile(rf"tokens per rank \u00d7 DCP{dcp} ="))
    expect(capacity).to_be_visible()
    # Token counts read as the Tuning page's (9.7M), the exact count in the title.
    expect(capacity).to_contain_text(re.compile(r"KV capacity: [\d.]+[KM]? tokens"))
    exact = capacity.locator("span").first.get_attribute("title") or ""
    per_rank = int(exact.split()[0].replace(",", ""))
    expect(capacity.locator("strong")).to_have_attribute("title", f"{per_rank * dcp:,} tokens")

    # The run, as it stands now (the runs table follows the status poll).
    expect(runs).to_have_count(1)
    run_cells = runs.first.locator("td")
    expect(run_cells.nth(2)).to_have_text("1")  # attempt
    expect(run_cells.nth(3)).to_have_text("ready")
    took = re.compile(r"^(\d+ minutes?( \d+ seconds?)?|\d+ seconds?)$")  # in words
    expect(run_cells.nth(4)).to_have_text(took)

    # The live log: every line of this start arrived through the event stream.
    expect(log_box).to_contain_text("Load weight begin")
    expect(log_box).to_contain_text("The server is fired up and ready to roll!")
    shot(page, "engine-ready")
    if os.environ.get("APPLIANCE_SHOTS"):  # and as a phone shows it
        page.set_viewport_size({"width": 390, "height": 844})
        shot(page, "engine-ready-narrow")
        page.set_viewport_size({"width": 1280, "height": 900})

    # The rank filter reconnects the log to TP1 (and the main process) only.
    with page.expect_response(lambda r: "/api/v1/engine/log?lines=200&rank=1" in r.url):
        page.get_by_label("Rank").select_option("1")
    expect(log_box).to_contain_text("] INFO:")
    expect(log_box).not_to_contain_text("TP0]")

    # Stop: the dialog states what the next start costs; accepting it stops the engine.
    dialogs: list[str] = []

    def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    status.get_by_role("button", name="Stop").click()
    expect(state).to_have_text(re.compile("^stopped$", re.I), timeout=READY_TIMEOUT)
    assert len(dialogs) == 1, dialogs
    assert dialogs[0].startswith("Stop the engine?"), dialogs
    assert re.search(r"\d+ (seconds|minutes)", dialogs[0]) and "start" in dialogs[0], dialogs
    expect(status.get_by_role("button", name="Start")).to_be_visible()
    expect(run_cells.nth(5)).not_to_have_text("—")  # ended
    expect(run_cells.nth(7)).to_contain_text("stopped")
    shot(page, "engine-stopped")

    # Both actions are in the audit log as the console's, by alice.
    stops = runtime.db.call(lambda s: list_audit(s, action="engine.stop")).items
    assert [(a.actor, a.outcome, a.detail) for a in stops] == [
        ("alice", "ok", {"via": "console"})]
    starts = runtime.db.call(lambda s: list_audit(s, action="engine.start")).items
    assert starts and {(a.actor, a.detail["via"]) for a in starts} == {("alice", "console")}
