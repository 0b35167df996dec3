"""The Tuning page over real loopback HTTP, without a browser.

A live server over the dev box with K3's `config.json` in the model folder (no engine start:
the budget is an estimate, and the page says so) and a console session (cookies, CSRF token).
Covers the page and its figures, the panel partial (profile picked, URL pushed; a draft
previewed), the editor (create, edit, delete; inline refusals naming the field that change
nothing), applying in two steps (the confirmation with the restart's cost, then the outcome
with the fresh panel), the no-htmx fallbacks, the page without a model config, and the form
helpers.
"""

from __future__ import annotations

import datetime as dt
import re
from html import unescape
from pathlib import Path

import httpx
import pytest

from appliance.auth.middleware import CSRF_COOKIE
from appliance.config import Config
from appliance.engine.schedule import list_scheduled
from appliance.runtime import Runtime
from appliance.tuning.profiles import K, M, ProfileError, builtin_profile
from appliance.ui.tuning import Draft, field_of, parse_tokens, tokens_text
from tests.conftest import Console
from tests.test_no_cdn import EXTERNAL
from tests.test_tuning_api import write_k3
from tests.test_weights_ui import audit_of

HTMX = {"HX-Request": "true"}
SUPPORT = {"name": "support-bots", "title": "Support bots", "description": "Ticket triage.",
           "minimum": "500", "p50": "3K", "p90": "12K", "p99": "", "max": "40K",
           "target": "120"}


@pytest.fixture
def page(config: Config, logged_in: Console) -> Console:
    write_k3(config)
    return logged_in


def htmx(console: Console, method: str, path: str, data: dict[str, str] | None = None,
         **headers: str) -> httpx.Response:
    """A request like the page's htmx makes: the HX-Request header and the CSRF header."""
    return console.http.request(method, path, data=data, headers={
        **HTMX, "X-CSRF-Token": console.http.cookies[CSRF_COOKIE], **headers})


def text_of(html: str) -> str:
    """The visible words, tags dropped and spaces folded."""
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))


# --- the page ---------------------------------------------------------------------------------


def test_page_shows_the_balanced_profile_with_an_estimated_budget(page: Console) -> None:
    response = page.http.get("/tuning")
    assert response.status_code == 200, response.text
    html = response.text
    words = text_of(html)
    assert '<a href="/tuning" aria-current="page">Tuning</a>' in html
    assert not EXTERNAL.search(html)
    # The picker: the built-ins, Balanced chosen (nothing applied yet).
    assert re.findall(r'<option value="([a-z-]+)"', html) == [
        "coding-agent", "chat", "long-document", "balanced"]
    assert '<option value="balanced" selected>Balanced</option>' in html
    # The workload: its percentiles, mean and target.
    assert "MIN P50 P90 P99 MAX MEAN" in words.upper()
    assert "512 16K 96K 200K 256K 42K" in words
    assert "Target: 64 concurrent requests" in words
    # The budget, visibly an estimate.
    assert 'id="tuning-budget-kind">estimate</span>' in html
    assert "(an estimate: no startup measured yet)" in words
    assert "No engine startup has been measured on this box yet" in words
    assert re.search(r"\d+\.\d\d GiB per GPU", words)
    # Current, recommended (with the gain), balanced; the words; no split applied yet.
    assert re.search(r"Current ratio 0\.9 \d+ concurrent requests The state pool fills first",
                     words)
    assert re.search(r"Recommended ratio [\d.]+ \d+ \+\d+ concurrent requests", words)
    assert re.search(r"Balanced ratio [\d.]+ where the state-slot limit meets the KV limit",
                     words)
    assert re.search(r"Ratio 0\.9 fits \d+ concurrent requests averaging 42K tokens", words)
    assert "What it gives up: KV capacity drops from" in words
    assert "No split applied yet: the engine runs with ratio 0.9" in words
    # The chart, inline, and the apply form with the recommendation filled in.
    assert html.count("<svg ") == 1 and 'class="tuning-chart"' in html
    assert "<script" not in html.split('<svg ', 1)[1].split("</svg>", 1)[0]
    recommended = re.search(r"Recommended ratio ([\d.]+)", words)
    assert recommended is not None
    assert f'name="ratio" value="{recommended.group(1)}"' in html
    # The editor starts from the shown profile's numbers, as a new profile.
    assert "New custom profile" in words
    assert 'name="p50" value="16K"' in html and 'name="max" value="256K"' in html
    assert 'name="title" value="Balanced (copy)"' in html


def test_a_profile_from_the_query_and_the_panel_partial(page: Console) -> None:
    html = page.http.get("/tuning", params={"profile": "long-document"}).text
    assert '<option value="long-document" selected>Long documents</option>' in html
    panel = htmx(page, "GET", "/tuning/panel?profile=chat", **{"HX-Trigger-Name": "profile"})
    assert panel.status_code == 200
    assert panel.headers["hx-push-url"] == "/tuning?profile=chat"
    assert "<html" not in panel.text and "<h2 id=\"tuning-workload-title\">Chat</h2>" in panel.text
    assert "Target: 256 concurrent requests" in text_of(panel.text)
    # The editor's preview asks without HX-Trigger-Name: the URL stays.
    assert "hx-push-url" not in htmx(page, "GET", "/tuning/panel?profile=chat").headers
    missing = htmx(page, "GET", "/tuning/panel?profile=ghost")
    assert missing.status_code == 200
    assert "there is no profile named 'ghost'" in text_of(missing.text)


def test_a_draft_is_previewed_and_a_bad_one_says_why(page: Console) -> None:
    draft = {"preview": "1", "title": "Bots", "p50": "2K", "max": "8K", "target": "500"}
    response = htmx(page, "GET", "/tuning/panel?" + httpx.QueryParams(draft).__str__())
    words = text_of(response.text)
    assert "unsaved draft" in words and "<h2 id=\"tuning-workload-title\">Bots</h2>" in (
        response.text)
    assert "Target: 500 concurrent requests" in words
    assert "save it (below) to apply it" in words and 'name="ratio"' not in response.text
    bad = {**draft, "p90": "1K"}
    response = htmx(page, "GET", "/tuning/panel?" + str(httpx.QueryParams(bad)))
    assert "The draft cannot be previewed: lengths.p90: 1024 tokens is below p50" in (
        text_of(response.text))
    assert "unsaved draft" not in response.text  # the panel of the profile shown stays


# --- the editor ---------------------------------------------------------------------------------


def test_create_edit_and_delete_a_profile_from_the_editor(page: Console,
                                                         runtime: Runtime) -> None:
    created = htmx(page, "POST", "/tuning/profiles", SUPPORT)
    assert created.status_code == 200, created.text
    html = created.text
    assert "Profile Support bots (support-bots) created." in html
    assert "Edit the profile support-bots" in html  # the editor now edits it
    assert 'hx-put="/tuning/profiles/support-bots"' in html
    assert 'id="tuning-picker" class="tuning-picker" method="get" action="/tuning" ' \
           'hx-swap-oob="true"' in html
    assert '<option value="support-bots" selected>Support bots</option>' in html
    assert '<div id="tuning-panel" hx-swap-oob="innerHTML">' in html
    assert "Target: 120 concurrent requests" in text_of(html)
    assert "500 3K 12K 40K" in text_of(html)

    edit = {**SUPPORT, "title": "Support bots (peak)", "target": "200", "p99": "30K"}
    edited = htmx(page, "PUT", "/tuning/profiles/support-bots", edit)
    assert edited.status_code == 200, edited.text
    assert "Profile Support bots (peak) (support-bots) saved." in edited.text
    assert "Target: 200 concurrent requests" in text_of(edited.text)

    deleted = htmx(page, "DELETE", "/tuning/profiles/support-bots")
    assert deleted.status_code == 200, deleted.text
    assert "Profile support-bots deleted." in deleted.text
    assert "New custom profile" in deleted.text
    assert 'value="support-bots"' not in deleted.text

    trail = [(outcome, detail.get("title")) for _, outcome, detail in
             reversed(audit_of(runtime, "tuning.profile."))]
    assert trail == [("ok", "Support bots"), ("ok", "Support bots (peak)"), ("ok", None)]
    assert all(detail["via"] == "console" for _, _, detail in
               audit_of(runtime, "tuning.profile."))


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"name": "Support Bots"}, "name", "'Support Bots' is not a valid profile name"),
    ({"max": ""}, "max", "max: the longest request is missing"),
    ({"p90": "2K"}, "p90", "lengths.p90: 2048 tokens is below p50 (3072)"),
    ({"p50": "lots"}, "p50", "p50: 'lots' is not a token count"),
    ({"target": "0"}, "target", "target_concurrency: 0 is outside 1..100000"),
    ({"target": "many"}, "target", "target: 'many' is not a whole number"),
    ({"title": " "}, "title", "title: must be 1-80 characters"),
    ({"name": "chat"}, "name", "'chat' is a built-in profile"),
])
def test_refusals_are_inline_on_their_field_and_create_nothing(
    page: Console, runtime: Runtime, change: dict[str, str], field: str, message: str
) -> None:
    response = htmx(page, "POST", "/tuning/profiles", {**SUPPORT, **change})
    assert response.status_code in (409, 422), response.text
    html = response.text
    assert message in unescape(html)
    assert f'aria-invalid="true" aria-describedby="tuning-ed-{field}-error"' in html
    assert f'id="tuning-ed-{field}-error"' in html
    assert "hx-swap-oob" not in html  # the panel and the picker stay as they are
    for key, value in {**SUPPORT, **change}.items():  # what was typed is kept
        if key not in ("description", "name") and value.strip():
            assert f'name="{key}" value="{value}"' in html, key
    assert [p["name"] for p in page.http.get("/api/v1/tuning/profiles").json()][-1] == (
        "balanced")
    assert [o for _, o, _ in audit_of(runtime, "tuning.profile.create")] == ["denied"]


def test_builtins_cannot_be_edited_or_deleted(page: Console) -> None:
    assert htmx(page, "DELETE", "/tuning/profiles/chat").status_code == 409
    refused = htmx(page, "PUT", "/tuning/profiles/chat", SUPPORT)
    assert refused.status_code == 409 and "cannot be edited" in refused.text
    editor = htmx(page, "GET", "/tuning/editor?profile=chat&mode=edit")
    assert "New custom profile" in editor.text  # a built-in opens as a copy
    assert 'name="title" value="Chat (copy)"' in editor.text


# --- applying -----------------------------------------------------------------------------------


def test_apply_asks_first_then_schedules_the_restart(page: Console, runtime: Runtime) -> None:
    at = (runtime.clock.now() + dt.timedelta(days=20)).strftime("%Y-%m-%dT%H:%M")
    form = {"profile": "coding-agent", "ratio": "2.2", "when": "window", "at": at}
    asked = htmx(page, "POST", "/tuning/apply", form)
    assert asked.status_code == 200, asked.text
    words = text_of(asked.text)
    assert 'role="alertdialog"' in asked.text
    assert "Apply ratio 2.2 for Coding agent?" in words
    assert re.search(r"it fits \d+ concurrent requests \(the \w+ \w+ fills first; KV [\d.]+M "
                     r"tokens\), against \d+ now", words)
    assert f"The engine restarts at {at.replace('T', ' ')}:00 UTC (maintenance window)" in words
    assert "A cold start of Kimi K3 takes about 90 minutes" in words
    assert "Apply and schedule the restart" in words
    assert 'name="confirm" value="yes"' in asked.text
    assert runtime.db.call(list_scheduled) == []  # asking records nothing
    assert audit_of(runtime, "tuning.apply") == []

    done = htmx(page, "POST", "/tuning/apply", {**form, "confirm": "yes"})
    assert done.status_code == 200, done.text
    assert done.headers["hx-retarget"] == "#tuning-panel"
    words = text_of(done.text)
    assert "Applied ratio 2.2 for the coding-agent profile." in words
    assert f"Engine restart scheduled for {at.replace('T', ' ')}:00 UTC" in words
    assert "Applied: ratio 2.2 for the coding-agent profile, by alice" in words
    assert re.search(r"Engine restart scheduled for [\d-]+ [\d:]+ UTC by alice \(#\d+", words)
    assert '<option value="coding-agent" selected>Coding agent (applied)</option>' in done.text
    [scheduled] = runtime.db.call(list_scheduled)
    assert scheduled.command == "restart" and scheduled.status == "pending"
    assert audit_of(runtime, "tuning.apply") == [
        ("alice", "ok", {"via": "console", "ratio": 2.2, "pin": None, "restart": "scheduled",
                         "at": scheduled.run_at.isoformat()})]
    assert [o for _, o, _ in audit_of(runtime, "engine.schedule")] == ["ok"]


def test_apply_without_a_restart_and_refusals(page: Console, runtime: Runtime) -> None:
    form = {"profile": "chat", "ratio": "40", "when": "none"}
    asked = text_of(htmx(page, "POST", "/tuning/apply", form).text)
    assert "The engine is not restarted now: its next start uses this split." in asked
    done = htmx(page, "POST", "/tuning/apply", {**form, "confirm": "yes"})
    assert "Recorded: the engine's next start uses it." in text_of(done.text)
    assert "The engine is stopped: its next start uses this split." in text_of(done.text)

    for change, status, message in (
            ({"ratio": "fast"}, 422, "Ratio 'fast' is not a positive number"),
            ({"ratio": "-1"}, 422, "Ratio '-1' is not a positive number"),
            ({"ratio": "0.000001"}, 422, "SGLang would refuse ratio 1e-06 at this budget"),
            ({"when": "window", "at": ""}, 422, "The maintenance window has no date and time"),
            ({"when": "window", "at": "2020-01-01T00:00"}, 422, "is not in the future"),
            ({"profile": "ghost"}, 404, "there is no profile named 'ghost'")):
        for confirm in ("", "yes"):
            response = htmx(page, "POST", "/tuning/apply", {**form, **change,
                                                            "confirm": confirm})
            assert response.status_code == status, (change, response.text)
            assert message in text_of(response.text), (change, response.text)
            assert 'role="alert"' in response.text
    assert page.http.get("/api/v1/tuning/").json()["choice"]["ratio"] == 40
    outcomes = [o for _, o, _ in audit_of(runtime, "tuning.apply")]
    assert outcomes == ["denied"] * 6 + ["ok"]  # only the confirmed refusals were actions


def test_apply_now_queues_an_engine_restart(page: Console, runtime: Runtime) -> None:
    form = {"profile": "balanced", "ratio": "3", "when": "now"}
    asked = text_of(htmx(page, "POST", "/tuning/apply", form).text)
    assert "The engine restarts now. It is stopped: this starts it." in asked
    assert "The new configuration is unqualified: until it is qualified the gateway admits " \
        "up to the new engine's own slot count" in asked  # what admission is meanwhile
    assert "Apply and restart now" in asked
    done = text_of(htmx(page, "POST", "/tuning/apply", {**form, "confirm": "yes"}).text)
    assert "Engine restart queued: a cold start of Kimi K3 takes about 90 minutes" in done
    assert audit_of(runtime, "engine.restart") == [("alice", "ok", {"via": "console"})]


def test_without_htmx_the_forms_get_the_whole_page(page: Console, runtime: Runtime) -> None:
    token = page.page_token("/tuning")
    asked = page.http.post("/tuning/apply", data={
        "profile": "chat", "ratio": "30", "when": "none", "_csrf_token": token})
    assert asked.status_code == 200 and "<html" in asked.text
    assert "Apply ratio 30 for Chat?" in text_of(asked.text)
    created = page.http.post("/tuning/profiles", data={**SUPPORT, "_csrf_token": token})
    assert created.status_code == 200 and "<html" in created.text
    assert "Profile Support bots (support-bots) created." in created.text
    assert '<option value="support-bots" selected>' in created.text
    deleted = page.http.post("/tuning/profiles/support-bots/delete",
                             data={"_csrf_token": token})
    assert deleted.status_code == 200 and "Profile support-bots deleted." in deleted.text


def test_every_change_needs_the_csrf_token(page: Console, runtime: Runtime) -> None:
    for method, path in (("POST", "/tuning/apply"), ("POST", "/tuning/profiles"),
                         ("PUT", "/tuning/profiles/x"), ("DELETE", "/tuning/profiles/x")):
        response = page.http.request(method, path, data={"profile": "chat", "ratio": "1",
                                                         "when": "none", "confirm": "yes"},
                                     headers=HTMX)
        assert response.status_code == 403, (method, path)
    assert audit_of(runtime, "tuning.") == []


def test_without_a_model_config_the_page_says_what_to_do(logged_in: Console) -> None:
    response = logged_in.http.get("/tuning")
    assert response.status_code == 200
    words = text_of(response.text)
    assert "The pools cannot be sized yet" in words
    assert "config.json: no such file" in words
    assert "What to do: pull or import the weights on the Weights page" in words
    assert '<option value="balanced" selected>' in response.text
    assert "New custom profile" in words


# --- the form helpers ---------------------------------------------------------------------------


def test_tokens_read_and_written_in_binary_units() -> None:
    assert [parse_tokens(t, "x") for t in ("6000", "6,000", "48K", "48k", "1M", "1.5M",
                                           " 256K ")] == [6000, 6000, 48 * K, 48 * K, M,
                                                         3 * M // 2, 256 * K]
    for bad in ("", "K", "-5", "1.5", "3 GB", "1e6"):
        with pytest.raises(ProfileError) as caught:
            parse_tokens(bad, "p50")
        assert caught.value.field == "p50"
    assert [tokens_text(t) for t in (512, 6000, 48 * K, M, 3 * M // 2)] == [
        "512", "6000", "48K", "1M", "1536K"]


def test_a_draft_round_trips_every_builtin() -> None:
    for name in ("coding-agent", "chat", "long-document", "balanced"):
        profile = builtin_profile(name)
        assert profile is not None
        draft = Draft.of(profile, editing=False)
        again = Draft({**draft.fields, "name": "copy", "title": profile.title}).profile()
        assert again.lengths == profile.lengths
        assert again.target_concurrency == profile.target_concurrency
    odd = Draft({"p95": "10K", "max": "20K", "target": "3", "name": "x-y", "title": "T"})
    assert [key for key, _ in odd.rows()] == ["minimum", "p25", "p50", "p75", "p90", "p95",
                                              "p99", "max"]
    assert odd.profile().lengths.points == ((95.0, 10 * K), (100.0, 20 * K))


def test_errors_point_at_their_inputs() -> None:
    cases = {"lengths.p100": "max", "lengths.p90": "p90", "target_concurrency": "target",
             "lengths.minimum": "minimum", "lengths[2].percentile": "lengths", "name": "name",
             "lengths.percentiles": "max"}
    for source, field in cases.items():
        assert field_of(ProfileError(source, "m", "h")) == field



def test_a_measured_budget_is_labelled_so(page: Console, runtime: Runtime) -> None:
    """The engine log holds a startup (the sample K3 log): the budget is measured from it."""
    log = runtime.supervisor.log_path
    log.parent.mkdir(parents=True, exist_ok=True)
    sample = Path(__file__).parent / "data" / "engine_logs" / "k3_startup.sample.log"
    log.write_text(sample.read_text())
    html = page.http.get("/tuning").text
    words = text_of(html)
    assert 'id="tuning-budget-kind">measured</span>' in html
    assert "an estimate" not in words and "No engine startup has been measured" not in words
    assert re.search(r"Measured from the engine's last startup \(.*engine\.log\): [\d.]+ GiB "
                     r"free after loading weights", words)


def test_a_pinned_state_pool_is_applied_and_shown(page: Console, runtime: Runtime) -> None:
    form = {"profile": "chat", "ratio": "1", "pin": "600", "when": "none"}
    asked = text_of(htmx(page, "POST", "/tuning/apply", form).text)
    assert "Apply ratio 1 pinned to 600 state slots for Chat?" in asked
    done = text_of(htmx(page, "POST", "/tuning/apply", {**form, "confirm": "yes"}).text)
    assert "Applied ratio 1 with --max-mamba-cache-size 600 for the chat profile." in done
    assert "Applied: ratio 1 with --max-mamba-cache-size 600 for the chat profile" in done
    assert "--max-mamba-cache-size 600" in text_of(page.http.get("/engine").text)
    refused = htmx(page, "POST", "/tuning/apply", {**form, "pin": "99999999"})
    assert refused.status_code == 422
    assert "SGLang would refuse --max-mamba-cache-size 99999999" in text_of(refused.text)


def test_the_current_figure_is_the_pinned_launchs(page: Console) -> None:
    form = {"profile": "chat", "ratio": "1", "pin": "600", "when": "none", "confirm": "yes"}
    htmx(page, "POST", "/tuning/apply", form)
    words = text_of(page.http.get("/tuning").text)
    assert "pinned: 600 state slots" in words
    assert page.http.get("/api/v1/tuning/").json()["current"]["state_limit"] <= 600 // 3


def test_the_observed_workload_is_shown_and_can_become_a_profile(
    page: Console, runtime: Runtime
) -> None:
    """Decode lines since the engine's last start: what the box really served, which pool ran
    out first, the best ratio for it, and an editor filled from it."""
    from tests.test_tuning_observed import _decode, _startup

    head, capacity, slots, _ = _startup(5.0)
    lines = [head] + [_decode(f"10:{10 + i}:00", 50, int(capacity * 0.95), capacity, 150,
                              slots, queued=4) for i in range(20)]
    runtime.supervisor.log_path.parent.mkdir(parents=True, exist_ok=True)
    runtime.supervisor.log_path.write_text("\n".join(lines) + "\n")
    words = text_of(page.http.get("/tuning").text)
    assert "What this box really served" in words
    assert "The KV pool saturated first in 20 of 20 busy samples" in words
    assert "Peak 50 concurrent requests" in words
    assert "Ran out first the KV cache: 20 of 20 busy samples KV first, 0 state first" in words
    # 20 samples: shown, but too few to recommend a change from (issue 14: ratio 42 from 20).
    assert ("Evidence From 20 decode samples over 19 minutes: too few decode samples to "
            "recommend a change (20 of the 200 needed)") in words
    assert "Best for it" not in words
    api = page.http.get("/api/v1/tuning/").json()["observed"]
    assert api["recommendation"] is None
    assert (api["evidence"]["samples"], api["evidence"]["needed"],
            api["evidence"]["refusal"]) == (
        20, 200, "too few decode samples to recommend a change (20 of the 200 needed)")

    lines += [_decode(f"{11 + i // 60}:{i % 60:02d}:00", 50, int(capacity * 0.95), capacity, 150,
                      slots, queued=4) for i in range(180)]
    runtime.supervisor.log_path.write_text("\n".join(lines) + "\n")
    words = text_of(page.http.get("/tuning").text)
    assert "Evidence From 200 decode samples over 3 hours" in words
    assert "too few" not in words
    assert re.search(r"Best for it ratio [\d.]+: \d+ concurrent requests, against \d+ at the "
                     r"current split", words)
    assert re.search(r"\(from 200 decode samples over 3 hours\)", words)
    editor = htmx(page, "GET", "/tuning/editor?mode=observed").text
    assert 'name="name" value="observed"' in editor
    assert 'name="title" value="Observed workload"' in editor
    assert 'name="target" value="50"' in editor
    assert "New custom profile" in text_of(editor)
