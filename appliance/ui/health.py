"""The Health page: every check by group with its level, summary, hint, since when and
recent changes; "Check now"; mute controls.

The board (`partials/health_board.html`) is one htmx swap target: "Check now", muting and
unmuting answer with it, refreshed, so the page never reloads. Without htmx the forms post
normally and redirect back to the page. Muting takes 1 hour, 24 hours or "until unmuted"
and an optional reason; the monitor records it (audited `health.mute`/`health.unmute`).
A refusal (an unknown check, a bad duration) shows above the board, which stays. Reading is
not audited. The data and the mutes go through `appliance.api.health`, as the API's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import get, post
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Redirect, Template

from appliance.api.health import load_board, mute_check, unmute_check
from appliance.auth.middleware import client_address
from appliance.errors import ApplianceError
from appliance.health.views import health_page
from appliance.runtime import runtime_of
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED

RECENT_SHOWN = 50
CHANGES_READ = 500  # enough for "since when" of every check on a troubled month
DURATIONS = {"1h": 60, "24h": 24 * 60, "forever": None}
DURATION_CHOICES = (("1h", "for 1 hour"), ("24h", "for 24 hours"),
                    ("forever", "until unmuted"))


def _htmx(request: AdminRequest) -> bool:
    return bool(request.headers.get("hx-request"))


async def _context(request: AdminRequest, **extra: Any) -> dict[str, Any]:
    runtime = runtime_of(request)
    board = await load_board(runtime, changes=CHANGES_READ)
    return {"page": health_page(board.snapshot, board.mutes, board.changes, RECENT_SHOWN),
            "now": board.now, "durations": DURATION_CHOICES, "nav": "health", "error": None,
            "notice": "", **extra}


async def _board(request: AdminRequest, status_code: int = 200, **extra: Any) -> Template:
    name = "partials/health_board.html" if _htmx(request) else "pages/health.html"
    return Template(name, status_code=status_code, context=await _context(request, **extra))


async def _done(request: AdminRequest, **extra: Any) -> Template | Redirect:
    """After a change: the refreshed board for htmx, otherwise back to the page."""
    if not _htmx(request):
        return Redirect("/health", status_code=303)
    return await _board(request, **extra)


@get("/health", **GUARDED)
async def health_ui(request: AdminRequest) -> Template:
    """The page, or (from htmx) the board alone."""
    return await _board(request)


@post("/health/check", **GUARDED)
async def health_check_ui(request: AdminRequest) -> Template | Redirect:
    """Run every check now and show the result."""
    await runtime_of(request).health.check_all()
    return await _done(request, notice="Every check ran just now.")


@dataclass
class MuteForm:
    duration: str = "1h"
    reason: str = ""


@post("/health/checks/{check:str}/mute", **GUARDED)
async def health_mute_ui(request: AdminRequest, check: FromPath[str],
                         data: URLEncodedBody[MuteForm]) -> Template | Redirect:
    runtime = runtime_of(request)
    try:
        if data.duration not in DURATIONS:
            raise ApplianceError("health_mute_invalid", f"unknown duration {data.duration!r}",
                                 "choose 1 hour, 24 hours or until unmuted", status=422)
        await mute_check(runtime, check, DURATIONS[data.duration], data.reason,
                         by=request.user.username, address=client_address(request))
    except ApplianceError as exc:
        return await _board(request, status_code=exc.status, error=exc)
    return await _done(request)


@post("/health/checks/{check:str}/unmute", **GUARDED)
async def health_unmute_ui(request: AdminRequest,
                           check: FromPath[str]) -> Template | Redirect:
    try:
        await unmute_check(runtime_of(request), check, by=request.user.username,
                           address=client_address(request))
    except ApplianceError as exc:
        return await _board(request, status_code=exc.status, error=exc)
    return await _done(request)
