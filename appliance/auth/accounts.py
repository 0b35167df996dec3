"""Local console accounts with argon2id password hashes, each with a role (auth/roles.py).

Functions take a SQLAlchemy `Session` and return frozen records. Password checks always run a
hash verification, even for unknown users, so response time does not reveal which usernames
exist.

An account whose role is `NO_ROLE` (a single sign-on account whose last sign-in mapped no
group, auth/oidc.py) is no one here: `get_admin` does not find it, so no session or API token
acts for it, and it is not listed. Its next sign-in with a mapped group gives it a role again.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from functools import lru_cache

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from appliance.auth.roles import ROLE_NAMES, Role
from appliance.db.models import AdminSession, AdminUser
from appliance.errors import ApplianceError

MIN_PASSWORD_LENGTH = 12
MAX_PASSWORD_LENGTH = 1024  # argon2 takes any length; the login form's body limit does not
USERNAME_MAX = 64
# Used with fullmatch(): `^...$` with match() would pass "alice\n" ($ matches before a final \n).
USERNAME_RE = re.compile(r"[a-z][a-z0-9_.-]{1,63}")
NO_ROLE = "none"  # stored, never assignable: see the module's docstring


@dataclass(frozen=True)
class Admin:
    id: int
    username: str
    must_change_password: bool
    created_at: dt.datetime
    password_changed_at: dt.datetime
    role: Role


@lru_cache(maxsize=1)
def hasher() -> PasswordHasher:
    """argon2id with argon2-cffi's RFC 9106 low-memory profile (built lazily, not at import)."""
    return PasswordHasher()


@lru_cache(maxsize=1)
def _dummy_hash() -> str:
    return hasher().hash("not a real password, used to equalise timing")


def _record(user: AdminUser) -> Admin:
    return Admin(user.id, user.username, user.must_change_password, user.created_at,
                 user.password_changed_at, Role(user.role))


def check_role(role: str) -> Role:
    if role not in ROLE_NAMES:
        raise ApplianceError(
            "role_invalid", f"there is no role {role!r}",
            "use one of " + ", ".join(ROLE_NAMES), status=422,
        )
    return Role(role)


def check_username(username: str) -> str:
    if not USERNAME_RE.fullmatch(username):
        raise ApplianceError(
            "username_invalid",
            f"username {username!r} is not allowed",
            "use 2-64 characters: lowercase letters, digits, '_', '.', '-', starting with a letter",
            status=422,
        )
    return username


def check_password(password: str) -> str:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ApplianceError(
            "password_too_short",
            f"the password has {len(password)} characters; at least {MIN_PASSWORD_LENGTH} "
            "are required",
            "choose a longer password (a passphrase of several words works well)",
            status=422,
        )
    if len(password) > MAX_PASSWORD_LENGTH:
        raise ApplianceError(
            "password_too_long",
            f"the password has {len(password)} characters; at most {MAX_PASSWORD_LENGTH} "
            "are accepted",
            "choose a shorter passphrase (the login form refuses longer ones)",
            status=422,
        )
    return password


def count_admins(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(AdminUser)) or 0


def list_admins(session: Session) -> list[Admin]:
    return [_record(u) for u in session.scalars(
        select(AdminUser).where(AdminUser.role != NO_ROLE).order_by(AdminUser.username))]


def get_admin(session: Session, user_id: int) -> Admin | None:
    """The account, or None when there is none or it has no role (`NO_ROLE`)."""
    user = session.get(AdminUser, user_id)
    return _record(user) if user and user.role != NO_ROLE else None


def create_admin(
    session: Session, username: str, password: str, now: dt.datetime, *,
    must_change_password: bool = False, role: str = Role.ADMIN,
) -> Admin:
    check_username(username)
    check_password(password)
    chosen = check_role(role)
    if session.scalar(select(AdminUser).where(AdminUser.username == username)):
        raise ApplianceError(
            "admin_exists", f"an admin named {username!r} already exists",
            "pick another name, or use `appliance admin reset-password`", status=409,
        )
    user = AdminUser(
        username=username, password_hash=hasher().hash(password),
        must_change_password=must_change_password, created_at=now, password_changed_at=now,
        role=chosen.value,
    )
    session.add(user)
    session.flush()
    return _record(user)


def set_password(
    session: Session, username: str, password: str, now: dt.datetime, *,
    must_change_password: bool = False,
) -> Admin:
    """Replace the password and end every session of that admin."""
    check_password(password)
    user = session.scalar(select(AdminUser).where(AdminUser.username == username,
                                                  AdminUser.role != NO_ROLE))
    if user is None:
        raise ApplianceError(
            "admin_unknown", f"there is no admin named {username!r}",
            "list admins with `appliance admin list`", status=404,
        )
    user.password_hash = hasher().hash(password)
    user.must_change_password = must_change_password
    user.password_changed_at = now
    session.query(AdminSession).filter(AdminSession.user_id == user.id).delete()
    return _record(user)


def set_role(session: Session, username: str, role: str) -> tuple[Role, Admin]:
    """Give an account another role; returns (its previous role, the account). Its sessions
    and tokens stay: each request reads the role afresh, and a token never acts above it."""
    chosen = check_role(role)
    user = session.scalar(select(AdminUser).where(AdminUser.username == username))
    if user is None or user.role == NO_ROLE:
        raise ApplianceError(
            "admin_unknown", f"there is no account named {username!r} with a role",
            "list accounts with `appliance admin list` (a single sign-on account that lost "
            "every mapped group gets its role from its groups at its next sign-in)",
            status=404,
        )
    before = Role(user.role)
    if before == Role.ADMIN and chosen != Role.ADMIN:
        admins = session.scalar(select(func.count()).select_from(AdminUser)
                                .where(AdminUser.role == Role.ADMIN.value)) or 0
        if admins <= 1:
            raise ApplianceError(
                "last_admin", f"{username!r} is the only admin; the box would have none",
                "make another account admin first (`appliance admin set-role`)", status=409,
            )
    user.role = chosen.value
    return before, _record(user)


def authenticate(session: Session, username: str, password: str) -> Admin | None:
    """The admin if the password matches, else None. Constant work whether or not they exist."""
    user = session.scalar(select(AdminUser).where(AdminUser.username == username))
    stored = user.password_hash if user else _dummy_hash()
    try:
        hasher().verify(stored, password)
    except (VerificationError, InvalidHashError):
        return None
    if user is None or user.role == NO_ROLE:
        return None
    if hasher().check_needs_rehash(user.password_hash):
        user.password_hash = hasher().hash(password)
    return _record(user)
