"""Console pages: dashboard (with the health monitor's view), audit, events, settings (with
admin API tokens and the support bundle's button).

Each page has a full template under `pages/` and each htmx swap target its own partial under
`partials/`; a request with `HX-Request` gets the partial only.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Annotated, Any

from litestar import Request, get, post
from litestar.params import FromPath, FromQuery, QueryParameter, URLEncodedBody
from litestar.response import File, Redirect, Template

from appliance.api.health import load_board
from appliance.auth.accounts import list_admins
from appliance.auth.guards import PasswordChangeRequired, password_current
from appliance.auth.middleware import client_address
from appliance.auth.token_actions import issue_token, withdraw_token
from appliance.auth.tokens import list_tokens
from appliance.cell.overview import Overview
from appliance.config import describe
from appliance.db.journal import SEVERITIES, list_audit, list_events
from appliance.errors import ApplianceError
from appliance.gateway.usage import class_counts
from appliance.health.dashboard_views import dashboard as health_dashboard
from appliance.health.dashboard_views import goodput_lines
from appliance.runtime import Runtime, runtime_of
from appliance.status import daemon_status
from appliance.ui.login import (
    AdminRequest,
)

PER_PAGE = 50
PageQuery = Annotated[int, QueryParameter(ge=1, le=1_000_000)]  # past it: 400, not an SQL overflow


def _to_password_page(request: Request[Any, Any, Any], _: PasswordChangeRequired) -> Any:
    if request.headers.get("hx-request"):
        return Template(
            "partials/error.html",
            status_code=403,
            headers={"HX-Redirect": "/account/password"},
            context={"status": 403, "message": "change your password first", "hint": ""},
        )
    return Redirect("/account/password", status_code=303)


GUARDED: dict[str, Any] = {
    "guards": [password_current],
    "exception_handlers": {PasswordChangeRequired: _to_password_page},
    "include_in_schema": False,
}


def _htmx(request: Request[Any, Any, Any]) -> bool:
    return bool(request.headers.get("hx-request"))


@get("/", **GUARDED)
async def dashboard(request: AdminRequest) -> Template:
    """The page, or (from htmx, every 10 s) its status part: overall health, the engine's
    figures, the GPU table with the last hour's sparklines, the daemon and its volumes."""
    runtime = runtime_of(request)
    status = await daemon_status(runtime)
    board = await load_board(runtime, hour=True)
    health = health_dashboard(board.snapshot, board.mutes, board.series, board.now)
    why = await engine_why(runtime)
    cell = await cell_summary(request, runtime)
    now = runtime.clock.now()  # per class, the last hour's requests by what they got
    goodput = goodput_lines(await runtime.db.run(
        lambda s: class_counts(s, now - dt.timedelta(hours=1), now)))
    if _htmx(request):
        return Template("partials/dashboard_status.html", context={
            "status": status, "health": health, "engine_why": why, "cell": cell,
            "goodput": goodput})
    events = await runtime.db.run(lambda s: list_events(s, per_page=8))
    return Template("pages/dashboard.html", context={
        "status": status, "health": health, "events": events.items, "nav": "dashboard",
        "engine_why": why, "cell": cell, "goodput": goodput})


async def cell_summary(request: AdminRequest, runtime: Runtime) -> Overview | None:
    """The cell as the head's Cell page shows it (serving, capacity left, the router's
    traffic), for the dashboard of a box that heads one; None on a box that does not."""
    from appliance.cell.ops import cell_ops_of

    watch = runtime.cell
    if watch.view is None or not (watch.view.members or watch.view.active):
        return None
    return await cell_ops_of(request.app.state, runtime).overview()


async def engine_why(runtime: Runtime) -> str:
    """Why the engine is not serving, in one sentence ("" while it serves): the supervisor's
    own words, and for a box waiting on its weights the pull's progress now."""
    from appliance.engine.states import EngineState
    from appliance.weights.views import waiting_text

    status = runtime.supervisor.status
    if status.state in (EngineState.READY, EngineState.DEGRADED):
        return ""
    if status.reason == "waiting_for_weights":
        view = await runtime.weights.status()
        text = waiting_text(view) if view.job == "pull" else status.message
        return f"{text[:1].upper()}{text[1:]}; the engine starts by itself once they are proven."
    message = status.message or status.state.value.replace("_", " ")
    return f"{message[:1].upper()}{message[1:]}." if not message.endswith(".") else message


@get("/audit", **GUARDED)
async def audit_page(
    request: AdminRequest,
    actor: FromQuery[str] = "",
    action: FromQuery[str] = "",
    outcome: FromQuery[str] = "",
    page: PageQuery = 1,
) -> Template:
    runtime = runtime_of(request)
    page = max(1, page)
    entries = await runtime.db.run(
        lambda s: list_audit(
            s, actor=actor, action=action, outcome=outcome, page=page, per_page=PER_PAGE
        )
    )
    name = "partials/audit_rows.html" if _htmx(request) else "pages/audit.html"
    return Template(
        name,
        context={
            "entries": entries,
            "nav": "audit",
            "filters": {"actor": actor, "action": action, "outcome": outcome},
        },
    )


@get("/events", **GUARDED)
async def events_page(
    request: AdminRequest,
    severity: FromQuery[str] = "",
    source: FromQuery[str] = "",
    page: PageQuery = 1,
) -> Template:
    runtime = runtime_of(request)
    if severity and severity not in SEVERITIES:
        raise ApplianceError(
            "severity_invalid",
            f"unknown severity {severity!r}",
            "use one of " + ", ".join(SEVERITIES),
            status=400,
        )
    page = max(1, page)
    events = await runtime.db.run(
        lambda s: list_events(s, severity=severity, source=source, page=page, per_page=PER_PAGE)
    )
    name = "partials/event_rows.html" if _htmx(request) else "pages/events.html"
    return Template(
        name,
        context={
            "events": events,
            "nav": "events",
            "severities": SEVERITIES,
            "filters": {"severity": severity, "source": source},
        },
    )


def settings_sections(
    rows: list[tuple[str, str, str]],
) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The configuration's (key, value, doc) rows in their file's sections, in file order:
    "engine.port" belongs to [engine]."""
    sections: dict[str, list[tuple[str, str, str]]] = {}
    for row in rows:
        sections.setdefault(row[0].rpartition(".")[0], []).append(row)
    return list(sections.items())


@get("/settings", **GUARDED)
async def settings_page(request: AdminRequest) -> Template:
    runtime = runtime_of(request)
    tokens = await runtime.db.run(list_tokens)
    admins = await runtime.db.run(list_admins)
    return Template(
        "pages/settings.html",
        context={
            "admins": admins,
            "sections": settings_sections(describe(runtime.config)),
            "source": runtime.config.source,
            "tokens": tokens,
            "now": runtime.clock.now(),
            "nav": "settings",
            "created": None,
        },
    )


@post("/settings/support-bundle", status_code=200, **GUARDED)
async def support_bundle_ui(request: AdminRequest) -> File:
    """The Settings page's "Download a support bundle" button: a plain form POST (no htmx),
    so the browser saves the answer as a file. Same archive and audit as the API's."""
    from appliance.api.ops import make_bundle

    return await make_bundle(runtime_of(request), actor=request.user.username,
                             address=client_address(request))


@dataclass
class TokenForm:
    name: str = ""
    expires_days: str = ""
    role: str = ""  # empty: the creator's own role


@post("/settings/tokens", **GUARDED)
async def create_token_ui(
    request: AdminRequest,
    data: URLEncodedBody[TokenForm],
) -> Template:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    error = ""
    created = None
    expires = None
    try:
        if data.expires_days.strip():
            days = int(data.expires_days)
            if days <= 0:
                raise ValueError
            expires = now + dt.timedelta(days=days)
        created = await issue_token(
            runtime, request.user, name=data.name.strip(), expires_at=expires,
            address=client_address(request), via="console", role=data.role or None,
        )
    except ValueError:
        error = "Expiry must be a whole number of days, or empty for none."
    except ApplianceError as exc:
        error = f"{exc.message}; {exc.hint}."
    tokens = await runtime.db.run(list_tokens)
    return Template(
        "partials/tokens.html",
        status_code=422 if error else 200,
        context={
            "tokens": tokens,
            "now": now,
            "error": error,
            "created": created[0] if created else None,
        },
    )


@post("/settings/tokens/{prefix:str}/revoke", **GUARDED)
async def revoke_token_ui(request: AdminRequest, prefix: FromPath[str]) -> Template:
    runtime = runtime_of(request)
    now = runtime.clock.now()
    await withdraw_token(runtime, request.user, prefix=prefix,
                         address=client_address(request), via="console")
    tokens = await runtime.db.run(list_tokens)
    return Template(
        "partials/tokens.html", context={"tokens": tokens, "now": now, "error": "", "created": None}
    )
