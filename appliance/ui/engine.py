"""The Engine page: state and progress, per-rank memory, argv with provenance, runs, actions
(with their cost and a confirmation), and a live log tail (server-sent events)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import get, post
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Template

from appliance.api.engine import cost_sentence, run_action
from appliance.auth.middleware import client_address
from appliance.engine.records import list_runs
from appliance.engine.states import Command
from appliance.engine.views import spec_rows
from appliance.errors import ApplianceError
from appliance.ui.login import AdminRequest, runtime_of
from appliance.ui.pages import GUARDED


def _status_context(request: AdminRequest) -> dict[str, Any]:
    runtime = runtime_of(request)
    return {"engine": runtime.supervisor.status, "cost": cost_sentence(runtime), "error": ""}


@get("/engine", **GUARDED)
async def engine_page(request: AdminRequest) -> Template:
    runtime = runtime_of(request)
    runs = await runtime.db.run(lambda s: list_runs(s, 15))
    try:
        spec = runtime.supervisor.current_spec()
        flags, argv = spec_rows(spec), " ".join(spec.argv())
    except ApplianceError as exc:
        flags, argv = [], f"(cannot build the launch spec: {exc.message})"
    return Template("pages/engine.html", context={
        **_status_context(request), "nav": "engine", "runs": runs, "flags": flags,
        "argv": argv, "tp_size": runtime.config.engine.tp_size,
    })


@get("/engine/status", **GUARDED)
async def engine_status_partial(request: AdminRequest) -> Template:
    return Template("partials/engine_status.html", context=_status_context(request))


@dataclass
class ActionForm:
    confirm: str = ""


@post("/engine/{action:str}", **GUARDED)
async def engine_action_ui(
    request: AdminRequest, action: FromPath[str], data: URLEncodedBody[ActionForm]
) -> Template:
    runtime = runtime_of(request)
    context = _status_context(request)
    try:
        command = Command(action)
        await run_action(runtime, command, data.confirm == "yes", request.user.username,
                         client_address(request), "console")
    except ValueError:
        context["error"] = f"Unknown engine action {action!r}."
    except ApplianceError as exc:
        context["error"] = f"{exc.message}. {exc.hint}"
    context["engine"] = runtime.supervisor.status
    return Template("partials/engine_status.html", context=context,
                    status_code=200 if not context["error"] else 409)
