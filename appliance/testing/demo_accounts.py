"""The demo's viewer account: `make demo` shows what each role sees (issue 16).

A demo instrument: its password is kept in a 0600 file in the state directory so each demo
prints it again (production never stores a password anywhere but as an argon2 hash).
"""

from __future__ import annotations

import datetime as dt
import secrets
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.auth.accounts import create_admin, set_password
from appliance.auth.roles import Role
from appliance.db.database import Database
from appliance.db.models import AdminUser
from appliance.secrets import write_private

VIEWER = "viewer"
PASSWORD_FILE = "demo-viewer-password.txt"  # noqa: S105 - a file name


def demo_viewer(db: Database, state_dir: Path, now: dt.datetime) -> str:
    """The demo viewer's password: the account is created once (role viewer); a missing
    password file means a new password, set on the existing account."""
    path = state_dir / PASSWORD_FILE
    known = path.read_text().strip() if path.exists() else ""
    password = known or secrets.token_urlsafe(12)

    def apply(session: Session) -> None:
        exists = session.scalar(select(AdminUser.id).where(AdminUser.username == VIEWER))
        if exists is None:
            create_admin(session, VIEWER, password, now, role=Role.VIEWER)
        elif not known:
            set_password(session, VIEWER, password, now)

    db.call(apply)
    if not known:
        write_private(path, password.encode())
    return password
