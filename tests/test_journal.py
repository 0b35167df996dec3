"""The audit and event logs on both backends: newest first, filters, paging, and timestamps
that always come back as aware UTC."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session

from appliance.db.database import Database
from appliance.db.journal import add_audit, add_event, list_audit, list_events
from appliance.db.models import AdminUser, AuditEntry
from appliance.db.schema import migrate
from appliance.resources import migrations_dir

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def at(seconds: int) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@pytest.fixture
def journal_db(backend_url: str, tmp_path: Path) -> Iterator[Database]:
    db = Database(backend_url)
    migrate(db, migrations_dir(), tmp_path / "backups", T0)
    yield db
    db.dispose()


def seed_audit(s: Session) -> None:
    rows = [  # (seconds, actor, action, outcome)
        (0, "alice", "admin.create", "ok"),
        (10, "alice", "admin.reset_password", "ok"),
        (20, "bob", "token.create", "ok"),
        (30, "mallory", "auth.login", "failed"),
        (40, "alice2", "auth.login", "ok"),
        (50, "alice", "auth.logout", "ok"),
        (50, "bob", "token.revoke", "denied"),  # same instant: the later insert is newer
    ]
    for seconds, actor, action, outcome in rows:
        add_audit(s, at=at(seconds), actor=actor, action=action, outcome=outcome,
                  address="192.0.2.7", target=f"t{seconds}", detail={"n": seconds})


def test_audit_is_newest_first_and_filters(journal_db: Database) -> None:
    journal_db.call(seed_audit)

    def actions(actor: str = "", action: str = "", outcome: str = "") -> list[str]:
        page = journal_db.call(lambda s: list_audit(s, actor=actor, action=action,
                                                    outcome=outcome))
        return [r.action for r in page.items]

    assert actions() == ["token.revoke", "auth.logout", "auth.login", "auth.login",
                         "token.create", "admin.reset_password", "admin.create"]
    # actor is exact: "alice" is not "alice2"
    assert actions(actor="alice") == ["auth.logout", "admin.reset_password", "admin.create"]
    assert actions(actor="ALICE") == []
    # action is a literal, case-sensitive prefix on both backends (no LIKE wildcards)
    assert actions(action="admin.") == ["admin.reset_password", "admin.create"]
    assert actions(action="auth") == ["auth.logout", "auth.login", "auth.login"]
    assert actions(action="admin.create") == ["admin.create"]
    assert actions(action="Admin.") == []
    assert actions(action="admin_") == []
    assert actions(action="%") == []
    assert actions(outcome="failed") == ["auth.login"]
    assert actions(outcome="denied") == ["token.revoke"]
    assert actions(actor="alice", action="auth.") == ["auth.logout"]
    assert actions(actor="bob", outcome="ok") == ["token.create"]

    first = journal_db.call(lambda s: list_audit(s, actor="mallory")).items[0]
    assert (first.actor, first.address, first.target, first.outcome, first.detail) == (
        "mallory", "192.0.2.7", "t30", "failed", {"n": 30})
    assert first.at == at(30)


def test_events_filter_by_minimum_severity_and_source(journal_db: Database) -> None:
    def seed(s: Session) -> None:
        for i, (severity, source) in enumerate([
            ("info", "database"), ("warning", "disk"), ("error", "engine"),
            ("critical", "engine"), ("info", "engine"), ("warning", "database"),
        ]):
            add_event(s, at=at(i), severity=severity, source=source,
                      message=f"{severity} from {source}", detail={"i": i})

    journal_db.call(seed)

    def seen(severity: str = "", source: str = "") -> list[tuple[str, str]]:
        page = journal_db.call(lambda s: list_events(s, severity=severity, source=source))
        return [(e.severity, e.source) for e in page.items]

    assert seen() == [("warning", "database"), ("info", "engine"), ("critical", "engine"),
                      ("error", "engine"), ("warning", "disk"), ("info", "database")]
    assert seen(severity="info") == seen()
    assert seen(severity="warning") == [("warning", "database"), ("critical", "engine"),
                                        ("error", "engine"), ("warning", "disk")]
    assert seen(severity="error") == [("critical", "engine"), ("error", "engine")]
    assert seen(severity="critical") == [("critical", "engine")]
    assert seen(source="engine") == [("info", "engine"), ("critical", "engine"),
                                     ("error", "engine")]
    assert seen(severity="warning", source="engine") == [("critical", "engine"),
                                                         ("error", "engine")]
    assert seen(source="nowhere") == []
    event = journal_db.call(lambda s: list_events(s, source="disk")).items[0]
    assert (event.message, event.detail, event.at) == ("warning from disk", {"i": 1}, at(1))


def test_paging(journal_db: Database) -> None:
    def seed(s: Session) -> None:
        for i in range(120):
            add_audit(s, at=at(i), actor="alice" if i % 3 else "bob", action="auth.login")
            add_event(s, at=at(i), severity="error" if i % 4 == 0 else "info",
                      source="engine", message=str(i))

    journal_db.call(seed)

    pages = [journal_db.call(functools.partial(list_audit, page=n, per_page=50))
             for n in (1, 2, 3, 4)]
    assert [len(p.items) for p in pages] == [50, 50, 20, 0]
    assert {(p.total, p.pages, p.per_page) for p in pages} == {(120, 3, 50)}
    assert [p.has_next for p in pages] == [True, True, False, False]
    stamps = [r.at for p in pages for r in p.items]
    assert stamps == [at(i) for i in reversed(range(120))]  # every row once, newest first

    bob = journal_db.call(lambda s: list_audit(s, actor="bob", page=2, per_page=30))
    assert (bob.total, bob.pages, bob.has_next, len(bob.items)) == (40, 2, False, 10)
    assert bob.items[-1].at == at(0)

    errors = journal_db.call(lambda s: list_events(s, severity="error", per_page=25))
    assert (errors.total, errors.pages, errors.has_next, len(errors.items)) == (30, 2, True, 25)
    assert [e.message for e in errors.items[:3]] == ["116", "112", "108"]
    last = journal_db.call(lambda s: list_events(s, severity="error", page=2, per_page=25))
    assert [e.message for e in last.items] == ["16", "12", "8", "4", "0"]

    empty = journal_db.call(lambda s: list_audit(s, actor="nobody"))
    assert (empty.items, empty.total, empty.pages, empty.has_next) == ([], 0, 1, False)


def test_timestamps_come_back_aware_utc(journal_db: Database) -> None:
    paris = dt.timezone(dt.timedelta(hours=2))
    # 12:30+02:00 is 10:30Z: earlier than 11:00Z although its wall-clock time is later.
    local = dt.datetime(2026, 11, 30, 12, 30, 0, 123456, tzinfo=paris)
    utc = dt.datetime(2026, 11, 30, 11, 0, tzinfo=dt.UTC)

    def seed(s: Session) -> None:
        add_audit(s, at=local, actor="a", action="x.local")
        add_audit(s, at=utc, actor="a", action="x.utc")
        add_event(s, at=local, severity="info", source="s", message="local")

    journal_db.call(seed)

    def read(s: Session) -> tuple[list[dt.datetime], list[str], dt.datetime, dt.datetime]:
        if not journal_db.is_sqlite:
            # PostgreSQL returns timestamptz in the session's zone; it must not leak out.
            s.execute(text("SET TIME ZONE 'America/New_York'"))
        audit = list_audit(s).items
        event = list_events(s).items[0]
        raw = s.scalars(select(AuditEntry.at).where(AuditEntry.action == "x.local")).one()
        return [r.at for r in audit], [r.action for r in audit], event.at, raw

    stamps, order, event_at, raw = journal_db.call(read)
    assert order == ["x.utc", "x.local"]
    for value in (*stamps, event_at, raw):
        assert value.tzinfo == dt.UTC and value.utcoffset() == dt.timedelta(0)
    assert stamps == [utc, local]  # same instants, microseconds kept
    assert stamps[1].hour == 10 and stamps[1].microsecond == 123456
    assert event_at == local


def test_naive_datetimes_are_refused(journal_db: Database) -> None:
    naive = dt.datetime(2026, 11, 30, 12, 0)

    with pytest.raises(ValueError, match=r"naive datetime 2026-11-30T12:00:00 .* aware UTC"):
        journal_db.call(lambda s: add_audit(s, at=naive, actor="a", action="x"))
    with pytest.raises(ValueError, match="naive datetime"):
        journal_db.call(lambda s: add_event(s, at=naive, severity="info", source="s",
                                            message="m"))
    assert journal_db.call(lambda s: list_audit(s).total) == 0
    assert journal_db.call(lambda s: list_events(s).total) == 0

    # Any other model column (and any query parameter) refuses them too; SQLAlchemy wraps
    # the type's ValueError in a StatementError.
    user = AdminUser(username="alice", password_hash="x", must_change_password=False,
                     created_at=naive, password_changed_at=naive)
    with pytest.raises(StatementError) as wrapped:
        journal_db.call(lambda s: s.add(user))
    assert isinstance(wrapped.value.orig, ValueError)
    assert "naive datetime" in str(wrapped.value.orig)
    with pytest.raises(StatementError, match="naive datetime"):
        journal_db.call(lambda s: s.scalars(select(AuditEntry).where(AuditEntry.at < naive)).all())
