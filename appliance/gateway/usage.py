"""Usage records: one per request the gateway answered, written in batches, summed into
hourly and daily roll-ups in the same transaction.

A roll-up row sums one bucket's requests of one key, model and service class, including what
they got of the class's promise (`slo_*`, and the early refusals by reason: `refused_*`), so
the per-class counts outlive the per-request rows (`prune`, gateway.usage_retention_days).
The gateway is the only writer (one process), so a roll-up row is read and updated in place
without a race; the same code runs on SQLite and PostgreSQL. `UsageRecord` satisfies the
tuning side's `RequestRecord` protocol (prompt, completion, cached tokens, start and end), so
the observed workload can be read straight from these rows.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from appliance.db.models import UsageDaily, UsageHourly, UsageRequest
from appliance.gateway import slo

# history: how a chat request's earlier turns relate to what this key sent before
# (appliance.gateway.history): "new", "appended", "rewritten", "unmatched", or "" (not a chat)
OK_OUTCOMES = frozenset({"ok"})
Rollup = TypeVar("Rollup", UsageHourly, UsageDaily)
# A roll-up's count of each per-class result (slo.RESULTS) and of each early refusal's
# reason (slo.REFUSALS, the error code sent); tests/test_usage_rollup_classes.py checks both
# cover the gateway's codes, so a new one cannot go uncounted.
RESULT_COLUMNS = {slo.MET: "slo_met", slo.REFUSED: "slo_refused",
                  slo.MISSED_TTFT: "slo_missed_ttft", slo.MISSED_DECODE: "slo_missed_decode"}
REFUSAL_COLUMNS = {slo.PREDICTED_MISS: "refused_predicted_miss",
                   "queue_full": "refused_queue_full", "queue_timeout": "refused_queue_timeout"}
SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens",
        "duration_ms", "ttft_ms", "ttft_count", "appended", "rewritten",
        *RESULT_COLUMNS.values(), *REFUSAL_COLUMNS.values())  # a roll-up row's sums


@dataclass(frozen=True)
class UsageRecord:
    key_id: int | None
    model: str
    endpoint: str  # "chat", "completions", "messages", "models", or "" before routing
    stream: bool
    status: int
    outcome: str  # "ok", "client_closed", or the error code sent (e.g. "queue_timeout")
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    started_at: dt.datetime
    ended_at: dt.datetime
    queue_ms: float
    ttft_ms: float | None
    duration_ms: float
    history: str = ""
    service_class: str = ""  # the key's class when it was served ("" before routing)
    slo: str = ""  # what it got of the class's promise: appliance.gateway.slo.RESULTS, or ""

    @property
    def error(self) -> bool:
        return self.outcome not in OK_OUTCOMES


def hour_of(at: dt.datetime) -> dt.datetime:
    return at.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)


def day_of(at: dt.datetime) -> dt.datetime:
    return hour_of(at).replace(hour=0)


def write_batch(session: Session, records: Sequence[UsageRecord]) -> None:
    """Insert the records and add them to their hourly and daily roll-ups."""
    if not records:
        return
    # One executemany through Core: the ORM's unit of work costs several times more per row,
    # and the gateway writes every request.
    # `vars`, not `dataclasses.asdict`: asdict deep-copies every value (the datetimes too),
    # which was over half of a flush's CPU, on the gateway's worker thread beside the streams.
    session.execute(insert(UsageRequest), [dict(vars(r)) for r in records])
    _add_to_rollup(session, UsageHourly, hour_of, records)
    _add_to_rollup(session, UsageDaily, day_of, records)


def _add_to_rollup(session: Session, model: type[Rollup],
                   bucket_of: Callable[[dt.datetime], dt.datetime],
                   records: Iterable[UsageRecord]) -> None:
    groups: dict[tuple[dt.datetime, int, str, str], list[UsageRecord]] = {}
    for r in records:
        groups.setdefault((bucket_of(r.started_at), r.key_id or 0, r.model, r.service_class),
                          []).append(r)
    for (bucket, key_id, name, cls), items in groups.items():
        row = session.scalar(select(model).where(
            model.bucket == bucket, model.key_id == key_id, model.model == name,
            model.service_class == cls))
        if row is None:
            row = model(bucket=bucket, key_id=key_id, model=name, service_class=cls,
                        **{column: 0 for column in SUMS})
            session.add(row)
        for column, value in rollup_sums(items).items():
            setattr(row, column, getattr(row, column) + value)
        session.flush()


def rollup_sums(records: Iterable[UsageRecord]) -> dict[str, int | float]:
    """What `records` add to their roll-up row, a value per column of `SUMS`. Pure. (The
    migration that split the roll-ups by class, 0016, keeps its own copy of these rules.)"""
    sums: dict[str, int | float] = dict.fromkeys(SUMS, 0)
    for r in records:
        sums["requests"] += 1
        sums["errors"] += r.error
        sums["prompt_tokens"] += r.prompt_tokens
        sums["completion_tokens"] += r.completion_tokens
        sums["cached_tokens"] += r.cached_tokens
        sums["duration_ms"] += r.duration_ms
        if r.ttft_ms is not None:
            sums["ttft_ms"] += r.ttft_ms
            sums["ttft_count"] += 1
        if r.history in ("appended", "rewritten"):
            sums[r.history] += 1
        if r.slo in RESULT_COLUMNS:
            sums[RESULT_COLUMNS[r.slo]] += 1
            if r.slo == slo.REFUSED and r.outcome in REFUSAL_COLUMNS:
                sums[REFUSAL_COLUMNS[r.outcome]] += 1
    sums["duration_ms"] = float(sums["duration_ms"])
    sums["ttft_ms"] = float(sums["ttft_ms"])
    return sums


def prune(session: Session, before: dt.datetime) -> int:
    """Delete per-request rows that started before `before`; the roll-ups stay."""
    result = session.execute(delete(UsageRequest).where(UsageRequest.started_at < before))
    return int(getattr(result, "rowcount", 0) or 0)


def tokens_today(session: Session, now: dt.datetime) -> dict[int, int]:
    """Tokens (prompt + completion) per key since 00:00 UTC, from the daily roll-up: where a
    restarted gateway's per-day counters start."""
    rows = session.execute(select(UsageDaily.key_id, UsageDaily.prompt_tokens,
                                  UsageDaily.completion_tokens)
                           .where(UsageDaily.bucket == day_of(now)))
    totals: dict[int, int] = {}
    for key_id, prompt, completion in rows:
        totals[key_id] = totals.get(key_id, 0) + int(prompt) + int(completion)
    return totals


@dataclass(frozen=True)
class ClassCount:
    """One service class's requests in a range by what they got of its promise; `refusals`:
    (error code, count) of the ones refused, most first."""

    name: str
    met: int = 0
    refused: int = 0
    missed_ttft: int = 0
    missed_decode: int = 0
    refusals: tuple[tuple[str, int], ...] = ()

    @property
    def judged(self) -> int:
        return self.met + self.refused + self.missed_ttft + self.missed_decode

    @property
    def attainment(self) -> float | None:
        """The share of its requests that got the promise (None: no request)."""
        return self.met / self.judged if self.judged else None

    def to_dict(self) -> dict[str, Any]:
        share = self.attainment
        return {"name": self.name, "requests": self.judged, "met": self.met,
                "met_pct": None if share is None else round(share * 100, 2),
                "refused": self.refused,
                "refusals": [{"code": code, "count": n} for code, n in self.refusals],
                "missed_ttft": self.missed_ttft, "missed_decode": self.missed_decode}


Piece = tuple[str, dt.datetime, dt.datetime]  # ("request" | "hour" | "day", start, end)
HOUR, DAY = dt.timedelta(hours=1), dt.timedelta(days=1)


def pieces(start: dt.datetime, end: dt.datetime) -> tuple[Piece, ...]:
    """[start, end) cut into the parts `class_counts` reads from each source, in order:
    whole UTC days ("day"), the whole hours around them ("hour"), and the partial hours at
    either end ("request"). Pure; the parts tile the range exactly."""
    if start >= end:
        return ()
    first = _ceil(start, hour_of, HOUR)
    last = hour_of(end)
    if first >= last:  # no whole hour inside
        return (("request", start, end),)
    out: list[Piece] = [("request", start, first)] if start < first else []
    day_first, day_last = _ceil(first, day_of, DAY), day_of(last)
    if day_first < day_last:
        out += [("hour", first, day_first)] if first < day_first else []
        out.append(("day", day_first, day_last))
        out += [("hour", day_last, last)] if day_last < last else []
    else:
        out.append(("hour", first, last))
    out += [("request", last, end)] if last < end else []
    return tuple(out)


def _ceil(at: dt.datetime, floor_of: Callable[[dt.datetime], dt.datetime],
          step: dt.timedelta) -> dt.datetime:
    floor = floor_of(at)
    return floor if floor == at else floor + step


def class_counts(session: Session, start: dt.datetime, end: dt.datetime,
                 key_id: int | None = None) -> list[ClassCount]:
    """Per service class, the requests that started in [start, end) (of key `key_id` only,
    when given) by what they got of its promise, classes by name.

    Whole UTC days are read from the daily roll-ups, whole hours from the hourly ones, and
    only the partial hours at the range's ends from the per-request rows (`pieces`). Why
    that and not "the roll-ups only where the per-request rows are gone": a roll-up row is
    written in the same transaction as its requests' rows and never pruned, so over a whole
    bucket it says exactly what the rows said, at any age; the rows are needed only inside
    an hour, which no roll-up resolves. Where the rows stop is not something the database
    records (the oldest row left is not the cut-off, and gateway.usage_retention_days can
    change), so a split by retention could count a bucket twice or not at all. A partial
    hour older than the retention counts only the rows left (the Usage page's ranges are
    whole buckets; the dashboard's last hour is always kept)."""
    counts: dict[str, dict[str, int]] = {}
    refusals: dict[str, dict[str, int]] = {}

    def add(name: str, key: str, value: int, into: dict[str, dict[str, int]]) -> None:
        if value:
            mine = into.setdefault(name, {})
            mine[key] = mine.get(key, 0) + value

    for source, begin, finish in pieces(start, end):
        if source == "request":
            for name, result, outcome, count in _request_counts(session, begin, finish,
                                                                key_id):
                add(name, result, count, counts)
                if result == slo.REFUSED:
                    add(name, outcome, count, refusals)
            continue
        found = (_rollup_counts(session, UsageHourly, begin, finish, key_id)
                 if source == "hour" else
                 _rollup_counts(session, UsageDaily, begin, finish, key_id))
        for name, *values in found:
            results, reasons = values[:len(RESULT_COLUMNS)], values[len(RESULT_COLUMNS):]
            for result, value in zip(RESULT_COLUMNS, results, strict=True):
                add(name, result, int(value or 0), counts)
            for code, value in zip(REFUSAL_COLUMNS, reasons, strict=True):
                add(name, code, int(value or 0), refusals)
    return [ClassCount(name, mine.get(slo.MET, 0), mine.get(slo.REFUSED, 0),
                       mine.get(slo.MISSED_TTFT, 0), mine.get(slo.MISSED_DECODE, 0),
                       tuple(sorted(refusals.get(name, {}).items(),
                                    key=lambda i: (-i[1], i[0]))))
            for name, mine in sorted(counts.items())]


def _request_counts(session: Session, start: dt.datetime, end: dt.datetime,
                    key_id: int | None) -> list[tuple[str, str, str, int]]:
    query = (select(UsageRequest.service_class, UsageRequest.slo, UsageRequest.outcome,
                    func.count(UsageRequest.id))
             .where(UsageRequest.started_at >= start, UsageRequest.started_at < end,
                    UsageRequest.slo != ""))
    if key_id is not None:
        query = query.where(UsageRequest.key_id == key_id)
    rows = session.execute(query.group_by(UsageRequest.service_class, UsageRequest.slo,
                                          UsageRequest.outcome))
    return [(name, result, outcome, int(count)) for name, result, outcome, count in rows]


def _rollup_counts(session: Session, table: type[Rollup], start: dt.datetime,
                   end: dt.datetime, key_id: int | None) -> list[tuple[Any, ...]]:
    """Per class: the sums of the result columns, then of the refusal columns."""
    columns = (*RESULT_COLUMNS.values(), *REFUSAL_COLUMNS.values())
    query = (select(table.service_class, *(func.sum(getattr(table, c)) for c in columns))
             .where(table.bucket >= start, table.bucket < end, table.service_class != ""))
    if key_id is not None:
        query = query.where(table.key_id == key_id)
    return [tuple(row) for row in session.execute(query.group_by(table.service_class))]


def records_between(session: Session, start: dt.datetime, end: dt.datetime,
                    key_id: int | None = None) -> list[UsageRecord]:
    """Per-request records that started in [start, end), oldest first."""
    query = select(UsageRequest).where(UsageRequest.started_at >= start,
                                       UsageRequest.started_at < end)
    if key_id is not None:
        query = query.where(UsageRequest.key_id == key_id)
    rows = session.scalars(query.order_by(UsageRequest.started_at, UsageRequest.id))
    return [UsageRecord(r.key_id, r.model, r.endpoint, r.stream, r.status, r.outcome,
                        r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.started_at,
                        r.ended_at, r.queue_ms, r.ttft_ms, r.duration_ms, r.history,
                        r.service_class, r.slo)
            for r in rows]
