"""Guards shared by the console and the API."""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from appliance.errors import ApplianceError


class PasswordChangeRequired(ApplianceError):
    status = 403

    def __init__(self) -> None:
        super().__init__(
            "password_change_required",
            "this account still uses a one-time or reset password",
            "choose a new password at /account/password before doing anything else",
        )


def password_current(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Refuse everything but the password page to an account that must change its password."""
    if getattr(connection.user, "must_change_password", False):
        raise PasswordChangeRequired
