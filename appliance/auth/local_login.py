"""Who may log in with a local password: everyone (`auth.local_login = "all"`), or, once
single sign-on carries the daily logins, only the break-glass accounts named in
`auth.break_glass_accounts` (the way in when the identity provider is down)."""

from __future__ import annotations

from appliance.config import AuthConfig


def local_login_refusal(auth: AuthConfig, username: str) -> str | None:
    """Why `username` may not log in locally (shown to the person), or None if it may.

    Asked only after the password was verified, so the answer reveals nothing to someone who
    does not know the password."""
    if auth.local_login == "all" or username in auth.break_glass_accounts:
        return None
    return ("Local login is reserved for break-glass accounts on this appliance. Use single "
            "sign-on, or ask an admin to add your account to auth.break_glass_accounts.")
