"""Per-class SLO counts that outlive the per-request rows (issue 24): the gateway's writer
(`write_batch`) adds each request's class result to its hourly and daily roll-ups, and
`class_counts` reads whole hours and days from them and only the partial hours at a range's
ends from the per-request rows. A real SQLite database migrated by alembic (the `db`
fixture): records written, every per-request row pruned, the counts still right, for every
key and for one; the roll-up CSV carries them.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import itertools

from sqlalchemy import func, select

from appliance.db.database import Database
from appliance.db.models import UsageRequest
from appliance.gateway import slo
from appliance.gateway.report import rollup_rows
from appliance.gateway.usage import (
    REFUSAL_COLUMNS,
    RESULT_COLUMNS,
    ClassCount,
    UsageRecord,
    class_counts,
    pieces,
    prune,
    write_batch,
)
from appliance.gateway.usage_csv import rollup_csv

UTC = dt.UTC
H = dt.timedelta(hours=1)
D = dt.timedelta(days=1)
T0 = dt.datetime(2026, 11, 27, 22, 0, tzinfo=UTC)  # a day boundary two hours later


def request(key_id: int | None, started: dt.datetime, cls: str, result: str,
            outcome: str = "ok") -> UsageRecord:
    status = 429 if result == slo.REFUSED else 200
    return UsageRecord(key_id, "kimi-k3", "chat", True, status, outcome, 1000, 100, 0,
                       started, started + dt.timedelta(seconds=2), 1.0, 300.0, 2000.0,
                       service_class=cls, slo=result)


# 2 keys, 2 classes, spread over three UTC days; a few unjudged (a bad body, no key).
HISTORY = [
    request(1, T0 + dt.timedelta(minutes=10), "interactive", slo.MET),
    request(1, T0 + dt.timedelta(minutes=50), "interactive", slo.MISSED_TTFT),
    request(1, T0 + H + dt.timedelta(minutes=5), "interactive", slo.REFUSED,
            slo.PREDICTED_MISS),
    request(2, T0 + 2 * H + dt.timedelta(minutes=1), "batch", slo.MET),
    request(2, T0 + 2 * H + dt.timedelta(minutes=59), "batch", slo.REFUSED, "queue_timeout"),
    request(1, T0 + 5 * H + dt.timedelta(minutes=30), "interactive", slo.MET),
    request(1, T0 + 5 * H + dt.timedelta(minutes=31), "batch", slo.MISSED_DECODE),  # moved
    request(2, T0 + 26 * H + dt.timedelta(minutes=20), "batch", slo.REFUSED, "queue_full"),
    request(1, T0 + 27 * H, "interactive", slo.MET),
    request(1, T0 + 27 * H + dt.timedelta(minutes=1), "interactive", "", "bad_request"),
    request(None, T0 + 27 * H + dt.timedelta(minutes=2), "", "", "unauthorized"),
]


def expected(records: list[UsageRecord], start: dt.datetime, end: dt.datetime,
             key_id: int | None = None) -> list[ClassCount]:
    """The counts straight from the records, as the per-request rows gave them."""
    mine = [r for r in records if start <= r.started_at < end and r.slo
            and (key_id is None or r.key_id == key_id)]
    out = []
    for name in sorted({r.service_class for r in mine}):
        of = [r for r in mine if r.service_class == name]
        reasons: dict[str, int] = {}
        for r in of:
            if r.slo == slo.REFUSED:
                reasons[r.outcome] = reasons.get(r.outcome, 0) + 1
        out.append(ClassCount(name, *(sum(r.slo == s for r in of) for s in slo.RESULTS),
                              tuple(sorted(reasons.items(), key=lambda i: (-i[1], i[0])))))
    return out


def kept(db: Database) -> int:
    return db.call(lambda s: s.scalar(select(func.count(UsageRequest.id))))


def test_the_roll_ups_count_every_result_and_refusal_the_gateway_sends() -> None:
    assert set(RESULT_COLUMNS) == set(slo.RESULTS)
    assert set(REFUSAL_COLUMNS) == slo.REFUSALS  # a new refusal code needs its column


def test_pieces_tile_the_range_with_whole_days_and_hours_from_the_roll_ups() -> None:
    at = dt.datetime(2026, 11, 28, 21, 40, tzinfo=UTC)
    assert pieces(at, at + 4 * D) == (
        ("request", at, at.replace(minute=0) + H),
        ("hour", at.replace(minute=0) + H, dt.datetime(2026, 11, 29, tzinfo=UTC)),
        ("day", dt.datetime(2026, 11, 29, tzinfo=UTC), dt.datetime(2026, 12, 2, tzinfo=UTC)),
        ("hour", dt.datetime(2026, 12, 2, tzinfo=UTC), dt.datetime(2026, 12, 2, 21, tzinfo=UTC)),
        ("request", dt.datetime(2026, 12, 2, 21, tzinfo=UTC), at + 4 * D))
    hour = at.replace(minute=0)
    assert pieces(hour, hour + H) == (("hour", hour, hour + H),)  # the dashboard at :00
    assert pieces(at, at + dt.timedelta(minutes=30)) == (("request", at, at + 30 * (H / 60)),)
    assert pieces(at, at) == ()
    # Any range, cut anywhere: the parts follow each other, start to end, none empty, and
    # the roll-up parts are whole buckets.
    starts = [T0 + dt.timedelta(minutes=m) for m in (0, 1, 59, 60, 61, 23 * 60, 24 * 60 + 7)]
    lengths = [dt.timedelta(minutes=m) for m in (1, 59, 60, 61, 25 * 60, 3 * 24 * 60 + 13)]
    for start, length in itertools.product(starts, lengths):
        parts = pieces(start, start + length)
        assert parts[0][1] == start and parts[-1][2] == start + length
        for (_, _, end), (_, begin, _) in itertools.pairwise(parts):
            assert end == begin
        for source, begin, end in parts:
            assert begin < end
            if source == "hour":
                assert begin.minute == 0 and end.minute == 0
            if source == "day":
                assert (begin.hour, begin.minute, end.hour, end.minute) == (0, 0, 0, 0)


def test_the_counts_outlive_the_per_request_rows(db: Database) -> None:
    db.call(lambda s: write_batch(s, HISTORY[:5]))
    db.call(lambda s: write_batch(s, HISTORY[5:]))  # a second batch adds to the same rows
    spans = [(T0, T0 + 3 * D),  # by day and hour
             (T0 - 2 * H, T0 + 28 * H),  # hours around whole days
             (T0 + H, T0 + 3 * H)]  # two hours
    before = {(a, b, k): db.call(lambda s, a=a, b=b, k=k: class_counts(s, a, b, k))
              for a, b in spans for k in (None, 1, 2)}
    for (a, b, k), counts in before.items():
        assert counts == expected(HISTORY, a, b, k), (a, b, k)
    assert before[(T0, T0 + 3 * D, None)] == [
        ClassCount("batch", met=1, refused=2, missed_decode=1,
                   refusals=(("queue_full", 1), ("queue_timeout", 1))),
        ClassCount("interactive", met=3, refused=1, missed_ttft=1,
                   refusals=((slo.PREDICTED_MISS, 1),))]
    assert before[(T0, T0 + 3 * D, 2)] == [ClassCount(
        "batch", met=1, refused=2, refusals=(("queue_full", 1), ("queue_timeout", 1)))]

    assert db.call(lambda s: prune(s, T0 + 10 * D)) == len(HISTORY)
    assert kept(db) == 0
    after = {(a, b, k): db.call(lambda s, a=a, b=b, k=k: class_counts(s, a, b, k))
             for a, b in spans for k in (None, 1, 2)}
    assert after == before


def test_a_partial_hour_is_read_from_the_per_request_rows(db: Database) -> None:
    db.call(lambda s: write_batch(s, HISTORY))
    inside = (T0 + dt.timedelta(minutes=30), T0 + dt.timedelta(minutes=90))
    assert db.call(lambda s: class_counts(s, *inside)) == [ClassCount(
        "interactive", missed_ttft=1, refused=1, refusals=((slo.PREDICTED_MISS, 1),))]
    # Once pruned, a partial hour has only the rows left: here none (the whole hours are
    # still counted from the roll-ups).
    db.call(lambda s: prune(s, T0 + 10 * D))
    assert db.call(lambda s: class_counts(s, *inside)) == []
    assert db.call(lambda s: class_counts(s, T0, T0 + 2 * H)) == expected(
        HISTORY, T0, T0 + 2 * H)


def test_the_roll_up_csv_carries_each_class_and_its_counts(db: Database) -> None:
    db.call(lambda s: write_batch(s, HISTORY))
    db.call(lambda s: prune(s, T0 + 10 * D))
    rows = db.call(lambda s: rollup_rows(s, T0.replace(hour=0), T0 + 3 * D, "day"))
    table = list(csv.DictReader(io.StringIO("".join(rollup_csv(rows, {})))))
    first_day = [(r["key_name"], r["service_class"], r["requests"], r["slo_met"],
                  r["slo_refused"], r["slo_missed_ttft"], r["slo_missed_decode"],
                  r["refused_predicted_miss"], r["refused_queue_full"],
                  r["refused_queue_timeout"])
                 for r in table if r["bucket"] == "2026-11-27T00:00:00Z"]
    assert first_day == [("key #1", "interactive", "3", "1", "1", "1", "0", "1", "0", "0")]
    second = {(r["key_name"], r["service_class"]): r for r in table
              if r["bucket"] == "2026-11-28T00:00:00Z"}
    assert set(second) == {("key #1", "interactive"), ("key #1", "batch"),
                           ("key #2", "batch")}
    assert (second[("key #2", "batch")]["slo_met"],
            second[("key #2", "batch")]["refused_queue_timeout"]) == ("1", "1")
    assert second[("key #1", "batch")]["slo_missed_decode"] == "1"
    third = {(r["key_name"], r["service_class"]): r["requests"] for r in table
             if r["bucket"] == "2026-11-29T00:00:00Z"}
    # the unjudged bad body counts under its class; the request refused before a key, under
    # none
    assert third == {("key #2", "batch"): "1", ("key #1", "interactive"): "2",
                     ("no key (refused)", ""): "1"}
