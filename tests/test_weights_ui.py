"""The Weights page over real loopback HTTP, without a browser.

A live server whose weights endpoint is a fake Hub (`appliance.testing.fake_hub`) serving a
small generated checkpoint, and a console session (cookies, CSRF token). Covers the page with
no manifest yet, the status partial and its polling interval, the nav link, CSRF on every
action, inline refusals (bad input, nothing to verify or cancel) that change nothing, the
no-htmx fallback (the whole page with the result), a whole pull to "ready for the engine"
with its audit entry, a failed quick check audited as failed (console and API), and the
presentation helpers (file order, rates, readiness).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy.orm import Session

from appliance.auth.middleware import CSRF_COOKIE
from appliance.config import Config
from appliance.db.journal import list_audit
from appliance.runtime import Runtime
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.fake_hub import FakeHub
from appliance.ui.weights import rate_text, readiness, sort_files
from appliance.weights.manifest import ManifestFile, build_manifest
from appliance.weights.records import set_control, store_manifest
from appliance.weights.views import FileView, WeightsView
from tests.conftest import Console, make_config, wait_for
from tests.test_no_cdn import EXTERNAL

REPO_ID = "moonshotai/Kimi-K3"
SECRET = "hf_this_token_must_never_be_rendered"
ACTIONS = ("/weights/pull", "/weights/verify/quick", "/weights/verify/full", "/weights/import",
           "/weights/cancel")
HTMX = {"HX-Request": "true"}


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    write_checkpoint(tmp_path / "checkpoint", shards=3, shard_bytes=64 << 10)
    with FakeHub({REPO_ID: tmp_path / "checkpoint"}) as running:
        yield running


@pytest.fixture
def config(tmp_path: Path, hub: FakeHub) -> Config:
    """conftest's dev config, pointed at the fake Hub, with a token that must stay hidden."""
    return make_config(tmp_path / "appliance", APPLIANCE_WEIGHTS_ENDPOINT=hub.url,
                       APPLIANCE_WEIGHTS_TOKEN=SECRET, APPLIANCE_WEIGHTS_RESERVE_GIB="0")


def htmx_post(console: Console, path: str, data: dict[str, str] | None = None) -> str:
    """POST like the page does: htmx header and the CSRF header from the cookie."""
    response = console.http.post(path, data=data or {}, headers={
        **HTMX, "X-CSRF-Token": console.http.cookies[CSRF_COOKIE]})
    return f"{response.status_code} {response.text}"


def audit_of(runtime: Runtime, action: str) -> list[tuple[str, str, dict[str, object]]]:
    entries = runtime.db.call(lambda s: list_audit(s, action=action)).items
    return [(a.actor, a.outcome, a.detail) for a in entries]


def test_page_without_a_manifest(logged_in: Console, runtime: Runtime, hub: FakeHub) -> None:
    response = logged_in.http.get("/weights")
    assert response.status_code == 200
    page = response.text
    assert '<a href="/weights" aria-current="page">Weights</a>' in page
    assert "Not ready for the engine: no manifest yet." in page
    assert "No manifest yet: nothing has been pulled or imported." in page
    assert "No files yet" in page
    assert 'class="wstate wstate-idle">idle<' in page
    assert "Download manifest (JSON)" not in page
    assert "Cancel</button>" not in page  # nothing to cancel
    assert 'hx-trigger="every 5s"' in page
    # The pull form shows the configured defaults; never the token.
    assert f'name="repo" value="{REPO_ID}"' in page
    assert 'name="revision" value="main"' in page
    assert f'name="endpoint" value="{hub.url}"' in page
    assert SECRET not in page
    assert str(runtime.weights.dir_for(REPO_ID)) in page
    for label in ("Repository", "Revision", "Endpoint", "Directory", "Manifest file"):
        assert re.search(rf'<label for="[\w-]+">{label}\b', page), label
    assert not EXTERNAL.search(page)


def test_status_partial_polls_and_carries_the_file_table(logged_in: Console) -> None:
    response = logged_in.http.get("/weights/status", headers=HTMX)
    assert response.status_code == 200
    body = response.text.strip()
    assert body.startswith('<div id="weights-status"')
    assert "<html" not in body
    first = body.split(">", 1)[0]
    assert 'hx-get="/weights/status"' in first and 'hx-swap="outerHTML"' in first
    assert 'hx-trigger="every 5s"' in first and "hx-swap-oob" not in first
    assert re.search(r'<section class="card" id="weights-files"[^>]*hx-swap-oob="true"', body)


def test_nav_links_to_the_weights_page(logged_in: Console) -> None:
    page = logged_in.http.get("/").text
    assert '<a href="/weights">Weights</a>' in page
    assert ">Weights</span>" not in page  # no longer greyed out


def test_every_action_needs_the_csrf_token(logged_in: Console, runtime: Runtime) -> None:
    for path in ACTIONS:
        response = logged_in.http.post(path, data={"directory": "/tmp"}, headers=HTMX)
        assert response.status_code == 403, path
        assert "CSRF" in response.text, path
        wrong = logged_in.http.post(path, data={}, headers={**HTMX, "X-CSRF-Token": "0" * 64})
        assert wrong.status_code == 403, path
    assert runtime.db.call(lambda s: list_audit(s, action="weights.pull")).items == []
    assert runtime.weights._task is None  # no job was started


def test_a_bad_endpoint_is_refused_inline_and_changes_nothing(
    logged_in: Console, runtime: Runtime
) -> None:
    answer = htmx_post(logged_in, "/weights/pull", {
        "repo": REPO_ID, "revision": "main", "endpoint": "ftp://x"})
    assert answer.startswith("422 ")
    assert ('<div class="error" role="alert"><p>Endpoint &#39;ftp://x&#39; is not an http(s)'
            in answer)
    assert "What to do: fix endpoint" in answer
    # The fresh status rides along out of band: still idle, still no manifest.
    assert re.search(r'<div id="weights-status"[^>]*hx-swap-oob="true"[^>]*data-activity="idle"',
                     answer)
    assert "Not ready for the engine: no manifest yet." in answer
    assert runtime.weights._task is None
    assert audit_of(runtime, "weights.pull") == [("alice", "denied", {
        "via": "console", "revision": "main", "endpoint": "ftp://x",
        "refused": "endpoint 'ftp://x' is not an http(s) URL of a Hub-compatible endpoint, "
                   "e.g. https://huggingface.co"})]
    bad_repo = htmx_post(logged_in, "/weights/pull", {"repo": "not a repo"})
    assert bad_repo.startswith("422 ") and "Repo &#39;not a repo&#39; is not" in bad_repo


def test_refusals_without_a_manifest_or_a_job(logged_in: Console, runtime: Runtime) -> None:
    quick = htmx_post(logged_in, "/weights/verify/quick")
    assert quick.startswith("409 ") and "No weights manifest is recorded yet" in quick
    full = htmx_post(logged_in, "/weights/verify/full", {"rehash": "yes"})
    assert full.startswith("409 ") and "No weights manifest is recorded yet" in full
    relative = htmx_post(logged_in, "/weights/import", {"directory": "usb/k3"})
    assert relative.startswith("422 ") and "Import paths must be absolute" in relative
    cancel = htmx_post(logged_in, "/weights/cancel")
    assert cancel.startswith("409 ") and "No weights job is running" in cancel
    assert cancel.split(" ", 1)[1].lstrip().startswith('<div id="weights-status"')
    assert runtime.weights._task is None


def test_without_htmx_a_form_post_gets_the_whole_page(logged_in: Console) -> None:
    token = logged_in.page_token("/weights")
    response = logged_in.http.post("/weights/pull", data={
        "repo": REPO_ID, "revision": "v2", "endpoint": "ftp://x", "_csrf_token": token})
    assert response.status_code == 422
    assert "<h1>Weights</h1>" in response.text
    assert 'name="endpoint" value="ftp://x"' in response.text  # what was typed is kept
    assert 'name="revision" value="v2"' in response.text
    assert "Endpoint &#39;ftp://x&#39; is not an http(s)" in response.text


def test_a_pull_from_the_page_ends_ready_for_the_engine(
    logged_in: Console, runtime: Runtime, hub: FakeHub, tmp_path: Path
) -> None:
    answer = htmx_post(logged_in, "/weights/pull", {"repo": "", "revision": "", "endpoint": ""})
    assert answer.startswith("200 ")
    assert f"Pull of {REPO_ID}@main from {hub.url} started." in answer
    assert 'role="status"' in answer

    def ready() -> str:
        text = logged_in.http.get("/weights/status", headers=HTMX).text
        return text if 'data-busy="no"' in text and "Ready for the engine" in text else ""

    status = wait_for(ready, "the pull to finish", timeout=60)
    commit = hub.commit(REPO_ID)
    assert f"{REPO_ID}@{commit[:12]}" in status
    assert "Ready for the engine: fully verified " in status
    assert ", quick check passed " in status
    rows = re.findall(r'<tr data-path="([^"]+)" data-state="(\w+)">', status)
    assert rows and {state for _, state in rows} == {"verified"}
    assert len(rows) == len(runtime.db.call(lambda s: _file_count(s)))
    assert 'href="/api/v1/weights/manifest"' in status
    assert 'hx-trigger="every 5s"' in status
    manifest = logged_in.http.get("/api/v1/weights/manifest")
    assert manifest.status_code == 200 and manifest.json()["commit"] == commit
    assert audit_of(runtime, "weights.pull") == [("alice", "ok", {
        "via": "console", "revision": "main", "endpoint": hub.url})]

    quick = htmx_post(logged_in, "/weights/verify/quick")
    assert quick.startswith("200 ") and "Quick check passed: " in quick
    full = htmx_post(logged_in, "/weights/verify/full", {"rehash": "yes"})
    assert full.startswith("200 ") and "Full verification started, re-hashing" in full
    wait_for(ready, "the full verification to finish", timeout=60)
    assert audit_of(runtime, "weights.verify") == [
        ("alice", "ok", {"via": "console", "rehash": True}),
        ("alice", "ok", {"via": "console", "ok": True})]
    assert SECRET not in logged_in.http.get("/weights").text

    # An import of the same checkpoint, with the manifest the page offers for download.
    missing = htmx_post(logged_in, "/weights/import", {"directory": str(tmp_path / "nowhere")})
    assert missing.startswith("422 ") and "nowhere is not a directory" in missing
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_bytes(manifest.content)
    imported = htmx_post(logged_in, "/weights/import", {
        "directory": str(tmp_path / "checkpoint"), "manifest": str(manifest_file)})
    assert imported.startswith("200 ")
    assert f"Import from {tmp_path / 'checkpoint'} started." in imported
    wait_for(ready, "the import to finish", timeout=60)
    assert [(o, d) for _, o, d in audit_of(runtime, "weights.import")] == [
        ("ok", {"via": "console", "manifest": str(manifest_file)}),
        ("denied", {"via": "console", "manifest": "",
                    "refused": f"{tmp_path / 'nowhere'} is not a directory"})]


def test_a_failed_quick_check_is_audited_as_failed(logged_in: Console,
                                                    runtime: Runtime) -> None:
    """A quick check that ran and found damage is a failure in the audit log, from the
    console and from the API alike (not "ok" with `{"ok": false}` in its detail)."""
    manifest = build_manifest(REPO_ID, "main", "b" * 40, [
        ManifestFile("model-00001-of-00001.safetensors", 4096, sha256="0" * 64)])
    now = runtime.clock.now()

    def record(s: Session) -> None:  # a manifest whose one shard is not on disk
        stored = store_manifest(s, manifest, "test", now)
        set_control(s, at=now, by="test", active_set_id=stored.id)

    runtime.db.call(record)
    console = htmx_post(logged_in, "/weights/verify/quick")
    assert console.startswith("200 ") and "Quick check failed: " in console
    api = logged_in.http.post("/api/v1/weights/verify", json={},
                              headers={"X-CSRF-Token": logged_in.http.cookies[CSRF_COOKIE]})
    assert api.status_code == 202, api.text
    assert audit_of(runtime, "weights.verify") == [
        ("alice", "failed", {"via": "api:session", "ok": False}),
        ("alice", "failed", {"via": "console", "ok": False})]


def _file_count(session: Session) -> list[object]:
    from appliance.weights import records

    control = records.get_control(session)
    assert control.active_set_id is not None
    return list(records.set_files(session, control.active_set_id))


# --- presentation helpers ----------------------------------------------------------------------


def _file(path: str, state: str, done: int = 0) -> FileView:
    return FileView(path, 100, done, state, 0.0, None, 0, "", None)


def _view(files: tuple[FileView, ...], **changes: object) -> WeightsView:
    base = WeightsView(
        repo_id=REPO_ID, revision="main", commit="c" * 40, source="hub", model_dir="/m",
        activity="idle", message="", hint="", total_bytes=100 * len(files),
        done_bytes=sum(f.bytes_done for f in files), rate_bps=0.0, eta_seconds=None,
        files=files, full_verified_at=None, quick_checked_at=None, quick_ok=None,
        quick_problems=(), ready_for_engine=False)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_files_are_sorted_moving_first_then_failed_queued_verified() -> None:
    files = (_file("a", "verified"), _file("b", "queued"), _file("c", "failed"),
             _file("d", "downloading"), _file("e", "missing"), _file("f", "retrying"),
             _file("g", "stalled"), _file("h", "verifying"), _file("i", "queued"))
    assert [f.path for f in sort_files(files)] == ["d", "f", "g", "h", "c", "e", "b", "i", "a"]


def test_rates_read_in_decimal_units() -> None:
    assert rate_text(0) == "—"
    assert rate_text(900) == "< 0.01 MB/s"
    assert rate_text(250_000) == "0.25 MB/s"
    assert rate_text(42_300_000) == "42.3 MB/s"
    assert rate_text(2_345_000_000) == "2.35 GB/s"


def test_readiness_says_why_not() -> None:
    at = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)
    files = (_file("a", "verified", 100), _file("b", "queued"))
    assert readiness(_view((), repo_id=None), REPO_ID).text.endswith("no manifest yet.")
    other = readiness(_view(files, repo_id="org/other"), REPO_ID)
    assert not other.ok and "of org/other, but the engine serves moonshotai/Kimi-K3" in other.text
    pending = readiness(_view(files), REPO_ID)
    assert pending.text == "Not ready for the engine: 1 of 2 files are not verified yet."
    broken = readiness(_view(files, full_verified_at=at, quick_ok=False, quick_checked_at=at,
                             quick_problems=tuple(f"p{i}" for i in range(7))), REPO_ID)
    assert not broken.ok and broken.problems[-1] == "and 2 more"
    done = readiness(_view(files, full_verified_at=at, quick_ok=True, quick_checked_at=at,
                           ready_for_engine=True), REPO_ID)
    assert done.ok and done.text == ("Ready for the engine: fully verified 2026-05-01 12:00:00 "
                                     "UTC, quick check passed 2026-05-01 12:00:00 UTC.")


def _render(template: str, view: WeightsView, **extra: object) -> str:
    """A partial rendered straight from its file, with the console's filters."""
    from jinja2 import Environment, FileSystemLoader

    from appliance.resources import templates_dir
    from appliance.ui.templating import can, filters
    from appliance.ui.weights import MOVING, sentence, state_counts
    from appliance.weights.views import bytes_text

    env = Environment(loader=FileSystemLoader(templates_dir()), autoescape=True)
    env.filters.update(filters())
    env.globals["can"] = can  # the actions show for an operator
    extra.setdefault("request", SimpleNamespace(scope={"user": SimpleNamespace(role="operator")}))
    return env.get_template(template).render(
        w=view, files=sort_files(view.files), counts=state_counts(view),
        ready=readiness(view, REPO_ID), rate=rate_text, sentence=sentence, moving=MOVING,
        bytes_text=bytes_text, status_oob=False, files_oob=False, error="", error_hint="",
        **extra)


def test_the_file_table_orders_rows_and_truncates_errors() -> None:
    error = "connection failed: ReadError: " + "x" * 200
    files = (_file("a.json", "verified", 100),
             FileView("b.safetensors", 100, 40, "downloading", 2_500_000.0, 24.0, 1, "", None),
             dataclasses.replace(_file("c.safetensors", "failed", 10), attempts=5,
                                 last_error=error),
             _file("d.safetensors", "queued"), _file("e.safetensors", "stalled", 5))
    html = _render("partials/weights_files.html", _view(files, activity="downloading"))
    assert re.findall(r'data-path="([^"]+)"', html) == [
        "b.safetensors", "e.safetensors", "c.safetensors", "d.safetensors", "a.json"]
    assert f'<span title="{error}">{error[:59]}…</span>' in html
    assert '<span class="badge wf-failed">failed</span>' in html
    assert '<progress max="100" value="40.0" aria-label="b.safetensors">' in html
    assert "2.5 MB/s" in html and ">24 seconds<" in html
    # No job: no rates or ETAs, whatever a file was left showing.
    idle = _render("partials/weights_files.html", _view(files))
    assert "MB/s" not in idle and ">24 seconds<" not in idle


def test_the_card_lists_what_the_quick_check_found() -> None:
    at = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)
    view = _view((_file("a", "failed"),), full_verified_at=at, quick_ok=False,
                 quick_checked_at=at, quick_problems=("a: 10 bytes, expected 100",),
                 activity="failed", message="pull failed: 1 file(s) could not be fetched: a",
                 hint="see each file's error")
    html = _render("partials/weights_status.html", view)
    assert "Not ready for the engine: the quick check failed 2026-05-01 12:00:00 UTC." in html
    assert "<li>a: 10 bytes, expected 100</li>" in html
    assert "Pull failed: 1 file(s) could not be fetched: a" in html
    assert "What to do: see each file&#39;s error" in html
    assert 'hx-trigger="every 5s"' in html and "Cancel</button>" not in html
    assert '<span class="badge wf-failed">failed 1</span>' in html
