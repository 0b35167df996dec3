"""CSV exports of usage: the per-request rows (`usage_requests`) and the hourly or daily
roll-ups, each key by name and prefix (never the key, never its hash).

The writers are generators of lines, header first, so an export streams: the admin API reads
the per-request rows page by page (`request_page`, keyset on start time and id) and sends each
page's lines as it goes. Lines follow RFC 4180 (the `csv` module's quoting, CRLF endings);
times are ISO 8601 UTC. A text cell a spreadsheet would run as a formula (starting with `=`,
`+`, `-`, `@`, tab or CR: a model name is whatever a client sent) gets a leading `'`.
Floats (millisecond sums) are written to the microsecond, without binary-float noise.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from appliance.db.models import UsageRequest
from appliance.gateway.report import KeyLabel, RollupRow, Span, iso, label_of
from appliance.gateway.usage import UsageRecord

REQUEST_COLUMNS = ("id", "started_at", "ended_at", "key_name", "key_prefix", "model",
                   "endpoint", "stream", "status", "outcome", "prompt_tokens",
                   "completion_tokens", "cached_tokens", "queue_ms", "ttft_ms", "duration_ms",
                   "history", "service_class", "slo")
# The class and its SLO counts come last, so a sheet that reads the earlier columns by
# position still does; a bucket, key and model has a line per class its requests had.
ROLLUP_COLUMNS = ("bucket", "key_name", "key_prefix", "model", "requests", "errors",
                  "prompt_tokens", "completion_tokens", "cached_tokens", "duration_ms_sum",
                  "ttft_ms_sum", "ttft_count", "appended", "rewritten", "service_class",
                  "slo_met", "slo_refused", "slo_missed_ttft", "slo_missed_decode",
                  "refused_predicted_miss", "refused_queue_full", "refused_queue_timeout")
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
PAGE = 5000


def _cell(value: object) -> object:
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    if isinstance(value, dt.datetime):
        return iso(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return float_text(value)
    return "" if value is None else value


def float_text(value: float) -> str:
    """A float cell to its unit's precision: every float column is milliseconds, kept to the
    microsecond (3 decimals), so a sum reads 41033.516, not 41033.51599999999; trailing zeros
    go down to one decimal (12.5, 2500.0), as the column always read."""
    text = f"{value:.3f}".rstrip("0")
    text = text + "0" if text.endswith(".") else text
    return "0.0" if text == "-0.0" else text


def csv_line(values: Iterable[object]) -> str:
    """One CSV record: quoted where needed, CRLF-terminated."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerow([_cell(v) for v in values])
    return buffer.getvalue()


@dataclass(frozen=True)
class RequestRow:
    """One per-request row with its id (the export's first column)."""

    id: int
    record: UsageRecord


def request_lines(rows: Iterable[RequestRow], labels: dict[int, KeyLabel]) -> Iterator[str]:
    """A line per per-request row (no header: pages of one export follow each other)."""
    for row in rows:
        r = row.record
        key = label_of(labels, r.key_id or 0)
        yield csv_line((row.id, r.started_at, r.ended_at, key.name, key.prefix, r.model,
                        r.endpoint, r.stream, r.status, r.outcome, r.prompt_tokens,
                        r.completion_tokens, r.cached_tokens, r.queue_ms, r.ttft_ms,
                        r.duration_ms, r.history, r.service_class, r.slo))


def request_csv(rows: Iterable[RequestRow], labels: dict[int, KeyLabel]) -> Iterator[str]:
    """The per-request export: the header, then a line a row."""
    yield csv_line(REQUEST_COLUMNS)
    yield from request_lines(rows, labels)


def rollup_csv(rows: Iterable[RollupRow], labels: dict[int, KeyLabel]) -> Iterator[str]:
    """The roll-up export (hourly or daily rows, as given): the header, then a line a row.
    Its SLO counts are kept for good, unlike the per-request rows'."""
    yield csv_line(ROLLUP_COLUMNS)
    for r in rows:
        key = label_of(labels, r.key_id)
        yield csv_line((r.bucket, key.name, key.prefix, r.model, r.requests, r.errors,
                        r.prompt_tokens, r.completion_tokens, r.cached_tokens,
                        r.duration_ms, r.ttft_ms, r.ttft_count, r.appended, r.rewritten,
                        r.service_class, r.slo_met, r.slo_refused, r.slo_missed_ttft,
                        r.slo_missed_decode, r.refused_predicted_miss, r.refused_queue_full,
                        r.refused_queue_timeout))


def export_filename(what: str, span: Span, prefix: str = "") -> str:
    """`usage-hour-20261129T1300Z-20261130T1300Z[-PREFIX].csv`."""
    stamp = "%Y%m%dT%H%MZ"
    tail = f"-{prefix}" if prefix else ""
    return (f"usage-{what}-{span.start.strftime(stamp)}-{span.end.strftime(stamp)}"
            f"{tail}.csv")


def request_page(session: Session, start: dt.datetime, end: dt.datetime,
                 key_id: int | None = None, after: tuple[dt.datetime, int] | None = None,
                 limit: int = PAGE) -> list[RequestRow]:
    """Up to `limit` per-request rows that started in [start, end), oldest first, after the
    (started_at, id) of the previous page's last row. Rows older than
    `gateway.usage_retention_days` are gone; the roll-ups keep their sums."""
    query = select(UsageRequest).where(UsageRequest.started_at >= start,
                                       UsageRequest.started_at < end)
    if key_id is not None:
        query = query.where(UsageRequest.key_id == key_id)
    if after is not None:
        at, last = after
        query = query.where(or_(UsageRequest.started_at > at,
                                and_(UsageRequest.started_at == at, UsageRequest.id > last)))
    rows = session.scalars(query.order_by(UsageRequest.started_at, UsageRequest.id)
                           .limit(limit))
    return [RequestRow(r.id, UsageRecord(
        r.key_id, r.model, r.endpoint, r.stream, r.status, r.outcome, r.prompt_tokens,
        r.completion_tokens, r.cached_tokens, r.started_at, r.ended_at, r.queue_ms, r.ttft_ms,
        r.duration_ms, r.history, r.service_class, r.slo)) for r in rows]
