"""An engine action as every caller asks for it: the console, the admin API, the cell's head
(a member's or its own engine, a rolling restart) and the tuning service.

One rule, below the HTTP layer so that a service (appliance/cell/ops.py) need not import a
route module: anything that ends a live engine (stop, restart), or is scheduled for a
maintenance window, needs the caller's confirmation, else it is refused with its cost (a
full start, from this box's load history); a confirmed action is queued to the supervisor
(or scheduled) and audited as `engine.<action>` with who asked and through what (`via`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from appliance.auditing import audit
from appliance.engine.schedule import Scheduled, schedule_action
from appliance.engine.states import LIVE, Command
from appliance.engine.views import status_dict
from appliance.errors import ApplianceError
from appliance.runtime import Runtime


def cost_sentence(runtime: Runtime) -> str:
    return runtime.supervisor.start_cost()


def scheduled_dict(action: Scheduled) -> dict[str, Any]:
    return {"id": action.id, "command": action.command, "run_at": action.run_at.isoformat(),
            "created_by": action.created_by, "status": action.status,
            "outcome": action.outcome}


async def run_action(runtime: Runtime, command: Command, confirm: bool, actor: str,
                     address: str, via: str, at: dt.datetime | None = None) -> dict[str, Any]:
    """Queue `command` for the supervisor (or schedule it) after the confirmation rule;
    audited. Raises the supervisor's refusal (after auditing it as denied)."""
    live = runtime.supervisor.status.state in LIVE
    if command in (Command.STOP, Command.RESTART) and (live or at) and not confirm:
        raise ApplianceError(
            "confirmation_required",
            f"{command.value} ends the running engine; {cost_sentence(runtime)}",
            "repeat with confirm=true (the console asks for you)", status=409)
    if at is not None:
        scheduled = await schedule_action(runtime, command, at, actor=actor, address=address)
        return {**status_dict(runtime.supervisor.status),
                "scheduled": scheduled_dict(scheduled)}
    future = runtime.supervisor.submit(command, actor)
    refused = future.exception() if future.done() else None
    # A later failure (a preflight refusal, say) is an event and the status; mark it seen.
    future.add_done_callback(lambda f: None if f.cancelled() else f.exception())
    await audit(runtime, actor=actor, address=address, action=f"engine.{command.value}",
                target=runtime.config.engine.served_model_name,
                outcome="denied" if refused else "ok",
                detail={"via": via, **({"refused": str(refused)} if refused else {})})
    if refused is not None:
        raise refused
    return status_dict(runtime.supervisor.status)
