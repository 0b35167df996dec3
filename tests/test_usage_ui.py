"""The Usage page over real loopback HTTP, without a browser.

A live server and a console session; the history is `tests.test_usage_api.seed`'s (written by
the gateway's own writer). Covers the empty state before anything was recorded, the page with
its figures, chart, per-key table and downloads, the htmx report (a clean URL pushed; a date
typed switching to a range of one's own, the picker coming back out of band), refusals shown
in the report's place, the nav, the login, and the formatters.
"""

from __future__ import annotations

import datetime as dt
import re
from html import unescape

import httpx
import pytest

from appliance.gateway.usage import prune
from appliance.runtime import Runtime
from appliance.ui.usage import count, millis, percent
from tests.conftest import Console, LiveServer
from tests.test_no_cdn import EXTERNAL
from tests.test_usage_api import Seeded, seed, seed_classes

HTMX = {"HX-Request": "true"}


@pytest.fixture
def data(runtime: Runtime) -> Seeded:
    return seed(runtime)


def text_of(html: str) -> str:
    """The visible words, tags dropped and spaces folded."""
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))


def key_rows(html: str) -> list[str]:
    """The per-key table's rows, as words."""
    body = re.search(r'<table class="figures usage-keys".*?<tbody>(.*?)</tbody>', html, re.S)
    assert body, html
    return [text_of(r).strip() for r in re.findall(r"<tr.*?</tr>", body.group(1), re.S)]


def test_empty_state_before_any_usage(logged_in: Console) -> None:
    response = logged_in.http.get("/usage")
    assert response.status_code == 200, response.text
    html = response.text
    assert '<a href="/usage" aria-current="page">Usage</a>' in html
    words = text_of(html)
    assert "No usage has been recorded yet." in words
    assert "Usage appears here once clients call the gateway" in words
    assert "<svg" not in html and 'id="usage-keys"' not in html
    assert not EXTERNAL.search(html)


def test_page_with_usage(logged_in: Console, data: Seeded) -> None:
    response = logged_in.http.get("/usage")
    assert response.status_code == 200, response.text
    html = response.text
    words = text_of(html)
    assert "No usage has been recorded yet" not in words
    assert "Last 24 hours · all keys" in words
    assert '<option value="24h" selected>Last 24 hours</option>' in html
    assert f'<option value="{data.alpha}">alpha ({data.alpha})</option>' in html
    # Totals: 5 requests, 2 errors; 2000 of 4500 prompt tokens cached; TTFT over timed ones.
    assert re.search(r'id="usage-requests">5<', html)
    assert "2 (40.0 %)" in words
    assert "4,500, 44.4 % from the prefix cache" in words
    assert re.search(r'id="usage-ttft">300 ms<', html)
    assert "33.3 % (1 of 3 continued conversations)" in words
    # The chart, inline, with its own link.
    assert re.search(r'<svg [^>]*class="usage-chart"[^>]*data-buckets="24"', html)
    assert 'href="/api/v1/usage/chart.svg?range=24h"' in html
    # A row per key, busiest first: requests, errors, tokens in/out, cache hit, TTFT, rewrite.
    assert key_rows(html) == [
        f"alpha {data.alpha} 4 1 (25.0 %) 4,500 350 44.4 % 300 ms 2 s 33.3 %",
        "no key (refused) — 1 1 (100.0 %) 0 0 — — 1 ms —"]
    assert "K3 reuses a conversation's cached prefix" in words
    for granularity in ("request", "hour", "day"):
        assert (f'href="/api/v1/usage/export.csv?granularity={granularity}&amp;range=24h"'
                in html)
    assert "Per-request rows are kept 90 days" in words
    assert not EXTERNAL.search(html)


def test_htmx_report_for_another_range_and_key(logged_in: Console, data: Seeded) -> None:
    response = logged_in.http.get("/usage", params={"range": "7d", "from": "", "to": "",
                                                    "key": ""}, headers=HTMX)
    assert response.status_code == 200, response.text
    assert "<html" not in response.text and 'id="usage-picker"' not in response.text
    assert response.headers["hx-push-url"] == "/usage?range=7d"
    assert [r.split(" ")[0] for r in key_rows(response.text)] == ["alpha", "beta", "no"]
    one = logged_in.http.get("/usage", params={"range": "30d", "key": data.beta},
                             headers=HTMX)
    assert one.headers["hx-push-url"] == f"/usage?range=30d&key={data.beta}"
    assert "Last 30 days · key beta" in text_of(one.text)
    assert [r.split(" ")[0] for r in key_rows(one.text)] == ["beta"]
    assert f"granularity=day&amp;range=30d&amp;key={data.beta}" in one.text


def test_a_date_typed_means_a_range_of_ones_own(logged_in: Console, data: Seeded) -> None:
    response = logged_in.http.get("/usage", params={
        "range": "24h", "from": "2026-11-27", "to": "2026-11-27", "key": ""},
        headers={**HTMX, "HX-Trigger-Name": "from"})
    assert response.status_code == 200, response.text
    assert response.headers["hx-push-url"] == "/usage?range=custom&from=2026-11-27&to=2026-11-27"
    html = response.text
    assert "2026-11-27 00:00 to 2026-11-28 00:00 UTC" in text_of(html)
    assert [r.split(" ")[0] for r in key_rows(html)] == ["beta"]
    # The picker comes back out of band, saying "custom".
    assert re.search(r'<form id="usage-picker"[^>]*hx-swap-oob="true"', html)
    assert '<option value="custom" selected>' in html
    # Picking a named range again ignores the dates still in the form.
    back = logged_in.http.get("/usage", params={
        "range": "24h", "from": "2026-11-27", "to": "2026-11-27"},
        headers={**HTMX, "HX-Trigger-Name": "range"})
    assert back.headers["hx-push-url"] == "/usage?range=24h"
    assert "hx-swap-oob" not in back.text
    assert [r.split(" ")[0] for r in key_rows(back.text)] == ["alpha", "no"]


def test_an_empty_range(logged_in: Console, data: Seeded) -> None:
    html = logged_in.http.get("/usage", params={
        "range": "custom", "from": "2026-01-01", "to": "2026-01-02"}).text
    assert "No requests in this range." in text_of(html)
    assert "No usage has been recorded yet" not in html
    assert '<option value="custom" selected>' in html
    assert 'value="2026-01-01"' in html


def test_refusals_show_in_the_reports_place(logged_in: Console, data: Seeded) -> None:
    response = logged_in.http.get("/usage", params={"range": "1y"})
    assert response.status_code == 400
    words = text_of(response.text)
    assert 'id="usage-picker"' in response.text  # the picker is still there
    assert "range: '1y' is not one of 24h, 7d, 30d or custom" in words
    missing = logged_in.http.get("/usage", params={"range": "custom"}, headers=HTMX)
    assert missing.status_code == 400 and "from: missing" in text_of(missing.text)
    unknown = logged_in.http.get("/usage", params={"key": "deadbeef"}, headers=HTMX)
    assert unknown.status_code == 404
    assert "there is no API key with prefix 'deadbeef'" in text_of(unknown.text)


def class_rows(html: str) -> dict[str, str]:
    """The service-class card's rows, as words, by class."""
    body = re.search(r'<table class="figures usage-classes".*?<tbody>(.*?)</tbody>', html, re.S)
    assert body, html
    return {m.group(1): text_of(m.group(0)).strip()
            for m in re.finditer(r'<tr data-class="([^"]+)">.*?</tr>', body.group(1), re.S)}


def test_the_class_card_follows_the_key_picked(logged_in: Console, runtime: Runtime,
                                               data: Seeded) -> None:
    """Alpha's interactive requests and beta's batch ones (`seed_classes`, through the
    gateway's writer): the card shows both for every key and only the picked key's
    otherwise, on the page and in the htmx report, and still does once the per-request rows
    are pruned (from the roll-ups)."""
    seed_classes(runtime, data)
    every = class_rows(logged_in.http.get("/usage").text)
    assert every == {"interactive": "interactive 3 2 (66.7 %) 1 1 refused at once: the first "
                                    "token would have come later than the key's class promises 0 0",
                     "batch": "batch 2 1 (50.0 %) 0 0 1"}
    for _ in range(2):  # the per-request rows, then the roll-ups alone
        for headers in ({}, HTMX):
            alpha = logged_in.http.get("/usage", params={"key": data.alpha}, headers=headers)
            assert alpha.status_code == 200, alpha.text
            assert class_rows(alpha.text) == {"interactive": every["interactive"]}
            assert "Key alpha only, by the class" in text_of(alpha.text)
            beta = logged_in.http.get("/usage", params={"key": data.beta}, headers=headers)
            assert class_rows(beta.text) == {"batch": every["batch"]}
        assert "Every key, by the class" in text_of(logged_in.http.get("/usage").text)
        runtime.db.call(lambda s: prune(s, runtime.clock.now() + dt.timedelta(days=1)))
    # a key with no judged request in the range: no card at all
    week_ago = logged_in.http.get("/usage", params={
        "range": "custom", "from": "2026-11-20", "to": "2026-11-21", "key": data.alpha})
    assert 'id="usage-classes"' not in week_ago.text


def test_login_needed(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:
        response = anonymous.get("/usage")
        assert response.status_code == 303
        assert response.headers["location"] == "/login?next=/usage"


def test_formatters() -> None:
    assert (count(0), count(1234567), count(12.6)) == ("0", "1,234,567", "13")
    assert (percent(None), percent(0.0), percent(0.12345), percent(1.0)) == (
        "—", "0.0 %", "12.3 %", "100.0 %")
    assert (millis(None), millis(0.4), millis(350), millis(1234), millis(59_999),
            millis(754_000)) == ("—", "0 ms", "350 ms", "1.23 s", "60 s", "12.6 min")
