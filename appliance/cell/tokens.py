"""A member's side of cell trust: one-time join tokens and the peer credentials a head gets
for one.

- A join token (`acj_<random>`) is made by an admin on the member, shown once, valid for
  `JOIN_TTL` (an hour) and for one use. Only its keyed hash (`appliance.secrets.keyed_hash`,
  as for admin API tokens) is stored, so a copy of the database cannot join anyone.
- Redeeming it (the head's `POST /api/v1/cell/join`) marks it used and issues a peer
  credential (`acp_<prefix>_<random>`, scope "cell") in the same transaction: a token redeemed
  twice, raced or not, yields one credential.
- A peer credential works only on the member's peer API (`PEER_ROUTES`, enforced by the auth
  middleware); it is stored as a keyed hash, and revoked by the member (leaving the cell) or
  given up by the head (removing the member). A revoked one stays, so the member can answer
  "revoked" rather than "unknown".

Pure over a database session: callers own the transaction and the audit entry.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from dataclasses import dataclass
from typing import Final, Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from appliance.cell.rows import CellJoinTokenRow, CellPeerCredentialRow
from appliance.secrets import keyed_hash

JOIN_PREFIX: Final = "acj_"
PEER_PREFIX: Final = "acp_"  # how the auth middleware tells a peer credential from an admin's
JOIN_TTL: Final = dt.timedelta(hours=1)
SCOPE: Final = "cell"
# The member's routes a peer credential opens (method, Litestar path template), and nothing else.
PEER_ROUTES: Final = frozenset({
    ("GET", "/api/v1/cell/peer/status"),
    ("POST", "/api/v1/cell/peer/engine/{action}"),
    ("DELETE", "/api/v1/cell/peer/credential"),
    ("PUT", "/api/v1/cell/peer/engine-key"),
    ("POST", "/api/v1/cell/peer/role"),
})
_JOIN_RE = re.compile(r"acj_[A-Za-z0-9_-]{43}")
_PEER_RE = re.compile(r"acp_([0-9a-f]{8})_[A-Za-z0-9_-]{43}")

JoinRefusal = Literal["malformed", "unknown", "expired", "used"]
PeerRefusal = Literal["unknown", "revoked"]


@dataclass(frozen=True)
class JoinToken:
    token: str  # shown once
    expires_at: dt.datetime


@dataclass(frozen=True)
class PeerGrant:
    """What a head receives for a valid join token: its credential, shown this once."""

    credential: str
    prefix: str


@dataclass(frozen=True)
class PeerInfo:
    prefix: str
    head: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    revoked_at: dt.datetime | None


def _peer_info(row: CellPeerCredentialRow) -> PeerInfo:
    return PeerInfo(row.prefix, row.head, row.created_at, row.last_used_at, row.revoked_at)


def create_join_token(session: Session, secret: bytes, *, created_by: str,
                      now: dt.datetime) -> JoinToken:
    token = JOIN_PREFIX + secrets.token_urlsafe(32)
    expires = now + JOIN_TTL
    session.add(CellJoinTokenRow(token_hash=keyed_hash(secret, token), created_at=now,
                                 created_by=created_by[:64], expires_at=expires, used_by=""))
    session.flush()
    return JoinToken(token, expires)


def redeem_join_token(session: Session, secret: bytes, token: str, *, head: str,
                      now: dt.datetime) -> PeerGrant | JoinRefusal:
    """Exchange a join token for a new peer credential, or say why not (nothing changes)."""
    if not _JOIN_RE.fullmatch(token):
        return "malformed"
    row = session.scalar(select(CellJoinTokenRow).where(
        CellJoinTokenRow.token_hash == keyed_hash(secret, token)))
    if row is None:
        return "unknown"
    if row.used_at is not None:
        return "used"
    if row.expires_at <= now:
        return "expired"
    # Conditional on still unused: of two redeemers racing, exactly one changes the row.
    claimed = session.execute(
        update(CellJoinTokenRow)
        .where(CellJoinTokenRow.id == row.id, CellJoinTokenRow.used_at.is_(None))
        .values(used_at=now, used_by=head[:255]))
    if getattr(claimed, "rowcount", 0) != 1:
        return "used"
    prefix = secrets.token_hex(4)
    while session.scalar(select(CellPeerCredentialRow.id)
                         .where(CellPeerCredentialRow.prefix == prefix)) is not None:
        prefix = secrets.token_hex(4)
    credential = f"{PEER_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    session.add(CellPeerCredentialRow(
        prefix=prefix, credential_hash=keyed_hash(secret, credential), scope=SCOPE,
        head=head[:255], created_at=now))
    session.flush()
    return PeerGrant(credential, prefix)


def is_peer_credential(presented: str) -> bool:
    """Whether a bearer value is meant as a peer credential (by its prefix, not its validity)."""
    return presented.startswith(PEER_PREFIX)


def resolve_peer(session: Session, secret: bytes, presented: str,
                 now: dt.datetime) -> PeerInfo | PeerRefusal:
    """The peer credential a head presented, if live (its last use noted), or why not."""
    if not _PEER_RE.fullmatch(presented):
        return "unknown"
    row = session.scalar(select(CellPeerCredentialRow).where(
        CellPeerCredentialRow.credential_hash == keyed_hash(secret, presented)))
    if row is None or row.scope != SCOPE:
        return "unknown"
    if row.revoked_at is not None:
        return "revoked"
    row.last_used_at = now
    return _peer_info(row)


def revoke_peers(session: Session, now: dt.datetime, prefix: str | None = None) -> list[str]:
    """Revoke every live peer credential (leaving the cell), or the one with `prefix` (a head
    giving its own up); returns the prefixes revoked."""
    query = select(CellPeerCredentialRow).where(CellPeerCredentialRow.revoked_at.is_(None))
    if prefix is not None:
        query = query.where(CellPeerCredentialRow.prefix == prefix)
    rows = list(session.scalars(query))
    for row in rows:
        row.revoked_at = now
    return [row.prefix for row in rows]


def list_peers(session: Session) -> list[PeerInfo]:
    rows = session.scalars(select(CellPeerCredentialRow).order_by(CellPeerCredentialRow.id))
    return [_peer_info(row) for row in rows]
