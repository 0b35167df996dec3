"""Server-side admin sessions.

The cookie carries a random 256-bit value; the database keeps only its sha256, with an idle
deadline and an absolute deadline. Sessions live in the database so they survive a daemon
restart and can be revoked (a password reset ends them all). Expiry uses wall-clock time
because it must persist; a stepped clock can end sessions early or late by the step, never
leave one valid forever (the absolute deadline is fixed at login).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from appliance.auth.accounts import Admin, get_admin
from appliance.db.models import AdminSession

COOKIE_NAME = "appliance_session"
# Sliding the idle deadline is a write (an fsync on SQLite with synchronous=FULL); the
# console polls every few seconds, so slide at most this often. Idle expiry is therefore
# exact to within this interval.
TOUCH_INTERVAL = dt.timedelta(seconds=30)


@dataclass(frozen=True)
class SessionPolicy:
    idle: dt.timedelta
    absolute: dt.timedelta


@dataclass(frozen=True)
class LiveSession:
    id_hash: str
    admin: Admin
    created_at: dt.datetime
    expires_at: dt.datetime


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def open_session(
    session: Session, admin: Admin, now: dt.datetime, policy: SessionPolicy, *,
    address: str, user_agent: str,
) -> str:
    """Create a session and return the cookie value (shown to nobody else, stored hashed)."""
    token = secrets.token_urlsafe(32)
    session.add(AdminSession(
        id=_digest(token), user_id=admin.id, created_at=now, last_seen_at=now,
        expires_at=min(now + policy.idle, now + policy.absolute),
        address=address[:64], user_agent=user_agent[:255],
    ))
    return token


def resolve_session(
    session: Session, token: str, now: dt.datetime, policy: SessionPolicy, *, touch: bool = True
) -> LiveSession | None:
    """The live session for a cookie value, sliding its idle deadline; None if unknown/expired.

    `touch=False` only checks: an open stream re-checking its session is not activity, so a
    log left streaming in a forgotten tab does not keep the session alive."""
    row = session.get(AdminSession, _digest(token))
    if row is None:
        return None
    if row.expires_at <= now:
        session.delete(row)
        return None
    admin = get_admin(session, row.user_id)
    if admin is None:
        return None
    if touch and (now - row.last_seen_at >= TOUCH_INTERVAL or now < row.last_seen_at):
        row.last_seen_at = now
        row.expires_at = min(now + policy.idle, row.created_at + policy.absolute)
    return LiveSession(row.id, admin, row.created_at, row.expires_at)


def close_session(session: Session, token: str) -> None:
    session.execute(delete(AdminSession).where(AdminSession.id == _digest(token)))


def purge_expired(session: Session, now: dt.datetime) -> int:
    result = session.execute(delete(AdminSession).where(AdminSession.expires_at <= now))
    return int(getattr(result, "rowcount", 0) or 0)


def count_sessions(session: Session, user_id: int) -> int:
    return len(session.scalars(
        select(AdminSession.id).where(AdminSession.user_id == user_id)).all())
