"""Usage reports for the admin side: totals, per-key figures and a time series over the
gateway's roll-ups.

The core is pure: `resolve_span` turns the request's range (`24h`, `7d`, `30d`, or `from`/
`to`) into a `Span` of whole buckets (hours for spans up to three days, UTC days beyond), and
`build_report` sums `RollupRow`s into a `Report`. Every rate is None where its denominator is
0, so "no data" never reads as "0 %". The query functions at the end take a Session and hand
back these typed rows, never ORM objects; keys appear by name and prefix only. The CSV
exports live in `appliance.gateway.usage_csv`.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal
from urllib.parse import urlencode

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.db.models import UsageDaily, UsageHourly
from appliance.errors import ApplianceError
from appliance.gateway.keys import list_keys
from appliance.gateway.usage import Rollup, day_of, hour_of

Granularity = Literal["hour", "day"]
HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)
RANGES = {"24h": (dt.timedelta(hours=24), "Last 24 hours"),
          "7d": (dt.timedelta(days=7), "Last 7 days"),
          "30d": (dt.timedelta(days=30), "Last 30 days")}
DEFAULT_RANGE = "24h"
HOURLY_MAX = dt.timedelta(days=3)   # longer spans are drawn and summed by UTC day
LONGEST = dt.timedelta(days=366)    # an explicit from/to may span at most this
PREFIX_RE = re.compile(r"^[0-9a-f]{8}\Z")
TIME_HINT = ("give an ISO 8601 date or time, e.g. 2026-11-30 or 2026-11-30T14:00Z "
             "(UTC when no zone is given)")


# --- the range ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A report's time range: whole buckets of `granularity` from `start` (included) to
    `end` (excluded), in UTC. `name` is the range asked for (`24h`, `7d`, `30d` or
    `custom`)."""

    name: str
    start: dt.datetime
    end: dt.datetime
    granularity: Granularity

    @property
    def step(self) -> dt.timedelta:
        return HOUR if self.granularity == "hour" else DAY

    def buckets(self) -> list[dt.datetime]:
        out, at = [], self.start
        while at < self.end:
            out.append(at)
            at += self.step
        return out

    @property
    def title(self) -> str:
        if self.name in RANGES:
            return RANGES[self.name][1]
        fmt = "%Y-%m-%d %H:%M" if self.granularity == "hour" else "%Y-%m-%d"
        last = self.end - self.step if self.granularity == "day" else self.end
        return f"{self.start.strftime(fmt)} to {last.strftime(fmt)} UTC"

    def query(self, key: str = "") -> str:
        """The query string that asks for this span again (and `key`, when given)."""
        params = ({"range": self.name} if self.name in RANGES else
                  {"from": iso(self.start), "to": iso(self.end)})
        if key:
            params["key"] = key
        return urlencode(params)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "start": iso(self.start),
                "end": iso(self.end), "granularity": self.granularity}


def iso(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def _bad(code: str, message: str, hint: str) -> ApplianceError:
    return ApplianceError(code, message, hint, status=400)


def parse_time(text: str, param: str, *, end: bool = False) -> dt.datetime:
    """An ISO date or time from the query, in UTC. A bare date is 00:00 UTC of that day; as
    the end of a range (`end`), it includes the whole day."""
    text = text.strip()
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            day = dt.date.fromisoformat(text)
            at = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
            return at + DAY if end else at
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise _bad("usage_time_invalid", f"{param}: {text!r} is not a date or time",
                   TIME_HINT) from None
    return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)


def _ceil(at: dt.datetime, granularity: Granularity) -> dt.datetime:
    floor = hour_of(at) if granularity == "hour" else day_of(at)
    return floor if floor == at else floor + (HOUR if granularity == "hour" else DAY)


def resolve_span(range_name: str | None, start: str | None, end: str | None,
                 now: dt.datetime) -> Span:
    """The span a request asks for: `range` (24h, 7d, 30d; the default 24h) counted back
    from `now`, or `from` (and `to`, default now) with `range` absent or `custom`. Anything
    else is a 400 naming the parameter and what it allows."""
    range_name = (range_name or "").strip()
    start, end = (start or "").strip(), (end or "").strip()
    allowed = ", ".join(RANGES)
    if range_name and range_name != "custom" and range_name not in RANGES:
        raise _bad("usage_range_invalid",
                   f"range: {range_name!r} is not one of {allowed} or custom",
                   f"use range={allowed.replace(', ', '|')}, or from=…&to=… for dates "
                   "of your own")
    if range_name in RANGES and (start or end):
        raise _bad("usage_range_conflict",
                   f"range={range_name} and from/to were both given",
                   "give either range, or from (and optionally to), not both")
    if range_name == "custom" or start or end:
        if not start:
            raise _bad("usage_range_incomplete", "from: missing (needed with "
                       f"{'to' if end else 'range=custom'})", TIME_HINT)
        begin = parse_time(start, "from")
        finish = parse_time(end, "to", end=True) if end else now.astimezone(dt.UTC)
        if begin >= finish:
            raise _bad("usage_range_empty",
                       f"from: {iso(begin)} is not before to: {iso(finish)}",
                       "give a from earlier than to")
        if finish - begin > LONGEST:
            raise _bad("usage_range_too_long",
                       f"from/to: {(finish - begin).days} days is longer than "
                       f"{LONGEST.days}", f"ask for at most {LONGEST.days} days at a time")
        granularity: Granularity = "hour" if finish - begin <= HOURLY_MAX else "day"
        floor = hour_of(begin) if granularity == "hour" else day_of(begin)
        return Span("custom", floor, _ceil(finish, granularity), granularity)
    name = range_name or DEFAULT_RANGE
    length = RANGES[name][0]
    if length <= HOURLY_MAX:
        last = hour_of(now) + HOUR
        return Span(name, last - length, last, "hour")
    last = day_of(now) + DAY
    return Span(name, last - length, last, "day")


def check_prefix(prefix: str) -> str:
    """A key prefix from the query (8 hex characters), else a 400 naming `key`."""
    prefix = prefix.strip().lower()
    if not PREFIX_RE.match(prefix):
        raise _bad("usage_key_invalid", f"key: {prefix!r} is not a key prefix",
                   "give the 8 hexadecimal characters after sk- (the API keys page lists "
                   "them), or leave key out for every key")
    return prefix


# --- figures ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RollupRow:
    """One roll-up row (per bucket, key, model and service class) as the report reads it.
    key_id 0: a request refused before a key was known; service_class "": none known (before
    routing, or rolled up before the roll-ups kept classes). The `slo_*` and `refused_*`
    counts are the class's (`appliance.gateway.usage.RESULT_COLUMNS`, `REFUSAL_COLUMNS`)."""

    bucket: dt.datetime
    key_id: int
    model: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    duration_ms: float
    ttft_ms: float
    ttft_count: int
    appended: int
    rewritten: int
    service_class: str = ""
    slo_met: int = 0
    slo_refused: int = 0
    slo_missed_ttft: int = 0
    slo_missed_decode: int = 0
    refused_predicted_miss: int = 0
    refused_queue_full: int = 0
    refused_queue_timeout: int = 0


@dataclass(frozen=True)
class KeyLabel:
    """How a key is shown: never the key itself."""

    id: int
    name: str
    prefix: str
    revoked: bool = False


NO_KEY = KeyLabel(0, "no key (refused)", "")


def label_of(labels: dict[int, KeyLabel], key_id: int) -> KeyLabel:
    if key_id == 0:
        return NO_KEY
    return labels.get(key_id) or KeyLabel(key_id, f"key #{key_id}", "")


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _pct(value: float | None) -> float | None:
    return None if value is None else round(value * 100, 2)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


@dataclass(frozen=True)
class Usage:
    """Sums over some roll-up rows, and the rates a person reads from them."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    duration_ms: float = 0.0
    ttft_ms: float = 0.0
    ttft_count: int = 0
    appended: int = 0
    rewritten: int = 0

    @classmethod
    def of(cls, rows: Iterable[RollupRow]) -> Usage:
        sums: dict[str, Any] = {f.name: f.default for f in fields(cls)}
        for row in rows:
            for name in sums:
                sums[name] += getattr(row, name)
        return cls(**sums)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def error_rate(self) -> float | None:
        return _ratio(self.errors, self.requests)

    @property
    def cache_hit_rate(self) -> float | None:
        """Prompt tokens served from the prefix cache, of all prompt tokens."""
        return _ratio(self.cached_tokens, self.prompt_tokens)

    @property
    def mean_ttft_ms(self) -> float | None:
        return _ratio(self.ttft_ms, self.ttft_count)

    @property
    def mean_duration_ms(self) -> float | None:
        return _ratio(self.duration_ms, self.requests)

    @property
    def rewrite_rate(self) -> float | None:
        """Chat requests that rewrote earlier turns, of those that continued a conversation
        (appended or rewritten)."""
        return _ratio(self.rewritten, self.appended + self.rewritten)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors,
                "error_pct": _pct(self.error_rate), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "tokens": self.tokens,
                "cache_hit_pct": _pct(self.cache_hit_rate),
                "mean_ttft_ms": _round(self.mean_ttft_ms),
                "mean_duration_ms": _round(self.mean_duration_ms),
                "appended": self.appended, "rewritten": self.rewritten,
                "rewrite_pct": _pct(self.rewrite_rate)}


@dataclass(frozen=True)
class KeyUsage:
    key: KeyLabel
    usage: Usage

    def to_dict(self) -> dict[str, Any]:
        return {"key_id": self.key.id, "name": self.key.name, "prefix": self.key.prefix,
                "revoked": self.key.revoked, **self.usage.to_dict()}


@dataclass(frozen=True)
class SeriesPoint:
    """One bucket of the series (zeros where nothing was recorded)."""

    bucket: dt.datetime
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"bucket": iso(self.bucket), "requests": self.requests, "errors": self.errors,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens}


@dataclass(frozen=True)
class Report:
    span: Span
    key: KeyLabel | None  # the key the report is limited to, if any
    totals: Usage
    keys: list[KeyUsage]
    series: list[SeriesPoint]

    @property
    def empty(self) -> bool:
        return self.totals.requests == 0

    def to_dict(self) -> dict[str, Any]:
        key = None if self.key is None else {"key_id": self.key.id, "name": self.key.name,
                                             "prefix": self.key.prefix}
        return {"range": self.span.to_dict(), "key": key, "totals": self.totals.to_dict(),
                "keys": [k.to_dict() for k in self.keys],
                "series": [p.to_dict() for p in self.series]}


def per_key(rows: Iterable[RollupRow], labels: dict[int, KeyLabel]) -> list[KeyUsage]:
    """Each key's usage, most requests first (then by name)."""
    groups: dict[int, list[RollupRow]] = {}
    for row in rows:
        groups.setdefault(row.key_id, []).append(row)
    found = [KeyUsage(label_of(labels, key_id), Usage.of(items))
             for key_id, items in groups.items()]
    return sorted(found, key=lambda k: (-k.usage.requests, k.key.name.lower(), k.key.id))


def series(rows: Iterable[RollupRow], span: Span,
           key_id: int | None = None) -> list[SeriesPoint]:
    """One point per bucket of the span (of `key_id` only, when given); rows outside the
    span are left out."""
    sums: dict[dt.datetime, list[int]] = {b: [0, 0, 0, 0, 0] for b in span.buckets()}
    for row in rows:
        if key_id is not None and row.key_id != key_id:
            continue
        point = sums.get(row.bucket)
        if point is not None:
            for i, value in enumerate((row.requests, row.errors, row.prompt_tokens,
                                       row.completion_tokens, row.cached_tokens)):
                point[i] += value
    return [SeriesPoint(bucket, *values) for bucket, values in sums.items()]


def build_report(rows: Sequence[RollupRow], labels: dict[int, KeyLabel], span: Span,
                 key: KeyLabel | None = None) -> Report:
    """The report of `rows` (those of `key` only, when given) over `span`."""
    inside = [r for r in rows if span.start <= r.bucket < span.end
              and (key is None or r.key_id == key.id)]
    return Report(span, key, Usage.of(inside), per_key(inside, labels), series(inside, span))


# --- queries ------------------------------------------------------------------------------------


def key_labels(session: Session) -> dict[int, KeyLabel]:
    return {k.id: KeyLabel(k.id, k.name, k.prefix, k.revoked_at is not None)
            for k in list_keys(session)}


def find_key(session: Session, prefix: str) -> KeyLabel:
    """The key with this prefix, else a 404 naming `key`."""
    prefix = check_prefix(prefix)
    found = next((k for k in key_labels(session).values() if k.prefix == prefix), None)
    if found is None:
        raise ApplianceError("usage_key_unknown", f"key: there is no API key with prefix "
                             f"{prefix!r}", "use a prefix the API keys page lists, or leave "
                             "key out for every key", status=404)
    return found


def rollup_rows(session: Session, start: dt.datetime, end: dt.datetime,
                granularity: Granularity, key_id: int | None = None) -> list[RollupRow]:
    """Hourly or daily roll-up rows with a bucket in [start, end), oldest first."""
    if granularity == "hour":
        return _rollup_rows(session, UsageHourly, start, end, key_id)
    return _rollup_rows(session, UsageDaily, start, end, key_id)


def _rollup_rows(session: Session, table: type[Rollup], start: dt.datetime,
                 end: dt.datetime, key_id: int | None) -> list[RollupRow]:
    query = select(table).where(table.bucket >= start, table.bucket < end)
    if key_id is not None:
        query = query.where(table.key_id == key_id)
    rows = session.scalars(query.order_by(table.bucket, table.key_id, table.model,
                                          table.service_class))
    return [RollupRow(r.bucket, r.key_id, r.model, r.requests, r.errors, r.prompt_tokens,
                      r.completion_tokens, r.cached_tokens, r.duration_ms, r.ttft_ms,
                      r.ttft_count, r.appended, r.rewritten, r.service_class, r.slo_met,
                      r.slo_refused, r.slo_missed_ttft, r.slo_missed_decode,
                      r.refused_predicted_miss, r.refused_queue_full,
                      r.refused_queue_timeout) for r in rows]


def usage_recorded(session: Session) -> bool:
    """Whether the gateway has recorded any request at all (the console's empty state)."""
    return session.scalar(select(UsageDaily.id).limit(1)) is not None


def load_report(session: Session, span: Span, prefix: str = "") -> Report:
    """The report over `span`, of the key with `prefix` when given."""
    key = find_key(session, prefix) if prefix else None
    labels = key_labels(session)
    rows = rollup_rows(session, span.start, span.end, span.granularity,
                       key.id if key else None)
    return build_report(rows, labels, span, key)
