"""Gateway API keys: the credentials of the box's users (not admins).

A key looks like `sk-<prefix>-<secret>`: the 8-hex-character prefix is stored in the clear so
people can tell keys apart; the whole key only as an HMAC under the server secret
(`appliance.secrets.keyed_hash`). The key itself is shown once, when created. Each key can
carry limits: concurrent requests, requests per minute, tokens per day and a cap on a request's
`max_tokens`. Each key belongs to a service class (`appliance.gateway.classes`;
`interactive` unless set). Both planes use this module: the control plane to create, list,
edit and revoke keys; the gateway to load its in-memory cache (`load_entries`) and to record
last use.
"""

from __future__ import annotations

import datetime as dt
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from appliance.db.models import GatewayKey
from appliance.errors import ApplianceError
from appliance.gateway.classes import INTERACTIVE
from appliance.secrets import keyed_hash
from appliance.sizes import when_text

KEY_RE = re.compile(r"^sk-([0-9a-f]{8})-([A-Za-z0-9_-]{43})\Z")
NAME_RE = re.compile(r"^[\w .@-]{1,64}\Z")
OWNER_MAX = 128
# The largest value each limit's column holds (Integer, BigInteger for tokens_per_day).
LIMIT_MAX = {"max_concurrency": 2**31 - 1, "requests_per_minute": 2**31 - 1,
             "tokens_per_day": 2**63 - 1, "max_tokens": 2**31 - 1}


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; None means no limit of that kind (the gateway's global ones still
    apply)."""

    max_concurrency: int | None = None
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_tokens: int | None = None

    def problems(self) -> list[str]:
        """What is wrong with each limit: each must be a whole number from 1 up to what its
        column holds (32-bit, 64-bit for tokens_per_day), so a bad value never reaches the
        database as an overflow."""
        return [f"{name} must be a whole number from 1 to {LIMIT_MAX[name]}, or empty "
                "(no limit)"
                for name, value in self.__dict__.items()
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                          or not 1 <= value <= LIMIT_MAX[name])]


@dataclass(frozen=True)
class KeyInfo:
    """What the console, the API and the CLI show about a key (never the key itself)."""

    id: int
    name: str
    owner: str
    prefix: str
    created_at: dt.datetime
    created_by: str
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    revoked_by: str
    limits: KeyLimits
    service_class: str = "interactive"

    def status(self, now: dt.datetime) -> str:
        """"active", "expired" or "revoked"."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


@dataclass(frozen=True)
class KeyEntry:
    """One key as the gateway caches it: enough to authenticate and to apply the limits."""

    id: int
    name: str
    prefix: str
    key_hash: str
    expires_at: dt.datetime | None
    revoked: bool
    limits: KeyLimits
    service_class: str = "interactive"

    def accepts(self, secret: bytes, key: str, now: dt.datetime) -> bool:
        """The presented key is this one, and it is neither revoked nor expired at `now`."""
        if self.revoked or (self.expires_at is not None and self.expires_at <= now):
            return False
        return hmac.compare_digest(self.key_hash, keyed_hash(secret, key))


def prefix_of(key: str) -> str | None:
    """The prefix of a well-formed key, else None."""
    match = KEY_RE.match(key)
    return match.group(1) if match else None


def _limits(row: GatewayKey) -> KeyLimits:
    return KeyLimits(row.max_concurrency, row.requests_per_minute, row.tokens_per_day,
                     row.max_tokens)


def _info(row: GatewayKey) -> KeyInfo:
    return KeyInfo(row.id, row.name, row.owner, row.prefix, row.created_at, row.created_by,
                   row.last_used_at, row.expires_at, row.revoked_at, row.revoked_by,
                   _limits(row), row.service_class)


def _check_limits(limits: KeyLimits) -> None:
    problems = limits.problems()
    if problems:
        raise ApplianceError("key_limits_invalid", "; ".join(problems),
                             "give each limit as a whole number of at least 1, or leave it "
                             "empty for none", status=422)


def check_class(name: str, known: Iterable[str]) -> None:
    """Refuse a class the configuration does not define (the key would be served as
    interactive without anyone having asked for it)."""
    known = sorted(known)
    if name not in known:
        raise ApplianceError("key_class_unknown", f"there is no service class {name!r}",
                             f"use one of {', '.join(known)}, or define it under "
                             "[gateway.classes] (docs/configuration.md)", status=422)


def create_key(session: Session, secret: bytes, *, name: str, owner: str, by: str,
               now: dt.datetime, expires_at: dt.datetime | None = None,
               limits: KeyLimits | None = None,
               service_class: str = INTERACTIVE) -> tuple[str, KeyInfo]:
    """Create a key; returns (the key, shown once; its record). The caller checks the class
    against the configuration (`check_class`)."""
    limits = limits or KeyLimits()
    name, owner = name.strip(), owner.strip()
    if not NAME_RE.match(name):
        raise ApplianceError(
            "key_name_invalid", f"key name {name!r} is not allowed",
            "use 1-64 letters, digits, spaces or . @ - _", status=422)
    if len(owner) > OWNER_MAX:
        raise ApplianceError("key_owner_invalid", f"the owner is {len(owner)} characters long",
                             f"use at most {OWNER_MAX}", status=422)
    if expires_at is not None and expires_at <= now:
        raise ApplianceError(
            "key_expiry_past", f"the expiry {when_text(expires_at)} is in the past",
            "give a future date, or none for a key that does not expire", status=422)
    _check_limits(limits)
    prefix = secrets.token_hex(4)
    while session.scalar(select(GatewayKey.id).where(GatewayKey.prefix == prefix)):
        prefix = secrets.token_hex(4)
    key = f"sk-{prefix}-{secrets.token_urlsafe(32)}"
    row = GatewayKey(
        name=name, owner=owner, prefix=prefix, key_hash=keyed_hash(secret, key),
        created_at=now, created_by=by, changed_at=now, expires_at=expires_at, revoked_by="",
        max_concurrency=limits.max_concurrency, requests_per_minute=limits.requests_per_minute,
        tokens_per_day=limits.tokens_per_day, max_tokens=limits.max_tokens,
        service_class=service_class)
    session.add(row)
    session.flush()
    return key, _info(row)


def list_keys(session: Session) -> list[KeyInfo]:
    rows = session.scalars(select(GatewayKey).order_by(GatewayKey.created_at.desc(),
                                                       GatewayKey.id.desc()))
    return [_info(row) for row in rows]


def _row(session: Session, prefix: str) -> GatewayKey:
    row = session.scalar(select(GatewayKey).where(GatewayKey.prefix == prefix))
    if row is None:
        raise ApplianceError("key_unknown", f"there is no API key with prefix {prefix!r}",
                             "list the keys to see their prefixes", status=404)
    return row


def get_key(session: Session, prefix: str) -> KeyInfo:
    return _info(_row(session, prefix))


def revoke_key(session: Session, prefix: str, *, by: str, now: dt.datetime) -> KeyInfo:
    """Revoke a key (idempotent). The gateway refuses it within its key poll (under 1 s)."""
    row = _row(session, prefix)
    if row.revoked_at is None:
        row.revoked_at, row.revoked_by, row.changed_at = now, by, now
    return _info(row)


def update_limits(session: Session, prefix: str, limits: KeyLimits, *,
                  now: dt.datetime) -> KeyInfo:
    _check_limits(limits)
    row = _row(session, prefix)
    row.max_concurrency, row.requests_per_minute = limits.max_concurrency, \
        limits.requests_per_minute
    row.tokens_per_day, row.max_tokens = limits.tokens_per_day, limits.max_tokens
    row.changed_at = now
    return _info(row)


def update_class(session: Session, prefix: str, service_class: str, *,
                 now: dt.datetime) -> KeyInfo:
    """Move a key to another class (checked by the caller); the gateway applies it within its
    key poll, to requests that arrive after."""
    row = _row(session, prefix)
    row.service_class, row.changed_at = service_class, now
    return _info(row)


def keys_version(session: Session) -> tuple[int, dt.datetime | None]:
    """Cheap fingerprint of the key table (count, newest change): the gateway reloads its
    cache only when this moves."""
    count, newest = session.execute(
        select(func.count(GatewayKey.id), func.max(GatewayKey.changed_at))).one()
    return int(count), newest


def load_entries(session: Session) -> list[KeyEntry]:
    return [KeyEntry(row.id, row.name, row.prefix, row.key_hash, row.expires_at,
                     row.revoked_at is not None, _limits(row), row.service_class)
            for row in session.scalars(select(GatewayKey))]


def touch_used(session: Session, used: dict[int, dt.datetime]) -> None:
    """Record when keys were last used (the gateway batches these)."""
    for row in session.scalars(select(GatewayKey).where(GatewayKey.id.in_(used))):
        at = used[row.id]
        if row.last_used_at is None or at > row.last_used_at:
            row.last_used_at = at
