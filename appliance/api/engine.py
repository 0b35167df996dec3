"""The engine through the admin API: status, runs, launch spec, actions, log tail and stream.

Actions are queued to the supervisor (202 Accepted with the status). Anything that ends a
live engine — stop, restart — costs a full start later, so it needs `"confirm": true`; without
it the answer is 409 with the expected cost from this box's load history.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from litestar import Request, Router, delete, get, post
from litestar.params import FromPath, JSONBody, QueryParameter
from litestar.response import ServerSentEvent, ServerSentEventMessage

from appliance.auth.accounts import Admin
from appliance.auth.guards import password_current
from appliance.auth.liveness import credential_check, while_authorised
from appliance.auth.middleware import AuthInfo, client_address
from appliance.engine.actions import run_action, scheduled_dict
from appliance.engine.logsecrets import redact, redact_json, redact_lines
from appliance.engine.logtail import follow, tail
from appliance.engine.records import list_runs
from appliance.engine.schedule import (
    cancel_action,
    list_scheduled,
)
from appliance.engine.states import Command
from appliance.engine.views import run_dict, spec_rows, status_dict
from appliance.errors import ApplianceError
from appliance.runtime import Runtime, runtime_of

AdminRequest = Request[Admin, AuthInfo, Any]



@dataclass(frozen=True)
class ActionBody:
    confirm: bool = False
    at: dt.datetime | None = None  # run in a maintenance window instead of now


async def keys_on_disk(runtime: Runtime) -> tuple[str, ...]:
    """The engine keys in this box's key files (EngineKeys.on_disk), read off the event loop:
    with the two the daemon holds in memory (`EngineKeys.known`), what an engine log line or
    figure loses by value wherever it leaves through the API."""
    return await asyncio.to_thread(runtime.engine_keys.on_disk)


@get("/", summary="Engine state, progress, memory table and launch figures")
async def engine_status(request: AdminRequest) -> dict[str, Any]:
    from appliance.status import engine_admission  # admits_requests: the gateway's word too

    runtime = runtime_of(request)
    status = status_dict(runtime.supervisor.status)
    known = runtime.engine_keys.known(await keys_on_disk(runtime))
    status["log"] = redact_json(status["log"], known)
    return {**status, **await engine_admission(runtime)}


@get("/spec", summary="The launch argv with the origin of every flag")
async def engine_spec(request: AdminRequest) -> dict[str, Any]:
    spec = runtime_of(request).supervisor.current_spec()
    return {"argv": spec.argv(), "spec_hash": spec.spec_hash, "flags": spec_rows(spec),
            "env": [list(e) for e in spec.env]}


@get("/runs", summary="Engine runs, newest first")
async def engine_runs(
    request: AdminRequest, limit: Annotated[int, QueryParameter(ge=1, le=200)] = 20
) -> list[dict[str, Any]]:
    runs = await runtime_of(request).db.run(lambda s: list_runs(s, limit))
    return [run_dict(r) for r in runs]


@post("/{action:str}", status_code=202, summary="start, stop, restart or rollback")
async def engine_action(
    request: AdminRequest, action: FromPath[str], data: JSONBody[ActionBody | None] = None
) -> dict[str, Any]:
    try:
        command = Command(action)
    except ValueError:
        raise ApplianceError("engine_action_unknown", f"unknown engine action {action!r}",
                             "use start, stop, restart or rollback", status=404) from None
    body = data or ActionBody()
    return await run_action(runtime_of(request), command, body.confirm, request.user.username,
                            client_address(request), f"api:{request.auth.kind}", body.at)


@get("/scheduled", summary="Engine actions scheduled for maintenance windows")
async def engine_scheduled(request: AdminRequest) -> list[dict[str, Any]]:
    actions = await runtime_of(request).db.run(list_scheduled)
    return [scheduled_dict(a) for a in actions]


@delete("/scheduled/{action_id:int}", status_code=200, summary="Cancel a scheduled action")
async def engine_schedule_cancel(request: AdminRequest, action_id: FromPath[int]) -> dict[str, Any]:
    cancelled = await cancel_action(runtime_of(request), action_id, actor=request.user.username,
                                    address=client_address(request))
    return scheduled_dict(cancelled)


@get("/log", summary="The last lines of the engine log (filter by rank and level)")
async def engine_log(
    request: AdminRequest,
    lines: Annotated[int, QueryParameter(ge=1, le=5000)] = 200,
    rank: Annotated[int | None, QueryParameter(ge=0)] = None,
    level: Annotated[Literal["", "info", "warning", "error"], QueryParameter()] = "",
) -> dict[str, Any]:
    runtime = runtime_of(request)
    shown = await tail(runtime.supervisor.log_path, lines, rank=rank, level=level)
    known = runtime.engine_keys.known(await keys_on_disk(runtime))
    return {"lines": redact_lines(shown, known)}


@get("/log/stream", summary="The engine log as server-sent events (new lines as they come)")
async def engine_log_stream(
    request: AdminRequest,
    rank: Annotated[int | None, QueryParameter(ge=0)] = None,
    level: Annotated[Literal["", "info", "warning", "error"], QueryParameter()] = "",
) -> ServerSentEvent:
    runtime = runtime_of(request)
    path = runtime.supervisor.log_path
    check = credential_check(request)

    opened = runtime.clock.monotonic()
    on_disk = await keys_on_disk(runtime)  # read once a stream: files, not memory

    async def lines() -> AsyncIterator[str | ServerSentEventMessage]:
        # The stream outlives the middleware's one check: it ends when its token is revoked
        # or its session ends, with a last event saying why. The re-checks count from the
        # request, not from the body's first read, which a loaded box starts later.
        async for line in while_authorised(follow(path, rank=rank, level=level), runtime,
                                           check, since=opened):
            yield redact(line, runtime.engine_keys.known(on_disk))
        yield ServerSentEventMessage(
            event="unauthorized",
            data="the API token or session of this stream was revoked or has ended; "
                 "log in again or use a valid token")

    return ServerSentEvent(lines())


def engine_router() -> Router:
    return Router(path="/api/v1/engine", guards=[password_current], tags=["engine"],
                  route_handlers=[engine_status, engine_spec, engine_runs, engine_log,
                                  engine_log_stream, engine_scheduled, engine_schedule_cancel,
                                  engine_action])
