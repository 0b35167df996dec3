"""The API keys page over real loopback HTTP, without a browser.

A live server and a console session (cookies, CSRF token). Covers the page and its nav item;
creating a key with htmx (the key once, in a copy field with its warning, the table out of
band) and without (the whole page); refusals shown next to the form that create nothing;
the status badges; revoking; editing limits inline (the row as a form, saved, refused with
what was typed kept, cancelled) and without htmx; CSRF; and the audit trail (`via: console`).
"""

from __future__ import annotations

import datetime as dt
import re
from html import unescape

import httpx
import pytest

from appliance.auth.middleware import CSRF_COOKIE
from appliance.db.journal import list_audit
from appliance.gateway.keys import KEY_RE, KeyLimits, list_keys
from appliance.runtime import Runtime
from appliance.testing.clock import FakeClock
from appliance.ui.keys import LimitsForm, limit_texts
from tests.conftest import Console
from tests.test_no_cdn import EXTERNAL

HTMX = {"HX-Request": "true"}
NEW_KEY = re.compile(r'<input id="new-key"[^>]* value="(sk-[^"]+)"')
FORM = {"name": "support bots", "owner": "Support team", "expires": "", "max_concurrency": "4",
        "requests_per_minute": "60", "tokens_per_day": "1,000,000", "max_tokens": ""}


def htmx(console: Console, method: str, path: str,
         data: dict[str, str] | None = None) -> httpx.Response:
    """A request like the page's htmx makes: the HX-Request header and the CSRF header."""
    return console.http.request(method, path, data=data, headers={
        **HTMX, "X-CSRF-Token": console.http.cookies[CSRF_COOKIE]})


def text_of(html: str) -> str:
    """The visible words, tags dropped and spaces folded."""
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html))).strip()


def row_of(html: str, prefix: str) -> str:
    match = re.search(rf'<tr id="key-{prefix}".*?</tr>', html, re.S)
    assert match, f"no row for {prefix}"
    return match.group(0)


def make_key(console: Console, **fields: str) -> tuple[str, str]:
    """Create a key through the page's form (htmx); returns (key, prefix)."""
    response = htmx(console, "POST", "/keys", {**FORM, **fields})
    assert response.status_code == 200, response.text
    match = NEW_KEY.search(response.text)
    assert match, response.text
    key = match.group(1)
    prefix = KEY_RE.match(key)
    assert prefix
    return key, prefix.group(1)


def audit_of(runtime: Runtime) -> list[tuple[str, str, str, dict[str, object]]]:
    entries = runtime.db.call(lambda s: list_audit(s, action="keys.", per_page=500)).items
    return [(a.action, a.actor, a.target, a.detail) for a in reversed(entries)]


def test_page_and_nav(logged_in: Console) -> None:
    response = logged_in.http.get("/keys")
    assert response.status_code == 200, response.text
    html = response.text
    assert '<a href="/keys" aria-current="page">API keys</a>' in html
    assert "<h1>API keys</h1>" in html
    assert not EXTERNAL.search(html)
    words = text_of(html)
    assert "No keys yet: create one above." in words
    assert "the key itself is shown once" in words
    assert 'name="_csrf_token"' in html  # the no-htmx form carries its CSRF field
    # The other pages link to it too (the nav item is live, not greyed out).
    assert '<a href="/keys">API keys</a>' in logged_in.http.get("/").text


def test_create_shows_the_key_once_with_a_warning(logged_in: Console, runtime: Runtime,
                                                  clock: FakeClock) -> None:
    response = htmx(logged_in, "POST", "/keys", {**FORM, "expires": "2027-01-31"})
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    html = response.text
    match = NEW_KEY.search(html)
    assert match
    key = match.group(1)
    prefix = key.split("-")[1]
    assert re.search(r'<input id="new-key"[^>]* readonly', html)
    words = text_of(html)
    assert f"Key {prefix} (support bots) created." in words
    assert "it is shown only this once and cannot be recovered" in words
    # The table comes along out of band, with the new key's row (and never the key itself
    # outside the copy field).
    assert 'id="keys-table" aria-labelledby="keys-table-title" hx-swap-oob="true"' in html
    row = text_of(row_of(html, prefix))
    assert "support bots Support team active" in row
    assert "4 concurrent 60 requests/min 1,000,000 tokens/day" in row
    assert "2027-01-31 00:00:00 UTC" in row
    assert html.count(key) == 1
    # Shown once: the page never has it again.
    page = logged_in.http.get("/keys").text
    assert key not in page and prefix in page
    [info] = runtime.db.call(list_keys)
    assert info.limits == KeyLimits(4, 60, 1_000_000, None)
    assert info.expires_at == dt.datetime(2027, 1, 31, tzinfo=dt.UTC)
    assert audit_of(runtime) == [("keys.create", "alice", prefix, {
        "via": "console", "name": "support bots", "owner": "Support team",
        "expires_at": "2027-01-31T00:00:00+00:00",
        "limits": {"max_concurrency": 4, "requests_per_minute": 60,
                   "tokens_per_day": 1_000_000, "max_tokens": None},
        "service_class": "interactive"})]


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "<b>x</b>"}, "Key name '<b>x</b>' is not allowed."),
    ({"name": "   "}, "Key name '' is not allowed."),
    ({"max_concurrency": "0"}, "Concurrent requests: '0' is not a whole number from 1"),
    ({"requests_per_minute": "-5"}, "Requests per minute: '-5' is not a whole number from 1"),
    ({"tokens_per_day": "lots"}, "Tokens per day: 'lots' is not a whole number"),
    ({"max_tokens": "1.5"}, "Max tokens per request: '1.5' is not a whole number"),
    ({"max_tokens": "9" * 30}, "is not a whole number from 1 to 2,147,483,647"),
    ({"expires": "2026-11-01"}, "The expiry 2026-11-01 00:00:00 UTC is in the past."),
    ({"expires": "someday"}, "The expiry 'someday' is not a date, a time or a number of days."),
])
def test_refusals_are_shown_by_the_form_and_create_nothing(
        logged_in: Console, runtime: Runtime, fields: dict[str, str], message: str) -> None:
    response = htmx(logged_in, "POST", "/keys", {**FORM, **fields})
    assert response.status_code == 422, response.text
    words = text_of(response.text)
    assert message in words
    assert "What to do:" in words
    assert 'role="alert"' in response.text and "new-key" not in response.text
    assert runtime.db.call(list_keys) == [] and audit_of(runtime) == []


def test_without_htmx_the_form_posts_and_the_page_comes_back(logged_in: Console,
                                                             runtime: Runtime) -> None:
    token = logged_in.page_token("/keys")
    refused = logged_in.http.post("/keys", data={**FORM, "name": "bad/name",
                                                 "_csrf_token": token})
    assert refused.status_code == 422
    assert "<h1>API keys</h1>" in refused.text
    assert 'value="bad/name"' in refused.text  # what was typed is kept
    assert runtime.db.call(list_keys) == []
    done = logged_in.http.post("/keys", data={**FORM, "_csrf_token": token})
    assert done.status_code == 200
    match = NEW_KEY.search(done.text)
    assert match and "<h1>API keys</h1>" in done.text
    assert 'value="support bots"' not in done.text  # the form starts empty again
    assert len(runtime.db.call(list_keys)) == 1


def test_posts_without_the_csrf_token_change_nothing(logged_in: Console,
                                                     runtime: Runtime) -> None:
    refused = logged_in.http.post("/keys", data=FORM, headers=HTMX)
    assert refused.status_code == 403
    assert runtime.db.call(list_keys) == []
    _, prefix = make_key(logged_in)
    assert logged_in.http.post(f"/keys/{prefix}/revoke", headers=HTMX).status_code == 403
    assert logged_in.http.post(f"/keys/{prefix}/limits", data={"max_tokens": "5"},
                               headers=HTMX).status_code == 403
    [info] = runtime.db.call(list_keys)
    assert info.revoked_at is None and info.limits.max_tokens is None


def test_status_badges_and_revoke(logged_in: Console, runtime: Runtime,
                                  clock: FakeClock) -> None:
    # The form takes a time too (a browser's date field sends a date; a script may send more).
    at = clock.now() + dt.timedelta(minutes=30)
    _, soon = make_key(logged_in, name="soon", expires=at.isoformat())
    _, keep = make_key(logged_in, name="keep")
    _, gone = make_key(logged_in, name="gone")
    html = logged_in.http.get("/keys").text
    assert 'hx-confirm="Revoke key ' + gone + ' (gone)? Its users are refused within a ' \
        'second; this cannot be undone."' in row_of(html, gone)
    response = htmx(logged_in, "POST", f"/keys/{gone}/revoke")
    assert response.status_code == 200, response.text
    assert response.text.lstrip().startswith('<section class="card" id="keys-table"')
    revoked = row_of(response.text, gone)
    assert '<span class="badge key-status key-revoked">revoked</span>' in revoked
    assert "by alice" in text_of(revoked)
    assert "Revoke" not in text_of(revoked) and "Edit limits" not in text_of(revoked)
    assert '<span class="badge key-status key-active">active</span>' in row_of(html, soon)
    clock.advance(30 * 60)  # the first key expires (the session lives on)
    html = logged_in.http.get("/keys").text
    assert '<span class="badge key-status key-expired">expired</span>' in row_of(html, soon)
    assert '<span class="badge key-status key-active">active</span>' in row_of(html, keep)
    assert [(a, t, d["via"]) for a, _, t, d in audit_of(runtime) if a == "keys.revoke"] == [
        ("keys.revoke", gone, "console")]
    missing = htmx(logged_in, "POST", "/keys/0123abcd/revoke")
    assert missing.status_code == 404
    assert "there is no API key with prefix '0123abcd'" in text_of(missing.text)


def test_edit_limits_inline(logged_in: Console, runtime: Runtime) -> None:
    _, prefix = make_key(logged_in)
    form = htmx(logged_in, "GET", f"/keys/{prefix}/limits")
    assert form.status_code == 200
    assert form.text.lstrip().startswith(f'<tr id="key-{prefix}" class="key-editing">')
    assert 'name="max_concurrency" value="4"' in form.text
    assert 'name="tokens_per_day" value="1000000"' in form.text
    assert 'name="max_tokens" value=""' in form.text

    # Refused: the form again, with what was typed and why; nothing changed.
    bad = htmx(logged_in, "POST", f"/keys/{prefix}/limits",
               {"max_concurrency": "8", "requests_per_minute": "0", "tokens_per_day": "",
                "max_tokens": ""})
    assert bad.status_code == 422
    assert f'<tr id="key-{prefix}" class="key-editing">' in bad.text
    assert 'name="max_concurrency" value="8"' in bad.text
    assert "Requests per minute: '0' is not a whole number from 1" in text_of(bad.text)
    [info] = runtime.db.call(list_keys)
    assert info.limits == KeyLimits(4, 60, 1_000_000, None)

    # Saved: the row as shown, with the new limits (an empty field clears one).
    saved = htmx(logged_in, "POST", f"/keys/{prefix}/limits",
                 {"max_concurrency": "8", "requests_per_minute": "", "tokens_per_day": "",
                  "max_tokens": "4096"})
    assert saved.status_code == 200, saved.text
    assert saved.text.lstrip().startswith(f'<tr id="key-{prefix}" class="key-active">')
    assert "8 concurrent max_tokens 4,096 (saved)" in text_of(saved.text)
    [info] = runtime.db.call(list_keys)
    assert info.limits == KeyLimits(8, None, None, 4096)
    limits = [(a, d) for a, _, _, d in audit_of(runtime) if a == "keys.limits"]
    assert limits == [("keys.limits", {
        "via": "console", "name": "support bots",
        "before": {"max_concurrency": 4, "requests_per_minute": 60,
                   "tokens_per_day": 1_000_000, "max_tokens": None},
        "limits": {"max_concurrency": 8, "requests_per_minute": None, "tokens_per_day": None,
                   "max_tokens": 4096}})]

    # Cancel swaps the row back as it is.
    cancel = htmx(logged_in, "GET", f"/keys/{prefix}/row")
    assert cancel.text.lstrip().startswith(f'<tr id="key-{prefix}" class="key-active">')
    assert "(saved)" not in cancel.text and "8 concurrent" in text_of(cancel.text)
    assert htmx(logged_in, "GET", "/keys/0123abcd/limits").status_code == 404


def test_limits_and_revoke_without_htmx(logged_in: Console, runtime: Runtime) -> None:
    _, prefix = make_key(logged_in)
    page = logged_in.http.get(f"/keys/{prefix}/limits")
    assert page.status_code == 200 and "<h1>API keys</h1>" in page.text
    assert f'<tr id="key-{prefix}" class="key-editing">' in page.text
    token = logged_in.page_token(f"/keys/{prefix}/limits")
    bad = logged_in.http.post(f"/keys/{prefix}/limits", data={
        "max_tokens": "none please", "_csrf_token": token})
    assert bad.status_code == 422 and 'value="none please"' in bad.text
    done = logged_in.http.post(f"/keys/{prefix}/limits", data={
        "max_concurrency": "2", "_csrf_token": token})
    assert done.status_code == 303 and done.headers["location"] == "/keys"
    assert runtime.db.call(list_keys)[0].limits == KeyLimits(2, None, None, None)
    revoked = logged_in.http.post(f"/keys/{prefix}/revoke", data={"_csrf_token": token})
    assert revoked.status_code == 303 and revoked.headers["location"] == "/keys"
    assert runtime.db.call(list_keys)[0].revoked_at is not None


def test_form_helpers() -> None:
    assert LimitsForm.of(KeyLimits(4, None, 10**10, None)) == LimitsForm("4", "", "10000000000", "")
    assert LimitsForm(" 1_000 ", "", "", "").limits() == KeyLimits(1000, None, None, None)
    assert LimitsForm("", "", "", "").limits() == KeyLimits()
    assert limit_texts(KeyLimits(4, 60, 2_000_000, 8192)) == [
        "4 concurrent", "60 requests/min", "2,000,000 tokens/day", "max_tokens 8,192"]
    assert limit_texts(KeyLimits()) == []
