"""Guards shared by the console and the API.

`require_role` is the app-wide guard (`create_app` installs it once, on the app): it reads the
route's entry in `appliance.auth.roles.ROUTES` and refuses, with 403 and an audit entry
(`auth.forbidden`), anyone whose role is below it. The console, the JSON API and its SSE
streams all pass through it; no handler checks a role itself.
"""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler

from appliance.auditing import audit
from appliance.auth.roles import PUBLIC, Role, describe_refusal, route_access
from appliance.errors import ApplianceError
from appliance.runtime import runtime_of

METRICS_PATH = "/metrics"


class PasswordChangeRequired(ApplianceError):
    status = 403

    def __init__(self) -> None:
        super().__init__(
            "password_change_required",
            "this account still uses a one-time or reset password",
            "choose a new password at /account/password before doing anything else",
        )


class RoleRequired(ApplianceError):
    """A signed-in account (or token) whose role is below what the route needs."""

    status = 403

    def __init__(self, needed: Role, have: Role) -> None:
        super().__init__(
            "role_required", describe_refusal(needed, have),
            f"ask an admin for the {needed.value} role (`appliance admin set-role "
            f"--username NAME --role {needed.value}`), or use an account that has it",
        )
        self.needed = needed
        self.have = have


def password_current(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Refuse everything but the password page to an account that must change its password."""
    if getattr(connection.user, "must_change_password", False):
        raise PasswordChangeRequired


async def require_role(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Let the request through only if the caller's role reaches the route's declared one.

    An undeclared route needs admin (fail closed; the route-table test catches it first)."""
    method = str(connection.scope.get("method", "GET"))
    template = str(connection.scope.get("path_template", ""))
    access = route_access(method, template)
    if access == PUBLIC:
        return
    needed = Role.ADMIN if access is None else Role(access)
    user = connection.scope.get("user")
    if user is None:
        # Only a path the auth middleware left open gets here unauthenticated: /metrics with
        # health.metrics_public set. Anything else is a wiring mistake: refuse it.
        if template == METRICS_PATH and runtime_of(connection).config.health.metrics_public:
            return
        raise NotAuthorizedException("login required")
    have = Role(getattr(user, "role", Role.VIEWER))
    if have.allows(needed):
        return
    await _audit_refusal(connection, user, needed, have, method, template)
    raise RoleRequired(needed, have)


async def _audit_refusal(connection: ASGIConnection[Any, Any, Any, Any], user: Any,
                         needed: Role, have: Role, method: str, template: str) -> None:
    auth = connection.scope.get("auth")
    via = getattr(auth, "kind", "") or "session"
    prefix = getattr(auth, "token_prefix", "")
    address = connection.client.host if connection.client else ""
    await audit(runtime_of(connection), actor=str(getattr(user, "username", "?")),
                address=address, action="auth.forbidden", outcome="denied",
                target=f"{method} {connection.url.path}"[:255],
                detail={"route": template, "needs": needed.value, "role": have.value,
                        "via": f"token {prefix}" if prefix else via})
