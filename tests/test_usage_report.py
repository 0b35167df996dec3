"""The usage report's pure core (`appliance.gateway.report`) and its CSV writers
(`appliance.gateway.usage_csv`): ranges resolved to whole buckets, sums and rates (None where
there is nothing to divide), the per-key rows and their order, the series with its empty
buckets, and CSV that a spreadsheet reads back cell for cell, whatever a name holds.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from dataclasses import replace

import pytest

from appliance.errors import ApplianceError
from appliance.gateway.report import (
    NO_KEY,
    KeyLabel,
    RollupRow,
    Span,
    Usage,
    build_report,
    check_prefix,
    per_key,
    resolve_span,
    series,
)
from appliance.gateway.usage import UsageRecord
from appliance.gateway.usage_csv import (
    REQUEST_COLUMNS,
    ROLLUP_COLUMNS,
    RequestRow,
    csv_line,
    export_filename,
    request_csv,
    rollup_csv,
)

UTC = dt.UTC
NOW = dt.datetime(2026, 11, 30, 12, 34, 56, tzinfo=UTC)
H = dt.timedelta(hours=1)
LABELS = {1: KeyLabel(1, "alpha", "aaaa1111"), 2: KeyLabel(2, "beta", "bbbb2222", revoked=True)}


def at(day: int, hour: int) -> dt.datetime:
    return dt.datetime(2026, 11, day, hour, tzinfo=UTC)


def row(bucket: dt.datetime, key_id: int = 1, model: str = "kimi-k3", *, requests: int = 1,
        errors: int = 0, prompt: int = 0, completion: int = 0, cached: int = 0,
        duration: float = 0.0, ttft: float = 0.0, ttft_count: int = 0, appended: int = 0,
        rewritten: int = 0) -> RollupRow:
    return RollupRow(bucket, key_id, model, requests, errors, prompt, completion, cached,
                     duration, ttft, ttft_count, appended, rewritten)


def problem(code: str, *args: str | None) -> ApplianceError:
    with pytest.raises(ApplianceError) as caught:
        resolve_span(*args, now=NOW)  # type: ignore[arg-type]
    assert caught.value.code == code, caught.value
    assert caught.value.status == 400
    return caught.value


# --- ranges -------------------------------------------------------------------------------------


def test_named_ranges_are_whole_buckets_ending_with_the_current_one() -> None:
    day = resolve_span("24h", None, None, NOW)
    assert (day.start, day.end, day.granularity) == (at(29, 13), at(30, 13), "hour")
    assert len(day.buckets()) == 24 and day.buckets()[-1] == at(30, 12)
    assert resolve_span(None, None, None, NOW) == day  # the default
    assert resolve_span("", "", "", NOW) == day
    week = resolve_span("7d", None, None, NOW)
    assert (week.start, week.end, week.granularity) == (at(24, 0), dt.datetime(
        2026, 12, 1, tzinfo=UTC), "day")
    assert len(week.buckets()) == 7
    month = resolve_span("30d", "", None, NOW)
    assert month.granularity == "day" and len(month.buckets()) == 30
    assert month.start == dt.datetime(2026, 11, 1, tzinfo=UTC)
    assert (day.title, week.title) == ("Last 24 hours", "Last 7 days")


def test_custom_ranges_by_date_and_time() -> None:
    # A bare `to` date includes that day; more than three days goes by day.
    span = resolve_span(None, "2026-11-01", "2026-11-05", NOW)
    assert (span.name, span.start, span.end, span.granularity) == (
        "custom", at(1, 0), at(6, 0), "day")
    assert span.title == "2026-11-01 to 2026-11-05 UTC"
    # Up to three days goes by hour; times are floored/ceiled to whole hours; no zone is UTC,
    # another zone is converted.
    span = resolve_span("custom", "2026-11-28T10:30", "2026-11-29T02:15+01:00", NOW)
    assert (span.start, span.end, span.granularity) == (at(28, 10), at(29, 2), "hour")
    assert span.title == "2026-11-28 10:00 to 2026-11-29 02:00 UTC"
    # Exactly three days is still hourly; `to` defaults to now.
    span = resolve_span(None, "2026-11-27T12:34:56Z", None, NOW)
    assert (span.start, span.end, span.granularity) == (at(27, 12), at(30, 13), "hour")
    assert len(span.buckets()) == 73


def test_a_span_asks_for_itself_again() -> None:
    assert resolve_span("7d", None, None, NOW).query("aaaa1111") == "range=7d&key=aaaa1111"
    custom = resolve_span(None, "2026-11-01", "2026-11-05", NOW)
    assert custom.query() == "from=2026-11-01T00%3A00%3A00Z&to=2026-11-06T00%3A00%3A00Z"
    again = resolve_span(None, "2026-11-01T00:00:00Z", "2026-11-06T00:00:00Z", NOW)
    assert again == custom
    assert custom.to_dict() == {"name": "custom", "title": "2026-11-01 to 2026-11-05 UTC",
                                "start": "2026-11-01T00:00:00Z",
                                "end": "2026-11-06T00:00:00Z", "granularity": "day"}


def test_bad_ranges_name_the_parameter_and_what_it_allows() -> None:
    error = problem("usage_range_invalid", "1y", None, None)
    assert error.message.startswith("range: '1y'") and "24h, 7d, 30d" in error.message
    assert "range=24h|7d|30d" in error.hint
    error = problem("usage_range_conflict", "7d", "2026-11-01", None)
    assert "range=7d" in error.message and "from/to" in error.message
    error = problem("usage_range_incomplete", None, None, "2026-11-05")
    assert error.message.startswith("from: missing")
    assert problem("usage_range_incomplete", "custom", None, None).message.startswith("from:")
    error = problem("usage_time_invalid", None, "yesterday", None)
    assert error.message == "from: 'yesterday' is not a date or time"
    assert "ISO 8601" in error.hint
    error = problem("usage_time_invalid", None, "2026-11-01", "2026-13-01")
    assert error.message.startswith("to: '2026-13-01'")
    error = problem("usage_range_empty", None, "2026-11-05", "2026-11-04")
    assert "is not before" in error.message
    error = problem("usage_range_too_long", None, "2025-01-01", "2026-11-01")
    assert "366" in error.message


def test_key_prefixes() -> None:
    assert check_prefix(" AAAA1111 ") == "aaaa1111"
    for bad in ("aaaa111", "aaaa11112", "sk-aaaa1111", "zzzz1111", ""):
        with pytest.raises(ApplianceError) as caught:
            check_prefix(bad)
        assert caught.value.code == "usage_key_invalid" and caught.value.status == 400
        assert caught.value.message.startswith("key: ")


# --- figures ------------------------------------------------------------------------------------


def test_sums_and_rates() -> None:
    usage = Usage.of([
        row(at(30, 10), requests=3, errors=1, prompt=1000, completion=300, cached=250,
            duration=3000.0, ttft=600.0, ttft_count=2, appended=1, rewritten=1),
        row(at(30, 11), key_id=2, requests=1, prompt=1000, completion=100, cached=750,
            duration=1000.0, ttft=200.0, ttft_count=1, appended=2),
    ])
    assert (usage.requests, usage.errors, usage.tokens) == (4, 1, 2400)
    assert usage.error_rate == 0.25
    assert usage.cache_hit_rate == 0.5  # 1000 cached of 2000 prompt tokens
    assert usage.mean_ttft_ms == pytest.approx(800 / 3)  # over the timed requests only
    assert usage.mean_duration_ms == 1000.0
    assert usage.rewrite_rate == 0.25  # 1 rewritten of 4 continued conversations
    figures = usage.to_dict()
    assert figures["error_pct"] == 25.0 and figures["cache_hit_pct"] == 50.0
    assert figures["mean_ttft_ms"] == 266.7 and figures["rewrite_pct"] == 25.0


def test_nothing_to_divide_is_none_not_zero() -> None:
    empty = Usage.of([])
    assert (empty.requests, empty.tokens) == (0, 0)
    assert empty.error_rate is None and empty.cache_hit_rate is None
    assert empty.mean_ttft_ms is None and empty.mean_duration_ms is None
    assert empty.rewrite_rate is None
    # Requests, but no prompt tokens, no first token timed, no continued conversation.
    refused = Usage.of([row(at(30, 10), key_id=0, requests=2, errors=2, duration=4.0)])
    assert refused.error_rate == 1.0 and refused.mean_duration_ms == 2.0
    assert refused.cache_hit_rate is None and refused.mean_ttft_ms is None
    assert refused.rewrite_rate is None
    assert refused.to_dict()["rewrite_pct"] is None


def test_per_key_rows_most_requests_first_with_labels_for_every_key() -> None:
    rows = [row(at(30, 10), key_id=1, requests=2), row(at(30, 11), key_id=1, requests=3,
                                                       model="other"),
            row(at(30, 10), key_id=0, requests=5), row(at(30, 10), key_id=2, requests=5),
            row(at(30, 10), key_id=9, requests=1)]
    keys = per_key(rows, LABELS)
    # Most requests first; a tie goes by name. Key 0 and an id no key has get a label too.
    assert [(k.key.name, k.usage.requests) for k in keys] == [
        ("alpha", 5), ("beta", 5), ("no key (refused)", 5), ("key #9", 1)]
    assert keys[1].key.revoked and keys[2].key == NO_KEY and keys[3].key.prefix == ""
    assert keys[0].to_dict()["prefix"] == "aaaa1111" and keys[0].to_dict()["requests"] == 5


def test_series_fills_every_bucket_and_sums_within_one() -> None:
    span = Span("custom", at(30, 8), at(30, 12), "hour")
    rows = [row(at(30, 9), key_id=1, requests=2, prompt=100, completion=10, cached=40),
            row(at(30, 9), key_id=2, model="other", requests=1, errors=1, prompt=50),
            row(at(30, 11), key_id=1, requests=4, completion=7),
            row(at(30, 12), key_id=1, requests=99)]  # after the span: left out
    points = series(rows, span)
    assert [p.bucket for p in points] == [at(30, 8), at(30, 9), at(30, 10), at(30, 11)]
    assert [p.requests for p in points] == [0, 3, 0, 4]
    nine = points[1]
    assert (nine.errors, nine.prompt_tokens, nine.completion_tokens, nine.cached_tokens,
            nine.tokens) == (1, 150, 10, 40, 160)
    assert [p.requests for p in series(rows, span, key_id=2)] == [0, 1, 0, 0]
    assert points[1].to_dict() == {"bucket": "2026-11-30T09:00:00Z", "requests": 3,
                                   "errors": 1, "prompt_tokens": 150,
                                   "completion_tokens": 10, "cached_tokens": 40}


def test_daily_series_and_report_limited_to_a_key() -> None:
    span = resolve_span("7d", None, None, NOW)
    rows = [row(at(24, 0), key_id=1, requests=1), row(at(27, 0), key_id=2, requests=2),
            row(at(30, 0), key_id=1, requests=3), row(at(23, 0), key_id=1, requests=50)]
    report = build_report(rows, LABELS, span)
    assert report.totals.requests == 6  # the 23rd is before the span
    assert [p.requests for p in report.series] == [1, 0, 0, 2, 0, 0, 3]
    only = build_report(rows, LABELS, span, LABELS[1])
    assert only.totals.requests == 4 and [k.key.id for k in only.keys] == [1]
    assert [p.requests for p in only.series] == [1, 0, 0, 0, 0, 0, 3]
    body = only.to_dict()
    assert body["key"] == {"key_id": 1, "name": "alpha", "prefix": "aaaa1111"}
    assert body["range"]["granularity"] == "day" and len(body["series"]) == 7


def test_an_empty_range() -> None:
    span = resolve_span("24h", None, None, NOW)
    report = build_report([], LABELS, span)
    assert report.empty and report.keys == [] and report.totals == Usage()
    assert len(report.series) == 24 and not any(p.requests for p in report.series)
    assert report.to_dict()["totals"]["cache_hit_pct"] is None


# --- CSV ----------------------------------------------------------------------------------------


def parse(lines: list[str]) -> list[list[str]]:
    assert all(line.endswith("\r\n") for line in lines)
    return list(csv.reader(io.StringIO("".join(lines))))


def record(key_id: int | None, model: str = "kimi-k3", **changes: object) -> UsageRecord:
    values: dict[str, object] = dict(
        key_id=key_id, model=model, endpoint="chat", stream=True, status=200, outcome="ok",
        prompt_tokens=1200, completion_tokens=80, cached_tokens=1024,
        started_at=at(30, 10), ended_at=at(30, 10) + dt.timedelta(seconds=2.5),
        queue_ms=1.5, ttft_ms=350.0, duration_ms=2500.0, history="appended")
    values.update(changes)
    return UsageRecord(**values)  # type: ignore[arg-type]


def test_request_csv_escapes_commas_quotes_and_newlines() -> None:
    labels = {1: KeyLabel(1, 'ops, "night" team', "aaaa1111"),
              2: KeyLabel(2, "line\nbreak", "bbbb2222")}
    lines = list(request_csv([RequestRow(7, record(1)), RequestRow(8, record(2)),
                              RequestRow(9, record(None, status=401, outcome="unauthorized",
                                                    ttft_ms=None, stream=False,
                                                    history=""))], labels))
    assert lines[0] == ",".join(REQUEST_COLUMNS) + "\r\n"
    assert '"ops, ""night"" team"' in lines[1]
    table = parse(lines)
    assert len(table) == 4 and table[0] == list(REQUEST_COLUMNS)
    first = dict(zip(REQUEST_COLUMNS, table[1], strict=True))
    assert first == {
        "id": "7", "started_at": "2026-11-30T10:00:00Z",
        "ended_at": "2026-11-30T10:00:02.500000Z", "key_name": 'ops, "night" team',
        "key_prefix": "aaaa1111", "model": "kimi-k3", "endpoint": "chat", "stream": "true",
        "status": "200", "outcome": "ok", "prompt_tokens": "1200", "completion_tokens": "80",
        "cached_tokens": "1024", "queue_ms": "1.5", "ttft_ms": "350.0",
        "duration_ms": "2500.0", "history": "appended", "service_class": "", "slo": ""}
    assert table[2][3] == "line\nbreak"
    refused = dict(zip(REQUEST_COLUMNS, table[3], strict=True))
    assert (refused["key_name"], refused["key_prefix"], refused["ttft_ms"],
            refused["stream"]) == ("no key (refused)", "", "", "false")


def test_cells_a_spreadsheet_would_run_are_defused() -> None:
    labels = {1: KeyLabel(1, "@admin", "aaaa1111")}
    lines = list(request_csv([RequestRow(1, record(1, model='=HYPERLINK("http://x","y")'))],
                             labels))
    cells = parse(lines)[1]
    assert cells[3] == "'@admin" and cells[5] == "'=HYPERLINK(\"http://x\",\"y\")"
    assert parse([csv_line(["-1+2", "+x", "\tz", "plain", -3])])[0] == [
        "'-1+2", "'+x", "'\tz", "plain", "-3"]  # numbers stay numbers


def test_rollup_csv_and_empty_exports() -> None:
    rows = [row(at(30, 10), key_id=1, model="a,b", requests=3, errors=1, prompt=10,
                completion=5, cached=4, duration=30.5, ttft=12.0, ttft_count=2, appended=1,
                rewritten=1), row(at(30, 11), key_id=0, requests=2, errors=2)]
    rows[0] = replace(rows[0], service_class="batch", slo_met=1, slo_refused=2,
                      slo_missed_ttft=0, slo_missed_decode=0, refused_queue_timeout=2)
    table = parse(list(rollup_csv(rows, LABELS)))
    assert table[0] == list(ROLLUP_COLUMNS)
    assert table[1] == ["2026-11-30T10:00:00Z", "alpha", "aaaa1111", "a,b", "3", "1", "10",
                        "5", "4", "30.5", "12.0", "2", "1", "1",
                        "batch", "1", "2", "0", "0", "0", "0", "2"]  # the class's counts last
    assert table[2][14:] == ["", "0", "0", "0", "0", "0", "0", "0"]  # no class known
    assert table[2][:3] == ["2026-11-30T11:00:00Z", "no key (refused)", ""]
    assert list(rollup_csv([], LABELS)) == [",".join(ROLLUP_COLUMNS) + "\r\n"]
    assert list(request_csv([], LABELS)) == [",".join(REQUEST_COLUMNS) + "\r\n"]


def test_export_filenames() -> None:
    span = resolve_span("24h", None, None, NOW)
    assert export_filename("hour", span) == "usage-hour-20261129T1300Z-20261130T1300Z.csv"
    assert export_filename("request", span, "aaaa1111") == (
        "usage-request-20261129T1300Z-20261130T1300Z-aaaa1111.csv")
