"""Goodput where people look (issue 24): the dashboard says, per service class, the share of
the last hour's requests that got their promise, were refused at once and missed it, in the
operator's words, next to the admission line; a class under 95 % is marked and points to the
Usage page. Rows written by the gateway's writer (SQLite), the page over real loopback HTTP."""

from __future__ import annotations

import datetime as dt

from appliance.gateway.usage import ClassCount, UsageRecord, write_batch
from appliance.health.dashboard_views import goodput_lines
from appliance.runtime import Runtime
from tests.conftest import Console


def test_the_words_per_class() -> None:
    (low, fine) = goodput_lines([ClassCount("interactive", 90, 6, 3, 1),
                                 ClassCount("batch", 40)])
    assert low.low and not fine.low
    assert low.words == ("90.0 % got their promise (90 of 100 requests), 6.0 % refused at "
                         "once, 4.0 % missed it (3 first tokens late, 1 stream too slow)")
    assert fine.words == ("100.0 % got their promise (40 of 40 requests), 0.0 % refused at "
                          "once, 0.0 % missed it")
    assert goodput_lines([ClassCount("idle")]) == ()  # no request: no line, no 0 of 0


def add_rows(runtime: Runtime, cls: str, slo: str, count: int, *, minutes_ago: float,
             outcome: str = "ok") -> None:
    """`count` requests, through the gateway's writer (the roll-ups too: the dashboard's
    hour, when whole, is read from them)."""
    at = runtime.clock.now() - dt.timedelta(minutes=minutes_ago)
    record = UsageRecord(None, "kimi-k3", "chat", True, 429 if slo == "refused" else 200,
                         outcome, 0, 0, 0, at, at, 0.0, None, 0.0, service_class=cls, slo=slo)
    runtime.db.call(lambda session: write_batch(session, [record] * count))


def test_the_dashboard_shows_the_last_hours_goodput_beside_admission(
        runtime: Runtime, logged_in: Console) -> None:
    page = logged_in.http.get("/").text
    assert 'id="goodput-lines"' not in page  # nothing judged yet: nothing to say
    add_rows(runtime, "interactive", "met", 19, minutes_ago=5)
    add_rows(runtime, "interactive", "refused", 1, minutes_ago=5,
             outcome="slo_ttft_predicted_miss")
    add_rows(runtime, "batch", "met", 4, minutes_ago=30)
    add_rows(runtime, "batch", "missed_decode", 50, minutes_ago=90)  # before the hour
    for headers in ({}, {"HX-Request": "true"}):  # the page, and its 10 s refresh
        page = logged_in.http.get("/", headers=headers).text
        assert page.index('id="admission-line"') < page.index('id="goodput-lines"')
        assert ('data-class="interactive" data-low="no"><strong>Interactive users, last '
                'hour:</strong> 95.0 % got their promise (19 of 20 requests), 5.0 % refused '
                'at once, 0.0 % missed it.</li>') in page
        assert ('data-class="batch" data-low="no"><strong>Batch users, last hour:</strong> '
                '100.0 % got their promise (4 of 4 requests)') in page  # the hour only
    add_rows(runtime, "interactive", "missed_ttft", 1, minutes_ago=1)
    add_rows(runtime, "interactive", "missed_decode", 4, minutes_ago=1)
    page = logged_in.http.get("/").text
    assert 'data-class="interactive" data-low="yes"' in page
    assert ("76.0 % got their promise (19 of 25 requests), 4.0 % refused at once, 20.0 % "
            "missed it (1 first token late, 4 streams too slow).") in page
    assert 'href="/usage">See the Usage page' in page
