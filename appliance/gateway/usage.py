"""Usage records: one per request the gateway answered, written in batches, summed into
hourly and daily roll-ups in the same transaction.

The gateway is the only writer (one process), so a roll-up row is read and updated in place
without a race; the same code runs on SQLite and PostgreSQL. `UsageRecord` satisfies the
tuning side's `RequestRecord` protocol (prompt, completion, cached tokens, start and end), so
the observed workload can be read straight from these rows.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from appliance.db.models import UsageDaily, UsageHourly, UsageRequest

# history: how a chat request's earlier turns relate to what this key sent before
# (appliance.gateway.history): "new", "appended", "rewritten", "unmatched", or "" (not a chat)
OK_OUTCOMES = frozenset({"ok"})
Rollup = TypeVar("Rollup", UsageHourly, UsageDaily)


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
    session.execute(insert(UsageRequest), [asdict(r) for r in records])
    _add_to_rollup(session, UsageHourly, hour_of, records)
    _add_to_rollup(session, UsageDaily, day_of, records)


def _add_to_rollup(session: Session, model: type[Rollup],
                   bucket_of: Callable[[dt.datetime], dt.datetime],
                   records: Iterable[UsageRecord]) -> None:
    groups: dict[tuple[dt.datetime, int, str], list[UsageRecord]] = {}
    for r in records:
        groups.setdefault((bucket_of(r.started_at), r.key_id or 0, r.model), []).append(r)
    for (bucket, key_id, name), items in groups.items():
        row = session.scalar(select(model).where(
            model.bucket == bucket, model.key_id == key_id, model.model == name))
        if row is None:
            row = model(bucket=bucket, key_id=key_id, model=name, requests=0, errors=0,
                        prompt_tokens=0, completion_tokens=0, cached_tokens=0, duration_ms=0.0,
                        ttft_ms=0.0, ttft_count=0, appended=0, rewritten=0)
            session.add(row)
        row.requests += len(items)
        row.errors += sum(1 for r in items if r.error)
        row.prompt_tokens += sum(r.prompt_tokens for r in items)
        row.completion_tokens += sum(r.completion_tokens for r in items)
        row.cached_tokens += sum(r.cached_tokens for r in items)
        row.duration_ms += sum(r.duration_ms for r in items)
        timed = [r.ttft_ms for r in items if r.ttft_ms is not None]
        row.ttft_ms += sum(timed)
        row.ttft_count += len(timed)
        row.appended += sum(1 for r in items if r.history == "appended")
        row.rewritten += sum(1 for r in items if r.history == "rewritten")
        session.flush()


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


def class_counts(session: Session, start: dt.datetime, end: dt.datetime) -> list[ClassCount]:
    """Per service class, the requests that started in [start, end) by what they got of
    its promise. From the per-request rows, so it covers gateway.usage_retention_days."""
    rows = session.execute(
        select(UsageRequest.service_class, UsageRequest.slo, UsageRequest.outcome,
               func.count(UsageRequest.id))
        .where(UsageRequest.started_at >= start, UsageRequest.started_at < end,
               UsageRequest.slo != "")
        .group_by(UsageRequest.service_class, UsageRequest.slo, UsageRequest.outcome))
    counts: dict[str, dict[str, int]] = {}
    refusals: dict[str, dict[str, int]] = {}
    for name, result, outcome, count in rows:
        mine = counts.setdefault(name, {})
        mine[result] = mine.get(result, 0) + int(count)
        if result == "refused":
            refusals.setdefault(name, {})[outcome] = int(count)
    return [ClassCount(name, mine.get("met", 0), mine.get("refused", 0),
                       mine.get("missed_ttft", 0), mine.get("missed_decode", 0),
                       tuple(sorted(refusals.get(name, {}).items(), key=lambda i: -i[1])))
            for name, mine in sorted(counts.items())]


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
