"""The first admin: a one-time password written to a 0600 file, never to a log.

On a start with no admin account, the daemon creates `admin` with a random password that must
be changed at first login, writes it to `<state_dir>/bootstrap-admin.txt` (0600) and says
where that file is, once. Changing the password deletes the file.
"""

from __future__ import annotations

import datetime as dt
import secrets
from pathlib import Path

from sqlalchemy.orm import Session

from appliance.auth.accounts import count_admins, create_admin
from appliance.db.journal import add_audit, add_event
from appliance.secrets import write_private

BOOTSTRAP_USER = "admin"


def bootstrap_file(state_dir: Path) -> Path:
    return state_dir / "bootstrap-admin.txt"


def ensure_first_admin(session: Session, state_dir: Path, now: dt.datetime) -> Path | None:
    """Create the bootstrap admin if there is no admin at all; return the credential file."""
    if count_admins(session) > 0:
        return None
    password = secrets.token_urlsafe(18)
    create_admin(session, BOOTSTRAP_USER, password, now, must_change_password=True)
    path = bootstrap_file(state_dir)
    write_private(
        path,
        (
            "# One-time admin credential for the appliance console.\n"
            "# You will be asked to choose a new password at first login;\n"
            "# this file is deleted when you do.\n"
            f"username: {BOOTSTRAP_USER}\npassword: {password}\n"
        ).encode(),
    )
    add_audit(session, at=now, actor="system", action="admin.bootstrap", target=BOOTSTRAP_USER,
              detail={"credential_file": str(path)})
    add_event(session, at=now, severity="warning", source="auth",
              message=f"created the bootstrap admin; its one-time password is in {path}")
    return path


def retire_bootstrap_file(state_dir: Path) -> bool:
    path = bootstrap_file(state_dir)
    if path.exists():
        path.unlink()
        return True
    return False
