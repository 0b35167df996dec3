"""The Cell page, on a head: the cell as its watch sees it (serving or why not, the capacity
left), each member with its role, engine state and progress, health, GPUs and the router's
view of it, the head's own engine, the cell's traffic, and the rolling restart's progress;
refreshed every five seconds; below it, what each mix of boxes would serve
(appliance.api.cell_plan's partial).

Actions go through the same service as the API and the CLI (appliance.cell.ops): a first
press asks the member (or plans the rolling restart) without confirming, and what comes back
(the member's own cost sentence, or the plan) is shown with a confirm button; only that
second press acts. Their answers land in a notice area outside the refreshed part and tell it
to refresh (`HX-Trigger: cell-changed`). A viewer sees no action buttons (`can()`); the role
guard refuses the routes all the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from litestar import MediaType, Response, get, post
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Template

from appliance.api.cell_plan import plan_context
from appliance.auth.middleware import client_address
from appliance.cell.membership import ROLES
from appliance.cell.ops import CellOps, cell_ops_of
from appliance.cell.overview import Overview
from appliance.cell.rolling import ROLLING_ROLES
from appliance.cell.view import READY
from appliance.errors import ApplianceError
from appliance.runtime import runtime_of
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED

REFRESH: Final = {"HX-Trigger": "cell-changed"}
ACTION_WORDS: Final = {"start": "Start", "stop": "Stop", "restart": "Restart"}
STEP_WORDS: Final = {"waiting": "waiting", "restarting": "restarting now", "done": "restarted",
                     "failed": "failed", "cancelled": "cancelled", "not started": "not started"}


def _ops(request: AdminRequest) -> CellOps:
    return cell_ops_of(request.app.state, runtime_of(request))


async def _status_context(request: AdminRequest) -> dict[str, Any]:
    overview = await _ops(request).overview()
    return {"cell": overview, "step_words": STEP_WORDS, "roles": ROLES,
            "rolling_roles": rolling_choices(overview)}


def rolling_choices(overview: Overview) -> tuple[str, ...]:
    """The rolling-restart form's roles, the one with the most READY engines first (the
    decodes in 1P+2D: a one-engine role is always refused, so it is never the default)."""
    engines = [(m.member.role, m.member.state) for m in overview.members]
    engines.append((overview.head.role, overview.head.state))
    ready = {role: sum(1 for r, state in engines if r == role and state == READY)
             for role in ROLLING_ROLES}
    return tuple(sorted(ROLLING_ROLES, key=lambda role: -ready[role]))


@get("/cell", **GUARDED)
async def cell_page(request: AdminRequest) -> Template:
    """The page, with what each mix of boxes would serve (appliance.api.cell_plan)."""
    plan = await plan_context(runtime_of(request))
    return Template("pages/cell.html",
                    context={**await _status_context(request), **plan, "nav": "cell"})


@get("/cell/status", **GUARDED)
async def cell_status_partial(request: AdminRequest) -> Template:
    return Template("partials/cell_status.html", context=await _status_context(request))


@dataclass(frozen=True)
class Notice:
    """The answer to an action: `confirm` (a question with its cost, and what confirming
    posts), `done` or `error`."""

    kind: str
    message: str
    hint: str = ""
    post: str = ""
    role: str = ""
    button: str = ""


def _notice(notice: Notice, status_code: int = 200) -> Template:
    return Template("partials/cell_notice.html", context={"notice": notice},
                    status_code=status_code, headers=REFRESH)


def _refused(exc: ApplianceError, post: str, button: str, role: str = "") -> Template:
    """A refusal: the confirmation a first press asks for, or an error."""
    if exc.code == "confirmation_required":
        return _notice(Notice("confirm", exc.message, post=post, role=role, button=button))
    return _notice(Notice("error", exc.message, exc.hint), exc.status)


@dataclass
class ActionForm:
    confirm: str = ""
    role: str = ""


@post("/cell/members/{member_id:int}/engine/{action:str}", **GUARDED)
async def cell_member_engine_ui(request: AdminRequest, member_id: FromPath[int],
                                action: FromPath[str],
                                data: URLEncodedBody[ActionForm]) -> Template:
    button = f"{ACTION_WORDS.get(action, action)} member {member_id}'s engine"
    url = f"/cell/members/{member_id}/engine/{action}"
    try:
        answer = await _ops(request).member_engine(
            member_id, action, confirm=data.confirm == "yes", actor=request.user.username,
            address=client_address(request))
    except ApplianceError as exc:
        return _refused(exc, url, button)
    return _notice(Notice("done", f"{ACTION_WORDS.get(action, action)} asked of member "
                                  f"{member_id} ({answer['address']}); its card follows it."))


@post("/cell/members/{member_id:int}/role", **GUARDED)
async def cell_member_role_ui(request: AdminRequest, member_id: FromPath[int],
                              data: URLEncodedBody[ActionForm]) -> Template:
    button = f"Make member {member_id} {data.role}"
    try:
        answer = await _ops(request).member_role(
            member_id, data.role, confirm=data.confirm == "yes", actor=request.user.username,
            address=client_address(request))
    except ApplianceError as exc:
        return _refused(exc, f"/cell/members/{member_id}/role", button, data.role)
    return _notice(Notice("done", f"Member {member_id}: {answer['message']}."))


@post("/cell/rolling-restart", **GUARDED)
async def cell_rolling_ui(request: AdminRequest, data: URLEncodedBody[ActionForm]) -> Template:
    try:
        progress = await _ops(request).start_rolling(
            data.role, confirm=data.confirm == "yes", actor=request.user.username,
            address=client_address(request))
    except ApplianceError as exc:
        return _refused(exc, "/cell/rolling-restart",
                        f"Restart the {data.role} members one at a time", data.role)
    return _notice(Notice("done", f"Rolling restart of the {progress.role} members started; "
                                  "its progress is below."))


@post("/cell/rolling-restart/cancel", **GUARDED)
async def cell_rolling_cancel_ui(request: AdminRequest) -> Template:
    try:
        progress = await _ops(request).cancel_rolling(actor=request.user.username,
                                                      address=client_address(request))
    except ApplianceError as exc:
        return _notice(Notice("error", exc.message, exc.hint), exc.status)
    return _notice(Notice("done", f"Rolling restart cancelled: {progress.message}."))


@get("/cell/notice", **GUARDED)
async def cell_notice_clear(request: AdminRequest) -> Response[str]:
    """"Not now": the notice area, empty again."""
    return Response("", media_type=MediaType.HTML)
