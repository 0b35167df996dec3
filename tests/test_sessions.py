"""Session and token bookkeeping against a real migrated database and a fake clock."""

from __future__ import annotations

import datetime as dt

from appliance.auth.accounts import Admin, create_admin
from appliance.auth.sessions import (
    TOUCH_INTERVAL,
    SessionPolicy,
    open_session,
    purge_expired,
    resolve_session,
)
from appliance.auth.tokens import create_token, resolve_token
from appliance.db.database import Database
from appliance.db.models import AdminSession, ApiToken
from appliance.testing.clock import FakeClock

POLICY = SessionPolicy(idle=dt.timedelta(hours=1), absolute=dt.timedelta(hours=12))


def _admin(db: Database, clock: FakeClock) -> Admin:
    return db.call(lambda s: create_admin(s, "alice", "long enough password", clock.now()))


def test_idle_deadline_slides_at_most_once_per_interval(db: Database, clock: FakeClock) -> None:
    admin = _admin(db, clock)
    token = db.call(lambda s: open_session(s, admin, clock.now(), POLICY, address="",
                                           user_agent=""))

    def seen() -> dt.datetime:
        return db.call(lambda s: s.query(AdminSession).one().last_seen_at)

    first = seen()
    clock.advance(TOUCH_INTERVAL.total_seconds() / 2)
    assert db.call(lambda s: resolve_session(s, token, clock.now(), POLICY)) is not None
    assert seen() == first  # no write for a poll inside the interval
    clock.advance(TOUCH_INTERVAL.total_seconds())
    assert db.call(lambda s: resolve_session(s, token, clock.now(), POLICY)) is not None
    assert seen() == clock.now()


def test_a_wall_clock_stepped_back_does_not_extend_a_session_forever(
    db: Database, clock: FakeClock
) -> None:
    admin = _admin(db, clock)
    token = db.call(lambda s: open_session(s, admin, clock.now(), POLICY, address="",
                                           user_agent=""))
    clock.jump_wall(-86400)
    live = db.call(lambda s: resolve_session(s, token, clock.now(), POLICY))
    assert live is not None
    assert live.expires_at <= live.created_at + POLICY.absolute


def test_purge_removes_only_expired_sessions(db: Database, clock: FakeClock) -> None:
    admin = _admin(db, clock)
    db.call(lambda s: open_session(s, admin, clock.now(), POLICY, address="", user_agent=""))
    clock.advance(1800)
    db.call(lambda s: open_session(s, admin, clock.now(), POLICY, address="", user_agent=""))
    clock.advance(1801)
    assert db.call(lambda s: purge_expired(s, clock.now())) == 1
    assert db.call(lambda s: s.query(AdminSession).count()) == 1


def test_token_last_used_is_written_at_most_once_per_interval(
    db: Database, clock: FakeClock
) -> None:
    admin = _admin(db, clock)
    secret = b"k" * 32
    token, _ = db.call(lambda s: create_token(s, secret, admin, "job", clock.now()))

    def used() -> dt.datetime | None:
        return db.call(lambda s: s.query(ApiToken).one().last_used_at)

    assert db.call(lambda s: resolve_token(s, secret, token, clock.now())) is not None
    first = used()
    assert first == clock.now()
    clock.advance(5)
    db.call(lambda s: resolve_token(s, secret, token, clock.now()))
    assert used() == first
    clock.advance(TOUCH_INTERVAL.total_seconds())
    db.call(lambda s: resolve_token(s, secret, token, clock.now()))
    assert used() == clock.now()
    assert db.call(lambda s: resolve_token(s, b"other key" * 4, token, clock.now())) is None
