"""The admin JSON API, `/api/v1`. Authenticated by session (with X-CSRF-Token on unsafe
methods) or by an admin API token; schema at `/api/v1/schema` (OpenAPI)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Annotated, Any

from litestar import Request, Router, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from appliance.auth.accounts import Admin, list_admins
from appliance.auth.guards import password_current
from appliance.auth.middleware import AuthInfo, client_address
from appliance.auth.token_actions import issue_token, withdraw_token
from appliance.auth.tokens import TokenInfo, list_tokens
from appliance.config import describe
from appliance.db.journal import SEVERITIES, AuditRecord, EventRecord, list_audit, list_events
from appliance.errors import ApplianceError
from appliance.runtime import runtime_of
from appliance.status import DaemonStatus, daemon_status

AdminRequest = Request[Admin, AuthInfo, Any]
# Bounded: a page past 64-bit offsets (1e22) was an OverflowError in SQLite, a 500.
PageQuery = Annotated[int, QueryParameter(ge=1, le=1_000_000)]
PerPageQuery = Annotated[int, QueryParameter(ge=1, le=500)]



@dataclass(frozen=True)
class Me:
    username: str
    auth: str
    must_change_password: bool
    role: str  # what this request may do: with a token, the lower of its and the account's


@dataclass(frozen=True)
class AuditPage:
    items: list[AuditRecord]
    page: int
    per_page: int
    total: int
    pages: int


@dataclass(frozen=True)
class EventPage:
    items: list[EventRecord]
    page: int
    per_page: int
    total: int
    pages: int


@dataclass(frozen=True)
class Setting:
    key: str
    value: str
    doc: str


@dataclass(frozen=True)
class TokenCreate:
    name: str
    expires_at: dt.datetime | None = None
    role: str | None = None  # viewer, operator or admin; default and ceiling: the caller's


@dataclass(frozen=True)
class TokenCreated:
    token: str
    info: TokenInfo


@get("/status", summary="The daemon's own status")
async def get_status(request: AdminRequest) -> DaemonStatus:
    return await daemon_status(runtime_of(request))


@get("/me", summary="Who is calling")
async def get_me(request: AdminRequest) -> Me:
    return Me(request.user.username, request.auth.kind, request.user.must_change_password,
              request.user.role.value)


@get("/audit", summary="Audit log, newest first")
async def get_audit(
    request: AdminRequest,
    actor: FromQuery[str] = "",
    action: FromQuery[str] = "",
    outcome: FromQuery[str] = "",
    page: PageQuery = 1,
    per_page: PerPageQuery = 50,
) -> AuditPage:
    result = await runtime_of(request).db.run(
        lambda s: list_audit(
            s, actor=actor, action=action, outcome=outcome, page=page, per_page=per_page
        )
    )
    return AuditPage(result.items, result.page, result.per_page, result.total, result.pages)


@get("/events", summary="Event log, newest first; severity means 'at least'")
async def get_events(
    request: AdminRequest,
    severity: FromQuery[str] = "",
    source: FromQuery[str] = "",
    page: PageQuery = 1,
    per_page: PerPageQuery = 50,
) -> EventPage:
    if severity and severity not in SEVERITIES:
        raise ApplianceError(
            "severity_invalid",
            f"unknown severity {severity!r}",
            "use one of " + ", ".join(SEVERITIES),
            status=400,
        )
    result = await runtime_of(request).db.run(
        lambda s: list_events(s, severity=severity, source=source, page=page, per_page=per_page)
    )
    return EventPage(result.items, result.page, result.per_page, result.total, result.pages)


@get("/settings", summary="The configuration in force (no secrets)")
async def get_settings(request: AdminRequest) -> list[Setting]:
    return [Setting(*row) for row in describe(runtime_of(request).config)]


@get("/admins", summary="Admin accounts (never their password hashes)")
async def get_admins(request: AdminRequest) -> list[Admin]:
    return await runtime_of(request).db.run(list_admins)


@get("/tokens", summary="Admin API tokens (never the secret part)")
async def get_tokens(request: AdminRequest) -> list[TokenInfo]:
    return await runtime_of(request).db.run(list_tokens)


@post("/tokens", summary="Create an admin API token; the token is returned only here")
async def post_token(request: AdminRequest, data: JSONBody[TokenCreate]) -> TokenCreated:
    runtime = runtime_of(request)
    expires = data.expires_at
    if expires is not None and expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.UTC)
    token, info = await issue_token(
        runtime, request.user, name=data.name, expires_at=expires,
        address=client_address(request), via=f"api:{request.auth.kind}", role=data.role,
    )
    return TokenCreated(token, info)


@delete("/tokens/{prefix:str}", status_code=200, summary="Revoke an admin API token")
async def delete_token(request: AdminRequest, prefix: FromPath[str]) -> TokenInfo:
    return await withdraw_token(
        runtime_of(request), request.user, prefix=prefix, address=client_address(request),
        via=f"api:{request.auth.kind}",
    )


def api_router() -> Router:
    return Router(
        path="/api/v1",
        route_handlers=[
            get_status,
            get_me,
            get_audit,
            get_events,
            get_settings,
            get_admins,
            get_tokens,
            post_token,
            delete_token,
        ],
        guards=[password_current],
        tags=["admin"],
    )
