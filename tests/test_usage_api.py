"""The usage admin API (`/api/v1/usage/`) over real loopback HTTP.

A live server over a migrated database into which the gateway's own writer
(`appliance.gateway.usage.write_batch`) put a small history at the fake clock's time
(2026-11-30 12:00 UTC): key "alpha" busy this morning, key "beta" three days ago, and a request
refused before any key. Covers the report per range and key, the CSV exports (per request,
streamed page by page; hourly and daily roll-ups), the chart, every bad parameter (a 4xx that
names it) and the login the routes need.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from appliance.gateway import keys
from appliance.gateway.report import find_key
from appliance.gateway.usage import UsageRecord, write_batch
from appliance.runtime import Runtime
from tests.conftest import Console, LiveServer, problem
from tests.test_engine_api import new_token

API = "/api/v1/usage"
UTC = dt.UTC


@dataclass(frozen=True)
class Seeded:
    alpha: str   # prefixes
    beta: str
    secrets: tuple[str, ...]  # the keys themselves: never in any answer


def record(key_id: int | None, started: dt.datetime, *, model: str = "kimi-k3",
           status: int = 200, outcome: str = "ok", prompt: int = 1000, completion: int = 100,
           cached: int = 0, ttft: float | None = 300.0, duration: float = 2000.0,
           history: str = "") -> UsageRecord:
    return UsageRecord(key_id, model, "chat", True, status, outcome, prompt, completion,
                       cached, started, started + dt.timedelta(milliseconds=duration), 2.0,
                       ttft, duration, history)


def seed(runtime: Runtime) -> Seeded:
    """Two keys and six requests, through the gateway's writer (roll-ups included)."""
    now = runtime.clock.now()  # 2026-11-30 12:00 UTC
    secret = runtime.secret

    def write(session: Any) -> Seeded:
        alpha_key, alpha = keys.create_key(session, secret, name="alpha", owner="team a",
                                           by="alice", now=now - dt.timedelta(days=10))
        beta_key, beta = keys.create_key(session, secret, name="beta", owner="",
                                         by="alice", now=now - dt.timedelta(days=10))
        morning = now.replace(hour=11, minute=10)
        write_batch(session, [
            record(alpha.id, morning, prompt=2000, completion=200, cached=1500, ttft=200.0,
                   history="appended"),
            record(alpha.id, morning, prompt=1000, completion=100, cached=500, ttft=400.0,
                   history="rewritten"),
            record(alpha.id, morning + dt.timedelta(minutes=5), status=504,
                   outcome="engine_timeout", prompt=1000, completion=0, ttft=None,
                   model='=evil,"model"'),
            record(alpha.id, now.replace(hour=9, minute=30), prompt=500, completion=50,
                   history="appended"),
            record(None, morning + dt.timedelta(minutes=10), status=401,
                   outcome="unauthorized", prompt=0, completion=0, ttft=None, duration=1.0),
            record(beta.id, now - dt.timedelta(days=3), prompt=4000, completion=400,
                   cached=4000, ttft=100.0),
        ])
        return Seeded(alpha.prefix, beta.prefix, (alpha_key, beta_key))

    return runtime.db.call(write)


def seed_classes(runtime: Runtime, data: Seeded) -> None:
    """Judged requests this morning: alpha's interactive (2 met, 1 refused at once), beta's
    batch (1 met, 1 too slow)."""
    morning = runtime.clock.now().replace(hour=11, minute=20)
    judged = [("alpha", "interactive", "met", "ok"), ("alpha", "interactive", "met", "ok"),
              ("alpha", "interactive", "refused", "slo_ttft_predicted_miss"),
              ("beta", "batch", "met", "ok"), ("beta", "batch", "missed_decode", "ok")]

    def write(session: Any) -> None:
        ids = {name: find_key(session, getattr(data, name)).id for name in ("alpha", "beta")}
        write_batch(session, [replace(record(ids[name], morning, outcome=outcome,
                                             status=429 if result == "refused" else 200),
                                      service_class=cls, slo=result)
                              for name, cls, result, outcome in judged])

    runtime.db.call(write)


@pytest.fixture
def data(runtime: Runtime) -> Seeded:
    return seed(runtime)


def get(console: Console, path: str = "/", **params: str) -> httpx.Response:
    return console.http.get(f"{API}{path}", params=params)


def rows_of(response: httpx.Response) -> list[dict[str, str]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    assert "\r\n" in response.text
    return list(csv.DictReader(io.StringIO(response.text)))


# --- the report -------------------------------------------------------------------------------


def test_last_24_hours_by_hour(logged_in: Console, data: Seeded) -> None:
    body = get(logged_in).json()
    assert body["range"] == {"name": "24h", "title": "Last 24 hours",
                             "start": "2026-11-29T13:00:00Z", "end": "2026-11-30T13:00:00Z",
                             "granularity": "hour"}
    assert body["key"] is None
    totals = body["totals"]
    assert (totals["requests"], totals["errors"]) == (5, 2)  # beta's is 3 days old
    assert totals["error_pct"] == 40.0
    assert (totals["prompt_tokens"], totals["completion_tokens"], totals["cached_tokens"]) \
        == (4500, 350, 2000)
    assert totals["cache_hit_pct"] == 44.44
    assert totals["mean_ttft_ms"] == 300.0  # (200 + 400 + 300) / 3 timed
    assert totals["rewrite_pct"] == 33.33  # 1 rewritten of 3 continued
    assert [(k["name"], k["prefix"], k["requests"]) for k in body["keys"]] == [
        ("alpha", data.alpha, 4), ("no key (refused)", "", 1)]
    alpha = body["keys"][0]
    assert alpha["errors"] == 1 and alpha["cache_hit_pct"] == 44.44
    assert alpha["revoked"] is False
    series = body["series"]
    assert len(series) == 24 and series[0]["bucket"] == "2026-11-29T13:00:00Z"
    by_bucket = {p["bucket"]: p for p in series}
    assert by_bucket["2026-11-30T11:00:00Z"]["requests"] == 4
    assert by_bucket["2026-11-30T11:00:00Z"]["errors"] == 2
    assert by_bucket["2026-11-30T09:00:00Z"]["prompt_tokens"] == 500
    assert sum(p["requests"] for p in series) == 5
    assert body["links"]["chart"] == f"{API}/chart.svg?range=24h"
    assert body["links"]["csv"]["request"] == f"{API}/export.csv?granularity=request&range=24h"


def test_week_by_day_and_one_key(logged_in: Console, data: Seeded) -> None:
    week = get(logged_in, range="7d").json()
    assert week["range"]["granularity"] == "day" and len(week["series"]) == 7
    assert week["totals"]["requests"] == 6
    assert [k["name"] for k in week["keys"]] == ["alpha", "beta", "no key (refused)"]
    assert [p["requests"] for p in week["series"]] == [0, 0, 0, 1, 0, 0, 5]
    beta = get(logged_in, range="30d", key=data.beta.upper()).json()
    assert beta["key"] == {"key_id": beta["keys"][0]["key_id"], "name": "beta",
                           "prefix": data.beta}
    assert beta["totals"]["requests"] == 1 and beta["totals"]["cache_hit_pct"] == 100.0
    assert len(beta["series"]) == 30
    assert beta["links"]["chart"] == f"{API}/chart.svg?range=30d&key={data.beta}"


def test_dates_of_ones_own(logged_in: Console, data: Seeded) -> None:
    body = get(logged_in, **{"from": "2026-11-27", "to": "2026-11-27"}).json()
    assert body["range"]["name"] == "custom" and body["range"]["granularity"] == "hour"
    assert len(body["series"]) == 24
    assert [k["name"] for k in body["keys"]] == ["beta"]
    morning = get(logged_in, **{"from": "2026-11-30T11:00Z", "to": "2026-11-30T11:30Z"})
    assert morning.json()["totals"]["requests"] == 4
    empty = get(logged_in, **{"from": "2026-01-01", "to": "2026-01-31"}).json()
    assert empty["totals"]["requests"] == 0 and empty["keys"] == []
    assert empty["totals"]["error_pct"] is None and len(empty["series"]) == 31


def test_the_class_counts_follow_the_key(logged_in: Console, runtime: Runtime,
                                         data: Seeded) -> None:
    assert get(logged_in).json()["classes"] == []  # nothing judged yet
    seed_classes(runtime, data)
    batch = {"name": "batch", "requests": 2, "met": 1, "met_pct": 50.0, "refused": 0,
             "refusals": [], "missed_ttft": 0, "missed_decode": 1}
    interactive = {"name": "interactive", "requests": 3, "met": 2, "met_pct": 66.67,
                   "refused": 1, "refusals": [{"code": "slo_ttft_predicted_miss", "count": 1}],
                   "missed_ttft": 0, "missed_decode": 0}
    assert get(logged_in).json()["classes"] == [batch, interactive]
    assert get(logged_in, key=data.alpha).json()["classes"] == [interactive]
    assert get(logged_in, range="30d", key=data.beta).json()["classes"] == [batch]


def test_an_empty_database(logged_in: Console) -> None:
    body = get(logged_in).json()
    assert body["totals"]["requests"] == 0 and body["keys"] == []
    assert len(body["series"]) == 24
    assert rows_of(get(logged_in, "/export.csv", granularity="request")) == []
    assert "No requests in this range" in get(logged_in, "/chart.svg").text


# --- exports ----------------------------------------------------------------------------------


def test_per_request_csv(logged_in: Console, data: Seeded, runtime: Runtime) -> None:
    response = get(logged_in, "/export.csv", granularity="request", range="7d")
    assert response.headers["content-disposition"] == (
        'attachment; filename="usage-request-20261124T0000Z-20261201T0000Z.csv"')
    assert response.headers["x-content-type-options"] == "nosniff"
    rows = rows_of(response)
    assert [r["key_name"] for r in rows] == ["beta", "alpha", "alpha", "alpha", "alpha",
                                             "no key (refused)"]
    assert [r["started_at"] for r in rows][:2] == ["2026-11-27T12:00:00Z",
                                                  "2026-11-30T09:30:00Z"]
    bad = next(r for r in rows if r["outcome"] == "engine_timeout")
    # The model is whatever the client sent: quoted, and defused for spreadsheets.
    assert bad["model"] == "'=evil,\"model\"" and bad["ttft_ms"] == "" and bad["status"] == "504"
    assert rows[-1]["key_prefix"] == "" and rows[-1]["status"] == "401"
    assert {r["key_prefix"] for r in rows[1:5]} == {data.alpha}
    hashes = runtime.db.call(lambda s: [e.key_hash for e in keys.load_entries(s)])
    for secret in (*data.secrets, *hashes):
        assert secret not in response.text
    only = rows_of(get(logged_in, "/export.csv", granularity="request", range="24h",
                       key=data.alpha))
    assert len(only) == 4 and {r["key_name"] for r in only} == {"alpha"}


def test_per_request_csv_streams_page_by_page(logged_in: Console, data: Seeded,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of two rows (the two 11:10 requests start at the same instant): every row
    once, in order, across page boundaries."""
    whole = rows_of(get(logged_in, "/export.csv", granularity="request", range="30d"))
    monkeypatch.setattr("appliance.api.usage.PAGE", 2)
    paged = rows_of(get(logged_in, "/export.csv", granularity="request", range="30d"))
    assert paged == whole and len(paged) == 6
    assert len({r["id"] for r in paged}) == 6


def test_rollup_csv(logged_in: Console, data: Seeded) -> None:
    hourly = get(logged_in, "/export.csv", granularity="hour", key=data.alpha)
    assert hourly.headers["content-disposition"] == (
        f'attachment; filename="usage-hour-20261129T1300Z-20261130T1300Z-{data.alpha}.csv"')
    rows = rows_of(hourly)
    assert [(r["bucket"], r["model"], r["requests"]) for r in rows] == [
        ("2026-11-30T09:00:00Z", "kimi-k3", "1"),
        ("2026-11-30T11:00:00Z", "'=evil,\"model\"", "1"),
        ("2026-11-30T11:00:00Z", "kimi-k3", "2")]
    assert rows[2]["appended"] == "1" and rows[2]["rewritten"] == "1"
    assert rows[2]["ttft_ms_sum"] == "600.0" and rows[2]["ttft_count"] == "2"
    daily = rows_of(get(logged_in, "/export.csv", granularity="day", range="7d"))
    assert [(r["bucket"], r["key_name"], r["requests"]) for r in daily] == [
        ("2026-11-27T00:00:00Z", "beta", "1"),
        ("2026-11-30T00:00:00Z", "no key (refused)", "1"),
        ("2026-11-30T00:00:00Z", "alpha", "1"),
        ("2026-11-30T00:00:00Z", "alpha", "3")]


def test_chart(logged_in: Console, data: Seeded) -> None:
    response = get(logged_in, "/chart.svg", range="7d", key=data.alpha)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("image/svg+xml")
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "default-src 'none'" in response.headers["content-security-policy"]
    root = ET.fromstring(response.text)  # noqa: S314 - our own answer, parsed to check it
    assert root.get("data-buckets") == "7" and root.get("data-requests-max") == "4"
    title = root.findtext("{http://www.w3.org/2000/svg}title") or ""
    assert title == f"Tokens and requests of key alpha ({data.alpha}), Last 7 days"
    assert "<script" not in response.text


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "params", "status", "code", "names"), [
    ("/", {"range": "1y"}, 400, "usage_range_invalid", ["range", "24h, 7d, 30d"]),
    ("/chart.svg", {"range": "week"}, 400, "usage_range_invalid", ["range"]),
    ("/", {"from": "soon"}, 400, "usage_time_invalid", ["from", "soon"]),
    ("/", {"to": "2026-11-30"}, 400, "usage_range_incomplete", ["from"]),
    ("/", {"range": "7d", "from": "2026-11-01"}, 400, "usage_range_conflict", ["range", "from"]),
    ("/", {"from": "2026-11-30", "to": "2026-11-01"}, 400, "usage_range_empty", ["from", "to"]),
    ("/", {"from": "2020-01-01"}, 400, "usage_range_too_long", ["366"]),
    ("/", {"key": "sk-1234"}, 400, "usage_key_invalid", ["key"]),
    ("/", {"key": "deadbeef"}, 404, "usage_key_unknown", ["key", "deadbeef"]),
    ("/export.csv", {}, 400, "usage_granularity_invalid", ["granularity", "request, hour, day"]),
    ("/export.csv", {"granularity": "minute"}, 400, "usage_granularity_invalid", ["minute"]),
    ("/export.csv", {"granularity": "hour", "range": "1d"}, 400, "usage_range_invalid", []),
    ("/export.csv", {"granularity": "request", "key": "deadbeef"}, 404, "usage_key_unknown",
     []),
])
def test_bad_parameters_are_named(logged_in: Console, path: str, params: dict[str, str],
                                  status: int, code: str, names: list[str]) -> None:
    body = problem(get(logged_in, path, **params), status, code)
    for name in names:
        assert name in body["detail"], body
    assert body["hint"]


def test_login_needed(server: LiveServer, data: Seeded, logged_in: Console) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:
        for path in ("/", "/chart.svg", "/export.csv?granularity=request"):
            response = anonymous.get(f"{API}{path}")
            problem(response, 401, "unauthorized")
            assert "alpha" not in response.text
    token = new_token(logged_in)
    with httpx.Client(base_url=server.base_url,
                      headers={"Authorization": f"Bearer {token}"}) as bearer:
        assert bearer.get(f"{API}/").json()["totals"]["requests"] == 5
