"""The Engine page: state and progress, per-rank memory, argv with provenance, runs, actions
(with their cost and a confirmation), and a live log tail (server-sent events).

What the status card shows fits the state: a load's progress only while a start is under way;
while draining, stopping or stopped, the stop's facts instead (when it began, the signal sent,
how the run ended); and only the actions that state accepts. The log's figures name the run
they were read from, so figures from different runs can never sit side by side unlabelled.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from litestar import get, post
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Template

from appliance.auth.middleware import client_address
from appliance.engine.actions import cost_sentence, run_action
from appliance.engine.records import RunRecord, list_runs
from appliance.engine.schedule import cancel_action, list_scheduled
from appliance.engine.states import STARTING, Command, EngineState
from appliance.engine.supervisor import EngineStatus
from appliance.engine.views import spec_rows
from appliance.errors import ApplianceError
from appliance.runtime import runtime_of
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED
from appliance.ui.templating import when

RUNS_SHOWN = 15


# The states in which a load's progress bar means something: a start under way.
SHOWS_PROGRESS = STARTING | {EngineState.ADOPTED}
_SIGNALS = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


def card_actions(status: EngineStatus) -> list[str]:
    """The actions the card offers in this state, in order: only those the supervisor accepts
    and that make sense (no start while an engine lives, no stop once stopped, nothing while a
    stop is under way; a start in progress can be stopped but not restarted)."""
    state = status.state
    if restarting(status):
        return []  # the restart's own start comes next: a Start now would be a second one
    if state in (EngineState.STOPPED, EngineState.FAILED):
        rollback = state is EngineState.FAILED and status.rollback_available
        return ["start", "rollback"] if rollback else ["start"]
    if state is EngineState.BACKOFF:
        return ["start", "stop"]  # start now instead of waiting; or stop retrying
    if state in (EngineState.DRAINING, EngineState.STOPPING):
        return []
    if state in STARTING:
        return ["stop"]
    return ["stop", "restart"]


def restarting(status: EngineStatus) -> bool:
    """A restart is under way and has not reached its start yet (it drains, stops, or has
    stopped and is about to launch)."""
    return status.pending == Command.RESTART.value and status.state in (
        EngineState.DRAINING, EngineState.STOPPING, EngineState.STOPPED)


def stop_facts(status: EngineStatus, last_run: RunRecord | None, *, drain_seconds: int,
               kill_after_seconds: int) -> list[str]:
    """Sentences that say how the stop stands, for the draining, stopping and stopped card
    (empty in other states, and for a stop that ended no run)."""
    state, since = status.state, when(status.since)
    if state is EngineState.DRAINING:
        return [f"Stop requested; draining since {since}: new requests are refused, and the "
                f"engine is sent SIGTERM once none is in flight, or after {drain_seconds} s.",
                f"Now: {status.message}."]
    if state is EngineState.STOPPING:
        return [f"SIGTERM sent at {since}; the engine has up to {kill_after_seconds} s to exit "
                "before its processes are killed (SIGKILL)."]
    if state is not EngineState.STOPPED or last_run is None or last_run.ended_at is None:
        return []
    adopted_now = status.adopted and status.run_id == last_run.id
    adopted = " (adopted after a daemon restart)" if last_run.adopted or adopted_now else ""
    how = last_run.hint if last_run.reason == "stopped" and last_run.hint else (
        f"it ended: {(last_run.reason or 'unknown').replace('_', ' ')}")
    return [f"Run {last_run.id}{adopted}, started {when(last_run.started_at)}, ended "
            f"{when(last_run.ended_at)}: {how}; {_exit(last_run.exit_code)}."]


def _exit(code: int | None) -> str:
    if code is None:
        return "exit status not known"
    if code < 0:
        return f"killed by {_SIGNALS.get(-code, f'signal {-code}')}"
    return f"exit status {code}"


async def _status_context(request: AdminRequest, *, oob_runs: bool) -> dict[str, Any]:
    """The status card's context, with the runs table: on the page it is rendered in place;
    in an htmx answer (`oob_runs`) it rides along as an out-of-band swap, so the runs follow
    the state without a reload."""
    runtime = runtime_of(request)
    runs = await runtime.db.run(lambda s: list_runs(s, RUNS_SHOWN))
    status = runtime.supervisor.status
    engine = runtime.config.engine
    return {"engine": status, "cost": cost_sentence(runtime), "error": "",
            "error_hint": "", "runs": runs, "oob_runs": oob_runs,
            "shows_progress": status.state in SHOWS_PROGRESS,
            "actions_offered": card_actions(status), "restarting": restarting(status),
            "stop_facts": stop_facts(status, runs[0] if runs else None,
                                     drain_seconds=engine.drain_seconds,
                                     kill_after_seconds=engine.kill_after_seconds),
            "log_run": next((run for run in runs if run.id == status.run_id), None)}


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
    error, hint, status_code = "", "", 200
    try:
        command = Command(action)
    except ValueError:
        error, status_code = f"Unknown engine action {action!r}.", 404
    else:
        try:
            await run_action(runtime, command, data.confirm == "yes", request.user.username,
                             client_address(request), "console")
        except ApplianceError as exc:
            error, hint, status_code = exc.message, exc.hint, 409
    # The card as the action left it: its state, and what that state offers now.
    context = await _status_context(request, oob_runs=False)
    context.update(error=error, error_hint=hint)
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
