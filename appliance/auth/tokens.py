"""Admin API tokens: bearer credentials for scripts and automation.

A token looks like `apt_<prefix>_<secret>`. The prefix (8 hex characters) is stored in the
clear so an operator can tell tokens apart; the whole token is stored as an HMAC-SHA256 keyed
with the server secret, so a copy of the database alone cannot be used to forge or test
tokens. The full token is shown exactly once, when created.

Each token carries a role (auth/roles.py) no higher than its owner's when it is created, and
acts with the lower of its own and its owner's current role: demoting an account demotes its
tokens too, and the tokens of an account with no role (`accounts.NO_ROLE`) act for no one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from appliance.auth.accounts import Admin, check_role, get_admin
from appliance.auth.roles import Role
from appliance.auth.sessions import TOUCH_INTERVAL
from appliance.db.models import AdminUser, ApiToken
from appliance.errors import EX_USAGE, ApplianceError
from appliance.secrets import keyed_hash

# Both used with fullmatch(): `^...$` with match() would pass a trailing "\n".
TOKEN_RE = re.compile(r"apt_([0-9a-f]{8})_([A-Za-z0-9_-]{43})")
NAME_RE = re.compile(r"[\w .@-]{1,64}")


@dataclass(frozen=True)
class TokenInfo:
    id: int
    name: str
    prefix: str
    owner: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    role: Role

    def active(self, now: dt.datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


def _info(row: ApiToken, owner: str) -> TokenInfo:
    return TokenInfo(row.id, row.name, row.prefix, owner, row.created_at, row.last_used_at,
                     row.expires_at, row.revoked_at, Role(row.role))


def create_token(
    session: Session, secret: bytes, admin: Admin, name: str, now: dt.datetime,
    expires_at: dt.datetime | None = None, role: str | None = None,
) -> tuple[str, TokenInfo]:
    """Create a token acting for `admin` with `role` (default: theirs, never above it);
    returns (the token, shown once; its record)."""
    chosen = admin.role if role is None else check_role(role)
    if not admin.role.allows(chosen):
        raise ApplianceError(
            "token_role_too_high",
            f"a token of {admin.username!r} cannot have the {chosen.value} role: their own "
            f"role is {admin.role.value}",
            f"give the token the {admin.role.value} role or a lower one", status=403,
            exit_code=EX_USAGE,
        )
    if not NAME_RE.fullmatch(name):
        raise ApplianceError(
            "token_name_invalid", f"token name {name!r} is not allowed",
            "use 1-64 letters, digits, spaces or . @ - _", status=422,
        )
    if expires_at is not None and expires_at <= now:
        raise ApplianceError(
            "token_expiry_past", f"the expiry {expires_at.isoformat()} is in the past",
            "give a future date, or none for a token that does not expire", status=422,
        )
    prefix = secrets.token_hex(4)
    while session.scalar(select(ApiToken.id).where(ApiToken.prefix == prefix)):
        prefix = secrets.token_hex(4)
    token = f"apt_{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiToken(name=name, prefix=prefix, token_hash=keyed_hash(secret, token),
                   user_id=admin.id, created_at=now, expires_at=expires_at, role=chosen.value)
    session.add(row)
    session.flush()
    return token, _info(row, admin.username)


def list_tokens(session: Session) -> list[TokenInfo]:
    rows = session.execute(
        select(ApiToken, AdminUser.username).join(AdminUser, AdminUser.id == ApiToken.user_id)
        .order_by(ApiToken.created_at.desc(), ApiToken.id.desc())
    ).all()
    return [_info(row, owner) for row, owner in rows]


CLI_TOKEN_PREFIX = "cli "  # noqa: S105 - the name a daemon-backed command gives its token


def drop_cli_token(session: Session, prefix: str, now: dt.datetime) -> int:
    """Delete the CLI's own short-lived token once its command is done, and any earlier ones
    that expired (a command killed before its cleanup): they must not pile up in the token
    list. Returns how many went. Operators' tokens are never touched."""
    gone = session.execute(delete(ApiToken).where(
        ApiToken.name.startswith(CLI_TOKEN_PREFIX),
        or_(ApiToken.prefix == prefix, ApiToken.expires_at < now)))
    return int(getattr(gone, "rowcount", 0) or 0)


def revoke_token(session: Session, prefix: str, now: dt.datetime) -> TokenInfo:
    row = session.scalar(select(ApiToken).where(ApiToken.prefix == prefix))
    if row is None:
        raise ApplianceError(
            "token_unknown", f"there is no API token with prefix {prefix!r}",
            "list tokens to see their prefixes", status=404,
        )
    if row.revoked_at is None:
        row.revoked_at = now
    owner = session.get(AdminUser, row.user_id)  # also one with no role left (NO_ROLE)
    return _info(row, owner.username if owner else "?")


def resolve_token(
    session: Session, secret: bytes, token: str, now: dt.datetime, *, touch: bool = True
) -> tuple[Admin, TokenInfo] | None:
    """The admin a presented token acts for, or None (unknown, revoked, expired, malformed).
    The admin's `role` is the lower of the token's and the account's.

    `touch=False` only checks (an open stream re-checking its credential is not a new use)."""
    match = TOKEN_RE.fullmatch(token)
    if match is None:
        return None
    row = session.scalar(select(ApiToken).where(ApiToken.prefix == match.group(1)))
    if row is None or not hmac.compare_digest(row.token_hash, keyed_hash(secret, token)):
        return None
    if row.revoked_at is not None or (row.expires_at is not None and row.expires_at <= now):
        return None
    admin = get_admin(session, row.user_id)
    if admin is None:
        return None
    if touch and (row.last_used_at is None or abs(now - row.last_used_at) >= TOUCH_INTERVAL):
        row.last_used_at = now  # at most one write per interval, as for sessions
    acting = min(admin.role, Role(row.role), key=lambda r: r.rank)
    return dataclasses.replace(admin, role=acting), _info(row, admin.username)
