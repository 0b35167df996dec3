"""The Engine page: state and progress, per-rank memory, argv with provenance, runs, actions
(with their cost and a confirmation), and a live log tail (server-sent events)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from litestar import get, post
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Template

from appliance.api.engine import cost_sentence, run_action
from appliance.auth.middleware import client_address
from appliance.engine.records import list_runs
from appliance.engine.schedule import cancel_action, list_scheduled
from appliance.engine.states import Command
from appliance.engine.views import spec_rows
from appliance.errors import ApplianceError
from appliance.runtime import runtime_of
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED

RUNS_SHOWN = 15


async def _status_context(request: AdminRequest, *, oob_runs: bool) -> dict[str, Any]:
    """The status card's context, with the runs table: on the page it is rendered in place;
    in an htmx answer (`oob_runs`) it rides along as an out-of-band swap, so the runs follow
    the state without a reload."""
    runtime = runtime_of(request)
    runs = await runtime.db.run(lambda s: list_runs(s, RUNS_SHOWN))
    return {"engine": runtime.supervisor.status, "cost": cost_sentence(runtime), "error": "",
            "error_hint": "", "runs": runs, "oob_runs": oob_runs}


@get("/engine", **GUARDED)
async def engine_page(request: AdminRequest) -> Template:
    runtime = runtime_of(request)
    argv: list[str] = []
    spec_error = ""
    try:
        spec = runtime.supervisor.current_spec()
        flags, argv = spec_rows(spec), spec.argv()
    except ApplianceError as exc:
        flags, spec_error = [], f"cannot build the launch spec: {exc.message}"
    return Template("pages/engine.html", context={
        **await _status_context(request, oob_runs=False), "nav": "engine", "flags": flags,
        "argv": argv, "spec_error": spec_error, "tp_size": runtime.config.engine.tp_size,
        "actions": await runtime.db.run(list_scheduled), "notice": "", "now": runtime.clock.now(),
    })


@get("/engine/status", **GUARDED)
async def engine_status_partial(request: AdminRequest) -> Template:
    return Template("partials/engine_status.html",
                    context=await _status_context(request, oob_runs=True))


@dataclass
class ActionForm:
    confirm: str = ""


@post("/engine/{action:str}", **GUARDED)
async def engine_action_ui(
    request: AdminRequest, action: FromPath[str], data: URLEncodedBody[ActionForm]
) -> Template:
    """Run an action from the Engine page; the answer is the status card. A refusal (409)
    carries the card with the reason, which the page swaps in like a success."""
    runtime = runtime_of(request)
    context = await _status_context(request, oob_runs=False)
    status_code = 200
    try:
        command = Command(action)
    except ValueError:
        context["error"] = f"Unknown engine action {action!r}."
        status_code = 404
    else:
        try:
            await run_action(runtime, command, data.confirm == "yes", request.user.username,
                             client_address(request), "console")
        except ApplianceError as exc:
            context["error"], context["error_hint"] = exc.message, exc.hint
            status_code = 409
    context["engine"] = runtime.supervisor.status
    return Template("partials/engine_status.html", context=context, status_code=status_code)


@dataclass
class ScheduleForm:
    command: str = "restart"
    at: str = ""  # <input type="datetime-local">, read as UTC
    confirm: str = ""


async def _schedule_template(request: AdminRequest, *, error: str = "", hint: str = "",
                             notice: str = "", status_code: int = 200) -> Template:
    runtime = runtime_of(request)
    actions = await runtime.db.run(list_scheduled)
    return Template("partials/engine_schedule.html", status_code=status_code, context={
        "actions": actions, "error": error, "error_hint": hint, "notice": notice,
        "now": runtime.clock.now(), "cost": cost_sentence(runtime)})


@get("/engine/schedule", **GUARDED)
async def engine_schedule_partial(request: AdminRequest) -> Template:
    return await _schedule_template(request)


@post("/engine/schedule", **GUARDED)
async def engine_schedule_ui(request: AdminRequest, data: URLEncodedBody[ScheduleForm]) -> Template:
    """Schedule an engine action for a maintenance window (the time is UTC)."""
    try:
        command = Command(data.command)
        at = dt.datetime.fromisoformat(data.at).replace(tzinfo=dt.UTC)
    except ValueError:
        return await _schedule_template(
            request, error="Choose an action and a date and time (UTC).", status_code=422)
    try:
        result = await run_action(runtime_of(request), command, data.confirm == "yes",
                                  request.user.username, client_address(request), "console",
                                  at=at)
    except ApplianceError as exc:
        return await _schedule_template(request, error=exc.message, hint=exc.hint,
                                        status_code=exc.status)
    planned = result["scheduled"]
    return await _schedule_template(
        request, notice=f"{planned['command']} scheduled for {at:%Y-%m-%d %H:%M} UTC.")


@post("/engine/scheduled/{action_id:int}/cancel", **GUARDED)
async def engine_schedule_cancel_ui(request: AdminRequest, action_id: FromPath[int]) -> Template:
    try:
        await cancel_action(runtime_of(request), action_id, actor=request.user.username,
                            address=client_address(request))
    except ApplianceError as exc:
        return await _schedule_template(request, error=exc.message, hint=exc.hint,
                                        status_code=exc.status)
    return await _schedule_template(request, notice="Cancelled.")
