"""A head's registry of the members it drives: address, role, when and by whom added, and the
peer credential each member issued to it.

The credential is the one secret here. The member keeps only its keyed hash; the head must
keep the credential itself to call the member, so it lives in a 0600 file under
`state_dir/secrets/cell/` (written with `appliance.secrets.write_private`), never in the
database: a copy of the database (a backup, a support bundle) cannot drive a member. The row
holds the credential's public 8-character prefix, which both boxes' audit logs name.

Addresses are base URLs (`https://member-2:8443`); `host:port` alone means https. Pure over a
session and a state directory: callers own the transaction, the audit entry and any call to
the member.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.cell.rows import CellMemberRow
from appliance.config import CELL_ROLES
from appliance.errors import EX_USAGE, ApplianceError
from appliance.secrets import write_private

ROLES: Final = CELL_ROLES
MAX_ADDRESS: Final = 200


@dataclass(frozen=True)
class Member:
    """A member as registered, with what the head last saw of its engine (`seen_at`: when;
    None: never answered yet). A member that stops answering keeps its last engine address:
    the router's spec is built from it."""

    id: int
    address: str
    role: str
    verify_tls: bool
    credential_prefix: str
    added_at: dt.datetime
    added_by: str
    engine_url: str | None = None
    bootstrap_port: int | None = None
    reported_role: str | None = None
    engine_state: str | None = None
    capacity: int | None = None
    seen_at: dt.datetime | None = None


@dataclass(frozen=True)
class Seen:
    """What a member reported of its engine through the peer status, to keep."""

    engine_url: str | None
    bootstrap_port: int | None
    reported_role: str
    engine_state: str
    capacity: int | None


def _member(row: CellMemberRow) -> Member:
    return Member(row.id, row.address, row.role, row.verify_tls, row.credential_prefix,
                  row.added_at, row.added_by, row.engine_url, row.bootstrap_port,
                  row.reported_role, row.engine_state, row.capacity, row.seen_at)


def normalize_address(text: str) -> str:
    """`text` as a base URL (scheme, host, port; no path), or a refusal that says what to type."""
    raw = text.strip()
    candidate = raw if "://" in raw else f"https://{raw}"
    try:
        parts = urlsplit(candidate)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or parts.username or parts.password or parts.path not in ("", "/") or parts.query
            or parts.fragment or len(candidate) > MAX_ADDRESS
            or any(c.isspace() or ord(c) < 32 for c in candidate)):
        raise ApplianceError(
            "member_address_invalid", f"{text[:80]!r} is not a member's address",
            "give the member's console address, e.g. https://member-2:8443 or member-2:8443",
            exit_code=EX_USAGE)
    host = parts.hostname
    assert host is not None
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


def credential_path(state_dir: Path, member_id: int) -> Path:
    return state_dir / "secrets" / "cell" / f"member-{member_id}.key"


def read_credential(state_dir: Path, member_id: int) -> str | None:
    try:
        return credential_path(state_dir, member_id).read_text().strip() or None
    except OSError:
        return None


def find_member(session: Session, address: str) -> Member | None:
    row = session.scalar(select(CellMemberRow).where(CellMemberRow.address == address))
    return None if row is None else _member(row)


def get_member(session: Session, member_id: int) -> Member:
    row = session.get(CellMemberRow, member_id)
    if row is None:
        raise ApplianceError(
            "member_not_found", f"this head has no member with id {member_id}",
            "list the members with `appliance cell members` (GET /api/v1/cell/members)",
            status=404, exit_code=EX_USAGE)
    return _member(row)


def list_members(session: Session) -> list[Member]:
    return [_member(r) for r in session.scalars(select(CellMemberRow).order_by(CellMemberRow.id))]


def add_member(session: Session, state_dir: Path, *, address: str, role: str, verify_tls: bool,
               credential: str, prefix: str, added_by: str, now: dt.datetime) -> Member:
    """Record a member and write its credential file (0600) inside the caller's transaction:
    a failed write leaves no row."""
    row = CellMemberRow(address=address, role=role, verify_tls=verify_tls,
                        credential_prefix=prefix, added_at=now, added_by=added_by[:64])
    session.add(row)
    session.flush()
    write_private(credential_path(state_dir, row.id), credential.encode() + b"\n")
    return _member(row)


def forget_member(session: Session, state_dir: Path, member_id: int) -> Member:
    """Delete the member's row and its credential file."""
    member = get_member(session, member_id)
    row = session.get(CellMemberRow, member_id)
    session.delete(row)
    session.flush()
    credential_path(state_dir, member_id).unlink(missing_ok=True)
    return member


def record_seen(session: Session, member_id: int, seen: Seen, now: dt.datetime) -> None:
    """Keep what the member reported. A capacity the member does not report (its engine is
    not READY) keeps the last one known, so the cell's full capacity can still be stated. A
    member removed meanwhile is skipped."""
    row = session.get(CellMemberRow, member_id)
    if row is None:
        return
    capacity = seen.capacity if seen.capacity is not None else row.capacity
    (row.engine_url, row.bootstrap_port, row.reported_role, row.engine_state,
     row.capacity) = (seen.engine_url[:300] if seen.engine_url else None, seen.bootstrap_port,
                      seen.reported_role[:16], seen.engine_state[:32], capacity)
    row.seen_at = now


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ApplianceError(
            "member_role_invalid", f"{role[:40]!r} is not a cell role",
            f"use one of {', '.join(ROLES)}", exit_code=EX_USAGE)
    return role
