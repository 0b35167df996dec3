"""Issuing and revoking admin API tokens on behalf of a signed-in admin, audited.

The console and the JSON API both call these, so the action and its audit entry are written
in one transaction and say the same thing whichever door was used (`via`).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy.orm import Session

from appliance.auth.accounts import Admin
from appliance.auth.tokens import TokenInfo, create_token, revoke_token
from appliance.db.journal import add_audit
from appliance.runtime import Runtime


async def issue_token(
    runtime: Runtime, admin: Admin, *, name: str, expires_at: dt.datetime | None,
    address: str, via: str, role: str | None = None,
) -> tuple[str, TokenInfo]:
    """Create a token for `admin` (with `role`, default theirs, never above it); returns
    (the token, shown once; its record)."""
    now = runtime.clock.now()

    def apply(s: Session) -> tuple[str, TokenInfo]:
        token, info = create_token(s, runtime.secret, admin, name, now, expires_at, role)
        add_audit(s, at=now, actor=admin.username, address=address, action="token.create",
                  target=info.prefix, detail={
                      "name": info.name, "via": via, "role": info.role.value,
                      "expires_at": expires_at.isoformat() if expires_at else None})
        return token, info

    return await runtime.db.run(apply)


async def withdraw_token(
    runtime: Runtime, admin: Admin, *, prefix: str, address: str, via: str
) -> TokenInfo:
    now = runtime.clock.now()

    def apply(s: Session) -> TokenInfo:
        info = revoke_token(s, prefix, now)
        add_audit(s, at=now, actor=admin.username, address=address, action="token.revoke",
                  target=prefix, detail={"name": info.name, "via": via})
        return info

    return await runtime.db.run(apply)
