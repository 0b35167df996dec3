"""The audit log (who did what, from where) and the event log (what happened by itself).

Both are append-only, newest first when read, filterable and paged. Callers get frozen
records, never ORM rows.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from appliance.db.models import AuditEntry, Event, as_utc

SEVERITIES = ("info", "warning", "error", "critical")
OUTCOMES = ("ok", "denied", "failed")
T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    page: int
    per_page: int
    total: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.per_page))

    @property
    def has_next(self) -> bool:
        return self.page < self.pages


@dataclass(frozen=True)
class AuditRecord:
    id: int
    at: dt.datetime
    actor: str
    address: str
    action: str
    target: str
    outcome: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class EventRecord:
    id: int
    at: dt.datetime
    severity: str
    source: str
    message: str
    detail: dict[str, Any]


def add_audit(
    session: Session,
    *,
    at: dt.datetime,
    actor: str,
    action: str,
    outcome: str = "ok",
    address: str = "",
    target: str = "",
    detail: dict[str, Any] | None = None,
) -> None:
    assert outcome in OUTCOMES, outcome
    session.add(
        AuditEntry(
            at=as_utc(at), actor=actor[:128], address=address[:64], action=action,
            target=target[:255], outcome=outcome, detail=json.dumps(detail or {}),
        )
    )


def add_event(
    session: Session,
    *,
    at: dt.datetime,
    severity: str,
    source: str,
    message: str,
    detail: dict[str, Any] | None = None,
) -> None:
    assert severity in SEVERITIES, severity
    session.add(
        Event(at=as_utc(at), severity=severity, source=source, message=message,
              detail=json.dumps(detail or {}))
    )


def _paged(session: Session, query: Select[Any], page: int, per_page: int) -> tuple[list[Any], int]:
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(query.limit(per_page).offset((page - 1) * per_page)).all()
    return list(rows), total


def list_audit(
    session: Session,
    *,
    actor: str = "",
    action: str = "",
    outcome: str = "",
    page: int = 1,
    per_page: int = 50,
) -> Page[AuditRecord]:
    query = select(AuditEntry).order_by(AuditEntry.at.desc(), AuditEntry.id.desc())
    if actor:
        query = query.where(AuditEntry.actor == actor)
    if action:
        # A literal, case-sensitive prefix on both backends. `startswith` would be LIKE, where
        # "_" and "%" are wildcards and SQLite ignores case while PostgreSQL does not.
        query = query.where(func.substr(AuditEntry.action, 1, len(action)) == action)
    if outcome:
        query = query.where(AuditEntry.outcome == outcome)
    rows, total = _paged(session, query, page, per_page)
    items = [
        AuditRecord(r.id, r.at, r.actor, r.address, r.action, r.target, r.outcome,
                    json.loads(r.detail))
        for r in rows
    ]
    return Page(items, page, per_page, total)


def list_events(
    session: Session,
    *,
    severity: str = "",
    source: str = "",
    page: int = 1,
    per_page: int = 50,
) -> Page[EventRecord]:
    query = select(Event).order_by(Event.at.desc(), Event.id.desc())
    if severity:
        # "at least this severe": warning shows warning, error and critical.
        query = query.where(Event.severity.in_(SEVERITIES[SEVERITIES.index(severity):]))
    if source:
        query = query.where(Event.source == source)
    rows, total = _paged(session, query, page, per_page)
    items = [
        EventRecord(r.id, r.at, r.severity, r.source, r.message, json.loads(r.detail))
        for r in rows
    ]
    return Page(items, page, per_page, total)
