"""Operating the cell through the admin API, `/api/v1/cell` (routes beside api/cell.py's).

On a member:
- `POST /peer/role` (admin for a person; a head's peer credential opens it): change this box's
  role. The role is a flag of the engine, so while the engine runs the change is a restart:
  without `"confirm": true` the answer is 409 with the restart's cost; confirmed, the role is
  kept (appliance.cell.role_choice) and the engine restarted through the supervisor; with
  `"at"` (a maintenance window) the role is kept and the restart scheduled then. A stopped
  engine takes the new role at its next start. Audited here as `cell.peer.role`.

On a head (appliance.cell.ops):
- `GET /` (viewer): the cell's overview (appliance.cell.overview);
- `POST /members/{id}/engine/{action}` (operator): start, stop or restart a member's engine
  through its peer API, with the member's own confirmation rule and cost;
- `POST /members/{id}/role` (admin): the member's `POST /peer/role`; the head keeps the role;
- `POST /rolling-restart` (operator) `{role, confirm}`: restart the role's READY members one
  at a time (refused when it would take the role's last READY member down; a second one while
  one runs is 409); `POST /rolling-restart/cancel` stops it before its next step.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
from litestar import Router, get, post
from litestar.params import FromPath, JSONBody

from appliance.api.cell import SIGNED_IN, CellRequest, actor_of, via_of
from appliance.auditing import audit
from appliance.auth.middleware import client_address
from appliance.cell.membership import check_role
from appliance.cell.ops import CellOps, cell_ops_of
from appliance.cell.overview import overview_json, progress_json
from appliance.cell.role_choice import store_role
from appliance.engine.actions import cost_sentence, run_action
from appliance.engine.states import LIVE, Command, refusal
from appliance.errors import ApplianceError
from appliance.runtime import Runtime, runtime_of
from appliance.sizes import when_text


class ConfirmBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    confirm: bool = False


class RoleBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    confirm: bool = False
    # A maintenance window: keep the role now and restart the engine then (engine.schedule),
    # instead of a confirmed restart now. None: now.
    at: dt.datetime | None = None


def ops_of(request: CellRequest) -> CellOps:
    return cell_ops_of(request.app.state, runtime_of(request))


# --- on a member ------------------------------------------------------------------------------


async def change_own_role(runtime: Runtime, role: str, confirm: bool, *, actor: str,
                          address: str, via: str,
                          at: dt.datetime | None = None) -> dict[str, Any]:
    """Keep `role` for this box's engine and restart a running engine to take it (confirmed);
    audited as `cell.peer.role`. The role is checked first, and so is whether the engine can
    restart now: nothing is kept that could not be applied. With `at` (a maintenance window)
    and a running engine, the role is kept now and a restart scheduled then
    (appliance.engine.schedule); no confirmation is asked, as nothing stops now. The engine
    takes the role at that restart, or at any start before it."""
    role = check_role(role)
    if at is not None and runtime.supervisor.status.state in LIVE \
            and role != runtime.supervisor.cell_role:
        return await _role_in_window(runtime, role, at, actor=actor, address=address, via=via)
    supervisor = runtime.supervisor
    previous = supervisor.cell_role
    state = supervisor.status.state
    live = state in LIVE
    detail: dict[str, Any] = {"via": via, "from": previous, "to": role}
    why: ApplianceError | None = None
    if role == previous:
        answer = {"role": role, "previous": previous, "changed": False, "restarted": False,
                  "message": f"this box's role is already {role}; nothing changed"}
        await audit(runtime, actor=actor, address=address, action="cell.peer.role",
                    detail={**detail, "changed": False})
        return answer
    if live and (held := refusal(state, Command.RESTART)) is not None:
        why = ApplianceError("engine_command_refused", f"cannot change the role now: {held}",
                             "wait until the engine is READY or stop it, then change the role",
                             status=409)
    elif live and not confirm:
        why = ApplianceError(
            "confirmation_required",
            f"changing this box's role from {previous} to {role} restarts its engine; "
            f"{cost_sentence(runtime)}", "repeat with confirm=true (the console asks for you)",
            status=409)
    if why is not None:
        await audit(runtime, actor=actor, address=address, action="cell.peer.role",
                    outcome="denied", detail={**detail, "refused": why.code})
        raise why
    store_role(runtime.config, role)
    supervisor.role = role
    if live:
        await run_action(runtime, Command.RESTART, True, actor, address, via)
    await audit(runtime, actor=actor, address=address, action="cell.peer.role",
                detail={**detail, "restarted": live})
    return {"role": role, "previous": previous, "changed": True, "restarted": live,
            "message": (f"role {role} kept; the engine restarts to take it ("
                        f"{cost_sentence(runtime)})") if live else
                       f"role {role} kept; the engine takes it at its next start"}


async def _role_in_window(runtime: Runtime, role: str, at: dt.datetime, *, actor: str,
                          address: str, via: str) -> dict[str, Any]:
    from appliance.engine.schedule import schedule_action

    previous = runtime.supervisor.cell_role
    detail: dict[str, Any] = {"via": via, "from": previous, "to": role, "at": at.isoformat()}
    try:  # the window is checked (in the future, with a zone) before the role is kept
        scheduled = await schedule_action(runtime, Command.RESTART, at, actor=actor,
                                          address=address)
    except ApplianceError as exc:
        await audit(runtime, actor=actor, address=address, action="cell.peer.role",
                    outcome="denied", detail={**detail, "refused": exc.code})
        raise
    store_role(runtime.config, role)
    runtime.supervisor.role = role
    await audit(runtime, actor=actor, address=address, action="cell.peer.role",
                detail={**detail, "restarted": False, "scheduled": scheduled.id})
    return {"role": role, "previous": previous, "changed": True, "restarted": False,
            "scheduled": {"id": scheduled.id, "at": scheduled.run_at.isoformat()},
            "message": f"role {role} kept; the engine restarts to take it in the maintenance "
                       f"window at {when_text(scheduled.run_at)} (or at any start before it)"}


@post("/peer/role", status_code=200, guards=SIGNED_IN,
      summary="Change this member's role (a restart of a running engine, confirmed)")
async def peer_role(request: CellRequest, data: JSONBody[RoleBody]) -> dict[str, Any]:
    return await change_own_role(runtime_of(request), data.role, data.confirm,
                                 actor=actor_of(request), address=client_address(request),
                                 via=via_of(request), at=data.at)


# --- on a head --------------------------------------------------------------------------------


@get("/", guards=SIGNED_IN, summary="The cell: members, router, traffic, rolling restart")
async def cell_overview(request: CellRequest) -> dict[str, Any]:
    return overview_json(await ops_of(request).overview())


@post("/members/{member_id:int}/engine/{action:str}", status_code=202, guards=SIGNED_IN,
      summary="Start, stop or restart a member's engine (stop and restart: confirmed)")
async def member_engine(request: CellRequest, member_id: FromPath[int], action: FromPath[str],
                        data: JSONBody[ConfirmBody | None] = None) -> dict[str, Any]:
    return await ops_of(request).member_engine(
        member_id, action, confirm=(data or ConfirmBody()).confirm, actor=actor_of(request),
        address=client_address(request))


@post("/members/{member_id:int}/role", status_code=200, guards=SIGNED_IN,
      summary="Change a member's role (a restart of its running engine, confirmed)")
async def member_role(request: CellRequest, member_id: FromPath[int],
                      data: JSONBody[RoleBody]) -> dict[str, Any]:
    return await ops_of(request).member_role(
        member_id, data.role, confirm=data.confirm, actor=actor_of(request),
        address=client_address(request), at=data.at)


@post("/rolling-restart", status_code=202, guards=SIGNED_IN,
      summary="Restart a role's members one at a time, never its last READY one")
async def rolling_restart(request: CellRequest, data: JSONBody[RoleBody]) -> dict[str, Any]:
    progress = await ops_of(request).start_rolling(
        data.role, confirm=data.confirm, actor=actor_of(request), address=client_address(request))
    return progress_json(progress) or {}


@post("/rolling-restart/cancel", status_code=200, guards=SIGNED_IN,
      summary="Stop the rolling restart before its next step")
async def rolling_restart_cancel(request: CellRequest) -> dict[str, Any]:
    progress = await ops_of(request).cancel_rolling(actor=actor_of(request),
                                                    address=client_address(request))
    return progress_json(progress) or {}


def cell_ops_router() -> Router:
    return Router(path="/api/v1/cell", tags=["cell"],
                  route_handlers=[peer_role, cell_overview, member_engine, member_role,
                                  rolling_restart, rolling_restart_cancel])
